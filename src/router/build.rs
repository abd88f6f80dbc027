//! ROUTING at convert time: which shards exist, their order, cost and key.

use rayon::prelude::*;
use tokenizers::Tokenizer;

use super::{bag_key, load_tokenizer, KEY_DIM};
use crate::archive::{Routing, Shard, ShardKind};
use crate::import::{ImportError, SourceModel};
use crate::model::{ModelDesc, TensorDesc};

/// Canonical name of the token embedding.
pub const EMBED_NAME: &str = "model.embed_tokens.weight";
/// Most tokens an expert's key is made of (those its gate scores highest); fewer when
/// the vocabulary split among the layer's experts is smaller, so keys stay distinct.
pub const EXPERT_KEY_TOKENS: usize = 256;

/// Rows per embedding shard: as many as fit in one mount chunk (256 KiB by default) in
/// the dtype a mount presents by default, so a shard touches at most two chunks (the
/// tensor is not chunk-aligned in the virtual file) and a route's cost is close to the
/// cache bytes it will take. 227 rows for SmolLM2-135M (576 × 2 bytes per row).
pub fn embedding_rows_per_shard(t: &TensorDesc, chunk_bytes: u64) -> u64 {
    let row = t.cols().max(1) * t.source.served_size();
    (chunk_bytes / row).clamp(1, t.rows().max(1))
}

fn cost(t: &TensorDesc, rows: u64) -> u64 {
    rows.saturating_mul(t.cols())
        .saturating_mul(t.source.served_size())
}

/// Where in a forward pass tensor `name` is used: 0 before the first block (the token
/// embedding), `l + 1` in block `l`, `n_layers + 1` after the last (final norm, head).
pub fn order_of(name: &str, n_layers: u32) -> u32 {
    match crate::model::names::layer_of(name) {
        Some(l) => l.saturating_add(1),
        None if name.contains("embed") => 0,
        None => n_layers.saturating_add(1),
    }
}

/// An MoE layer: its gate (`<prefix>gate.weight`, `[n_expert, hidden]`) and, per
/// expert, the tensors under `<prefix>experts.<e>.` (Mixtral's `block_sparse_moe.`,
/// Qwen-MoE's `mlp.`).
struct MoeLayer {
    gate: usize,
    experts: Vec<Vec<usize>>,
}

fn moe_layers(desc: &ModelDesc) -> Vec<MoeLayer> {
    let mut out = Vec::new();
    for (g, t) in desc.tensors.iter().enumerate() {
        let Some(prefix) = t.name.strip_suffix("gate.weight") else {
            continue;
        };
        if t.shape.len() != 2 || !prefix.ends_with('.') {
            continue;
        }
        let n = t.rows() as usize;
        let mut experts = vec![Vec::new(); n];
        let under = format!("{prefix}experts.");
        for (i, x) in desc.tensors.iter().enumerate() {
            let Some(rest) = x.name.strip_prefix(&under) else {
                continue;
            };
            let Some(e) = rest.split('.').next().and_then(|e| e.parse::<usize>().ok()) else {
                continue;
            };
            if let Some(v) = experts.get_mut(e) {
                v.push(i);
            }
        }
        if experts.iter().any(|v| !v.is_empty()) {
            out.push(MoeLayer { gate: g, experts });
        }
    }
    out
}

/// The token strings of the vocabulary, by id (None where the tokenizer has no token).
fn vocab(tok: &Tokenizer, n: u64) -> Vec<Option<String>> {
    (0..n)
        .map(|id| u32::try_from(id).ok().and_then(|id| tok.id_to_token(id)))
        .collect()
}

/// ROUTING for `src` (docs/ROUTER.md): embedding blocks and experts with keys, every
/// other tensor with order and cost. Without a usable tokenizer, no shard gets a key
/// (a warning says why) and routes carry order and cost only.
pub fn build_routing(src: &dyn SourceModel, chunk_bytes: u64) -> Result<Routing, ImportError> {
    let desc = src.desc();
    let n_layers = desc.arch.n_layers;
    let tok = match load_tokenizer(desc) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!("router: no keys ({e})");
            None
        }
    };
    let embed = desc.tensor_index(EMBED_NAME);
    let words = match (&tok, embed) {
        (Some(tok), Some(e)) => Some(vocab(tok, desc.tensors[e].rows())),
        _ => None,
    };
    let key_of = |ids: &mut dyn Iterator<Item = u64>| -> Vec<(u32, f32)> {
        match &words {
            Some(w) => bag_key(
                ids.filter_map(|i| w.get(i as usize).and_then(|s| s.as_deref())),
                KEY_DIM,
            ),
            None => Vec::new(),
        }
    };
    // A shard covering a whole tensor (experts and everything without a key).
    let whole = |i: usize, kind: ShardKind, key: Vec<(u32, f32)>| {
        let t = &desc.tensors[i];
        Shard {
            tensor: i as u32,
            kind,
            order: order_of(&t.name, n_layers),
            row0: 0,
            row1: t.rows().max(1),
            cost: cost(t, t.rows().max(1)),
            key,
        }
    };
    let mut shards = Vec::new();
    if let Some(e) = embed {
        let t = &desc.tensors[e];
        let rps = embedding_rows_per_shard(t, chunk_bytes);
        let mut r0 = 0;
        while r0 < t.rows() {
            let r1 = (r0 + rps).min(t.rows());
            shards.push(Shard {
                tensor: e as u32,
                kind: ShardKind::Embedding,
                order: 0,
                row0: r0,
                row1: r1,
                cost: cost(t, r1 - r0),
                key: key_of(&mut (r0..r1)),
            });
            r0 = r1;
        }
    }
    let moe = moe_layers(desc);
    let mut is_expert = vec![false; desc.tensors.len()];
    if !moe.is_empty() && words.is_some() {
        let e = embed.expect("words need the embedding");
        let emb = src.f32(e)?;
        let hidden = desc.tensors[e].cols() as usize;
        for layer in &moe {
            let gt = &desc.tensors[layer.gate];
            if gt.cols() as usize != hidden {
                tracing::warn!(
                    "router: {} is {} wide, the embedding {hidden}; its experts get no key",
                    gt.name,
                    gt.cols()
                );
                continue;
            }
            let gate = src.f32(layer.gate)?;
            let vocab_n = emb.len() / hidden.max(1);
            let m = (vocab_n / layer.experts.len().max(1)).clamp(1, EXPERT_KEY_TOKENS);
            for (x, tensors) in layer.experts.iter().enumerate() {
                let row = &gate[x * hidden..(x + 1) * hidden];
                let key = key_of(&mut top_tokens(&emb, row, m).into_iter());
                for &i in tensors {
                    is_expert[i] = true;
                    shards.push(whole(i, ShardKind::Expert, key.clone()));
                }
            }
        }
    }
    for (i, t) in desc.tensors.iter().enumerate() {
        if Some(i) == embed || is_expert[i] || t.numel() == 0 {
            continue;
        }
        shards.push(whole(i, ShardKind::Other, Vec::new()));
    }
    Ok(Routing {
        dim: KEY_DIM,
        shards,
    })
}

/// Token ids whose embedding row scores highest against `gate_row` (the expert's gate
/// vector): at the first MoE layer the hidden state is close to the embedding, so these
/// are the tokens that send themselves to this expert. Deeper layers' hidden states
/// drift from the embedding; their keys are an approximation (docs/ROUTER.md).
fn top_tokens(emb: &[f32], gate_row: &[f32], m: usize) -> Vec<u64> {
    let h = gate_row.len();
    let mut scored: Vec<(f32, u64)> = emb
        .par_chunks_exact(h)
        .enumerate()
        .map(|(id, row)| {
            (
                row.iter().zip(gate_row).map(|(a, b)| a * b).sum(),
                id as u64,
            )
        })
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    scored.truncate(m);
    let mut ids: Vec<u64> = scored.into_iter().map(|(_, id)| id).collect();
    ids.sort_unstable();
    ids
}

#[cfg(test)]
pub(super) fn top_tokens_for_test(emb: &[f32], gate_row: &[f32], m: usize) -> Vec<u64> {
    top_tokens(emb, gate_row, m)
}
