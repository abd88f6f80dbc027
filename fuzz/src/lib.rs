//! What the fuzz targets share: putting the input where a parser that opens by path
//! finds it, the multi-file input encoding of directory formats, and "use what was
//! opened" — read rows of every tensor and bytes of every virtual file, so the decode
//! paths behind a successful parse are fuzzed too.
//!
//! Every function here returns normally on any input: errors are the expected answer to
//! bad bytes; a panic, an abort (out of memory included) or a hang is the bug AFL reports.
//!
//! # Directory inputs
//!
//! Targets whose parser opens a directory (npy-dir, Hugging Face model directory) read
//! their input as a list of files: the input is split on [`FILE_SEP`]; each piece is
//! `NAME '\n' CONTENT`. `NAME` is a relative path of at most [`MAX_DEPTH`] components
//! of `[A-Za-z0-9._-]` (not `.` or `..`); a piece with another name, or without a
//! newline, is ignored, and so is anything after [`MAX_FILES`] pieces. Bytes before the
//! first separator are ignored too. [`encode_files`] writes this form (the seeds).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cawsfs::archive::Store;
use cawsfs::layout::{self, GgufView, Held, VirtualFile};
use cawsfs::model::{ModelDesc, RowSource};

/// Every fuzz target (a binary of this crate of the same name).
pub const TARGETS: &[&str] = &[
    "cawsf",
    "delta",
    "npydir",
    "npy_header",
    "gguf",
    "safetensors",
    "hf_json",
    "routing",
    "control",
    "imatrix",
];

/// Separates the files of a directory input.
pub const FILE_SEP: &[u8] = b"\n\x00%%FILE%%";
/// Files of a directory input, at most.
pub const MAX_FILES: usize = 64;
/// Path components of one file name, at most.
pub const MAX_DEPTH: usize = 2;
/// f32 values one harness read may ask for (bounds the harness's own buffers, not the
/// reader's).
const MAX_READ_VALUES: u64 = 1 << 20;
/// Bytes read from each virtual file region.
const READ_CHUNK: usize = 64 << 10;

/// Run rayon's parallel iterators (the archives' `verify_all`, `decode_failures`, the
/// GGUF importer's dequantization) on the calling thread: a global pool of one thread,
/// the caller's. The same closures run, in order, with no thread handoff per
/// `par_iter` (which cost more than the work on these tiny models) and with coverage
/// that does not depend on the scheduling of worker threads (AFL's stability). Every
/// target calls this first; later calls do nothing. No fuzzed path starts threads of
/// its own (rayon called from another thread would wait for this one: a hang).
pub fn init() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .use_current_thread()
            .build_global()
            .expect("the global rayon pool is built once, here");
    });
}

/// This process's scratch directory, on tmpfs when there is one:
/// `/dev/shm/cawsfs-fuzz-PID`, made on first use and reused by every execution (AFL
/// runs the harness hundreds to thousands of times a second in one process; a fresh
/// temporary directory per execution cost more than some parses). AFL kills the
/// process without unwinding, so nothing removes it at exit: the first use in a
/// process removes the directories of processes that no longer run.
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        remove_stale_scratch(&base);
        let dir = base.join(format!("{SCRATCH_PREFIX}{}", std::process::id()));
        // Left by an earlier process of the same id.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).expect("scratch directory");
        dir
    })
}

const SCRATCH_PREFIX: &str = "cawsfs-fuzz-";

/// Remove the `cawsfs-fuzz-PID` directories in `base` whose process is gone.
fn remove_stale_scratch(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(SCRATCH_PREFIX)) else {
            continue;
        };
        if !pid.is_empty()
            && pid.bytes().all(|b| b.is_ascii_digit())
            && !Path::new("/proc").join(pid).exists()
        {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Write `data` as the file `name` in the scratch directory (replacing the previous
/// execution's); run `f` on its path.
pub fn with_file<R>(name: &str, data: &[u8], f: impl FnOnce(&Path) -> R) -> R {
    let path = scratch().join(name);
    std::fs::write(&path, data).expect("write input");
    f(&path)
}

/// An empty directory `name` in the scratch directory (what the previous execution
/// left there removed).
pub fn fresh_dir(name: &str) -> PathBuf {
    let dir = scratch().join(name);
    match std::fs::remove_dir_all(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            panic!("removing {}: {e}", dir.display())
        }
        _ => {}
    }
    std::fs::create_dir(&dir).expect("scratch subdirectory");
    dir
}

fn valid_component(c: &str) -> bool {
    !c.is_empty()
        && c != "."
        && c != ".."
        && c.len() <= 255
        && c.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

/// The (relative path, content) pairs of a directory input (see the module docs).
pub fn decode_files(data: &[u8]) -> Vec<(PathBuf, &[u8])> {
    let mut out = Vec::new();
    let mut pieces = split(data, FILE_SEP);
    pieces.next(); // before the first separator
    for piece in pieces.take(MAX_FILES) {
        let Some(nl) = piece.iter().position(|&b| b == b'\n') else {
            continue;
        };
        let Ok(name) = std::str::from_utf8(&piece[..nl]) else {
            continue;
        };
        let parts: Vec<&str> = name.split('/').collect();
        if parts.len() > MAX_DEPTH || !parts.iter().all(|c| valid_component(c)) {
            continue;
        }
        out.push((PathBuf::from(name), &piece[nl + 1..]));
    }
    out
}

/// The directory-input form of `files` (names must be valid, contents must not hold
/// [`FILE_SEP`]).
pub fn encode_files(files: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, content) in files {
        assert!(
            split(content, FILE_SEP).count() == 1,
            "{name} holds the separator"
        );
        out.extend_from_slice(FILE_SEP);
        out.extend_from_slice(name.as_bytes());
        out.push(b'\n');
        out.extend_from_slice(content);
    }
    out
}

fn split<'a>(data: &'a [u8], sep: &'a [u8]) -> impl Iterator<Item = &'a [u8]> + 'a {
    let mut rest = Some(data);
    std::iter::from_fn(move || {
        let r = rest?;
        match find(r, sep) {
            Some(i) => {
                rest = Some(&r[i + sep.len()..]);
                Some(&r[..i])
            }
            None => {
                rest = None;
                Some(r)
            }
        }
    })
}

/// The first position of `needle` (not empty) in `hay`: candidates are the positions
/// of its first byte (comparing a window at every position cost more than parsing).
fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = hay[from..].iter().position(|&b| b == needle[0]) {
        let at = from + i;
        if hay[at..].starts_with(needle) {
            return Some(at);
        }
        from = at + 1;
    }
    None
}

/// Write a directory input into a fresh directory; run `f` on the directory.
pub fn with_dir<R>(data: &[u8], f: impl FnOnce(&Path) -> R) -> R {
    with_dir_defaults(data, &[], f)
}

/// As [`with_dir`], and each `(name, content)` of `defaults` is a file of the
/// directory too when the input has no file or directory of that name.
///
/// The directory holds exactly what writing the files into a fresh directory, in
/// input order, would leave: a later file replaces an earlier one of the same name; a
/// file whose directory is a file, or whose name is a directory, is not written. It is
/// not rebuilt per execution: the files and directories the previous execution left
/// are compared with these in memory, and only what differs is removed or written
/// (creating and removing every file each time was most of an execution's time).
pub fn with_dir_defaults<R>(
    data: &[u8],
    defaults: &[(&str, &[u8])],
    f: impl FnOnce(&Path) -> R,
) -> R {
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::Mutex;

    /// What the directory holds: files (relative path → content) and directories.
    #[derive(Default)]
    struct Tree {
        files: BTreeMap<PathBuf, Vec<u8>>,
        dirs: BTreeSet<PathBuf>,
    }
    static LEFT: Mutex<Option<(PathBuf, Tree)>> = Mutex::new(None);

    let mut want: BTreeMap<PathBuf, &[u8]> = BTreeMap::new();
    let mut dirs: BTreeSet<PathBuf> = BTreeSet::new();
    let defaults = defaults.iter().map(|&(n, c)| (PathBuf::from(n), c));
    let input = decode_files(data);
    let n_input = input.len();
    for (i, (rel, content)) in input.into_iter().chain(defaults).enumerate() {
        if i >= n_input && (want.contains_key(&rel) || dirs.contains(&rel)) {
            continue;
        }
        // Names have at most MAX_DEPTH (2) components: one parent at most.
        if let Some(parent) = rel.parent().filter(|p| !p.as_os_str().is_empty()) {
            if want.contains_key(parent) {
                continue;
            }
            dirs.insert(parent.to_path_buf());
        }
        if !dirs.contains(&rel) {
            want.insert(rel, content);
        }
    }

    let mut left = LEFT.lock().unwrap_or_else(|e| e.into_inner());
    let (dir, old) = left.get_or_insert_with(|| (fresh_dir("input"), Tree::default()));
    let io = |what: &str, p: &Path, e: std::io::Error| -> ! {
        panic!("scratch directory: {what} {}: {e}", p.display())
    };
    for rel in old.files.keys().filter(|r| !want.contains_key(*r)) {
        let p = dir.join(rel);
        std::fs::remove_file(&p).unwrap_or_else(|e| io("remove", &p, e));
    }
    for rel in old.dirs.iter().filter(|r| !dirs.contains(*r)) {
        let p = dir.join(rel);
        std::fs::remove_dir_all(&p).unwrap_or_else(|e| io("remove", &p, e));
    }
    for rel in dirs.iter().filter(|r| !old.dirs.contains(*r)) {
        let p = dir.join(rel);
        std::fs::create_dir(&p).unwrap_or_else(|e| io("create", &p, e));
    }
    for (rel, content) in &want {
        if old.files.get(rel).map(Vec::as_slice) != Some(*content) {
            let p = dir.join(rel);
            std::fs::write(&p, content).unwrap_or_else(|e| io("write", &p, e));
        }
    }
    old.files = want.into_iter().map(|(r, c)| (r, c.to_vec())).collect();
    old.dirs = dirs;
    let dir = dir.clone();
    drop(left);
    f(&dir)
}

/// Open `path` as an archive of any kind and, when it opens, use it.
pub fn open_archive(path: &Path) {
    if let Ok(store) = cawsfs::archive::open(path) {
        exercise_store(store.as_ref());
    }
}

/// Use an opened archive the way mount, export and verify do: rows of every tensor
/// (first block, last row), every integrity check, the ROUTING section and router, and
/// bytes of every virtual file.
pub fn exercise_store(store: &dyn Store) {
    let model = store.model();
    for i in 0..model.tensors.len() {
        let _ = store.tensor_summary(i);
        let _ = store.block_locations(i);
    }
    let _ = store.parts();
    let _ = store.extra();
    let _ = store.read_counters();
    read_tensors(model, store);
    let _ = store.verify_all();
    let routing = store.routing_bytes();
    if !routing.is_empty() {
        if let Ok(r) = cawsfs::archive::parse_routing(routing) {
            let _ = r.len();
        }
        if let Ok(Some(router)) = cawsfs::router::Router::open(model, routing) {
            let _ = router.routing.len();
        }
    }
    read_layouts(model, store);
}

/// Rows of each tensor through [`RowSource::read_rows`]: the first rows (the first
/// block), the last row, and a read past the end (an error, never a panic).
pub fn read_tensors(model: &ModelDesc, src: &dyn RowSource) {
    for (i, t) in model.tensors.iter().enumerate() {
        let (rows, cols) = (t.rows(), t.cols());
        if cols == 0 || cols > MAX_READ_VALUES {
            continue;
        }
        let n = rows.min(MAX_READ_VALUES / cols).min(64);
        let mut buf = vec![0f32; (n * cols) as usize];
        let _ = src.read_rows(i, 0, n, &mut buf);
        if rows > 0 {
            let mut row = vec![0f32; cols as usize];
            let _ = src.read_rows(i, rows - 1, rows, &mut row);
            let _ = src.read_rows(i, rows, rows + 1, &mut row);
        }
    }
}

/// Every virtual file the mount would serve for `model`: its header (the first
/// [`READ_CHUNK`] bytes, the whole file when it is smaller, so every piece read from
/// its start), the end of the file, and for each tensor a read from its middle (an
/// offset inside a row) through its end into the next piece (padding, the next
/// tensor).
///
/// Each read asks only for what it adds: reading [`READ_CHUNK`] bytes from every
/// tensor's start, as this did first, decoded the rest of the model once per tensor
/// (most of the time of an execution) through no path these reads do not take.
pub fn read_layouts(model: &ModelDesc, src: &dyn RowSource) {
    let mut files: Vec<VirtualFile> = Vec::new();
    if let Ok(f) = layout::safetensors_file(model, None) {
        files.push(f);
    }
    // The mount's default view: stored blocks raw, the rest quantized.
    let held: Vec<Held> = (0..model.tensors.len())
        .map(|i| src.raw_format(i).map_or(Held::Lossy(None), Held::Exact))
        .collect();
    if let Ok(f) = layout::gguf_plan(model, GgufView::Auto, &held)
        .and_then(|plan| layout::gguf_file(model, &plan))
    {
        files.push(f);
    }
    if let Ok(meta) = layout::hf_metadata_files(model) {
        for (name, bytes) in meta {
            files.push(VirtualFile::from_bytes(&name, bytes));
        }
    }
    let mut buf = vec![0u8; READ_CHUNK];
    for f in &files {
        // (offset, length)
        let mut reads = vec![(0, READ_CHUNK)];
        let end = f.size.saturating_sub(READ_CHUNK as u64);
        if end > 0 {
            reads.push((end, READ_CHUNK));
        }
        for (_, a, b) in f.tensor_ranges() {
            let mid = a.saturating_add(b.saturating_sub(a) / 2 | 1);
            let len = b.saturating_sub(mid).saturating_add(PAST_END);
            reads.push((mid, len.min(READ_CHUNK as u64) as usize));
        }
        for (off, len) in reads {
            let _ = f.read_at(src, off, &mut buf[..len]);
        }
    }
}

/// Bytes past a tensor's end that the read from its middle also asks for.
const PAST_END: u64 = 64;

/// Open `path` as a source model (a `.gguf` file or a Hugging Face directory) and, when
/// it opens, read what a conversion reads: every tensor's raw bytes and f32 values
/// (tensors of at most [`MAX_READ_VALUES`] values), the virtual files, and, when
/// `tokenizer`, the tokenizer loaded and run.
pub fn open_source(path: &Path, tokenizer: bool) {
    let Ok(src) = cawsfs::import::open_source(path) else {
        return;
    };
    let desc = src.desc();
    let mut values = Vec::with_capacity(desc.tensors.len());
    for (i, t) in desc.tensors.iter().enumerate() {
        if t.numel() <= MAX_READ_VALUES {
            let _ = src.raw(i);
            values.push(src.f32(i).map_err(|e| e.to_string()));
        } else {
            values.push(Err("too large for the harness".into()));
        }
    }
    let rows = SourceRows {
        src: src.as_ref(),
        values,
    };
    read_tensors(desc, &rows);
    read_layouts(desc, &rows);
    if tokenizer {
        if let Ok(tok) = cawsfs::router::load_tokenizer(desc) {
            let _ = cawsfs::router::tokenize(&tok, "Hello world, the tiny model.");
        }
    }
}

/// A source model read as rows (what `read_layouts` needs): rows of the f32 values
/// `SourceModel::f32` gave for each tensor, decoded once per execution (decoding them
/// again for each row range read gives the same values through the same code).
struct SourceRows<'a> {
    src: &'a dyn cawsfs::import::SourceModel,
    /// `src.f32(i)` of every tensor, or why not.
    values: Vec<Result<Vec<f32>, String>>,
}

impl RowSource for SourceRows<'_> {
    fn read_rows(
        &self,
        tensor: usize,
        r0: u64,
        r1: u64,
        out: &mut [f32],
    ) -> Result<(), cawsfs::model::ReadError> {
        let io = |m: String| {
            cawsfs::model::ReadError::Io(std::io::Error::new(std::io::ErrorKind::InvalidInput, m))
        };
        let t = self
            .src
            .desc()
            .tensors
            .get(tensor)
            .ok_or_else(|| io(format!("no tensor {tensor}")))?;
        let all = self.values[tensor].as_ref().map_err(|e| io(e.clone()))?;
        let cols = t.cols() as usize;
        let (a, b) = (r0 as usize * cols, r1 as usize * cols);
        let rows = all
            .get(a..b)
            .filter(|r| r.len() == out.len())
            .ok_or_else(|| io(format!("rows {r0}..{r1} out of range")))?;
        out.copy_from_slice(rows);
        Ok(())
    }
}

pub mod targets;
pub mod tiny;

/// The seeds of `target` a generator wrote: every file of `dir/target`.
pub fn seed_files(dir: &Path, target: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir.join(target))
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_round_trip_and_bad_names_are_skipped() {
        let files = vec![
            ("manifest.json".to_string(), b"{}".to_vec()),
            ("tensors/a.npy".to_string(), b"\x93NUMPY\n".to_vec()),
        ];
        let enc = encode_files(&files);
        let dec = decode_files(&enc);
        assert_eq!(dec.len(), 2);
        assert_eq!(dec[1].0, PathBuf::from("tensors/a.npy"));
        assert_eq!(dec[1].1, b"\x93NUMPY\n");
        let mut bad = enc.clone();
        for name in ["../x", "/abs", "a/b/c", "", ".", "a\0b"] {
            bad.extend_from_slice(FILE_SEP);
            bad.extend_from_slice(name.as_bytes());
            bad.extend_from_slice(b"\nzz");
        }
        assert_eq!(decode_files(&bad).len(), 2);
    }

    /// Every file under `dir` (relative path → content) and every directory.
    fn tree(dir: &Path) -> Vec<(String, Option<Vec<u8>>)> {
        let mut out = Vec::new();
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                if p.is_dir() {
                    out.push((rel, None));
                    todo.push(p);
                } else {
                    out.push((rel, Some(std::fs::read(&p).unwrap())));
                }
            }
        }
        out.sort();
        out
    }

    /// The directory `with_dir_defaults` leaves equals the input written into a fresh
    /// directory in order, whatever the previous input left.
    #[test]
    fn reused_directory_equals_a_fresh_one() {
        let inputs: Vec<Vec<(&str, &[u8])>> = vec![
            vec![
                ("manifest.json", b"{}"),
                ("t/a.npy", b"A"),
                ("t/b.npy", b"B"),
            ],
            vec![("manifest.json", b"{}"), ("t/a.npy", b"A2")],
            vec![("t", b"file"), ("t/a.npy", b"A")],
            vec![("t/a.npy", b"A"), ("t", b"file"), ("x", b"1"), ("x", b"2")],
            vec![("model.safetensors", b"mine"), ("u/v", b"")],
            vec![("model.safetensors/x", b"dir"), ("t/a.npy", b"A")],
            vec![],
            vec![("t/a.npy", b"A"), ("t/a.npy/z", b"no")],
        ];
        let defaults: &[(&str, &[u8])] = &[("model.safetensors", b"default")];
        for order in [inputs.clone(), inputs.iter().rev().cloned().collect()] {
            for files in &order {
                let owned: Vec<(String, Vec<u8>)> = files
                    .iter()
                    .map(|(n, c)| (n.to_string(), c.to_vec()))
                    .collect();
                let data = encode_files(&owned);
                let fresh = tempfile::tempdir().unwrap();
                for (rel, content) in decode_files(&data) {
                    let p = fresh.path().join(rel);
                    if std::fs::create_dir_all(p.parent().unwrap()).is_ok() {
                        let _ = std::fs::write(&p, content);
                    }
                }
                let st = fresh.path().join("model.safetensors");
                if !st.exists() {
                    std::fs::write(&st, b"default").unwrap();
                }
                let got = with_dir_defaults(&data, defaults, tree);
                assert_eq!(got, tree(fresh.path()), "{files:?}");
            }
        }
    }
}
