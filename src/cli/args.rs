//! The command line's shape: every subcommand and flag, with the help texts users see.
//! Parsing only; what each command does lives in the sibling modules.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use cawsfs::layout::GgufView;
use cawsfs::model::FloatType;
use cawsfs::reconstruct::DeviceChoice;

#[derive(Parser)]
#[command(
    name = "cawsfs",
    version,
    about = "Mount compressed LLM weight archives as plain model files"
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
    /// The S3 endpoint for s3:// archives (an S3-compatible server, path-style); by
    /// default AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS itself (docs/REMOTE.md).
    #[arg(long, global = true, value_name = "URL")]
    pub endpoint: Option<String>,
    /// Where parts fetched from s3:// and http(s):// archives are kept on disk, so each
    /// is fetched once per machine (default: CAWSFS_FETCH_CACHE_DIR, else fetch/ in the
    /// user's cawsfs cache).
    #[arg(long, global = true, value_name = "DIR")]
    pub fetch_cache: Option<PathBuf>,
    /// Bound on the fetch cache, e.g. 50GiB (default: a fifth of its filesystem's free
    /// space, at most 64GiB).
    #[arg(long, global = true, value_parser = cawsfs::mount::parse_size, value_name = "SIZE")]
    pub fetch_cache_size: Option<u64>,
    /// Keep no fetched parts on disk.
    #[arg(long, global = true, conflicts_with_all = ["fetch_cache", "fetch_cache_size"])]
    pub no_fetch_cache: bool,
}

#[derive(Subcommand)]
pub enum Cmd {
    /// Convert a Hugging Face directory or a GGUF file into an archive (.cawsf, delta or npy-dir).
    Convert(Box<ConvertArgs>),
    /// Gather error feedback's statistics once into a file `convert --calibration`
    /// reads: a CPU forward pass of a llama-family model over calibration text (what
    /// convert does by itself each time; docs/CODECS.md, "Error feedback").
    Calibrate {
        /// A Hugging Face directory or a GGUF file.
        src: PathBuf,
        /// The statistics file to write (safetensors).
        #[arg(short, long)]
        output: PathBuf,
        /// Calibration text (default: the bundled prose and code).
        #[arg(long, value_name = "FILE")]
        text: Option<PathBuf>,
        /// Tokens of text to run over (windows of 512).
        #[arg(long, value_name = "N", default_value_t = cawsfs::convert::calibrate::DEFAULT_TOKENS as u64,
              value_parser = clap::value_parser!(u64).range(64..=1 << 20))]
        tokens: u64,
    },
    /// Show an archive's sections, model and tensors.
    Inspect {
        archive: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
        /// With --json: list each block's file offset and stored length.
        #[arg(long)]
        blocks: bool,
        /// Show what model.gguf serves each tensor as under this view.
        #[arg(long, default_value = "auto", value_parser = GgufView::parse)]
        gguf_type: GgufView,
    },
    /// Check an archive whole: every checksum, then every block decoded, the ROUTING
    /// section and the virtual files' headers, as a mount would use them; exits
    /// non-zero naming the first problem.
    Verify {
        archive: PathBuf,
        /// Checksums only (no decoding): much faster, catches corruption but not
        /// parameters that no read can use.
        #[arg(long)]
        quick: bool,
        #[command(flatten)]
        device: DeviceArgs,
    },
    /// Reconstruct every tensor on the CPU and on the GPU and compare the bytes; with
    /// --bench, time both per codec (docs/CUDA.md). Needs a CUDA GPU.
    #[command(hide = true)]
    DeviceCheck {
        archive: PathBuf,
        /// Time each tensor this many times per backend (0: compare only).
        #[arg(long, default_value_t = 0)]
        bench: usize,
        #[command(flatten)]
        device: DeviceArgs,
    },
    /// Write a virtual file (or a Hugging Face directory) out of an archive.
    Export(ExportArgs),
    /// Mount an archive: a read-only directory of model files reconstructed on read.
    Mount(MountArgs),
    /// Unmount a cawsfs mount and wait for its daemon to exit.
    Umount { mountpoint: PathBuf },
    /// See and reclaim the disk tier: list its entries, trim it to a size, or empty it
    /// (entries a mount has open are kept).
    Tier {
        #[command(subcommand)]
        cmd: TierCmd,
    },
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
    /// Reconstruct whole files of a mount into its disk tier, so that their next open
    /// is served by the kernel from local disk (FUSE passthrough).
    Materialize {
        mountpoint: PathBuf,
        /// One virtual file (default: every tensor file).
        #[arg(long)]
        file: Option<String>,
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Start it and return; progress shows in `cawsfs stat`.
        #[arg(long)]
        no_wait: bool,
    },
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

#[derive(Subcommand)]
pub enum TierCmd {
    /// List the entries, least recently used first.
    Ls {
        /// The tier directory (default: the one mounts use by default).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Remove least recently used entries until the tier's data fits a size.
    Gc {
        #[arg(long)]
        dir: Option<PathBuf>,
        /// The size to fit, e.g. 10GiB (default: the bound a mount would use).
        #[arg(long, value_parser = cawsfs::mount::parse_size)]
        max_size: Option<u64>,
    },
    /// Remove every entry no mount has open.
    Clear {
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

/// What a cache verb acts on: a tensor, a layer, or a virtual file's byte range.
#[derive(clap::Args)]
pub struct Selector {
    /// A tensor (Hugging Face name), in every file that holds it.
    #[arg(long)]
    pub tensor: Option<String>,
    /// Every tensor of one transformer block.
    #[arg(long)]
    pub layer: Option<u32>,
    /// A virtual file (e.g. model.gguf), whole or with --range.
    #[arg(long)]
    pub file: Option<String>,
    /// Byte range A..B of --file.
    #[arg(long, requires = "file", value_parser = parse_range)]
    pub range: Option<(u64, u64)>,
}

impl Selector {
    /// None when no selector was given (clap allows at most one).
    pub fn target(&self) -> Option<cawsfs::control::Target> {
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
pub struct SelectArgs {
    pub mountpoint: PathBuf,
    #[command(flatten)]
    pub what: Selector,
    #[arg(long)]
    pub socket: Option<PathBuf>,
}

impl SelectArgs {
    pub fn target(&self) -> cawsfs::control::Target {
        self.what.target().expect("clap requires one selector")
    }
}

/// evict: at most one selector (none = everything unpinned).
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("what").args(["tensor", "layer", "file"])))]
pub struct EvictArgs {
    pub mountpoint: PathBuf,
    #[command(flatten)]
    pub what: Selector,
    #[arg(long)]
    pub socket: Option<PathBuf>,
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
pub struct RouteArgs {
    pub mountpoint: PathBuf,
    /// The prompt.
    #[arg(short, long)]
    pub prompt: String,
    /// Keyed shards (embedding blocks, experts) to return.
    #[arg(long)]
    pub top_k: Option<u32>,
    /// Cache bytes the route may name, e.g. 64MiB; the rest of the budget goes to the
    /// other shards in forward-pass order.
    #[arg(long, value_parser = cawsfs::mount::parse_size)]
    pub budget: Option<u64>,
    /// Reconstruct the routed shards in the background now.
    #[arg(long)]
    pub prefetch: bool,
    /// Virtual file whose chunks to name (default model.gguf).
    #[arg(long)]
    pub file: Option<String>,
    /// Print the daemon's reply as JSON.
    #[arg(long)]
    pub json: bool,
    #[arg(long)]
    pub socket: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
pub enum Eviction {
    /// Chunks a pending route names are evicted after all others.
    Router,
    /// Plain least-recently-used.
    Lru,
}

/// What a mixture of experts' predictor does (docs/MOE.md, "One step ahead").
#[derive(Clone, Copy, ValueEnum, PartialEq)]
pub enum ExpertPrefetch {
    /// Learn which experts follow which and queue the next layer's.
    On,
    /// Learn and report precision and recall, queue nothing.
    Learn,
    /// No predictor.
    Off,
}

#[derive(clap::Args)]
pub struct MountArgs {
    pub archive: PathBuf,
    pub mountpoint: PathBuf,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Cache budget for reconstructed bytes, e.g. 2GiB (default: a quarter of RAM; with
    /// the disk tier on, at most 512 MiB unless --pin-infra or --pin-prompt is given).
    #[arg(long, value_parser = parse_cache_size)]
    pub cache_size: Option<u64>,
    /// Mount over a directory that has files (they are hidden while mounted).
    #[arg(long)]
    pub nonempty: bool,
    /// Keep reconstructed bytes in this directory, checked, across mounts and restarts
    /// (the disk tier, docs/TIER.md; default: $CAWSFS_TIER_DIR, else tier/ under
    /// $CAWSFS_CACHE, $XDG_CACHE_HOME/cawsfs or ~/.cache/cawsfs).
    #[arg(long, value_name = "DIR")]
    pub disk_cache: Option<PathBuf>,
    /// Bound on the disk tier directory, e.g. 20GiB (default: a fifth of its
    /// filesystem's free space, at most 64GiB).
    #[arg(long, value_parser = cawsfs::mount::parse_size)]
    pub disk_cache_size: Option<u64>,
    /// Keep no reconstructed bytes on disk: every mount reconstructs from the archive.
    #[arg(long, conflicts_with_all = ["disk_cache", "disk_cache_size", "no_passthrough"])]
    pub no_disk_cache: bool,
    /// Serve whole disk tier files through the daemon rather than handing them to the
    /// kernel (FUSE passthrough, kernel >= 6.9 and root).
    #[arg(long)]
    pub no_passthrough: bool,
    /// FUSE request threads (1 to 256).
    #[arg(long, default_value_t = 4, value_parser = parse_fuse_threads)]
    pub threads: usize,
    /// Background prefetch / read-ahead threads (default: half the cores, 2 to 8).
    #[arg(long, default_value_t = default_prefetch_threads())]
    pub prefetch_threads: usize,
    /// What model.gguf serves: auto, source, or one type (f16, q8_0, q6_k, q5_k, q4_k,
    /// q5_0, q4_0 ...); docs/MOUNT.md lists them.
    #[arg(long, default_value = "auto", value_parser = GgufView::parse)]
    pub gguf_type: GgufView,
    /// Tensor dtype of model.safetensors (default: the source's float type).
    #[arg(long, value_enum)]
    pub dtype: Option<Dtype>,
    /// Serve model.safetensors as Hugging Face shards (model-0000i-of-0000N.safetensors
    /// and model.safetensors.index.json) of at most this many tensor bytes when it
    /// would be larger, e.g. 2GiB (default: Hugging Face's 5 GB, decimal).
    #[arg(long, default_value_t = cawsfs::layout::DEFAULT_SHARD_BYTES, value_parser = cawsfs::mount::parse_size)]
    pub safetensors_shard_size: u64,
    /// Let other users read the mount (needs user_allow_other in /etc/fuse.conf for non-root).
    #[arg(long)]
    pub allow_other: bool,
    /// Control socket path (default: derived from the mount point).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Chunks queued after a sequential read (0: no read-ahead by cawsfs; at most a
    /// sixteenth of the cache budget).
    #[arg(long, default_value_t = cawsfs::cache::DEFAULT_READAHEAD_CHUNKS)]
    pub readahead_chunks: u64,
    /// Eviction policy of the chunk cache.
    #[arg(long, value_enum, default_value_t = Eviction::Router)]
    pub eviction: Eviction,
    /// In a mixture of experts, learn which experts of the next layer follow the ones
    /// being read (kept between mounts; precision and recall in stat), and with `on`
    /// queue them (only the pages the page cache lacks). Learning only by default: on a
    /// 2-core machine queueing halved the reads that wait and gave 1.19 x the tokens/s
    /// with llama.cpp on both cores, but cost 12 % of them on one (docs/MOE.md).
    #[arg(long, value_enum, default_value_t = ExpertPrefetch::Learn)]
    pub expert_prefetch: ExpertPrefetch,
    /// Pin infrastructure in model.gguf: norms and other 1-D tensors, and the first
    /// --pin-infra-layers layers. The mount fails if they do not fit the cache budget.
    #[arg(long)]
    pub pin_infra: bool,
    #[arg(long, default_value_t = 2, requires = "pin_infra")]
    pub pin_infra_layers: u32,
    /// With --pin-infra: also pin the token-embedding blocks of this text's tokens.
    #[arg(long, requires = "pin_infra")]
    pub pin_prompt: Option<String>,
    /// Stay attached and log to stderr instead of running in the background.
    #[arg(long)]
    pub foreground: bool,
}

#[derive(clap::Args)]
pub struct ConvertArgs {
    /// Hugging Face model directory or .gguf file.
    pub src: PathBuf,
    /// The archive to write: a path, or s3://BUCKET/KEY (written locally first, under
    /// TMPDIR, then uploaded in parts; docs/REMOTE.md).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Archive kind to write.
    #[arg(long, value_enum, default_value_t = To::Cawsf)]
    pub to: To,
    /// Rank of the low-rank component: L for cawsf (default 4), each layer's delta for
    /// delta (default 64).
    #[arg(long, conflicts_with = "max_rel_err")]
    pub rank: Option<u32>,
    /// delta: per matrix, the smallest rank whose stored ‖W−Ŵ‖/‖W‖ is at most this.
    #[arg(long)]
    pub max_rel_err: Option<f64>,
    /// delta: bases per weight type (k-means clusters of layers; 1 = mean of all layers).
    #[arg(long, default_value_t = 1)]
    pub bases: usize,
    /// delta: how bases are stored.
    #[arg(long, value_enum, default_value_t = BaseDtypeArg::F16)]
    pub base_dtype: BaseDtypeArg,
    /// |value| quantile of W−L above which entries are kept exactly as outliers (S);
    /// default 0.999, 1 (no S) with --bpw.
    #[arg(long)]
    pub outlier_q: Option<f32>,
    /// PQ sub-vectors per row (must divide every coded tensor's width); overrides --pq-dim.
    /// Any PQ option codes R by product quantization (rank 4, outliers above the 0.999
    /// quantile, the embedding and output kept) instead of the default --bpw plan.
    #[arg(long)]
    pub pq_m: Option<u32>,
    /// PQ sub-vector length (bits per weight of R = 8 / pq-dim when k = 256) [PQ default: 2].
    #[arg(long)]
    pub pq_dim: Option<u32>,
    /// PQ centroids per codebook (at most 256) [PQ default: 256].
    #[arg(long)]
    pub pq_k: Option<u32>,
    /// k-means iterations: PQ's codebooks [default: 12], delta's bases [default: 10].
    #[arg(long)]
    pub kmeans_iters: Option<u32>,
    /// Average bits per weight of the whole archive: each tensor's R becomes scalar
    /// groups of the width (2-8 bits) that, by its measured error, spends the bits best,
    /// or the tensor keeps its source bytes; rank defaults to 0, and the embedding and
    /// output are planned like the rest (docs/CODECS.md, "Bits-per-weight target").
    /// The default is 5 (or the smallest archive the model allows, when --passthrough
    /// keeps more than that), unless --sq-bits or a PQ option is given.
    #[arg(long, value_name = "BITS", conflicts_with_all = ["sq_bits", "pq_m", "pq_dim", "pq_k"])]
    pub bpw: Option<f64>,
    /// Code R as scalar groups of this many bits (1-8) instead of PQ: an affine grid
    /// (f16 scale and minimum) per --sq-group values of a row; 4 bits in groups of 32
    /// is 5.0 bits per weight before compression (docs/CODECS.md).
    #[arg(long, value_name = "BITS")]
    pub sq_bits: Option<u32>,
    /// Values per scalar group (must divide every coded tensor's width).
    #[arg(long, default_value_t = 32, requires = "sq_bits")]
    pub sq_group: u32,
    /// Scalar bits (and values per group) for the tensors matching PATTERN (a
    /// --passthrough glob) instead of --sq-bits (--sq-group); the first matching rule
    /// wins (repeatable). Example: --sq-for 'model.embed_tokens.weight=5/64'.
    #[arg(
        long = "sq-for",
        value_name = "PATTERN=BITS[/GROUP]",
        requires = "sq_bits"
    )]
    pub sq_for: Vec<String>,
    /// Round the tensors matching PATTERN (a --passthrough glob) into this ggml type
    /// instead of the one --bpw chooses; they count against the budget; the first
    /// matching rule wins (repeatable). Types: q4_0 q4_1 q5_0 q5_1 q8_0 iq4_nl, and
    /// for widths that are a multiple of 256 q2_k q3_k q4_k q5_k q6_k iq4_xs iq3_xxs
    /// iq3_s iq2_s. Example:
    /// --type-for '*.down_proj.weight=q5_0'.
    #[arg(long = "type-for", value_name = "PATTERN=TYPE")]
    pub type_for: Vec<String>,
    /// The ggml types --bpw may choose from, comma-separated (default: those --type-for
    /// lists but q4_1, q5_0 and q5_1, which llama.cpp runs slower on the CPU and the
    /// plan keeps only for a tensor already on their grid), e.g. to add those for a
    /// GPU or to leave out types a backend lacks.
    #[arg(long, value_name = "TYPE,TYPE...", value_delimiter = ',')]
    pub bpw_types: Vec<String>,
    /// What --bpw chooses each tensor's coding from: ggml block types rounded by
    /// cawsfs, which the GGUF view serves as stored (the default), or NDSQ's scalar
    /// groups of 2-8 bits (docs/CODECS.md).
    #[arg(long, value_enum, default_value_t = BpwCodec::Ggml)]
    pub bpw_codec: BpwCodec,
    /// Weight every NDSQ fit by how much each input column matters: an importance
    /// matrix written by llama.cpp's `llama-imatrix` for this model (GGUF or legacy
    /// .dat; docs/IMATRIX.md has the one-command workflow).
    #[arg(long, value_name = "FILE")]
    pub imatrix: Option<PathBuf>,
    /// Second moments of every linear layer's inputs over calibration text, written by
    /// scripts/calibrate.py: matrices rounded into ggml types get error feedback
    /// across columns (GPTQ) from them (docs/CODECS.md, "Error feedback").
    #[arg(long, value_name = "FILE", conflicts_with_all = ["calibration_text", "no_calibration"])]
    pub calibration: Option<PathBuf>,
    /// Without --calibration, convert runs the model itself (llama-family models, on
    /// the CPU) over a calibration text to gather those statistics: this file's text
    /// instead of the bundled one (prose and code, docs/CODECS.md).
    #[arg(long, value_name = "FILE", conflicts_with = "no_calibration")]
    pub calibration_text: Option<PathBuf>,
    /// Tokens of calibration text the forward pass runs over (windows of 512; one
    /// shorter window below 512).
    #[arg(long, value_name = "N", default_value_t = cawsfs::convert::calibrate::DEFAULT_TOKENS as u64,
          value_parser = clap::value_parser!(u64).range(64..=1 << 20))]
    pub calibration_tokens: u64,
    /// Round without error feedback: no forward pass, each block fitted on its own.
    #[arg(long)]
    pub no_calibration: bool,
    /// Tokens of the calibration text over which --bpw measures how much each matrix's
    /// error moves the model's output (docs/CODECS.md, "Measured sensitivity"; the
    /// llama family, and not with --no-calibration); 0: plan by relative error alone.
    #[arg(long, value_name = "N", default_value_t = cawsfs::convert::calibrate::probe::DEFAULT_TOKENS as u64,
          value_parser = clap::value_parser!(u64).range(0..=4096))]
    pub sensitivity_tokens: u64,
    /// Store tensors matching this glob (`*` any run) as bit-exact passthrough (repeatable).
    /// 1-D tensors, the token embedding and the output head always are unless
    /// --no-default-passthrough is given.
    #[arg(long = "passthrough", value_name = "PATTERN")]
    pub passthrough: Vec<String>,
    #[arg(long)]
    pub no_default_passthrough: bool,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Compression of row blocks.
    #[arg(long, value_enum, default_value_t = Comp::Zstd)]
    pub compression: Comp,
    /// Keep a block compressed only where that saves at least this fraction of its
    /// bytes, else store it raw: faster reads for a larger archive (docs/CODECS.md
    /// measures the trade). 0 keeps every saving.
    #[arg(long, default_value_t = 0.0)]
    pub min_saving: f64,
    /// Also write the per-tensor report as JSON here.
    #[arg(long)]
    pub report_json: Option<PathBuf>,
    /// After writing, check the archive as `cawsfs verify` does: every checksum, every
    /// block decoded (on --device), the virtual files' headers.
    #[arg(long)]
    pub verify: bool,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// npy-dir: bits per quantized weight, 8 (int8 per row) or 4 (int4 per group).
    #[arg(long, default_value_t = 8)]
    pub bits: u8,
    /// npy-dir: columns per int4 scale.
    #[arg(long, default_value_t = 64)]
    pub group: usize,
    /// npy-dir: write data files as .npy.zst (one zstd frame per row block).
    #[arg(long)]
    pub zstd: bool,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
pub enum To {
    /// NDSQ .cawsf container (D + L + R + S).
    Cawsf,
    /// Shared bases + per-layer low-rank deltas (Base + U·Vᵀ).
    Delta,
    /// Squish npy directory (int8 / int4 / f16 passthrough).
    NpyDir,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum BaseDtypeArg {
    F16,
    Int8,
}

/// `convert --bpw-codec`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BpwCodec {
    Ggml,
    Sq,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum Comp {
    Zstd,
    Lz4,
    None,
}

#[derive(Clone, Copy, ValueEnum, PartialEq)]
pub enum Format {
    Safetensors,
    Gguf,
    HfDir,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
}

#[derive(clap::Args)]
pub struct ExportArgs {
    pub archive: PathBuf,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[arg(long, value_enum)]
    pub format: Format,
    #[arg(short, long)]
    pub output: PathBuf,
    /// Tensor dtype of model.safetensors (default: the source's float type, f16 for quantized sources).
    #[arg(long, value_enum)]
    pub dtype: Option<Dtype>,
    /// What model.gguf serves: auto, source, or one type (f16, q8_0, q6_k, q5_k, q4_k,
    /// q5_0, q4_0 ...); docs/MOUNT.md lists them.
    #[arg(long, default_value = "auto", value_parser = GgufView::parse)]
    pub gguf_type: GgufView,
    /// With --format hf-dir: Hugging Face shards of at most this many tensor bytes
    /// when model.safetensors would be larger, as the mount serves them (default:
    /// Hugging Face's 5 GB, decimal).
    #[arg(long, default_value_t = cawsfs::layout::DEFAULT_SHARD_BYTES, value_parser = cawsfs::mount::parse_size)]
    pub safetensors_shard_size: u64,
    #[arg(long)]
    pub threads: Option<usize>,
}

/// Where reconstruction runs; shared by the commands that reconstruct.
#[derive(clap::Args, Clone)]
pub struct DeviceArgs {
    /// auto (a CUDA GPU when one and its libraries are usable, else the CPU), cpu,
    /// cuda or cuda:N (an error when that GPU cannot be used).
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: DeviceChoice,
    /// GPU memory kept resident for tensor-wide data (Σ·Vᵀ, codebooks, delta bases
    /// and Vᵀ), e.g. 2GiB (default: a quarter of the free memory, at most 8 GiB).
    #[arg(long, value_parser = cawsfs::mount::parse_size)]
    pub vram_budget: Option<u64>,
}

/// Half the cores, 2 to 8: on a 16-core H200 machine a cold sequential read of a mounted
/// 579 MB model.safetensors took 0.201 s with 8 and 0.211 s with 16, read-ahead 64
/// chunks (docs/CUDA.md, 2026-11-28).
/// `--cache-size`: a size, and at least [`MIN_CACHE_BYTES`].
fn parse_cache_size(s: &str) -> Result<u64, String> {
    let v = cawsfs::mount::parse_size(s)?;
    if v < MIN_CACHE_BYTES {
        return Err(format!(
            "{s:?} is too small: the cache holds whole chunks of {} KiB, several at once \
             (readers and read-ahead), so it needs at least 1MiB",
            cawsfs::cache::DEFAULT_CHUNK_SIZE >> 10
        ));
    }
    Ok(v)
}

/// Four chunks: one for a reader, the rest for read-ahead and a second reader.
const MIN_CACHE_BYTES: u64 = 1 << 20;

/// `--threads` of `mount`: FUSE request threads, each serving one request at a time.
fn parse_fuse_threads(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
    if !(1..=256).contains(&n) {
        return Err(format!(
            "{n} is out of range: at least 1 thread must serve requests, and more than 256 \
             only add memory (each serves one request at a time)"
        ));
    }
    Ok(n)
}

fn default_prefetch_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    (cores / 2).clamp(2, 8)
}

fn parse_device(s: &str) -> Result<DeviceChoice, String> {
    s.parse()
}

/// The library's float type for a `--dtype` value.
pub fn float_of(d: Dtype) -> FloatType {
    match d {
        Dtype::F32 => FloatType::F32,
        Dtype::F16 => FloatType::F16,
        Dtype::Bf16 => FloatType::BF16,
    }
}

#[cfg(test)]
mod tests {
    use super::parse_range;
    use cawsfs::mount::parse_size;

    /// Every spelling `parse_size` accepts, with the value it has always had: K/M/G/T with
    /// or without B are binary, like KiB/MiB/GiB/TiB (bytesize alone would read them as
    /// powers of 1000).
    #[test]
    fn size_spellings_are_binary() {
        let cases: &[(&[&str], u64)] = &[
            (&["1", "1b", "1B", "1.5", "1.9"], 1),
            (&["4096", "4096b", "4096B", " 4096 "], 4096),
            (
                &["2k", "2K", "2kb", "2KB", "2kib", "2KiB", "2 KiB"],
                2 << 10,
            ),
            (
                &["512m", "512M", "512mb", "512MB", "512mib", "512MiB"],
                512 << 20,
            ),
            (
                &["2g", "2G", "2gb", "2GB", "2gib", "2GiB", "2GIB", " 2 GiB "],
                2 << 30,
            ),
            (&["1t", "1T", "1tb", "1TB", "1tib", "1TiB"], 1 << 40),
            (&["1.5G", "1.5GB", "1.5GiB"], 3 << 29),
            (&[".5G", "0.5GiB", "512.MiB"], 1 << 29),
            (&["0.5K"], 512),
            (&[" 64 KiB ", "64\tKiB"], 64 << 10),
            (&["4194304T", "4611686018427387904"], 1 << 62),
        ];
        for (spellings, want) in cases {
            for s in *spellings {
                assert_eq!(parse_size(s), Ok(*want), "{s:?}");
            }
        }
        // Fractions of a byte are dropped, as before: 1.1 · 2^30 = 1181116006.4.
        assert_eq!(parse_size("1.1G"), Ok(1_181_116_006));
        // Above 2^53, plain byte counts are now exact; the old f64 product rounded them
        // (and so let 2^62 + 1 through as 2^62; it is now out of range).
        assert_eq!(parse_size("9007199254740993"), Ok(9_007_199_254_740_993));
    }

    #[test]
    fn size_errors() {
        assert_eq!(
            parse_size("lots"),
            Err(r#""lots" is not a size (try 2GiB or 512MiB)"#.into())
        );
        assert_eq!(
            parse_size("2XB"),
            Err(r#""2XB": unknown unit "xb" (use KiB, MiB, GiB or TiB)"#.into())
        );
        assert_eq!(parse_size("0"), Err(r#""0" is out of range"#.into()));
        for s in [
            "", "-1", "+1", "G", "1.2.3", "1e3", "2P", "2PiB", "2Ki", "2 Mi",
        ] {
            assert!(parse_size(s).is_err(), "{s:?}");
        }
        for s in [
            "0",
            "0.5",
            "0.0001K",
            "4194305T",
            "99999999T",
            "4611686018427387905",
        ] {
            assert_eq!(parse_size(s), Err(format!("{s:?} is out of range")));
        }
    }

    #[test]
    fn ranges() {
        assert_eq!(parse_range("0..4096"), Ok((0, 4096)));
        assert_eq!(parse_range("1MiB..2M"), Ok((1 << 20, 2 << 20)));
        assert_eq!(parse_range("5..5"), Err(r#""5..5": empty range"#.into()));
        assert_eq!(parse_range("4096"), Err(r#""4096": expected A..B"#.into()));
    }
}
