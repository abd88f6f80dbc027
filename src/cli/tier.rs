//! `cawsfs tier`: the disk tier directory seen and reclaimed from outside any mount
//! (docs/TIER.md). Entries a mount has open hold a lock and are never removed.

use std::path::PathBuf;
use std::time::SystemTime;

use anyhow::{Context, Result};

use bytesize::ByteSize;
use cawsfs::tier::{self, EntryInfo};

use super::args::TierCmd;

pub fn cmd_tier(cmd: TierCmd) -> Result<()> {
    match cmd {
        TierCmd::Ls { dir, json } => {
            let dir = tier_dir(dir)?;
            let entries = tier::list(&dir)?;
            if json {
                let v: Vec<_> = entries.iter().map(entry_json).collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print_table(&dir, &entries);
            }
            Ok(())
        }
        TierCmd::Gc { dir, max_size } => {
            let dir = tier_dir(dir)?;
            let max = max_size.unwrap_or_else(|| cawsfs::mount::default_tier_bytes(&dir));
            report(&dir, tier::gc(&dir, max, &[])?)
        }
        TierCmd::Clear { dir } => {
            let dir = tier_dir(dir)?;
            report(&dir, tier::clear(&dir)?)
        }
    }
}

fn tier_dir(dir: Option<PathBuf>) -> Result<PathBuf> {
    dir.or_else(cawsfs::mount::default_tier_dir)
        .context("no tier directory: give --dir, or set CAWSFS_TIER_DIR, XDG_CACHE_HOME or HOME")
}

fn report(dir: &std::path::Path, done: tier::Collected) -> Result<()> {
    let freed: u64 = done.removed.iter().map(|e| e.disk_bytes).sum();
    println!(
        "{}: removed {} entries ({}), {} left{}",
        dir.display(),
        done.removed.len(),
        ByteSize::b(freed).display().iec(),
        ByteSize::b(done.left_bytes).display().iec(),
        if done.busy.is_empty() {
            String::new()
        } else {
            format!("; {} in use by a mount, kept", done.busy.len())
        }
    );
    // Not fatal: everything else was removed.
    for (e, why) in &done.failed {
        eprintln!("{}: entry {} not removed: {why}", dir.display(), e.key);
    }
    Ok(())
}

fn age(t: SystemTime) -> String {
    let s = SystemTime::now()
        .duration_since(t)
        .map_or(0, |d| d.as_secs());
    match s {
        0..=119 => format!("{s}s ago"),
        120..=7199 => format!("{}m ago", s / 60),
        7200..=172_799 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86400),
    }
}

fn entry_json(e: &EntryInfo) -> serde_json::Value {
    let l = e.label.clone().unwrap_or_default();
    serde_json::json!({
        "key": e.key,
        "file": l.file,
        "view": l.view,
        "archive": l.archive,
        "size": e.size,
        "disk_bytes": e.disk_bytes,
        "whole": e.whole,
        "in_use": e.in_use,
        "last_used_unix": e.last_used.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
    })
}

fn print_table(dir: &std::path::Path, entries: &[EntryInfo]) {
    let b = |n: u64| ByteSize::b(n).display().iec().to_string();
    let rows: Vec<[String; 8]> = entries
        .iter()
        .map(|e| {
            let l = e.label.clone().unwrap_or_default();
            [
                e.key[..16].to_string(),
                if l.file.is_empty() {
                    "?".into()
                } else {
                    l.file
                },
                b(e.size),
                b(e.disk_bytes),
                if e.whole { "yes" } else { "no" }.into(),
                if e.in_use { "yes" } else { "no" }.into(),
                age(e.last_used),
                l.archive,
            ]
        })
        .collect();
    let head = [
        "KEY", "FILE", "SIZE", "ON DISK", "WHOLE", "IN USE", "USED", "ARCHIVE",
    ];
    let mut w = head.map(str::len);
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: [&str; 8]| {
        let mut out = String::new();
        for (i, c) in cells.iter().enumerate() {
            let pad = w[i] - c.chars().count();
            match i {
                2 | 3 => out += &format!("{}{c}  ", " ".repeat(pad)),
                7 => out += c,
                _ => out += &format!("{c}{}  ", " ".repeat(pad)),
            }
        }
        println!("{}", out.trim_end());
    };
    line(head);
    for r in &rows {
        line(std::array::from_fn(|i| r[i].as_str()));
    }
    let total: u64 = entries.iter().map(|e| e.disk_bytes).sum();
    println!(
        "{} entries, {} on disk in {}",
        entries.len(),
        b(total),
        dir.display()
    );
}
