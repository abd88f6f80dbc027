//! The crate's shape, checked: every `crate::` path in `src/` points down the data path
//! (docs/ARCHITECTURE.md). A module may name itself and the modules listed before it in
//! [`LAYERS`], never one after it; inside `archive`, the same holds for [`ARCHIVE`], and
//! the three kinds do not name each other. Test code (`tests.rs` files, `test_support`,
//! and a trailing `#[cfg(test)] mod tests { … }`) may name anything: fixtures are built
//! with the layers above.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// Top-level modules, bottom of the data path first.
const LAYERS: &[&str] = &[
    "error",
    "localfs",
    "mem",
    "gguf",
    "model",
    "codec",
    "reconstruct",
    "import",
    "archive",
    "layout",
    "router",
    "export",
    "cache",
    "tier",
    "fs",
    "fuse",
    "control",
    "convert",
    "mount",
    "cli",
];

/// Inside `archive`: rank of each part. Parts of equal rank may not name each other.
const ARCHIVE: &[(&str, u32)] = &[
    ("error", 0),
    ("aws_profile", 0),
    ("remote", 1),
    ("file", 2),
    ("store", 2),
    ("container", 3),
    ("dir", 3),
    ("cawsf", 4),
    ("delta", 4),
    ("npydir", 4),
    ("open", 5),
];

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `src/archive/delta/reader.rs` → `["archive", "delta", "reader"]`; `mod.rs` and
/// `lib.rs` name their directory's module.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    if parts.first().is_some_and(|p| p == "main") {
        parts = vec!["cli".into()];
    }
    parts
}

/// The code of a file without comments, string contents and its trailing test module.
fn code_of(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests {") {
        Some(i) => &text[..i],
        None => text,
    };
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let line = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Every module path named as `crate::a::b…` (including inside `crate::{a::b, c}`),
/// as its first two segments.
fn references(code: &str) -> Vec<(String, Option<String>)> {
    let mut refs = Vec::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in code.match_indices("crate::") {
        if code[..i].ends_with("$") {
            continue;
        }
        let rest = &code[i + "crate::".len()..];
        let groups: Vec<&str> = if let Some(inner) = rest.strip_prefix('{') {
            let end = inner.find('}').unwrap_or(inner.len());
            inner[..end].split(',').collect()
        } else {
            vec![rest]
        };
        for g in groups {
            let g = g.trim_start();
            let first = ident(g);
            if first.is_empty() {
                continue;
            }
            let after = g[first.len()..].strip_prefix("::").unwrap_or("");
            if let Some(inner) = after.strip_prefix('{') {
                // `crate::a::{B, c::D}`: one reference per name of the group.
                let end = inner.find('}').unwrap_or(inner.len());
                for name in inner[..end].split(',').map(|n| ident(n.trim_start())) {
                    if !name.is_empty() {
                        refs.push((first.clone(), Some(name)));
                    }
                }
                continue;
            }
            let second = Some(ident(after)).filter(|s| !s.is_empty());
            refs.push((first, second));
        }
    }
    refs
}

/// `archive/mod.rs`'s `pub use part::…{A, B}` lines: re-exported name → part.
fn archive_reexports(src: &Path) -> BTreeMap<String, String> {
    let text = fs::read_to_string(src.join("archive/mod.rs")).unwrap();
    let mut map = BTreeMap::new();
    for stmt in text.split(';') {
        let Some(body) = stmt.trim().strip_prefix("pub use ") else {
            continue;
        };
        let part: String = body.chars().take_while(|c| *c != ':').collect();
        let names = body.rsplit("::").next().unwrap();
        for n in names.trim_matches(|c| c == '{' || c == '}').split(',') {
            let n = n.trim();
            if !n.is_empty() {
                map.insert(n.to_string(), part.clone());
            }
        }
    }
    map
}

fn archive_rank(part: &str) -> Option<u32> {
    ARCHIVE.iter().find(|(p, _)| *p == part).map(|&(_, r)| r)
}

/// Why `from` may not name `to`, if it may not.
fn violation(
    from: &[String],
    to: &(String, Option<String>),
    reexports: &BTreeMap<String, String>,
) -> Option<String> {
    let rank = |m: &str| LAYERS.iter().position(|l| *l == m);
    let (Some(rf), Some(rt)) = (rank(&from[0]), rank(&to.0)) else {
        return Some(format!("module {} or {} is not in LAYERS", from[0], to.0));
    };
    if rt > rf {
        return Some(format!("{} is above {} in the data path", to.0, from[0]));
    }
    if rt < rf || from[0] != "archive" || from.len() < 2 {
        return None; // below, or archive/mod.rs (declarations and re-exports)
    }
    let target = match &to.1 {
        Some(s) if archive_rank(s).is_some() => s.clone(),
        Some(s) => match reexports.get(s) {
            Some(part) => part.clone(),
            None => return Some(format!("archive::{s} is not a known part of archive")),
        },
        None => return Some("names the archive layer as a whole".into()),
    };
    let (Some(pf), Some(pt)) = (archive_rank(&from[1]), archive_rank(&target)) else {
        return Some(format!("archive part {} is not in ARCHIVE", from[1]));
    };
    if from[1] == target || pt < pf {
        None
    } else {
        Some(format!(
            "archive::{target} is not below archive::{}",
            from[1]
        ))
    }
}

#[test]
fn imports_point_down_the_data_path() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let reexports = archive_reexports(&src);
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    files.sort();
    let mut bad = Vec::new();
    for file in &files {
        let module = module_of(&src, file);
        let name = file.file_name().unwrap().to_string_lossy();
        if module.is_empty() || name == "tests.rs" || module.iter().any(|m| m == "test_support") {
            continue; // lib.rs, test code
        }
        let code = code_of(&fs::read_to_string(file).unwrap());
        for r in references(&code) {
            if let Some(why) = violation(&module, &r, &reexports) {
                let to = match &r.1 {
                    Some(s) => format!("crate::{}::{s}", r.0),
                    None => format!("crate::{}", r.0),
                };
                bad.push(format!(
                    "{}: names {to}: {why}",
                    file.strip_prefix(&src).unwrap().display()
                ));
            }
        }
    }
    bad.sort();
    bad.dedup();
    assert!(
        bad.is_empty(),
        "imports against the data path:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_check_catches_an_upward_import() {
    let re = BTreeMap::from([("Store".to_string(), "store".to_string())]);
    let m = |s: &str| s.split('/').map(String::from).collect::<Vec<_>>();
    let r = |a: &str, b: Option<&str>| (a.to_string(), b.map(String::from));
    assert!(violation(&m("codec"), &r("archive", Some("Store")), &re).is_some());
    assert!(violation(&m("archive/delta"), &r("archive", Some("npydir")), &re).is_some());
    assert!(violation(&m("archive/store"), &r("archive", Some("container")), &re).is_some());
    assert!(violation(&m("archive/delta"), &r("archive", Some("Store")), &re).is_none());
    assert!(violation(&m("mount"), &r("cache", None), &re).is_none());
    let refs = references("use crate::{model::X, codec};\nuse crate::archive::{A, b::C};");
    assert_eq!(
        refs,
        vec![
            r("model", Some("X")),
            r("codec", None),
            r("archive", Some("A")),
            r("archive", Some("b"))
        ]
    );
}
