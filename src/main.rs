//! The `cawsfs` command line: parses arguments and calls the library. Every error
//! reaches the user as one line naming the thing and the problem.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use cawsfs::archive::cawsf::CawsfArchive;
use cawsfs::archive::Compression;
use cawsfs::convert::{self, ConvertOptions};
use cawsfs::layout::{self, GgufOutType};
use cawsfs::model::{FloatType, RowSource};

#[derive(Parser)]
#[command(
    name = "cawsfs",
    version,
    about = "Mount compressed LLM weight archives as plain model files"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Convert a Hugging Face directory or a GGUF file into an archive (.cawsf, delta or npy-dir).
    Convert(ConvertArgs),
    /// Show an archive's sections, model and tensors.
    Inspect {
        archive: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// With --json: list each block's file offset and stored length.
        #[arg(long)]
        blocks: bool,
    },
    /// Check every checksum in an archive; exits non-zero naming the first bad one.
    Verify { archive: PathBuf },
    /// Write a virtual file (or a Hugging Face directory) out of an archive.
    Export(ExportArgs),
    /// Mount an archive: a read-only directory of model files reconstructed on read.
    Mount(MountArgs),
    /// Unmount a cawsfs mount and wait for its daemon to exit.
    Umount { mountpoint: PathBuf },
    /// Show a mount's cache and read statistics.
    Stat {
        mountpoint: PathBuf,
        /// Control socket (default: the one the mount registered).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Print the daemon's reply as JSON.
        #[arg(long, conflicts_with_all = ["prometheus", "watch"])]
        json: bool,
        /// Prometheus text exposition format.
        #[arg(long, conflicts_with = "watch")]
        prometheus: bool,
        /// Refresh in place like top.
        #[arg(long)]
        watch: bool,
        /// Seconds between refreshes with --watch.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
    },
    /// Ask a mount to reconstruct a tensor, a layer or a byte range in the background.
    Prefetch(SelectArgs),
    /// Keep a tensor, layer or byte range resident (counts against the cache budget).
    Pin(SelectArgs),
    /// Let pinned chunks be evicted again.
    Unpin(SelectArgs),
    /// Drop unpinned chunks from a mount's cache: all of them, or those of a tensor,
    /// layer or byte range.
    Evict(EvictArgs),
    /// Rank the shards a prompt will need (the archive's router); optionally prefetch them.
    Route(RouteArgs),
    /// Record which chunks are read, in order (`on`), and print the record (`off`, JSON).
    Trace {
        mountpoint: PathBuf,
        #[arg(value_parser = ["on", "off"])]
        state: String,
        #[arg(long)]
        socket: Option<PathBuf>,
    },
    /// Compute y = Ŵx for one tensor straight from its compressed components.
    Apply {
        archive: PathBuf,
        /// Tensor name (Hugging Face convention).
        #[arg(long)]
        tensor: String,
        /// x: little-endian f32 values, or whitespace-separated numbers if the name ends in .txt.
        #[arg(long)]
        x: PathBuf,
        /// Write y as little-endian f32 here instead of printing it.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
}

/// What a cache verb acts on: a tensor, a layer, or a virtual file's byte range.
#[derive(clap::Args)]
struct Selector {
    /// A tensor (Hugging Face name), in every file that holds it.
    #[arg(long)]
    tensor: Option<String>,
    /// Every tensor of one transformer block.
    #[arg(long)]
    layer: Option<u32>,
    /// A virtual file (e.g. model.gguf), whole or with --range.
    #[arg(long)]
    file: Option<String>,
    /// Byte range A..B of --file.
    #[arg(long, requires = "file", value_parser = parse_range)]
    range: Option<(u64, u64)>,
}

impl Selector {
    /// None when no selector was given (clap allows at most one).
    fn target(&self) -> Option<cawsfs::control::Target> {
        use cawsfs::control::Target;
        match (&self.tensor, self.layer, &self.file) {
            (Some(t), _, _) => Some(Target::Tensor(t.clone())),
            (_, Some(l), _) => Some(Target::Layer(l)),
            (_, _, Some(f)) => Some(Target::File {
                file: f.clone(),
                range: self.range,
            }),
            _ => None,
        }
    }
}

/// prefetch / pin / unpin: exactly one selector.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["tensor", "layer", "file"])))]
struct SelectArgs {
    mountpoint: PathBuf,
    #[command(flatten)]
    what: Selector,
    #[arg(long)]
    socket: Option<PathBuf>,
}

impl SelectArgs {
    fn target(&self) -> cawsfs::control::Target {
        self.what.target().expect("clap requires one selector")
    }
}

/// evict: at most one selector (none = everything unpinned).
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("what").args(["tensor", "layer", "file"])))]
struct EvictArgs {
    mountpoint: PathBuf,
    #[command(flatten)]
    what: Selector,
    #[arg(long)]
    socket: Option<PathBuf>,
}

fn parse_range(s: &str) -> std::result::Result<(u64, u64), String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("{s:?}: expected A..B"))?;
    let a = cawsfs::mount::parse_size(a).or_else(|e| if a == "0" { Ok(0) } else { Err(e) })?;
    let b = cawsfs::mount::parse_size(b)?;
    if a >= b {
        return Err(format!("{s:?}: empty range"));
    }
    Ok((a, b))
}

#[derive(clap::Args)]
struct RouteArgs {
    mountpoint: PathBuf,
    /// The prompt.
    #[arg(short, long)]
    prompt: String,
    /// Keyed shards (embedding blocks, experts) to return.
    #[arg(long)]
    top_k: Option<u32>,
    /// Cache bytes the route may name, e.g. 64MiB; the rest of the budget goes to the
    /// other shards in forward-pass order.
    #[arg(long, value_parser = cawsfs::mount::parse_size)]
    budget: Option<u64>,
    /// Reconstruct the routed shards in the background now.
    #[arg(long)]
    prefetch: bool,
    /// Virtual file whose chunks to name (default model.gguf).
    #[arg(long)]
    file: Option<String>,
    /// Print the daemon's reply as JSON.
    #[arg(long)]
    json: bool,
    #[arg(long)]
    socket: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum Eviction {
    /// Chunks a pending route names are evicted after all others.
    Router,
    /// Plain least-recently-used.
    Lru,
}

#[derive(clap::Args)]
struct MountArgs {
    archive: PathBuf,
    mountpoint: PathBuf,
    /// Cache budget for reconstructed bytes, e.g. 2GiB (default: a quarter of RAM).
    #[arg(long, value_parser = cawsfs::mount::parse_size)]
    cache_size: Option<u64>,
    /// FUSE request threads.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Background prefetch / read-ahead threads.
    #[arg(long, default_value_t = 2)]
    prefetch_threads: usize,
    /// Tensor type of 2-D weights in model.gguf.
    #[arg(long, value_enum, default_value_t = Dtype::F16)]
    gguf_type: Dtype,
    /// Tensor dtype of model.safetensors (default: the source's float type).
    #[arg(long, value_enum)]
    dtype: Option<Dtype>,
    /// Let other users read the mount (needs user_allow_other in /etc/fuse.conf for non-root).
    #[arg(long)]
    allow_other: bool,
    /// Control socket path (default: derived from the mount point).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Chunks queued after a sequential read (0: no read-ahead by cawsfs).
    #[arg(long, default_value_t = cawsfs::cache::DEFAULT_READAHEAD_CHUNKS)]
    readahead_chunks: u64,
    /// Eviction policy of the chunk cache.
    #[arg(long, value_enum, default_value_t = Eviction::Router)]
    eviction: Eviction,
    /// Pin infrastructure in model.gguf: norms and other 1-D tensors, and the first
    /// --pin-infra-layers layers. The mount fails if they do not fit the cache budget.
    #[arg(long)]
    pin_infra: bool,
    #[arg(long, default_value_t = 2, requires = "pin_infra")]
    pin_infra_layers: u32,
    /// With --pin-infra: also pin the token-embedding blocks of this text's tokens.
    #[arg(long, requires = "pin_infra")]
    pin_prompt: Option<String>,
    /// Stay attached and log to stderr instead of running in the background.
    #[arg(long)]
    foreground: bool,
}

#[derive(clap::Args)]
struct ConvertArgs {
    /// Hugging Face model directory or .gguf file.
    src: PathBuf,
    #[arg(short, long)]
    output: PathBuf,
    /// Archive kind to write.
    #[arg(long, value_enum, default_value_t = To::Cawsf)]
    to: To,
    /// Rank of the low-rank component: L for cawsf (default 4), each layer's delta for
    /// delta (default 64).
    #[arg(long, conflicts_with = "max_rel_err")]
    rank: Option<u32>,
    /// delta: per matrix, the smallest rank whose stored ‖W−Ŵ‖/‖W‖ is at most this.
    #[arg(long)]
    max_rel_err: Option<f64>,
    /// delta: bases per weight type (k-means clusters of layers; 1 = mean of all layers).
    #[arg(long, default_value_t = 1)]
    bases: usize,
    /// delta: how bases are stored.
    #[arg(long, value_enum, default_value_t = BaseDtypeArg::F16)]
    base_dtype: BaseDtypeArg,
    /// |value| quantile of W−L above which entries are kept exactly as outliers (S).
    #[arg(long, default_value_t = ConvertOptions::default().ndsq.outlier_q)]
    outlier_q: f32,
    /// PQ sub-vectors per row (must divide every coded tensor's width); overrides --pq-dim.
    #[arg(long)]
    pq_m: Option<u32>,
    /// PQ sub-vector length (bits per weight of R = 8 / pq-dim when k = 256).
    #[arg(long, default_value_t = ConvertOptions::default().ndsq.pq_dim)]
    pq_dim: u32,
    /// PQ centroids per codebook (at most 256).
    #[arg(long, default_value_t = ConvertOptions::default().ndsq.pq_k)]
    pq_k: u32,
    #[arg(long, default_value_t = ConvertOptions::default().ndsq.kmeans_iters)]
    kmeans_iters: u32,
    /// Store tensors matching this `*` pattern as bit-exact passthrough (repeatable).
    /// 1-D tensors, the token embedding and the output head always are unless
    /// --no-default-passthrough is given.
    #[arg(long = "passthrough", value_name = "PATTERN")]
    passthrough: Vec<String>,
    #[arg(long)]
    no_default_passthrough: bool,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Compression of row blocks.
    #[arg(long, value_enum, default_value_t = Comp::Zstd)]
    compression: Comp,
    /// Also write the per-tensor report as JSON here.
    #[arg(long)]
    report_json: Option<PathBuf>,
    /// npy-dir: bits per quantized weight, 8 (int8 per row) or 4 (int4 per group).
    #[arg(long, default_value_t = 8)]
    bits: u8,
    /// npy-dir: columns per int4 scale.
    #[arg(long, default_value_t = 64)]
    group: usize,
    /// npy-dir: write data files as .npy.zst (one zstd frame per row block).
    #[arg(long)]
    zstd: bool,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum To {
    /// NDSQ .cawsf container (D + L + R + S).
    Cawsf,
    /// Shared bases + per-layer low-rank deltas (Base + U·Vᵀ).
    Delta,
    /// Squish npy directory (int8 / int4 / f16 passthrough).
    NpyDir,
}

#[derive(Clone, Copy, ValueEnum)]
enum BaseDtypeArg {
    F16,
    Int8,
}

#[derive(Clone, Copy, ValueEnum)]
enum Comp {
    Zstd,
    Lz4,
    None,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
enum Format {
    Safetensors,
    Gguf,
    HfDir,
}

#[derive(Clone, Copy, ValueEnum)]
enum Dtype {
    F32,
    F16,
    Bf16,
}

#[derive(clap::Args)]
struct ExportArgs {
    archive: PathBuf,
    #[arg(long, value_enum)]
    format: Format,
    #[arg(short, long)]
    output: PathBuf,
    /// Tensor dtype of model.safetensors (default: the source's float type, f16 for quantized sources).
    #[arg(long, value_enum)]
    dtype: Option<Dtype>,
    /// Tensor type of 2-D weights in model.gguf.
    #[arg(long, value_enum, default_value_t = Dtype::F16)]
    gguf_type: Dtype,
    #[arg(long)]
    threads: Option<usize>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CAWSFS_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    if !matches!(cli.cmd, Cmd::Mount(_)) {
        // `cawsfs inspect | head` should end quietly like other Unix tools, not panic in
        // println!. The daemon keeps Rust's SIGPIPE-ignored default: a client that hangs
        // up must cost one write error, not the mount.
        // SAFETY: restoring a default disposition before any thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cawsfs: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Convert(a) => cmd_convert(a),
        Cmd::Inspect {
            archive,
            json,
            blocks,
        } => cmd_inspect(&archive, json, blocks),
        Cmd::Verify { archive } => cmd_verify(&archive),
        Cmd::Export(a) => cmd_export(a),
        Cmd::Mount(a) => cmd_mount(a),
        Cmd::Umount { mountpoint } => cmd_umount(&mountpoint),
        Cmd::Stat {
            mountpoint,
            socket,
            json,
            prometheus,
            watch,
            interval,
        } => cmd_stat(
            &mountpoint,
            socket.as_deref(),
            json,
            prometheus,
            watch,
            interval,
        ),
        Cmd::Prefetch(a) => control_call(
            &a.mountpoint,
            a.socket.as_deref(),
            cawsfs::control::Request::Prefetch(a.target()),
        ),
        Cmd::Pin(a) => control_call(
            &a.mountpoint,
            a.socket.as_deref(),
            cawsfs::control::Request::Pin(a.target()),
        ),
        Cmd::Unpin(a) => control_call(
            &a.mountpoint,
            a.socket.as_deref(),
            cawsfs::control::Request::Unpin(a.target()),
        ),
        Cmd::Evict(a) => control_call(
            &a.mountpoint,
            a.socket.as_deref(),
            cawsfs::control::Request::Evict(a.what.target()),
        ),
        Cmd::Route(a) => cmd_route(a),
        Cmd::Trace {
            mountpoint,
            state,
            socket,
        } => control_call(
            &mountpoint,
            socket.as_deref(),
            cawsfs::control::Request::Trace { on: state == "on" },
        ),
        Cmd::Apply {
            archive,
            tensor,
            x,
            output,
        } => cmd_apply(&archive, &tensor, &x, output.as_deref()),
    }
}

fn init_threads(threads: Option<usize>) -> Result<()> {
    if let Some(n) = threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("setting up the thread pool")?;
    }
    Ok(())
}

fn bar(len: u64, template: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}

fn cmd_convert(a: ConvertArgs) -> Result<()> {
    refuse_foreign_flags(&a)?;
    init_threads(a.threads)?;
    match a.to {
        To::Cawsf => {}
        To::Delta => return cmd_convert_delta(a),
        To::NpyDir => return cmd_convert_npy(a),
    }
    let src = cawsfs::import::open_source(&a.src)?;
    let mut opts = ConvertOptions::default();
    if let Some(r) = a.rank {
        opts.ndsq.rank = r;
    }
    opts.ndsq.outlier_q = a.outlier_q;
    opts.ndsq.pq_m = a.pq_m;
    opts.ndsq.pq_dim = a.pq_dim;
    opts.ndsq.pq_k = a.pq_k;
    opts.ndsq.kmeans_iters = a.kmeans_iters;
    opts.ndsq.seed = a.seed;
    if a.no_default_passthrough {
        opts.passthrough.clear();
    }
    opts.passthrough.extend(a.passthrough.iter().cloned());
    opts.compression = compression_of(a.compression);
    let n = src.desc().tensors.len();
    let pb = bar(n as u64, "{elapsed_precise} [{bar:40}] {pos}/{len} {msg}");
    let report = convert::convert(src.as_ref(), &a.output, &opts, &|done, _, name| {
        pb.set_position(done as u64);
        pb.set_message(name.to_string());
    })
    .with_context(|| format!("converting {}", a.src.display()))?;
    pb.finish_and_clear();
    print_report(&report, ("codec", 24), ("archive", "NDSQ"), &a)
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
    let nd = ConvertOptions::default().ndsq;
    let given: [(&str, bool, &[To]); 16] = [
        ("--rank", a.rank.is_some(), &[Cawsf, Delta]),
        ("--max-rel-err", a.max_rel_err.is_some(), &[Delta]),
        ("--bases", a.bases != 1, &[Delta]),
        (
            "--base-dtype",
            !matches!(a.base_dtype, BaseDtypeArg::F16),
            &[Delta],
        ),
        ("--outlier-q", a.outlier_q != nd.outlier_q, &[Cawsf]),
        ("--pq-m", a.pq_m.is_some(), &[Cawsf]),
        ("--pq-dim", a.pq_dim != nd.pq_dim, &[Cawsf]),
        ("--pq-k", a.pq_k != nd.pq_k, &[Cawsf]),
        (
            "--kmeans-iters",
            a.kmeans_iters != nd.kmeans_iters,
            &[Cawsf, Delta],
        ),
        ("--seed", a.seed != 0, &[Cawsf]),
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
    opts.kmeans_iters = a.kmeans_iters;
    opts.compression = compression_of(a.compression);
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
    let n = src.desc().tensors.len();
    let pb = bar(n as u64, "{elapsed_precise} [{bar:40}] {pos}/{len} {msg}");
    let report =
        cawsfs::convert::npydir::convert(src.as_ref(), &a.output, &opts, &|done, _, name| {
            pb.set_position(done as u64);
            pb.set_message(name.to_string());
        })
        .with_context(|| format!("converting {}", a.src.display()))?;
    pb.finish_and_clear();
    print_report(&report, ("kind", 22), ("directory", "quantized"), &a)
}

fn cmd_inspect(path: &Path, json: bool, blocks: bool) -> Result<()> {
    let ar = cawsfs::archive::open(path)?;
    let m = ar.model();
    if json {
        let tensors: Vec<_> = m
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let info = ar.tensor_summary(i);
                let locations = blocks.then(|| ar.block_locations(i));
                serde_json::json!({
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
        a.gguf_arch,
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
        "  {:<52} {:>16} {:>10} {:>24} {:>7} {:>12} {:>7} {:>9}",
        "name", "shape", "source", "codec", "blocks", "bytes", "bpw", "rel_err"
    );
    let mut total = 0;
    for (i, t) in m.tensors.iter().enumerate() {
        let info = ar.tensor_summary(i);
        total += info.stored_bytes;
        println!(
            "  {:<52} {:>16} {:>10} {:>24} {:>7} {:>12} {:>7.3} {:>9.5}",
            t.name,
            format!("{:?}", t.shape),
            format!("{:?}", t.source).to_lowercase(),
            info.codec,
            info.n_blocks,
            info.stored_bytes,
            info.stored_bytes as f64 * 8.0 / t.numel().max(1) as f64,
            info.rel_err.unwrap_or(0.0)
        );
    }
    println!("total tensor bytes: {total}");
    Ok(())
}

fn cmd_verify(path: &Path) -> Result<()> {
    let ar = cawsfs::archive::open(path)?;
    let fails = ar.verify_all();
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
    println!(
        "{}: ok ({}, {} parts, {} tensors, {} blocks verified)",
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

fn float_of(d: Dtype) -> FloatType {
    match d {
        Dtype::F32 => FloatType::F32,
        Dtype::F16 => FloatType::F16,
        Dtype::Bf16 => FloatType::BF16,
    }
}

fn cmd_export(a: ExportArgs) -> Result<()> {
    init_threads(a.threads)?;
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
            let ty = match a.gguf_type {
                Dtype::F32 => GgufOutType::F32,
                Dtype::F16 => GgufOutType::F16,
                Dtype::Bf16 => GgufOutType::BF16,
            };
            export(&layout::gguf_file(model, ty)?, &a.output)
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
                std::fs::write(&p, bytes).with_context(|| format!("{}", p.display()))?;
                println!("wrote {}", p.display());
            }
            export(
                &layout::safetensors_file(model, a.dtype.map(float_of))?,
                &a.output.join("model.safetensors"),
            )
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

fn cmd_apply(path: &Path, tensor: &str, x: &Path, output: Option<&Path>) -> Result<()> {
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

fn gguf_type_of(d: Dtype) -> GgufOutType {
    match d {
        Dtype::F32 => GgufOutType::F32,
        Dtype::F16 => GgufOutType::F16,
        Dtype::Bf16 => GgufOutType::BF16,
    }
}

fn cmd_mount(a: MountArgs) -> Result<()> {
    let opts = cawsfs::mount::MountOptions {
        fs: cawsfs::fs::FsOptions {
            cache_bytes: a
                .cache_size
                .unwrap_or_else(cawsfs::mount::default_cache_bytes),
            gguf_type: gguf_type_of(a.gguf_type),
            safetensors_dtype: a.dtype.map(float_of),
            prefetch_threads: a.prefetch_threads,
            readahead_chunks: a.readahead_chunks,
            router_eviction: a.eviction == Eviction::Router,
            ..Default::default()
        },
        threads: a.threads,
        allow_other: a.allow_other,
        socket: a.socket.clone(),
        pin_infra_layers: a.pin_infra.then_some(a.pin_infra_layers),
        pin_prompt: a.pin_prompt.clone(),
    };
    if a.foreground {
        return cawsfs::mount::run(&a.archive, &a.mountpoint, &opts).map_err(Into::into);
    }
    // Check what can be checked before detaching, so mistakes are reported here.
    cawsfs::archive::open(&a.archive)?;
    if !a.mountpoint.is_dir() {
        bail!("{}: not a directory", a.mountpoint.display());
    }
    if cawsfs::mount::is_mounted(&a.mountpoint) {
        bail!("{}: already a cawsfs mount", a.mountpoint.display());
    }
    let dir = cawsfs::control::socket_dir();
    cawsfs::control::ensure_private_dir(&dir)?;
    let log = cawsfs::control::default_socket_path(&a.mountpoint).with_extension("log");
    let log_file = std::fs::File::create(&log).with_context(|| format!("{}", log.display()))?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(std::env::args_os().skip(1)).arg("--foreground");
    if std::env::var_os("CAWSFS_LOG").is_none() {
        cmd.env("CAWSFS_LOG", "info");
    }
    cmd.stdin(std::process::Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file);
    // SAFETY: setsid is async-signal-safe; it detaches the daemon from our terminal.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting the mount daemon")?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait()? {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let last = text
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("no message");
            bail!(
                "mount daemon exited ({status}): {}",
                last.trim_start_matches("cawsfs: error: ")
            );
        }
        let sock = a
            .socket
            .clone()
            .unwrap_or_else(|| cawsfs::control::find_socket(&a.mountpoint));
        let ping = cawsfs::control::request(
            &sock,
            &cawsfs::control::Request::Ping,
            std::time::Duration::from_secs(2),
        );
        if ping.is_ok() && cawsfs::mount::is_mounted(&a.mountpoint) {
            println!(
                "mounted {} at {} (pid {}, socket {}, log {})",
                a.archive.display(),
                a.mountpoint.display(),
                child.id(),
                sock.display(),
                log.display()
            );
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = std::process::Command::new("fusermount3")
                .arg("-u")
                .arg(&a.mountpoint)
                .status();
            bail!(
                "{}: the mount did not come up within 60 s (log {})",
                a.mountpoint.display(),
                log.display()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

fn cmd_umount(mp: &Path) -> Result<()> {
    if !cawsfs::mount::is_mounted(mp) {
        bail!("{}: not a cawsfs mount", mp.display());
    }
    let sock = cawsfs::control::find_socket(mp);
    let status = std::process::Command::new("fusermount3")
        .arg("-u")
        .arg(mp)
        .status()
        .or_else(|_| std::process::Command::new("umount").arg(mp).status())
        .context("running fusermount3")?;
    if !status.success() {
        bail!(
            "{}: unmount failed ({status}); is a program still using it?",
            mp.display()
        );
    }
    // The daemon notices and exits; wait for its socket to go away.
    for _ in 0..100 {
        let alive = cawsfs::control::request(
            &sock,
            &cawsfs::control::Request::Ping,
            std::time::Duration::from_millis(200),
        );
        if alive.is_err() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    println!("unmounted {}", mp.display());
    Ok(())
}

fn cmd_stat(
    mp: &Path,
    socket: Option<&Path>,
    json: bool,
    prometheus: bool,
    watch: bool,
    interval: f64,
) -> Result<()> {
    use cawsfs::control::{self, Request};
    let sock = socket
        .map(Path::to_path_buf)
        .unwrap_or_else(|| control::find_socket(mp));
    let timeout = std::time::Duration::from_secs(5);
    if watch {
        if !(interval.is_finite() && interval >= 0.05) {
            bail!("--interval must be at least 0.05 seconds");
        }
        let mut client = control::ControlClient::connect(&sock, timeout)?;
        control::watch(
            std::time::Duration::from_secs_f64(interval),
            || Ok(client.call(&Request::Stat)?),
            &mut std::io::stdout(),
        )?;
        return Ok(());
    }
    let stats = control::request(&sock, &Request::Stat, timeout)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&stats)?);
    } else if prometheus {
        print!("{}", control::render_prometheus(&stats));
    } else {
        print!("{}", control::render_stat(&stats));
    }
    Ok(())
}

/// Send one control request and print the reply's payload.
fn control_call(mp: &Path, socket: Option<&Path>, req: cawsfs::control::Request) -> Result<()> {
    let sock = socket
        .map(Path::to_path_buf)
        .unwrap_or_else(|| cawsfs::control::find_socket(mp));
    let reply = cawsfs::control::request(&sock, &req, std::time::Duration::from_secs(30))?;
    let mut v = reply;
    if let Some(o) = v.as_object_mut() {
        o.remove("ok");
    }
    println!("{}", serde_json::to_string(&v)?);
    Ok(())
}

fn cmd_route(a: RouteArgs) -> Result<()> {
    use cawsfs::control::{self, Request};
    let sock = a
        .socket
        .clone()
        .unwrap_or_else(|| control::find_socket(&a.mountpoint));
    let req = Request::Route {
        prompt: a.prompt.clone(),
        top_k: a.top_k,
        budget_bytes: a.budget,
        prefetch: a.prefetch,
        file: a.file.clone(),
    };
    let v = control::request(&sock, &req, std::time::Duration::from_secs(30))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let toks: Vec<&str> = v["tokens"]
        .as_array()
        .map(|t| t.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    println!("prompt tokens: {}", toks.join(" "));
    println!(
        "{:>4}  {:<9} {:>6} {:>8}  {:>10}  {:>13}  tensor [rows]",
        "rank", "kind", "order", "score", "cost", "chunks"
    );
    for s in v["shards"].as_array().into_iter().flatten() {
        let score = s["score"]
            .as_f64()
            .map_or("-".to_string(), |x| format!("{x:.4}"));
        // serde_json values ignore width, so numbers go through to_string first.
        println!(
            "{:>4}  {:<9} {:>6} {:>8}  {:>10}  {:>13}  {} [{}..{}]",
            s["rank"].to_string(),
            s["kind"].as_str().unwrap_or("?"),
            s["order"].to_string(),
            score,
            s["cost"].to_string(),
            format!("{}..{}", s["chunks"][0], s["chunks"][1]),
            s["tensor"].as_str().unwrap_or("?"),
            s["rows"][0],
            s["rows"][1],
        );
    }
    print!(
        "the routed shards cover {} bytes of {} chunks",
        v["chunk_bytes"],
        v["file"].as_str().unwrap_or("?")
    );
    if a.prefetch {
        print!(
            "; queued {} chunks for prefetch, {} hinted",
            v["queued_chunks"], v["hinted_chunks"]
        );
    }
    println!();
    Ok(())
}
