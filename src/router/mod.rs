//! The semantic router (seed 000 §5, made honest; docs/ROUTER.md).
//!
//! Keys are hashed bags of words: every token (its string in the model's own
//! vocabulary) maps through XXH3-64 to a signed unit entry of a `dim`-dimensional key
//! space, and a bag of tokens is the L2-normalized sum of its tokens' entries. Keys are
//! sparse (a few hundred entries at most), so the key space can be large enough that
//! unrelated tokens rarely collide, and ROUTING stays small.
//!
//! At convert time [`build`] gives each block of token-embedding rows the key of the
//! tokens it holds and each expert of a mixture-of-experts layer the key of the tokens
//! its gate scores highest; every other tensor gets an order (where in a forward pass
//! it is used) and a cost. At mount time [`Router`] turns a prompt into a key with the
//! same tokenizer and ranks the keyed shards by cosine similarity.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokenizers::Tokenizer;
use xxhash_rust::xxh3::xxh3_64;

use crate::archive::{parse_routing, Routing, ShardKind};
use crate::model::ModelDesc;

pub mod build;

pub use build::{build_routing, embedding_rows_per_shard};

/// Key space dimension written by the converter: 2^24 (the format's maximum). Keys are
/// sparse, so the dimension costs nothing to store; what it buys is few collisions.
/// Measured on SmolLM2 (49 152 tokens): with 2^16 a prompt token's slot is shared with
/// ~0.75 other vocabulary tokens, and blocks holding none of the prompt's tokens tied
/// with the right ones; with 2^24 the expected share is ~0.003.
pub const KEY_DIM: u32 = 1 << 24;

/// Sparse vector: (index, value), indices strictly increasing.
pub type SparseKey = Vec<(u32, f32)>;

/// The signed slot of one token (hash scheme 1, docs/FORMAT.md §7).
pub fn token_slot(token: &str, dim: u32) -> (u32, f32) {
    let h = xxh3_64(token.as_bytes());
    let sign = if h >> 63 == 1 { -1.0 } else { 1.0 };
    ((h % dim as u64) as u32, sign)
}

/// The hashed bag-of-words key of `tokens` (with multiplicity), L2-normalized; empty
/// when nothing is left (no tokens, or entries that cancelled out).
pub fn bag_key<'a>(tokens: impl IntoIterator<Item = &'a str>, dim: u32) -> SparseKey {
    let mut acc: BTreeMap<u32, f32> = BTreeMap::new();
    for t in tokens {
        let (i, s) = token_slot(t, dim);
        *acc.entry(i).or_insert(0.0) += s;
    }
    let norm = acc.values().map(|v| v * v).sum::<f32>().sqrt();
    if norm == 0.0 {
        return Vec::new();
    }
    acc.into_iter()
        .filter(|(_, v)| *v != 0.0)
        .map(|(i, v)| (i, v / norm))
        .collect()
}

/// Cosine similarity of two sparse keys (each re-normalized, for numeric stability).
pub fn cosine(a: &[(u32, f32)], b: &[(u32, f32)]) -> f32 {
    let (mut i, mut j, mut dot) = (0, 0, 0.0f32);
    while i < a.len() && j < b.len() {
        match a[i].0.cmp(&b[j].0) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                dot += a[i].1 * b[j].1;
                i += 1;
                j += 1;
            }
        }
    }
    let na = a.iter().map(|x| x.1 * x.1).sum::<f32>().sqrt();
    let nb = b.iter().map(|x| x.1 * x.1).sum::<f32>().sqrt();
    if na == 0.0 || nb == 0.0 {
        0.0
    } else {
        dot / (na * nb)
    }
}

/// The model's tokenizer: its `tokenizer.json`, verbatim from a Hugging Face source or
/// derived from GGUF metadata (the same file the mount serves).
pub fn load_tokenizer(model: &ModelDesc) -> Result<Tokenizer, String> {
    let bytes = match model.hf_files.get("tokenizer.json") {
        Some(b) => b.clone(),
        None => crate::layout::hf_metadata_files(model)
            .map_err(|e| format!("tokenizer: {e}"))?
            .into_iter()
            .find(|(n, _)| n == "tokenizer.json")
            .map(|(_, b)| b)
            .ok_or("the model has no tokenizer.json")?,
    };
    // tokenizers 0.22 panics ("Helper") on a JSON syntax error inside "decoder" rather
    // than returning it (found by fuzzing, tests/fuzz_regressions.rs): check the JSON
    // first, without building a tree of it (a `Value` of a 3.5 MB tokenizer.json is
    // 31 MB of heap for a moment).
    serde_json::from_slice::<serde::de::IgnoredAny>(&bytes)
        .map_err(|e| format!("tokenizer.json does not load: not valid JSON: {e}"))?;
    // Skipping a value does not read its numbers, and one out of range in "decoder"
    // panics there too (found by fuzzing): the decoder is small, so it is parsed whole.
    #[derive(serde::Deserialize)]
    struct Decoder<'a> {
        #[serde(borrow)]
        decoder: Option<&'a serde_json::value::RawValue>,
    }
    if let Ok(Decoder { decoder: Some(d) }) = serde_json::from_slice::<Decoder>(&bytes) {
        serde_json::from_str::<serde_json::Value>(d.get())
            .map_err(|e| format!("tokenizer.json does not load: decoder: {e}"))?;
    }
    tokenizer_from_json(&bytes).map_err(|e| format!("tokenizer.json does not load: {e}"))
}

/// About the most heap [`load_tokenizer`] holds at once: deriving tokenizer.json from
/// GGUF metadata peaks near 3x the file, loading it near 7x (SmolLM2: 10.6 and 23.7 MB
/// for its 3.5 MB tokenizer.json; a non-BPE model through tokenizers' own path more).
fn load_peak_estimate(model: &ModelDesc) -> u64 {
    7 * crate::layout::tokenizer_json_len_estimate(model)
}

/// What `Tokenizer::from_bytes` gives, with less memory on the way for BPE models.
///
/// tokenizers deserializes the model through an untagged enum, which first buffers the
/// whole vocabulary and merges as a generic tree: loading SmolLM2's 3.5 MB
/// tokenizer.json peaked at 53 MB of heap to keep 9.5 MB, and the mount's memory bound
/// is its cache budget + 24 MiB. Here a BPE model is deserialized as `BPE` directly
/// (20 MB peak); the rest goes through tokenizers' own code with a stand-in model and
/// no added tokens, and then, in the order its deserializer uses, the model is set and
/// the added tokens are added (their ids come from the model or follow it, as there).
/// Any other model type takes tokenizers' own path unchanged.
fn tokenizer_from_json(bytes: &[u8]) -> Result<Tokenizer, String> {
    // tokenizers panics on some malformed models (0.22: a merge whose second token is
    // shorter than the model's continuing_subword_prefix is sliced out of bounds in
    // `BpeBuilder::build`). That is the file's fault, reported as any other.
    std::panic::catch_unwind(|| parse_tokenizer(bytes)).unwrap_or_else(|p| {
        Err(format!(
            "the tokenizers crate failed on it ({})",
            crate::error::panic_text(&*p)
        ))
    })
}

fn parse_tokenizer(bytes: &[u8]) -> Result<Tokenizer, String> {
    use serde_json::value::RawValue;
    use tokenizers::models::bpe::BPE;

    #[derive(serde::Deserialize)]
    struct ModelType<'a> {
        #[serde(rename = "type", borrow)]
        ty: Option<std::borrow::Cow<'a, str>>,
    }
    let whole = || Tokenizer::from_bytes(bytes).map_err(|e| e.to_string());
    let fields: BTreeMap<String, &RawValue> =
        serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    let Some(model) = fields.get("model") else {
        return whole();
    };
    let is_bpe = serde_json::from_str::<ModelType>(model.get())
        .is_ok_and(|m| m.ty.as_deref() == Some("BPE"));
    if !is_bpe {
        return whole();
    }
    let bpe: BPE = serde_json::from_str(model.get()).map_err(|e| format!("model: {e}"))?;
    // Each entry's "id" is not used: tokenizers' deserializer only warns when it differs.
    let added: Vec<tokenizers::AddedToken> = match fields.get("added_tokens") {
        Some(raw) => serde_json::from_str(raw.get()).map_err(|e| format!("added_tokens: {e}"))?,
        None => Vec::new(),
    };
    let stand_in = RawValue::from_string(r#"{"type":"BPE","vocab":{},"merges":[]}"#.into())
        .expect("valid JSON");
    let no_tokens = RawValue::from_string("[]".into()).expect("valid JSON");
    let mut rest: BTreeMap<&str, &RawValue> =
        fields.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    rest.insert("model", &stand_in);
    rest.insert("added_tokens", &no_tokens);
    let rest = serde_json::to_vec(&rest).map_err(|e| e.to_string())?;
    let mut tok = Tokenizer::from_bytes(&rest).map_err(|e| e.to_string())?;
    tok.with_model(bpe);
    tok.add_tokens(&added);
    Ok(tok)
}

/// Token strings of `text` under `tok` (no special tokens added).
pub fn tokenize(tok: &Tokenizer, text: &str) -> Result<Vec<String>, String> {
    let enc = tok
        .encode(text, false)
        .map_err(|e| format!("cannot tokenize the prompt: {e}"))?;
    Ok(enc.get_tokens().to_vec())
}

/// One ranked shard.
#[derive(Clone, Debug, PartialEq)]
pub struct Ranked {
    /// Index into [`Routing::shards`].
    pub shard: usize,
    pub score: f32,
}

/// The mount's router: the archive's ROUTING checked against its model, and the
/// tokenizer that makes prompt keys.
pub struct Router {
    pub routing: Routing,
    /// Whether any shard has a key (only then can a prompt be routed).
    keyed: bool,
    /// The model's tokenizer, for prompt keys. Loaded on the first route, not at mount:
    /// its vocabulary and merges take ~10 MiB of heap for a 49 k-token model that a
    /// mount which is never asked to route should not carry. A load error or a
    /// refused charge is kept and answered to every later route.
    tokenizer: Mutex<Option<Result<Arc<Tokenizer>, String>>>,
    /// Makes room for the load and accepts (or refuses) the heap the tokenizer keeps.
    budget: Option<Box<dyn TokenizerBudget>>,
}

/// Where the tokenizer's memory is accounted (the mount: its cache budget).
pub trait TokenizerBudget: Send + Sync {
    /// Before the load: set aside up to `bytes` for what it holds at once, best effort;
    /// returns what was set aside, given back with `release`.
    fn reserve(&self, bytes: u64) -> u64;
    fn release(&self, bytes: u64);
    /// After it: the bytes the tokenizer keeps for the mount's life; an error refuses
    /// the load.
    fn charge(&self, bytes: u64) -> Result<(), String>;
}

impl Router {
    /// `Ok(None)` when the archive has no routes.
    pub fn open(model: &ModelDesc, routing_bytes: &[u8]) -> Result<Option<Router>, String> {
        let routing = parse_routing(routing_bytes).map_err(|e| e.to_string())?;
        if routing.is_empty() {
            return Ok(None);
        }
        for (i, s) in routing.shards.iter().enumerate() {
            let t = model.tensors.get(s.tensor as usize).ok_or_else(|| {
                format!(
                    "ROUTING shard {i}: tensor {} does not exist ({} tensors)",
                    s.tensor,
                    model.tensors.len()
                )
            })?;
            if s.row1 > t.rows() {
                return Err(format!(
                    "ROUTING shard {i}: rows {}..{} past the {} rows of {}",
                    s.row0,
                    s.row1,
                    t.rows(),
                    t.name
                ));
            }
        }
        let keyed = routing.shards.iter().any(|s| !s.key.is_empty());
        Ok(Some(Router {
            routing,
            keyed,
            tokenizer: Mutex::new(None),
            budget: None,
        }))
    }

    /// Account for the tokenizer's memory, and its load's, in `budget`.
    pub fn with_tokenizer_budget(mut self, budget: Box<dyn TokenizerBudget>) -> Router {
        self.budget = Some(budget);
        self
    }

    fn tokenizer(&self, model: &ModelDesc) -> Result<Arc<Tokenizer>, String> {
        let mut slot = self
            .tokenizer
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(loaded) = &*slot {
            return loaded.clone();
        }
        // Room first: the load briefly holds several times the tokenizer.json, and on
        // top of a full cache that would exceed the mount's memory bound.
        let held = self
            .budget
            .as_ref()
            .map_or(0, |b| b.reserve(load_peak_estimate(model)));
        let (mut loaded, bytes) = crate::mem::retained(|| load_tokenizer(model).map(Arc::new));
        if let Some(budget) = &self.budget {
            budget.release(held);
            // Refused: dropped, and the refusal kept, so repeated routes do not load
            // (and briefly hold) it again and again.
            if loaded.is_ok() {
                if let Err(e) = budget.charge(bytes) {
                    loaded = Err(e);
                }
            }
        }
        *slot = Some(loaded.clone());
        loaded
    }

    /// The prompt's token strings and its key.
    pub fn prompt_key(
        &self,
        model: &ModelDesc,
        prompt: &str,
    ) -> Result<(Vec<String>, SparseKey), String> {
        if !self.keyed {
            return Err("this archive's routes have no keys".into());
        }
        let tok = self.tokenizer(model)?;
        let tokens = tokenize(&tok, prompt)?;
        let key = bag_key(tokens.iter().map(String::as_str), self.routing.dim);
        Ok((tokens, key))
    }

    /// Keyed shards with a positive score, best first (ties: shard order), at most `top_k`.
    pub fn rank(&self, key: &[(u32, f32)], top_k: usize) -> Vec<Ranked> {
        let mut v: Vec<Ranked> = self
            .routing
            .shards
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.key.is_empty())
            .map(|(i, s)| Ranked {
                shard: i,
                score: cosine(key, &s.key),
            })
            .filter(|r| r.score > 0.0)
            .collect();
        v.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.shard.cmp(&b.shard)));
        v.truncate(top_k);
        v
    }

    /// Shards without a key, in forward-pass order (then shard order).
    pub fn ordered(&self) -> Vec<usize> {
        let mut v: Vec<usize> = (0..self.routing.shards.len())
            .filter(|&i| {
                let s = &self.routing.shards[i];
                s.key.is_empty() && s.kind == ShardKind::Other
            })
            .collect();
        v.sort_by_key(|&i| (self.routing.shards[i].order, i));
        v
    }
}

#[cfg(test)]
mod tests;
