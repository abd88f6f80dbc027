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

use cawsfs::archive::Store;
use cawsfs::layout::{self, GgufOutType, VirtualFile};
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

/// A scratch directory on tmpfs when there is one (AFL runs the harness thousands of
/// times a second; each run writes its input there).
pub fn scratch() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    tempfile::Builder::new()
        .prefix("cawsfs-fuzz-")
        .tempdir_in(base)
        .expect("scratch directory")
}

/// Write `data` as the file `name` in a fresh scratch directory; run `f` on its path.
pub fn with_file<R>(name: &str, data: &[u8], f: impl FnOnce(&Path) -> R) -> R {
    let dir = scratch();
    let path = dir.path().join(name);
    std::fs::write(&path, data).expect("write input");
    f(&path)
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
        match r.windows(sep.len()).position(|w| w == sep) {
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

/// Write a directory input into a fresh scratch directory; run `f` on the directory.
pub fn with_dir<R>(data: &[u8], f: impl FnOnce(&Path) -> R) -> R {
    let dir = scratch();
    for (rel, content) in decode_files(data) {
        let path = dir.path().join(&rel);
        if let Some(parent) = path.parent() {
            // A name used both as a file and as a directory: the later one loses.
            if std::fs::create_dir_all(parent).is_err() {
                continue;
            }
        }
        let _ = std::fs::write(&path, content);
    }
    f(dir.path())
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

/// Every virtual file the mount would serve for `model`: its header, the first bytes of
/// each tensor and the end of the file.
pub fn read_layouts(model: &ModelDesc, src: &dyn RowSource) {
    let mut files: Vec<VirtualFile> = Vec::new();
    if let Ok(f) = layout::safetensors_file(model, None) {
        files.push(f);
    }
    if let Ok(f) = layout::gguf_file(model, GgufOutType::F16) {
        files.push(f);
    }
    if let Ok(meta) = layout::hf_metadata_files(model) {
        for (name, bytes) in meta {
            files.push(VirtualFile::from_bytes(&name, bytes));
        }
    }
    let mut buf = vec![0u8; READ_CHUNK];
    for f in &files {
        let mut offsets = vec![0, f.size.saturating_sub(READ_CHUNK as u64)];
        offsets.extend(f.tensor_ranges().iter().map(|&(_, a, _)| a));
        for off in offsets {
            let _ = f.read_at(src, off, &mut buf);
        }
    }
}

/// Open `path` as a source model (a `.gguf` file or a Hugging Face directory) and, when
/// it opens, read what a conversion reads: every tensor's raw bytes and f32 values
/// (tensors of at most [`MAX_READ_VALUES`] values), the virtual files, the tokenizer.
pub fn open_source(path: &Path) {
    let Ok(src) = cawsfs::import::open_source(path) else {
        return;
    };
    let desc = src.desc();
    for (i, t) in desc.tensors.iter().enumerate() {
        if t.numel() <= MAX_READ_VALUES {
            let _ = src.raw(i);
            let _ = src.f32(i);
        }
    }
    let rows = SourceRows(src.as_ref());
    read_tensors(desc, &rows);
    read_layouts(desc, &rows);
    if let Ok(tok) = cawsfs::router::load_tokenizer(desc) {
        let _ = cawsfs::router::tokenize(&tok, "Hello world, the tiny model.");
    }
}

/// A source model read as rows (what `read_layouts` needs), through `SourceModel::f32`.
struct SourceRows<'a>(&'a dyn cawsfs::import::SourceModel);

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
            .0
            .desc()
            .tensors
            .get(tensor)
            .ok_or_else(|| io(format!("no tensor {tensor}")))?;
        if t.numel() > MAX_READ_VALUES {
            return Err(io("too large for the harness".into()));
        }
        let all = self.0.f32(tensor).map_err(|e| io(e.to_string()))?;
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
}
