//! `cawsfs convert`: the three archive kinds' converters, their progress bars and
//! their per-tensor reports.

use anyhow::{bail, Context, Result};
use clap::ValueEnum;

use cawsfs::archive::Compression;
use cawsfs::convert::{self, ConvertOptions};
use cawsfs::reconstruct::DeviceChoice;

use super::args::{BaseDtypeArg, BpwCodec, Comp, ConvertArgs, To};
use super::{bar, init_device, init_threads};

/// `cawsfs calibrate`: the statistics file `convert --calibration` reads.
pub fn cmd_calibrate(
    src: &std::path::Path,
    out: &std::path::Path,
    text: Option<&std::path::Path>,
    tokens: usize,
) -> Result<()> {
    use convert::calibrate::{write_statistics, SelfCalibration};
    let cal = match text {
        Some(p) => SelfCalibration::from_file(p, tokens)?,
        None => SelfCalibration {
            max_tokens: tokens,
            ..SelfCalibration::bundled()
        },
    };
    let model = cawsfs::import::open_source(src)?;
    let t0 = std::time::Instant::now();
    match write_statistics(model.as_ref(), &cal, out)
        .with_context(|| format!("calibrating {}", src.display()))?
    {
        Ok(n) => println!(
            "{}: statistics of {n} tokens of {} ({:.1} s)",
            out.display(),
            cal.label,
            t0.elapsed().as_secs_f64()
        ),
        Err(why) => bail!("{}: cannot calibrate: {why}", src.display()),
    }
    Ok(())
}

pub fn cmd_convert(a: ConvertArgs) -> Result<()> {
    refuse_foreign_flags(&a)?;
    if !a.verify && (a.device.device != DeviceChoice::Auto || a.device.vram_budget.is_some()) {
        bail!("--device and --vram-budget choose where --verify decodes: add --verify");
    }
    init_threads(a.threads)?;
    if a.verify {
        // Before converting: a device that cannot be used fails at once, not minutes later.
        init_device(&a.device, false)?;
    }
    // An object is written as a local file first, checked, then uploaded.
    let upload_to = cawsfs::archive::remote::is_url(&a.output).then(|| a.output.clone());
    let mut a = a;
    let _staging = match &upload_to {
        Some(url) => {
            if a.to == To::NpyDir {
                bail!(
                    "{}: an npy-dir is written to a local directory only",
                    url.display()
                );
            }
            // Refused before converting, not after.
            if !url
                .to_string_lossy()
                .to_ascii_lowercase()
                .starts_with("s3://")
            {
                bail!(
                    "{}: archives are uploaded to s3:// only (an HTTP server takes no uploads)",
                    url.display()
                );
            }
            let dir = tempfile::Builder::new()
                .prefix("cawsfs-upload-")
                .tempdir()
                .context("a staging directory for the upload (TMPDIR)")?;
            a.output = dir.path().join("archive");
            Some(dir)
        }
        None => None,
    };
    let (verify, output) = (a.verify, a.output.clone());
    match a.to {
        To::Cawsf => convert_cawsf(a)?,
        To::Delta => cmd_convert_delta(a)?,
        To::NpyDir => cmd_convert_npy(a)?,
    }
    if verify {
        // The written archive read back as a mount would.
        super::archive::cmd_verify(&output, false)?;
    }
    if let Some(url) = upload_to {
        let t = std::time::Instant::now();
        let n = cawsfs::archive::remote::upload(&output, &url)?;
        println!(
            "uploaded {} to {} in {:.1} s",
            bytesize::ByteSize::b(n).display().iec(),
            url.display(),
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

fn convert_cawsf(a: ConvertArgs) -> Result<()> {
    let src = cawsfs::import::open_source(&a.src)?;
    let mut opts = ConvertOptions::default();
    let pq_given =
        a.pq_m.is_some() || a.pq_dim.is_some() || a.pq_k.is_some() || a.kmeans_iters.is_some();
    // (clap refuses --bpw beside the other PQ options.)
    if a.bpw.is_some() && pq_given {
        bail!("--kmeans-iters trains PQ codebooks, which --bpw replaces with scalar groups");
    }
    // Without a choice of R, a bits-per-weight plan: the best KL-divergence per bit
    // measured (docs/QUALITY.md).
    let bpw = match a.bpw {
        Some(b) => Some((b, false)),
        None if !pq_given && a.sq_bits.is_none() => Some((convert::DEFAULT_BPW, true)),
        None => None,
    };
    if let Some((target, implied)) = bpw {
        // Scalar R with no L or S measured best per bit (docs/CODECS.md), and the
        // embedding and output are the planner's to price, not kept whole by default.
        opts.ndsq.rank = 0;
        opts.ndsq.outlier_q = 1.0;
        opts.passthrough.clear();
        opts.bpw = Some(target);
        opts.bpw_at_least_floor = implied;
    }
    if let Some(r) = a.rank {
        opts.ndsq.rank = r;
    }
    if let Some(q) = a.outlier_q {
        opts.ndsq.outlier_q = q;
    }
    let nd = &mut opts.ndsq;
    nd.pq_m = a.pq_m;
    nd.pq_dim = a.pq_dim.unwrap_or(nd.pq_dim);
    nd.pq_k = a.pq_k.unwrap_or(nd.pq_k);
    nd.kmeans_iters = a.kmeans_iters.unwrap_or(nd.kmeans_iters);
    nd.seed = a.seed;
    if let Some(bits) = a.sq_bits {
        if pq_given {
            bail!(
                "--pq-m, --pq-dim, --pq-k and --kmeans-iters set up PQ, which --sq-bits replaces"
            );
        }
        opts.ndsq.sq = Some(cawsfs::codec::SqParams {
            bits,
            group: a.sq_group,
        });
        for rule in &a.sq_for {
            let parsed = rule.rsplit_once('=').and_then(|(p, v)| {
                let (bits, group) = match v.split_once('/') {
                    Some((b, g)) => (b.parse().ok()?, g.parse().ok()?),
                    None => (v.parse().ok()?, a.sq_group),
                };
                Some((p.to_string(), cawsfs::codec::SqParams { bits, group }))
            });
            let Some(r) = parsed else {
                bail!("--sq-for {rule:?}: expected PATTERN=BITS or PATTERN=BITS/GROUP");
            };
            opts.sq_for.push(r);
        }
    }
    opts.bpw_sq = a.bpw_codec == BpwCodec::Sq;
    for rule in &a.type_for {
        let parsed = rule
            .rsplit_once('=')
            .and_then(|(p, t)| Some((p.to_string(), cawsfs::gguf::GgmlType::from_name(t)?)));
        let Some(r) = parsed else {
            bail!("--type-for {rule:?}: expected PATTERN=TYPE with TYPE a ggml type (q5_0, iq4_nl ...)");
        };
        if opts.bpw.is_none() {
            bail!("--type-for chooses types within a --bpw plan; it cannot be combined with --sq-bits or PQ options");
        }
        opts.type_for.push(r);
    }
    if !a.bpw_types.is_empty() {
        let mut types = Vec::new();
        for name in &a.bpw_types {
            match cawsfs::gguf::GgmlType::from_name(name) {
                Some(ty) if cawsfs::gguf::fit::can_fit(ty) => types.push(ty),
                _ => bail!("--bpw-types: {name:?} is not a type cawsfs rounds into (q2_k q3_k q4_0 q4_1 q4_k q5_0 q5_1 q5_k q6_k q8_0 iq4_nl iq4_xs)"),
            }
        }
        if opts.bpw.is_none() || opts.bpw_sq {
            bail!("--bpw-types chooses among ggml types within a --bpw plan; it cannot be combined with --sq-bits, --bpw-codec sq or PQ options");
        }
        opts.bpw_types = Some(types);
    }
    if a.no_default_passthrough {
        opts.passthrough.clear();
    }
    opts.passthrough.extend(a.passthrough.iter().cloned());
    opts.compression = compression_of(a.compression);
    opts.min_saving = a.min_saving;
    if let Some(p) = &a.imatrix {
        opts.imatrix = Some(std::sync::Arc::new(cawsfs::import::imatrix::Imatrix::open(
            p,
        )?));
    }
    if let Some(p) = &a.calibration {
        opts.calibration = Some(std::sync::Arc::new(
            cawsfs::import::calibration::Calibration::open(p)?,
        ));
    }
    opts.self_calibration = match (&a.calibration_text, a.no_calibration) {
        (_, true) => None,
        (Some(p), false) => Some(convert::calibrate::SelfCalibration::from_file(
            p,
            a.calibration_tokens as usize,
        )?),
        (None, false) => Some(convert::calibrate::SelfCalibration {
            max_tokens: a.calibration_tokens as usize,
            ..convert::calibrate::SelfCalibration::bundled()
        }),
    };
    opts.sensitivity_tokens = a.sensitivity_tokens as usize;
    let (pb, progress) = weights_bar(src.desc());
    let report = convert::convert(src.as_ref(), &a.output, &opts, &progress)
        .with_context(|| format!("converting {}", a.src.display()))?;
    pb.finish_and_clear();
    if let Some(b) = &report.bpw {
        let target = match (b.at_floor, a.bpw.is_none()) {
            (false, false) => format!("{}", b.target),
            (false, true) => format!("{} (the default)", b.target),
            (true, _) => format!(
                "{} (the default), below the smallest archive this model allows",
                b.target
            ),
        };
        println!(
            "bits per weight: target {target}, planned {:.3} (block compression estimated from samples), achieved {:.3}",
            b.planned, report.bits_per_weight
        );
    }
    if let Some(c) = &report.calibration {
        match &c.skipped {
            Some(why) => println!("error feedback: none ({why})"),
            None if c.seconds > 0.0 => println!(
                "error feedback: statistics of a forward pass over {} tokens of {} ({:.1} s)",
                c.tokens, c.source, c.seconds
            ),
            None => println!(
                "error feedback: statistics from {} ({} tokens)",
                c.source, c.tokens
            ),
        }
    }
    if let Some(s) = &report.sensitivity {
        match &s.skipped {
            Some(why) => {
                println!("sensitivity: not measured ({why}); relative error planned alike")
            }
            None => println!(
                "sensitivity: measured for {} tensors over {} tokens ({:.1} s)",
                s.tensors, s.tokens, s.seconds
            ),
        }
    }
    if let Some(u) = &report.imatrix {
        let chunks = u.chunks.map_or(String::new(), |c| format!(", {c} chunks"));
        println!(
            "importance matrix {} ({} entries{chunks}): {} coded tensors weighted, {} without an entry{}",
            u.path,
            u.entries,
            u.weighted,
            u.unweighted.len(),
            if u.unweighted.is_empty() {
                String::new()
            } else {
                format!(" ({})", u.unweighted.join(", "))
            }
        );
    }
    print_report(&report, ("codec", 24), ("archive", "lossy"), &a)
}

/// A progress bar over the weights of `desc`'s tensors, with an ETA (tensors differ in
/// size by 1000×, so counting tensors says little), and the converters' progress
/// callback driving it: they finish tensors in model order, so `done` tensors finished
/// are the weights of the first `done`.
fn weights_bar(
    desc: &cawsfs::model::ModelDesc,
) -> (indicatif::ProgressBar, impl Fn(usize, usize, &str) + Sync) {
    let mut upto = vec![0u64];
    for t in &desc.tensors {
        upto.push(upto.last().copied().unwrap_or(0) + t.numel());
    }
    let pb = bar(
        upto.last().copied().unwrap_or(0),
        "{elapsed_precise} [{bar:40}] {percent:>3}% of {human_len} weights, eta {eta} {msg}",
    );
    let p = pb.clone();
    (pb, move |done: usize, _: usize, name: &str| {
        p.set_position(upto.get(done).copied().unwrap_or(0));
        p.set_message(name.to_string());
    })
}

/// The per-tensor table and totals of a cawsf or npy-dir conversion, and the JSON report
/// when asked for. `col` = (label, width) of the codec column; `what` = (what was
/// written, which error the totals summarize).
fn print_report(
    report: &convert::ConvertReport,
    (col, width): (&str, usize),
    (what, err): (&str, &str),
    a: &ConvertArgs,
) -> Result<()> {
    println!(
        "{:<52} {:>16} {:>width$} {:>12} {:>7} {:>9}",
        "tensor", "shape", col, "bytes", "bpw", "rel_err"
    );
    for t in &report.tensors {
        println!(
            "{:<52} {:>16} {:>width$} {:>12} {:>7.3} {:>9.5}",
            t.name,
            format!("{:?}", t.shape),
            t.codec,
            t.bytes,
            t.bits_per_weight,
            t.rel_err
        );
    }
    println!(
        "total: {} weights, {what} {} bytes, {:.3} bits per weight, {err} rel_err mean {:.5} max {:.5} -> {}",
        report.total_weights,
        report.archive_bytes,
        report.bits_per_weight,
        report.mean_rel_err,
        report.max_rel_err,
        a.output.display()
    );
    write_report_json(report, a)
}

fn write_report_json(report: &impl serde::Serialize, a: &ConvertArgs) -> Result<()> {
    if let Some(p) = &a.report_json {
        std::fs::write(p, serde_json::to_vec_pretty(report)?)
            .with_context(|| format!("{}", p.display()))?;
    }
    Ok(())
}

/// Options given (away from their defaults) that the chosen kind would silently ignore
/// are refused, in one line naming each with the kinds it is for.
fn refuse_foreign_flags(a: &ConvertArgs) -> Result<()> {
    use To::{Cawsf, Delta, NpyDir};
    let given: [(&str, bool, &[To]); 28] = [
        ("--rank", a.rank.is_some(), &[Cawsf, Delta]),
        ("--max-rel-err", a.max_rel_err.is_some(), &[Delta]),
        ("--bases", a.bases != 1, &[Delta]),
        (
            "--base-dtype",
            !matches!(a.base_dtype, BaseDtypeArg::F16),
            &[Delta],
        ),
        ("--outlier-q", a.outlier_q.is_some(), &[Cawsf]),
        ("--bpw", a.bpw.is_some(), &[Cawsf]),
        ("--type-for", !a.type_for.is_empty(), &[Cawsf]),
        ("--bpw-types", !a.bpw_types.is_empty(), &[Cawsf]),
        ("--bpw-codec", a.bpw_codec != BpwCodec::Ggml, &[Cawsf]),
        ("--pq-m", a.pq_m.is_some(), &[Cawsf]),
        ("--pq-dim", a.pq_dim.is_some(), &[Cawsf]),
        ("--pq-k", a.pq_k.is_some(), &[Cawsf]),
        ("--kmeans-iters", a.kmeans_iters.is_some(), &[Cawsf, Delta]),
        ("--seed", a.seed != 0, &[Cawsf]),
        ("--sq-bits", a.sq_bits.is_some(), &[Cawsf]),
        ("--imatrix", a.imatrix.is_some(), &[Cawsf]),
        ("--calibration", a.calibration.is_some(), &[Cawsf]),
        ("--calibration-text", a.calibration_text.is_some(), &[Cawsf]),
        (
            "--calibration-tokens",
            a.calibration_tokens != convert::calibrate::DEFAULT_TOKENS as u64,
            &[Cawsf],
        ),
        ("--no-calibration", a.no_calibration, &[Cawsf]),
        (
            "--sensitivity-tokens",
            a.sensitivity_tokens != convert::calibrate::probe::DEFAULT_TOKENS as u64,
            &[Cawsf],
        ),
        ("--passthrough", !a.passthrough.is_empty(), &[Cawsf, NpyDir]),
        (
            "--no-default-passthrough",
            a.no_default_passthrough,
            &[Cawsf, NpyDir],
        ),
        (
            "--compression",
            !matches!(a.compression, Comp::Zstd),
            &[Cawsf, Delta],
        ),
        ("--min-saving", a.min_saving != 0.0, &[Cawsf, Delta]),
        ("--bits", a.bits != 8, &[NpyDir]),
        ("--group", a.group != 64, &[NpyDir]),
        ("--zstd", a.zstd, &[NpyDir]),
    ];
    let name = |t: To| {
        t.to_possible_value()
            .expect("no skipped variants")
            .get_name()
            .to_string()
    };
    let foreign: Vec<String> = given
        .iter()
        .filter(|(_, set, kinds)| *set && !kinds.contains(&a.to))
        .map(|(flag, _, kinds)| {
            let kinds: Vec<String> = kinds.iter().map(|&k| name(k)).collect();
            format!("{flag} (for {})", kinds.join(", "))
        })
        .collect();
    if !foreign.is_empty() {
        bail!("--to {} does not take {}", name(a.to), foreign.join(", "));
    }
    Ok(())
}

fn compression_of(c: Comp) -> Compression {
    match c {
        Comp::Zstd => Compression::Zstd(3),
        Comp::Lz4 => Compression::Lz4,
        Comp::None => Compression::None,
    }
}

fn cmd_convert_delta(a: ConvertArgs) -> Result<()> {
    use cawsfs::codec::delta::{BaseDtype, RankChoice};
    use cawsfs::convert::delta::{self, DeltaOptions};
    let mut opts = DeltaOptions::default();
    if let Some(r) = a.rank {
        opts.rank = RankChoice::Fixed(r as usize);
    }
    if let Some(e) = a.max_rel_err {
        opts.rank = RankChoice::MaxRelErr(e);
    }
    opts.bases = a.bases;
    opts.base_dtype = match a.base_dtype {
        BaseDtypeArg::F16 => BaseDtype::F16,
        BaseDtypeArg::Int8 => BaseDtype::Int8,
    };
    if let Some(k) = a.kmeans_iters {
        opts.kmeans_iters = k;
    }
    opts.compression = compression_of(a.compression);
    opts.min_saving = a.min_saving;
    let src = cawsfs::import::open_source(&a.src)?;
    let pb = bar(1, "{elapsed_precise} [{bar:40}] {pos}/{len} {msg}");
    let report = delta::convert(src.as_ref(), &a.output, &opts, &|done, total, name| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
        pb.set_message(name.to_string());
    })
    .with_context(|| format!("converting {}", a.src.display()))?;
    pb.finish_and_clear();
    print_delta_report(&report);
    println!("-> {}", a.output.display());
    write_report_json(&report, &a)
}

fn print_delta_report(r: &cawsfs::convert::delta::DeltaReport) {
    let opt = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |v| format!("{v:.4}"));
    println!(
        "{:<44} {:>5} {:>10} {:>7} {:>8} {:>8} {:>8} {:>8}",
        "matrix", "rank", "bytes", "bpw", "rel_err", "base_err", "cos_prev", "cos_base"
    );
    for m in &r.matrices {
        println!(
            "{:<44} {:>5} {:>10} {:>7.3} {:>8.4} {:>8.4} {:>8} {:>8.4}{}",
            m.name,
            m.rank,
            m.bytes,
            m.bits_per_weight,
            m.rel_err,
            m.base_rel_err,
            opt(m.cos_prev),
            m.cos_base,
            m.note
                .as_deref()
                .map(|n| format!("  ({n})"))
                .unwrap_or_default()
        );
    }
    println!("bases:");
    for b in &r.bases {
        println!(
            "  {:<28} #{} layers {:?} {} bytes",
            b.ty, b.cluster, b.layers, b.bytes
        );
    }
    println!("per type (mean over layers):");
    let mut types: Vec<&str> = Vec::new();
    for m in &r.matrices {
        if !types.contains(&m.ty.as_str()) {
            types.push(&m.ty);
        }
    }
    for ty in types {
        let ms: Vec<_> = r.matrices.iter().filter(|m| m.ty == ty).collect();
        let mean = |f: &dyn Fn(&cawsfs::convert::delta::MatrixReport) -> Option<f64>| {
            let v: Vec<f64> = ms.iter().filter_map(|m| f(m)).collect();
            v.iter().sum::<f64>() / v.len().max(1) as f64
        };
        println!(
            "  {:<10} rank {:>7.1} rel_err {:.4} base_err {:.4} cos_prev {:.4} cos_base {:.4}",
            ty,
            mean(&|m| Some(m.rank as f64)),
            mean(&|m| Some(m.rel_err)),
            mean(&|m| Some(m.base_rel_err)),
            mean(&|m| m.cos_prev),
            mean(&|m| Some(m.cos_base)),
        );
    }
    println!(
        "total: {} weights, archive {} bytes, {:.3} bits per weight ({:.3} over the delta matrices incl. bases), rel_err mean {:.5} max {:.5}{}",
        r.total_weights,
        r.archive_bytes,
        r.bits_per_weight,
        r.delta_bits_per_weight,
        r.mean_rel_err,
        r.max_rel_err,
        if r.unreachable > 0 {
            format!(", {} matrices could not meet --max-rel-err at full rank", r.unreachable)
        } else {
            String::new()
        }
    );
}

fn cmd_convert_npy(a: ConvertArgs) -> Result<()> {
    let src = cawsfs::import::open_source(&a.src)?;
    let mut opts = cawsfs::convert::npydir::NpyOptions {
        bits: a.bits,
        group: a.group,
        zstd: a.zstd,
        ..Default::default()
    };
    if a.no_default_passthrough {
        opts.passthrough.clear();
    }
    opts.passthrough.extend(a.passthrough.iter().cloned());
    let (pb, progress) = weights_bar(src.desc());
    let report = cawsfs::convert::npydir::convert(src.as_ref(), &a.output, &opts, &progress)
        .with_context(|| format!("converting {}", a.src.display()))?;
    pb.finish_and_clear();
    print_report(&report, ("kind", 22), ("directory", "quantized"), &a)
}
