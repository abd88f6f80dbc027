//! The `cawsfs` command line: parses arguments and calls the library. Every error
//! reaches the user as one line naming the thing and the problem.

mod cli;

use std::process::ExitCode;

use clap::Parser;

use cli::{Cli, Cmd};

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            // object_store logs each retry at info: one line per failure is ours to
            // write (docs/REMOTE.md); CAWSFS_LOG=object_store=info shows them.
            std::env::var("CAWSFS_LOG")
                .ok()
                .and_then(|v| {
                    let v = if v.contains("object_store") {
                        v
                    } else {
                        format!("{v},object_store=warn")
                    };
                    tracing_subscriber::EnvFilter::try_new(v).ok()
                })
                .unwrap_or_else(|| "warn".into()),
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
        use nix::sys::signal::{signal, SigHandler, Signal};
        let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) };
    }
    match cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cawsfs: error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes joined with ": ", leaving out a cause whose text is
/// already there (many errors show their source in their own message; `{:#}` would
/// print it twice: "x: No such file (os error 2): No such file (os error 2)").
fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}
