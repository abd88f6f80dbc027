//! Commands that work on an archive file without mounting it: inspect, verify,
//! export and apply.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

use cawsfs::archive::cawsf::CawsfArchive;
use cawsfs::layout;
use cawsfs::model::RowSource;

use super::args::{float_of, ExportArgs, Format};
use super::{bar, init_threads};

pub fn cmd_inspect(path: &Path, json: bool, blocks: bool, view: layout::GgufView) -> Result<()> {
    let ar = cawsfs::archive::open(path)?;
    let m = ar.model();
    // A model without a GGUF view is inspected all the same; `no_gguf` says why.
    let plan = layout::gguf_plan(m, view, &layout::held_of(&*ar));
    // The file too: its vocabulary can be what rules the view out.
    let (plan, no_gguf) = match plan.and_then(|p| layout::gguf_file(m, &p).map(|_| p)) {
        Ok(plan) => (Some(plan), None),
        Err(layout::LayoutError::NoGguf(why)) => (None, Some(why)),
        Err(e) => return Err(e.into()),
    };
    let served = |i: usize| {
        plan.as_ref()?
            .tensors
            .iter()
            .find(|tv| tv.parts.contains(&i))
    };
    if json {
        let tensors: Vec<_> = m
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let info = ar.tensor_summary(i);
                let locations = blocks.then(|| ar.block_locations(i));
                let gguf = served(i).map(|tv| {
                    serde_json::json!({
                        "name": tv.gguf_name, "type": layout::type_name(tv.ty), "stored": tv.raw,
                        "wanted": tv.wanted.map(layout::type_name),
                    })
                });
                serde_json::json!({
                    "gguf": gguf,
                    "block_locations": locations,
                    "name": t.name, "shape": t.shape, "source": t.source,
                    "codec": info.codec, "rows_per_block": info.rows_per_block,
                    "blocks": info.n_blocks, "bytes": info.stored_bytes,
                    "rel_err": info.rel_err,
                })
            })
            .collect();
        let sections: Vec<_> = ar
            .parts()
            .iter()
            .map(|s| serde_json::json!({"kind": s.kind, "offset": s.offset, "size": s.size, "flags": s.flags}))
            .collect();
        let v = serde_json::json!({
            "kind": ar.kind().name(), "sections": sections, "arch": m.arch,
            "tensors": tensors, "extra": ar.extra(),
            "gguf_view": plan.as_ref().map(|_| view.to_string()),
            "gguf_notes": plan.as_ref().map_or_else(Vec::new, |p| layout::gguf_notes(m, p)),
            "gguf_missing": no_gguf,
            "experts": expert_summary(m, |i| ar.tensor_summary(i).stored_bytes),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("archive: {} ({})", path.display(), ar.kind().name());
    println!("parts:");
    for s in ar.parts() {
        println!(
            "  {:<11} offset {:>12} size {:>12} flags {:#x}",
            s.kind, s.offset, s.size, s.flags
        );
    }
    let a = &m.arch;
    println!(
        "model: {} ({}) layers {} hidden {} ffn {} heads {}/{} vocab {} ctx {} tied {}",
        a.model_type,
        a.gguf_arch.as_deref().unwrap_or("no GGUF architecture"),
        a.n_layers,
        a.hidden_size,
        a.intermediate_size,
        a.n_heads,
        a.n_kv_heads,
        a.vocab_size,
        a.context_length,
        a.tie_word_embeddings
    );
    println!(
        "files kept: hf {:?}, gguf metadata keys {}",
        m.hf_files.keys().collect::<Vec<_>>(),
        m.gguf_meta.len()
    );
    println!("tensors: {}", m.tensors.len());
    println!(
        "  {:<52} {:>16} {:>10} {:>24} {:>7} {:>12} {:>7} {:>9} {:>14}",
        "name",
        "shape",
        "source",
        "codec",
        "blocks",
        "bytes",
        "bpw",
        "rel_err",
        format!("gguf ({view})")
    );
    let mut total = 0;
    for (i, t) in m.tensors.iter().enumerate() {
        let info = ar.tensor_summary(i);
        total += info.stored_bytes;
        let gguf = served(i).map_or_else(
            || "-".to_string(),
            |tv| match (tv.raw, tv.wanted) {
                (true, _) => format!("{} stored", layout::type_name(tv.ty)),
                (false, Some(w)) => {
                    format!(
                        "{} (for {})",
                        layout::type_name(tv.ty),
                        layout::type_name(w)
                    )
                }
                (false, None) => layout::type_name(tv.ty).to_string(),
            },
        );
        println!(
            "  {:<52} {:>16} {:>10} {:>24} {:>7} {:>12} {:>7.3} {:>9.5} {:>14}",
            t.name,
            format!("{:?}", t.shape),
            format!("{:?}", t.source).to_lowercase(),
            info.codec,
            info.n_blocks,
            info.stored_bytes,
            info.stored_bytes as f64 * 8.0 / t.numel().max(1) as f64,
            info.rel_err.unwrap_or(0.0),
            gguf
        );
    }
    println!("total tensor bytes: {total}");
    if let Some(x) = expert_summary(m, |i| ar.tensor_summary(i).stored_bytes) {
        let per_token = x
            .per_token
            .map_or_else(String::new, |k| format!(", {k} per token"));
        println!(
            "experts: {} layers x {}{per_token}; stored {} ({:.1}% of tensor bytes), one expert {}..{}; everything else (infrastructure) {}",
            x.layers,
            x.per_layer,
            super::control::human(x.stored_bytes),
            x.stored_bytes as f64 * 100.0 / total.max(1) as f64,
            super::control::human(x.min_expert_bytes),
            super::control::human(x.max_expert_bytes),
            super::control::human(total.saturating_sub(x.stored_bytes)),
        );
    }
    let Some(plan) = plan else {
        println!("model.gguf: not served: {}", no_gguf.unwrap_or_default());
        return Ok(());
    };
    let weights: u64 = plan
        .tensors
        .iter()
        .flat_map(|tv| &tv.parts)
        .map(|&i| m.tensors[i].numel())
        .sum();
    let bytes: u64 = plan
        .tensors
        .iter()
        .flat_map(|tv| tv.parts.iter().map(move |&i| (tv.ty, &m.tensors[i])))
        .map(|(ty, t)| ty.row_bytes(t.cols()).unwrap_or(0) * t.rows())
        .sum();
    let parts: Vec<String> = layout::gguf_summary(m, &plan)
        .into_iter()
        .map(|(ty, raw, n, w)| {
            let how = if raw { " stored" } else { "" };
            format!(
                "{}{how} {n} tensors {:.1}M weights",
                layout::type_name(ty),
                w as f64 / 1e6
            )
        })
        .collect();
    println!(
        "model.gguf ({view}): {} tensor bytes, {:.2} bits/weight: {}",
        bytes,
        bytes as f64 * 8.0 / weights.max(1) as f64,
        parts.join(", ")
    );
    for note in layout::gguf_notes(m, &plan) {
        println!("  {note}");
    }
    Ok(())
}

pub fn cmd_verify(path: &Path, quick: bool) -> Result<()> {
    let ar = cawsfs::archive::open(path)?;
    let mut fails = ar.verify_all();
    // Past the checksums: what a mount builds at start, then every block decoded.
    if fails.is_empty() && !quick {
        let m = ar.model();
        let files = [
            layout::safetensors_file(m, None).map(drop),
            match layout::gguf_plan(m, layout::GgufView::Auto, &layout::held_of(&*ar))
                .and_then(|plan| layout::gguf_file(m, &plan))
            {
                Err(layout::LayoutError::NoGguf(_)) => Ok(()),
                file => file.map(drop),
            },
            layout::hf_metadata_files(m).map(drop),
        ];
        fails.extend(
            files
                .into_iter()
                .filter_map(|r| r.err().map(|e| e.to_string())),
        );
        if let Err(e) = cawsfs::router::Router::open(m, ar.routing_bytes()) {
            fails.push(e);
        }
        if !ar.verify_decodes() {
            fails.extend(cawsfs::archive::decode_failures(ar.as_ref()));
        }
    }
    if let Some(first) = fails.first() {
        // One line: the first failure names the block; the count says how much more.
        match fails.len() - 1 {
            0 => bail!("{}: {first}", path.display()),
            n => bail!("{}: {first} (and {n} more failures)", path.display()),
        }
    }
    let blocks: usize = (0..ar.model().tensors.len())
        .map(|i| ar.tensor_summary(i).n_blocks)
        .sum();
    let how = if quick {
        "checksums verified; --quick: not decoded"
    } else {
        "verified and decoded"
    };
    println!(
        "{}: ok ({}, {} parts, {} tensors, {} blocks {how})",
        path.display(),
        ar.kind().name(),
        ar.parts().len(),
        ar.model().tensors.len(),
        blocks
    );
    if let Some(note) = ar.extra().get("note").and_then(|v| v.as_str()) {
        println!("{}: note: {note}", path.display());
    }
    Ok(())
}

pub fn cmd_export(a: ExportArgs) -> Result<()> {
    init_threads(a.threads)?;
    super::init_device(&a.device, false)?;
    let ar = cawsfs::archive::open(&a.archive)?;
    let model = ar.model();
    let export = |vf: &layout::VirtualFile, path: &Path| -> Result<()> {
        let pb = bar(
            vf.size,
            "{elapsed_precise} [{bar:40}] {bytes}/{total_bytes} {msg}",
        );
        pb.set_message(vf.name.clone());
        cawsfs::export::export_file(vf, &*ar as &dyn RowSource, path, &|done| {
            pb.set_position(done)
        })?;
        pb.finish_and_clear();
        println!("wrote {} ({} bytes)", path.display(), vf.size);
        Ok(())
    };
    match a.format {
        Format::Gguf => {
            let plan = layout::gguf_plan(model, a.gguf_type, &layout::held_of(&*ar))?;
            for note in layout::gguf_notes(model, &plan) {
                eprintln!("{note}");
            }
            export(&layout::gguf_file(model, &plan)?, &a.output)
        }
        Format::Safetensors => export(
            &layout::safetensors_file(model, a.dtype.map(float_of))?,
            &a.output,
        ),
        Format::HfDir => {
            std::fs::create_dir_all(&a.output)
                .with_context(|| format!("{}", a.output.display()))?;
            for (name, bytes) in layout::hf_metadata_files(model)? {
                let p = a.output.join(&name);
                // A sentence-transformers module's file (`1_Pooling/config.json`).
                if let Some(d) = p.parent() {
                    std::fs::create_dir_all(d).with_context(|| format!("{}", d.display()))?;
                }
                std::fs::write(&p, bytes).with_context(|| format!("{}", p.display()))?;
                println!("wrote {}", p.display());
            }
            let (files, index) =
                layout::safetensors_view(model, a.dtype.map(float_of), a.safetensors_shard_size)?;
            if let Some(index) = index {
                let p = a.output.join(layout::SAFETENSORS_INDEX);
                std::fs::write(&p, index).with_context(|| format!("{}", p.display()))?;
                println!("wrote {}", p.display());
            }
            for f in &files {
                export(f, &a.output.join(&f.name))?;
            }
            Ok(())
        }
    }
}

fn read_vector(path: &Path) -> Result<Vec<f32>> {
    let bytes = std::fs::read(path).with_context(|| format!("{}", path.display()))?;
    if path.extension().is_some_and(|e| e == "txt") {
        let text =
            String::from_utf8(bytes).map_err(|_| anyhow!("{}: not UTF-8 text", path.display()))?;
        return text
            .split_whitespace()
            .map(|w| {
                w.parse::<f32>()
                    .map_err(|_| anyhow!("{}: {w:?} is not a number", path.display()))
            })
            .collect();
    }
    if bytes.len() % 4 != 0 {
        bail!(
            "{}: {} bytes is not a whole number of f32 values",
            path.display(),
            bytes.len()
        );
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

pub fn cmd_apply(path: &Path, tensor: &str, x: &Path, output: Option<&Path>) -> Result<()> {
    let ar = CawsfArchive::open(path)?;
    let i = ar
        .model()
        .tensor_index(tensor)
        .ok_or_else(|| anyhow!("{}: no tensor named {tensor}", path.display()))?;
    let cols = ar.model().tensors[i].cols();
    let xv = read_vector(x)?;
    if xv.len() as u64 != cols {
        bail!(
            "{}: x has {} values but tensor {tensor} has {cols} columns",
            x.display(),
            xv.len()
        );
    }
    let y = ar
        .apply(i, &xv)
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    match output {
        Some(o) => {
            let bytes: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
            std::fs::write(o, bytes).with_context(|| format!("{}", o.display()))?;
            println!("wrote {} values to {}", y.len(), o.display());
        }
        None => {
            for v in &y {
                println!("{v}");
            }
        }
    }
    Ok(())
}

/// How a mixture of experts' experts are stored, for `inspect`.
#[derive(serde::Serialize)]
struct ExpertSummary {
    /// Layers that hold experts, and the most experts one of them holds.
    layers: usize,
    per_layer: usize,
    per_token: Option<u32>,
    /// Stored bytes of all experts' tensors, and of the smallest and largest expert
    /// (its gate, up and down matrices together).
    stored_bytes: u64,
    min_expert_bytes: u64,
    max_expert_bytes: u64,
}

/// None for a dense model.
fn expert_summary(
    m: &cawsfs::model::ModelDesc,
    bytes: impl Fn(usize) -> u64,
) -> Option<ExpertSummary> {
    let x = layout::ExpertTensors::of(m);
    let experts = x.per_expert(bytes);
    let mut per_layer = std::collections::BTreeMap::<u32, usize>::new();
    for ((l, _), _) in &experts {
        *per_layer.entry(*l).or_insert(0) += 1;
    }
    let sizes = || experts.iter().map(|(_, b)| *b);
    Some(ExpertSummary {
        layers: per_layer.len(),
        per_layer: per_layer.values().copied().max()?,
        per_token: x.per_token,
        stored_bytes: sizes().sum(),
        min_expert_bytes: sizes().min()?,
        max_expert_bytes: sizes().max()?,
    })
}
