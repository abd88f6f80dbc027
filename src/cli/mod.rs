//! The `cawsfs` command line, kept out of the library: `args` holds the clap types,
//! one module per command group turns parsed arguments into library calls and prints
//! the results.

mod archive;
mod args;
mod control;
mod convert;
mod device;
mod mount;
mod tier;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

pub use args::{Cli, Cmd};

/// Chooses where reconstruction runs. A GPU in use is said on stderr (`quiet`: only
/// logged); `auto` without one says nothing but logs why at info level.
pub fn init_device(d: &args::DeviceArgs, quiet: bool) -> Result<()> {
    let active = cawsfs::reconstruct::init(d.device, d.vram_budget)?;
    match &active {
        cawsfs::reconstruct::Active::Cuda { .. } if !quiet => {
            eprintln!("reconstructing on {active}")
        }
        _ => tracing::info!("reconstructing on {active}"),
    }
    Ok(())
}

/// Run one parsed command.
/// The fetch cache for remote archives (docs/REMOTE.md): the flags, else the default.
fn fetch_cache_options(cli: &Cli) -> Option<cawsfs::archive::remote::FetchCacheOptions> {
    if cli.no_fetch_cache {
        return None;
    }
    let dir = cli.fetch_cache.clone().or_else(|| {
        std::env::var_os("CAWSFS_FETCH_CACHE_DIR")
            .filter(|v| !v.is_empty())
            .map(std::path::PathBuf::from)
            .or_else(|| cawsfs::mount::default_cache_root().map(|d| d.join("fetch")))
    })?;
    let max_bytes = cli
        .fetch_cache_size
        .unwrap_or_else(|| cawsfs::mount::default_tier_bytes(&dir));
    Some(cawsfs::archive::remote::FetchCacheOptions { dir, max_bytes })
}

pub fn run(cli: Cli) -> Result<()> {
    if let Some(e) = &cli.endpoint {
        // Read where the store is built (archive::remote); set before any thread starts.
        std::env::set_var("CAWSFS_S3_ENDPOINT", e);
    }
    cawsfs::archive::remote::configure_fetch_cache(fetch_cache_options(&cli));
    match cli.cmd {
        Cmd::Convert(a) => convert::cmd_convert(*a),
        Cmd::Calibrate {
            src,
            output,
            text,
            tokens,
        } => convert::cmd_calibrate(&src, &output, text.as_deref(), tokens as usize),
        Cmd::Inspect {
            archive,
            json,
            blocks,
            gguf_type,
        } => archive::cmd_inspect(&archive, json, blocks, gguf_type),
        Cmd::Verify {
            archive,
            quick,
            device,
        } => {
            init_device(&device, false)?;
            archive::cmd_verify(&archive, quick)
        }
        Cmd::DeviceCheck {
            archive,
            bench,
            device,
        } => device::cmd_device_check(&archive, bench, &device),
        Cmd::Export(a) => archive::cmd_export(a),
        Cmd::Mount(a) => mount::cmd_mount(a),
        Cmd::Umount { mountpoint } => mount::cmd_umount(&mountpoint),
        Cmd::Tier { cmd } => tier::cmd_tier(cmd),
        Cmd::Stat {
            mountpoint,
            socket,
            json,
            prometheus,
            watch,
            interval,
        } => control::cmd_stat(
            &mountpoint,
            socket.as_deref(),
            json,
            prometheus,
            watch,
            interval,
        ),
        Cmd::Prefetch(a) => control::control_call(
            &a.mountpoint,
            a.socket.as_deref(),
            cawsfs::control::Request::Prefetch(a.target()),
        ),
        Cmd::Pin(a) => control::control_call(
            &a.mountpoint,
            a.socket.as_deref(),
            cawsfs::control::Request::Pin(a.target()),
        ),
        Cmd::Unpin(a) => control::control_call(
            &a.mountpoint,
            a.socket.as_deref(),
            cawsfs::control::Request::Unpin(a.target()),
        ),
        Cmd::Evict(a) => control::control_call(
            &a.mountpoint,
            a.socket.as_deref(),
            cawsfs::control::Request::Evict(a.what.target()),
        ),
        Cmd::Route(a) => control::cmd_route(a),
        Cmd::Materialize {
            mountpoint,
            file,
            socket,
            no_wait,
        } => control::cmd_materialize(&mountpoint, file, socket.as_deref(), no_wait),
        Cmd::Trace {
            mountpoint,
            state,
            socket,
        } => control::control_call(
            &mountpoint,
            socket.as_deref(),
            cawsfs::control::Request::Trace { on: state == "on" },
        ),
        Cmd::Apply {
            archive,
            tensor,
            x,
            output,
        } => archive::cmd_apply(&archive, &tensor, &x, output.as_deref()),
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

pub(crate) fn bar(len: u64, template: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb
}
