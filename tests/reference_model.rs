//! Reference-model property tests of the mounted filesystem (`cawsfs::fs::MountFs`
//! and its chunk cache), driven without FUSE. For every archive kind built from a tiny
//! synthetic model, the reference is what `cawsfs export` writes for each served file.
//! proptest generates a mount configuration (chunk size, budget down to less than one
//! chunk, read-ahead, prefetch workers, output dtypes) and a sequence of operations:
//! reads anywhere (past EOF and empty included), and what the control socket does to
//! the cache (prefetch, pin, unpin, evict, route hints, trace) on file ranges, tensors
//! and layers. After every operation reads equal the reference bytes, pin outcomes and
//! pinned bytes equal a model of the pins, and the statistics stay within the budget,
//! match the reads made and never go backwards.
//!
//! `PROPTEST_CASES=N` raises the number of cases per archive kind (default
//! [`DEFAULT_CASES`]).

mod common;

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cawsfs::archive::Store;
use cawsfs::cache::{CacheStats, ChunkKey, TraceEvent};
use cawsfs::convert::{delta, npydir, ConvertOptions};
use cawsfs::fs::{file_id, FsOptions, MountFs, TierOptions, ROOT_INO};
use cawsfs::gguf::GgmlType;
use cawsfs::layout::{self, GgufView};
use cawsfs::model::{FloatType, RowSource};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};

/// Cases per archive kind: the four kinds together run in well under a minute in
/// release on two cores.
const DEFAULT_CASES: u32 = 256;
const LAYERS: usize = 2;
/// Prefetch work left after an operation must finish within this (tiny files).
const IDLE_WAIT: Duration = Duration::from_secs(10);
/// Time spent removing operations from a failing sequence after proptest's shrinking.
const MINIMIZE_TIME: Duration = Duration::from_secs(120);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Cawsf,
    Delta,
    Npy,
    NpyZstd,
}

/// Each served file's bytes by name.
type Refs = HashMap<String, Vec<u8>>;

/// One archive and the reference bytes of its served files, per output dtypes.
struct Fixture {
    _dir: tempfile::TempDir,
    store: Arc<dyn Store>,
    /// Keyed by the output dtypes' names (the layout enums are not `Hash`).
    refs: Mutex<HashMap<String, Arc<Refs>>>,
}

fn build(kind: Kind) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    common::write_tiny_hf(
        &hf,
        common::Dims {
            hidden: 32,
            ffn: 48,
            vocab: 40,
            layers: LAYERS,
        },
    );
    let src = cawsfs::import::open_source(&hf).unwrap();
    let out = dir.path().join("archive");
    match kind {
        Kind::Cawsf => {
            let mut o = ConvertOptions::default();
            o.ndsq.rank = 2;
            o.ndsq.pq_k = 4;
            cawsfs::convert::convert(src.as_ref(), &out, &o, &|_, _, _| {}).unwrap();
        }
        Kind::Delta => {
            let o = delta::DeltaOptions {
                rank: cawsfs::codec::delta::RankChoice::Fixed(2),
                ..delta::DeltaOptions::default()
            };
            delta::convert(src.as_ref(), &out, &o, &|_, _, _| {}).unwrap();
        }
        Kind::Npy | Kind::NpyZstd => {
            let o = npydir::NpyOptions {
                zstd: kind == Kind::NpyZstd,
                ..npydir::NpyOptions::default()
            };
            npydir::convert(src.as_ref(), &out, &o, &|_, _, _| {}).unwrap();
        }
    }
    let store = cawsfs::archive::open(&out).unwrap();
    Fixture {
        _dir: dir,
        store,
        refs: Mutex::new(HashMap::new()),
    }
}

fn fixture(kind: Kind) -> &'static Fixture {
    static FIXTURES: OnceLock<Mutex<HashMap<Kind, &'static Fixture>>> = OnceLock::new();
    let mut m = FIXTURES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    m.entry(kind)
        .or_insert_with(|| Box::leak(Box::new(build(kind))))
}

impl Fixture {
    /// What `cawsfs export` writes, by served name: GGUF and safetensors streamed to
    /// files by `export_file`, the metadata files as the HF-directory export writes them.
    fn reference(&self, gguf: GgufView, st: Option<FloatType>) -> Arc<Refs> {
        let mut refs = self.refs.lock().unwrap_or_else(|e| e.into_inner());
        refs.entry(format!("{gguf:?} {st:?}"))
            .or_insert_with(|| {
                let model = self.store.model();
                let dir = tempfile::tempdir().unwrap();
                let mut out = HashMap::new();
                for (name, bytes) in layout::hf_metadata_files(model).unwrap() {
                    out.insert(name, bytes);
                }
                for vf in [
                    layout::gguf_file(
                        model,
                        &layout::gguf_plan(model, gguf, &layout::held_of(&*self.store)).unwrap(),
                    )
                    .unwrap(),
                    layout::safetensors_file(model, st).unwrap(),
                ] {
                    let p = dir.path().join(&vf.name);
                    cawsfs::export::export_file(&vf, &*self.store as &dyn RowSource, &p, &|_| {})
                        .unwrap();
                    out.insert(vf.name.clone(), std::fs::read(&p).unwrap());
                }
                Arc::new(out)
            })
            .clone()
    }
}

/// A mount's options, as generated.
#[derive(Clone, Debug)]
struct Setup {
    chunk_shift: u32,
    /// Budget = `budget_chunks` chunks plus `budget_extra` bytes (less than a chunk).
    budget_chunks: u64,
    budget_extra: Index,
    readahead: u64,
    threads: usize,
    router_eviction: bool,
    gguf: GgufView,
    st: Option<FloatType>,
    /// A disk tier: after the ops, a second filesystem on the same tier serves every
    /// file byte-identical to the reference.
    tier: bool,
}

impl Setup {
    fn chunk(&self) -> u64 {
        1 << self.chunk_shift
    }
    fn budget(&self) -> u64 {
        self.budget_chunks * self.chunk() + self.budget_extra.index(self.chunk() as usize) as u64
    }
}

fn setup_strategy() -> impl Strategy<Value = Setup> {
    let float = prop_oneof![
        Just(FloatType::F16),
        Just(FloatType::BF16),
        Just(FloatType::F32)
    ];
    (
        8u32..=13,
        // Less than one chunk, a few chunks (less than one tensor), and everything.
        prop_oneof![0u64..=3, 4u64..=24, Just(1 << 20)],
        any::<Index>(),
        0u64..=4,
        0usize..=2,
        any::<bool>(),
        prop_oneof![
            Just(GgufView::Type(GgmlType::F16)),
            Just(GgufView::Type(GgmlType::BF16)),
            Just(GgufView::Type(GgmlType::F32)),
            Just(GgufView::Type(GgmlType::Q8_0)),
            Just(GgufView::Auto),
            Just(GgufView::Source),
        ],
        proptest::option::of(float),
        any::<bool>(),
    )
        .prop_map(
            |(chunk_shift, budget_chunks, budget_extra, readahead, threads, re, gguf, st, tier)| {
                Setup {
                    chunk_shift,
                    budget_chunks,
                    budget_extra,
                    readahead,
                    threads,
                    router_eviction: re,
                    gguf,
                    st,
                    tier,
                }
            },
        )
}

/// Where a read starts, resolved against the file's size and the chunk size.
#[derive(Clone, Debug)]
enum Off {
    Anywhere(Index),
    /// `size + d` (past EOF for d ≥ 0).
    FromEnd(i64),
    /// Chunk boundary `i * chunk + d`.
    Chunk(Index, i64),
}

/// What a control request names (`control::Target`), resolved as the daemon does.
#[derive(Clone, Debug)]
enum Sel {
    /// Whole file, or a byte range `a .. a + len` of it.
    File(Index, Option<(Index, u64)>),
    Tensor(Index),
    /// Layers past the model's are errors, as in the daemon.
    Layer(u32),
}

#[derive(Clone, Debug)]
enum Op {
    Read {
        file: Index,
        off: Off,
        len: u32,
    },
    /// Continue where the previous read of the file ended (triggers read-ahead).
    ReadNext {
        file: Index,
        len: u32,
    },
    Parallel(Vec<(Index, Off, u32)>),
    Prefetch(Sel),
    Pin(Sel),
    Unpin(Sel),
    Evict(Sel),
    EvictAll,
    Hints(Sel),
    ClearHints,
    TraceOn,
    TraceOff,
    WaitIdle,
    Stat,
}

fn len_strategy() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0u32), 1u32..16, 1u32..3000, 3000u32..12_000]
}

fn sel_strategy() -> impl Strategy<Value = Sel> {
    prop_oneof![
        (
            any::<Index>(),
            proptest::option::of((any::<Index>(), 0u64..8000))
        )
            .prop_map(|(f, r)| Sel::File(f, r)),
        any::<Index>().prop_map(Sel::Tensor),
        (0u32..=LAYERS as u32).prop_map(Sel::Layer),
    ]
}

fn off_strategy() -> impl Strategy<Value = Off> {
    prop_oneof![
        any::<Index>().prop_map(Off::Anywhere),
        (-64i64..=64).prop_map(Off::FromEnd),
        (any::<Index>(), -2i64..=2).prop_map(|(i, d)| Off::Chunk(i, d)),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (any::<Index>(), off_strategy(), len_strategy())
            .prop_map(|(file, off, len)| Op::Read { file, off, len }),
        2 => proptest::collection::vec((any::<Index>(), off_strategy(), len_strategy()), 2..=4)
            .prop_map(Op::Parallel),
        4 => (any::<Index>(), len_strategy()).prop_map(|(file, len)| Op::ReadNext { file, len }),
        2 => sel_strategy().prop_map(Op::Prefetch),
        3 => sel_strategy().prop_map(Op::Pin),
        2 => sel_strategy().prop_map(Op::Unpin),
        2 => sel_strategy().prop_map(Op::Evict),
        1 => Just(Op::EvictAll),
        1 => sel_strategy().prop_map(Op::Hints),
        1 => Just(Op::ClearHints),
        1 => Just(Op::TraceOn),
        1 => Just(Op::TraceOff),
        1 => Just(Op::WaitIdle),
        1 => Just(Op::Stat),
    ]
}

/// What the test expects of the mount, kept beside it.
#[derive(Default)]
struct Model {
    /// Pin counts and the bytes they reserve.
    pins: HashMap<ChunkKey, u32>,
    reserved: u64,
    /// Where the previous read of each file ended.
    last_end: HashMap<u64, u64>,
    /// Reads that reached the cache, bytes they served, chunk lookups they made.
    reads: u64,
    bytes_served: u64,
    lookups: u64,
    per_file: HashMap<u32, (u64, u64)>,
    /// Chunk lookups since the trace started; None when it is off.
    traced: Option<Vec<(u32, u64)>>,
    prev: Option<CacheStats>,
}

/// What the cases of one kind did, printed at the end (`--nocapture`) so a run
/// shows it exercised something.
#[derive(Default)]
struct Tally {
    cases: AtomicU64,
    ops: AtomicU64,
    reads: AtomicU64,
    bytes: AtomicU64,
    pins: AtomicU64,
    refused: AtomicU64,
    evictions: AtomicU64,
    prefetch_loads: AtomicU64,
    tier_hit_bytes: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Relaxed);
}

type Spans = Vec<(u32, u64, Range<u64>)>;

struct Case<'a> {
    fs: MountFs,
    setup: &'a Setup,
    refs: &'a Refs,
    /// Served files in inode order: (ino, name, cached).
    files: Vec<(u64, String, bool)>,
    m: Model,
    tally: &'a Tally,
}

fn fail(msg: String) -> TestCaseError {
    TestCaseError::fail(msg)
}

impl Case<'_> {
    fn chunk_len(&self, size: u64, index: u64) -> u64 {
        let cs = self.setup.chunk();
        (size - index * cs).min(cs)
    }

    /// The chunk spans a selector covers, exactly as the daemon's control handler
    /// computes them; None where it answers with an error.
    fn spans(&self, sel: &Sel) -> Option<Spans> {
        let cs = self.setup.chunk();
        let span = |size: u64, a: u64, b: u64| (a / cs)..b.min(size).div_ceil(cs);
        let model = self.fs.archive().model();
        let want: Vec<usize> = match sel {
            Sel::File(f, range) => {
                let (ino, name, cached) = &self.files[f.index(self.files.len())];
                if !cached {
                    return None;
                }
                let size = self.refs[name].len() as u64;
                let (a, b) = match range {
                    None => (0, size),
                    Some((a, len)) => {
                        let a = a.index(size as usize + 16) as u64;
                        (a, a + len)
                    }
                };
                if a >= size {
                    return None;
                }
                return Some(vec![(file_id(*ino), size, span(size, a, b))]);
            }
            Sel::Tensor(t) => vec![t.index(model.tensors.len())],
            Sel::Layer(l) => {
                let v: Vec<usize> = (0..model.tensors.len())
                    .filter(|&i| cawsfs::model::names::layer_of(&model.tensors[i].name) == Some(*l))
                    .collect();
                if v.is_empty() {
                    return None;
                }
                v
            }
        };
        let mut out = Vec::new();
        for e in self.fs.tensor_files() {
            for (t, a, b) in e.file.tensor_ranges() {
                if want.contains(&t) {
                    out.push((file_id(e.ino), e.file.size, span(e.file.size, a, b)));
                }
            }
        }
        Some(out)
    }

    fn keys(spans: &Spans) -> Vec<(ChunkKey, u64)> {
        spans
            .iter()
            .flat_map(|(f, size, r)| {
                r.clone()
                    .map(move |index| (ChunkKey { file: *f, index }, *size))
            })
            .collect()
    }

    /// Wait for the prefetch workers to finish what is queued (none: nothing runs).
    fn idle(&self) -> Result<(), TestCaseError> {
        if self.setup.threads > 0 && !self.fs.cache().wait_prefetch_idle(IDLE_WAIT) {
            return Err(fail("prefetch did not become idle".into()));
        }
        Ok(())
    }

    fn offset(&self, ino: u64, size: u64, off: Option<&Off>) -> u64 {
        let cs = self.setup.chunk();
        match off {
            None => self.m.last_end.get(&ino).copied().unwrap_or(0),
            Some(Off::Anywhere(i)) => i.index((size + 2 * cs) as usize) as u64,
            Some(Off::FromEnd(d)) => (size as i64 + d).max(0) as u64,
            Some(Off::Chunk(i, d)) => {
                let n = size.div_ceil(cs) + 2;
                (i.index(n as usize) as i64 * cs as i64 + d).max(0) as u64
            }
        }
    }

    /// An operation with its indices resolved, for failure reports (proptest prints
    /// the raw `Index` values, which say little).
    fn describe(&self, op: &Op) -> String {
        let read = |fi: &Index, off: Option<&Off>, len: u32| {
            let (ino, name, _) = &self.files[fi.index(self.files.len())];
            let size = self.refs[name].len() as u64;
            format!(
                "read {name} @{}+{len} (size {size})",
                self.offset(*ino, size, off)
            )
        };
        let sel = |verb: &str, s: &Sel| match self.spans(s) {
            None => format!("{verb} {s:?}: refused"),
            Some(spans) => {
                let parts: Vec<String> = spans
                    .iter()
                    .map(|(f, _, r)| {
                        let name = &self.files.iter().find(|x| file_id(x.0) == *f).unwrap().1;
                        format!("{name} chunks {r:?}")
                    })
                    .collect();
                format!("{verb} {}", parts.join(", "))
            }
        };
        match op {
            Op::Read { file, off, len } => read(file, Some(off), *len),
            Op::ReadNext { file, len } => read(file, None, *len),
            Op::Parallel(rs) => {
                let v: Vec<String> = rs.iter().map(|(f, o, l)| read(f, Some(o), *l)).collect();
                format!("at once: {}", v.join("; "))
            }
            Op::Prefetch(s) => sel("prefetch", s),
            Op::Pin(s) => sel("pin", s),
            Op::Unpin(s) => sel("unpin", s),
            Op::Evict(s) => sel("evict", s),
            Op::Hints(s) => sel("hint", s),
            other => format!("{other:?}"),
        }
    }

    /// (ino, name, cached, offset) of a generated read.
    fn resolve(&self, fi: &Index, off: Option<&Off>) -> (u64, String, bool, u64) {
        let (ino, name, cached) = self.files[fi.index(self.files.len())].clone();
        let size = self.refs[&name].len() as u64;
        let offset = self.offset(ino, size, off);
        (ino, name, cached, offset)
    }

    fn read(&mut self, fi: &Index, off: Option<&Off>, len: u32) -> Result<(), TestCaseError> {
        let (ino, name, cached, offset) = self.resolve(fi, off);
        let got = self.fs.read(ino, offset, len);
        self.verify_read(ino, &name, cached, offset, len, got)
    }

    /// Several reads at once (as FUSE issues them), so that they coalesce on the same
    /// chunk loads and race the prefetch workers.
    fn parallel(&mut self, reads: &[(Index, Off, u32)]) -> Result<(), TestCaseError> {
        let resolved: Vec<_> = reads
            .iter()
            .map(|(fi, off, len)| (self.resolve(fi, Some(off)), *len))
            .collect();
        let fs = &self.fs;
        let results: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = resolved
                .iter()
                .map(|((ino, _, _, offset), len)| s.spawn(move || fs.read(*ino, *offset, *len)))
                .collect();
            hs.into_iter().map(|h| h.join()).collect()
        });
        for (((ino, name, cached, offset), len), got) in resolved.into_iter().zip(results) {
            let got = got.map_err(|_| fail(format!("read {name} {offset}+{len} panicked")))?;
            self.verify_read(ino, &name, cached, offset, len, got)?;
        }
        Ok(())
    }

    /// Compare a read with the reference and count what it did in the model.
    fn verify_read(
        &mut self,
        ino: u64,
        name: &str,
        cached: bool,
        offset: u64,
        len: u32,
        got: Result<Vec<u8>, cawsfs::fs::FsError>,
    ) -> Result<(), TestCaseError> {
        let r = &self.refs[name];
        let size = r.len() as u64;
        let cs = self.setup.chunk();
        bump(&self.tally.reads, 1);
        let got = got.map_err(|e| fail(format!("read {name} {offset}+{len}: {e}")))?;
        let lo = offset.min(size) as usize;
        let hi = offset.saturating_add(len as u64).min(size) as usize;
        if got[..] != r[lo..hi] {
            let first = got.iter().zip(&r[lo..hi]).position(|(a, b)| a != b);
            return Err(fail(format!(
                "read {name} {offset}+{len}: {} bytes, reference {}; first difference at {:?}",
                got.len(),
                hi - lo,
                first.map(|p| offset + p as u64)
            )));
        }
        bump(&self.tally.bytes, got.len() as u64);
        if cached && hi > lo {
            // Only non-empty reads inside the file reach the cache (fs clips them).
            let n = (hi - lo) as u64;
            let f = file_id(ino);
            self.m.reads += 1;
            self.m.bytes_served += n;
            let pf = self.m.per_file.entry(f).or_default();
            pf.0 += 1;
            pf.1 += n;
            let chunks = (lo as u64 / cs)..(hi as u64).div_ceil(cs);
            self.m.lookups += chunks.end - chunks.start;
            if let Some(t) = &mut self.m.traced {
                t.extend(chunks.clone().map(|i| (f, i)));
            }
            // A pinned chunk, once read, stays resident.
            for index in chunks {
                let key = ChunkKey { file: f, index };
                if self.m.pins.contains_key(&key) && !self.fs.cache().contains(key) {
                    return Err(fail(format!(
                        "pinned chunk {key:?} not resident after a read"
                    )));
                }
            }
        }
        // After parallel reads this is one of their ends; any is a fine next offset.
        self.m.last_end.insert(ino, hi.max(lo) as u64);
        Ok(())
    }

    fn pin(&mut self, sel: &Sel) -> Result<(), TestCaseError> {
        let Some(spans) = self.spans(sel) else {
            return Ok(());
        };
        let cache = self.fs.cache().clone();
        let budget = self.setup.budget();
        let mut done = Vec::new();
        for (key, size) in Self::keys(&spans) {
            let len = self.chunk_len(size, key.index);
            let expect = self.m.pins.contains_key(&key) || self.m.reserved + len <= budget;
            let got = cache.pin(key, size);
            if got.is_ok() != expect {
                return Err(fail(format!(
                    "pin {key:?} ({len} bytes, {} reserved, budget {budget}): {got:?}, expected {}",
                    self.m.reserved,
                    if expect { "Ok" } else { "an error" }
                )));
            }
            bump(&self.tally.pins, 1);
            if got.is_err() {
                bump(&self.tally.refused, 1);
                // All or nothing, as the daemon does.
                for (k, ksize) in done {
                    cache
                        .unpin(k)
                        .map_err(|e| fail(format!("undo pin {k:?}: {e}")))?;
                    self.model_unpin(k, ksize);
                }
                return Ok(());
            }
            *self.m.pins.entry(key).or_insert(0) += 1;
            if self.m.pins[&key] == 1 {
                self.m.reserved += len;
            }
            done.push((key, size));
        }
        for (f, size, r) in spans {
            cache.prefetch_registered(f, size, r);
        }
        Ok(())
    }

    fn model_unpin(&mut self, key: ChunkKey, size: u64) {
        let c = self.m.pins.get_mut(&key).expect("pinned in the model");
        *c -= 1;
        if *c == 0 {
            self.m.pins.remove(&key);
            self.m.reserved -= self.chunk_len(size, key.index);
        }
    }

    fn unpin(&mut self, sel: &Sel) -> Result<(), TestCaseError> {
        let Some(spans) = self.spans(sel) else {
            return Ok(());
        };
        for (key, size) in Self::keys(&spans) {
            let expect = self.m.pins.contains_key(&key);
            let got = self.fs.cache().unpin(key);
            if got.is_ok() != expect {
                return Err(fail(format!("unpin {key:?}: {got:?}, pinned: {expect}")));
            }
            if expect {
                self.model_unpin(key, size);
            }
        }
        Ok(())
    }

    fn evict(&mut self, sel: &Sel) -> Result<(), TestCaseError> {
        let Some(spans) = self.spans(sel) else {
            return Ok(());
        };
        // Idle first, so no prefetch brings a chunk back behind the test's back.
        self.idle()?;
        let cache = self.fs.cache().clone();
        let mut expect = 0;
        let mut seen = HashSet::new();
        for (key, size) in Self::keys(&spans) {
            if seen.insert(key) && !self.m.pins.contains_key(&key) && cache.contains(key) {
                expect += self.chunk_len(size, key.index);
            }
        }
        let mut freed = 0;
        for (f, _, r) in &spans {
            freed += cache.evict(r.clone().map(|index| ChunkKey { file: *f, index }));
        }
        if freed != expect {
            return Err(fail(format!(
                "evict freed {freed} bytes, expected {expect}"
            )));
        }
        for (key, _) in Self::keys(&spans) {
            if cache.contains(key) != self.m.pins.contains_key(&key) && cache.contains(key) {
                return Err(fail(format!("{key:?} resident after evict")));
            }
        }
        Ok(())
    }

    fn evict_all(&mut self) -> Result<(), TestCaseError> {
        self.idle()?;
        let cache = self.fs.cache();
        let before = cache.stats().unpinned_bytes;
        let freed = cache.evict_all_unpinned();
        let s = cache.stats();
        if freed != before || s.unpinned_bytes != 0 || s.bytes_used != s.pinned_resident_bytes {
            return Err(fail(format!(
                "evict all freed {freed} of {before} unpinned bytes; now {s:?}"
            )));
        }
        Ok(())
    }

    fn hints(&mut self, sel: Option<&Sel>) -> Result<(), TestCaseError> {
        let keys: HashSet<ChunkKey> = match sel {
            None => HashSet::new(),
            Some(s) => match self.spans(s) {
                None => return Ok(()),
                Some(sp) => Self::keys(&sp).into_iter().map(|(k, _)| k).collect(),
            },
        };
        let cache = self.fs.cache();
        let n = cache.set_hints(keys.iter().copied());
        let expect = if self.setup.router_eviction {
            keys.len()
        } else {
            0
        };
        if n != expect || cache.hint_count() != expect {
            return Err(fail(format!(
                "set_hints of {} chunks: {n} set, hint_count {}, expected {expect}",
                keys.len(),
                cache.hint_count()
            )));
        }
        Ok(())
    }

    fn trace_off(&mut self) -> Result<(), TestCaseError> {
        let (events, dropped) = self.fs.cache().trace_stop();
        let Some(expect) = self.m.traced.take() else {
            return Ok(());
        };
        let mut got: Vec<(u32, u64)> = events
            .iter()
            .map(|e: &TraceEvent| (e.file, e.index))
            .collect();
        let mut expect = expect;
        // Chunks missed by one read load in parallel, so order within a read varies.
        got.sort_unstable();
        expect.sort_unstable();
        if dropped != 0 || got != expect {
            return Err(fail(format!(
                "trace recorded {} lookups ({dropped} dropped), expected {}",
                got.len(),
                expect.len()
            )));
        }
        Ok(())
    }

    fn stat(&self) -> Result<(), TestCaseError> {
        let listing = self.fs.readdir(ROOT_INO).map_err(|e| fail(e.to_string()))?;
        if listing.len() != self.files.len() + 2 {
            return Err(fail(format!("readdir: {listing:?}")));
        }
        for (ino, name, _) in &self.files {
            let a = self
                .fs
                .lookup(ROOT_INO, std::ffi::OsStr::new(name))
                .map_err(|e| fail(e.to_string()))?;
            let g = self.fs.getattr(*ino).map_err(|e| fail(e.to_string()))?;
            if a != g || a.ino != *ino || a.size != self.refs[name].len() as u64 || a.is_dir {
                return Err(fail(format!("{name}: lookup {a:?}, getattr {g:?}")));
            }
            self.fs
                .open(*ino, false)
                .map_err(|e| fail(format!("open {name}: {e}")))?;
        }
        Ok(())
    }

    /// The statistics' promises, checked after every operation.
    fn check_stats(&mut self, idle: bool) -> Result<(), TestCaseError> {
        let cache = self.fs.cache();
        let s = cache.stats();
        let budget = self.setup.budget();
        let m = &self.m;
        let mut bad = Vec::new();
        if s.budget_bytes != budget || s.chunk_size != self.setup.chunk() {
            bad.push("budget or chunk size");
        }
        if s.bytes_used != s.unpinned_bytes + s.pinned_resident_bytes {
            bad.push("bytes_used != unpinned + pinned resident");
        }
        if s.unpinned_bytes + s.pinned_bytes > budget || s.bytes_used > budget {
            bad.push("over budget");
        }
        if s.pinned_resident_bytes > s.pinned_bytes {
            bad.push("pinned resident > pinned reserved");
        }
        if s.pinned_bytes != m.reserved || s.pinned_entries != m.pins.len() as u64 {
            bad.push("pinned bytes or entries differ from the pins made");
        }
        if m.pins.keys().any(|k| !cache.is_pinned(*k)) {
            bad.push("a pinned chunk is not pinned");
        }
        if s.reads != m.reads || s.bytes_served != m.bytes_served {
            bad.push("reads or bytes served differ from the reads made");
        }
        if s.hits + s.prefetch_hits + s.misses != m.lookups {
            bad.push("hits + prefetch hits + misses != chunks read");
        }
        if s.read_errors + s.load_errors + s.prefetch_errors != 0 {
            bad.push("errors on a clean archive");
        }
        if s.misses < s.coalesced {
            bad.push("more coalesced than misses");
        }
        if s.latency_us.count != s.reads {
            bad.push("latency samples != reads");
        }
        if idle && s.load_latency_us.count != s.loads {
            bad.push("load latency samples != loads");
        }
        for f in &s.files {
            let (r, b) = m.per_file.get(&f.file).copied().unwrap_or_default();
            if f.reads != r || f.bytes_served != b {
                bad.push("per-file reads or bytes differ");
            }
        }
        if idle && s.loads + s.coalesced != s.misses + s.prefetch_loads {
            // Every load is a demand miss that was not coalesced, or a prefetch load.
            bad.push("loads != misses - coalesced + prefetch loads");
        }
        if let Some(p) = &m.prev {
            let mono = [
                (p.reads, s.reads),
                (p.hits, s.hits),
                (p.prefetch_hits, s.prefetch_hits),
                (p.misses, s.misses),
                (p.coalesced, s.coalesced),
                (p.bytes_served, s.bytes_served),
                (p.bytes_loaded, s.bytes_loaded),
                (p.loads, s.loads),
                (p.evictions, s.evictions),
                (p.not_retained, s.not_retained),
                (p.readahead_triggers, s.readahead_triggers),
                (p.prefetch_queued, s.prefetch_queued),
                (p.prefetch_loads, s.prefetch_loads),
                (p.prefetch_skipped, s.prefetch_skipped),
                (p.prefetch_dropped, s.prefetch_dropped),
                (p.latency_us.count, s.latency_us.count),
            ];
            if mono.iter().any(|(a, b)| b < a) {
                bad.push("a counter went backwards");
            }
        }
        if !bad.is_empty() {
            return Err(fail(format!("{}: {s:?}", bad.join("; "))));
        }
        self.m.prev = Some(s);
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        let mut idle = self.setup.threads == 0;
        match op {
            Op::Read { file, off, len } => self.read(file, Some(off), *len)?,
            Op::ReadNext { file, len } => self.read(file, None, *len)?,
            Op::Parallel(reads) => self.parallel(reads)?,
            Op::Prefetch(sel) => {
                if let Some(spans) = self.spans(sel) {
                    for (f, size, r) in spans {
                        let n = r.end - r.start;
                        let q = self.fs.cache().prefetch_registered(f, size, r);
                        if q as u64 > n {
                            return Err(fail(format!("prefetch queued {q} of {n} chunks")));
                        }
                    }
                }
            }
            Op::Pin(sel) => self.pin(sel)?,
            Op::Unpin(sel) => self.unpin(sel)?,
            Op::Evict(sel) => self.evict(sel)?,
            Op::EvictAll => self.evict_all()?,
            Op::Hints(sel) => self.hints(Some(sel))?,
            Op::ClearHints => self.hints(None)?,
            Op::TraceOn => {
                self.fs.cache().trace_start();
                self.m.traced = Some(Vec::new());
            }
            Op::TraceOff => self.trace_off()?,
            Op::WaitIdle => {
                self.idle()?;
                idle = true;
                // A pin queues its chunks' loads; once those ran, they are resident.
                let cache = self.fs.cache();
                if self.setup.threads > 0 && cache.stats().prefetch_dropped == 0 {
                    if let Some(k) = self.m.pins.keys().find(|k| !cache.contains(**k)) {
                        return Err(fail(format!("pinned {k:?} not resident once idle")));
                    }
                }
            }
            Op::Stat => self.stat()?,
        }
        self.check_stats(idle)
    }
}

fn run_case(kind: Kind, setup: &Setup, ops: &[Op], tally: &Tally) -> Result<(), TestCaseError> {
    let fx = fixture(kind);
    let refs = fx.reference(setup.gguf, setup.st);
    let opts = FsOptions {
        cache_bytes: setup.budget(),
        chunk_size: setup.chunk(),
        gguf_type: setup.gguf,
        safetensors_dtype: setup.st,
        safetensors_shard_bytes: cawsfs::layout::DEFAULT_SHARD_BYTES,
        readahead_chunks: setup.readahead,
        prefetch_threads: setup.threads,
        router_eviction: setup.router_eviction,
        tier: None,
        experts: FsOptions::default().experts,
    };
    let tier_dir = setup.tier.then(|| tempfile::tempdir().unwrap());
    let opts = FsOptions {
        tier: tier_dir.as_ref().map(|d| TierOptions {
            dir: d.path().to_path_buf(),
            max_bytes: 1 << 30,
            required: true,
        }),
        ..opts
    };
    let fs = MountFs::new(fx.store.clone(), &opts).map_err(|e| fail(e.to_string()))?;
    let files: Vec<(u64, String, bool)> = fs
        .entries()
        .map(|e| (e.ino, e.name.clone(), e.cached))
        .collect();
    let names: HashSet<&String> = files.iter().map(|f| &f.1).collect();
    if names != refs.keys().collect::<HashSet<_>>() {
        return Err(fail(format!(
            "served {names:?}, export writes {:?}",
            refs.keys()
        )));
    }
    let mut case = Case {
        fs,
        setup,
        refs: &refs,
        files,
        m: Model::default(),
        tally,
    };
    bump(&tally.cases, 1);
    bump(&tally.ops, ops.len() as u64);
    let mut log = format!(
        "chunk {} B, budget {} B, read-ahead {}, {} prefetch threads, router eviction {}, gguf {:?}, safetensors {:?}",
        setup.chunk(),
        setup.budget(),
        setup.readahead,
        setup.threads,
        setup.router_eviction,
        setup.gguf,
        setup.st
    );
    for (i, op) in ops.iter().enumerate() {
        log += &format!("\n  {i}: {}", case.describe(op));
        case.apply(op)
            .map_err(|e| fail(format!("{log}\n  failed: {e}")))?;
    }
    // Whatever was queued finishes cleanly, and the cache drops without hanging.
    case.idle()?;
    case.check_stats(true)?;
    let s = case.fs.cache().stats();
    bump(&tally.evictions, s.evictions);
    bump(&tally.prefetch_loads, s.prefetch_loads);
    if setup.tier {
        case.fs.flush_tier();
        let written = case.fs.tier().unwrap().writer_stats().written_bytes;
        let again = MountFs::new(fx.store.clone(), &opts).map_err(|e| fail(e.to_string()))?;
        for e in again.entries() {
            let want = &refs[&e.name];
            let mut got = Vec::with_capacity(want.len());
            while got.len() < want.len() {
                let part = again
                    .read(e.ino, got.len() as u64, 1 << 20)
                    .map_err(|err| fail(format!("{log}\n  tier re-read of {}: {err}", e.name)))?;
                got.extend_from_slice(&part);
            }
            if &got != want {
                return Err(fail(format!(
                    "{log}\n  {} differs after a restart on the tier",
                    e.name
                )));
            }
        }
        let t = again.tier().unwrap();
        if written > 0 && t.hit_bytes() == 0 {
            return Err(fail(format!(
                "{log}\n  {written} bytes written to the tier, none served back"
            )));
        }
        bump(&tally.tier_hit_bytes, t.hit_bytes());
    }
    Ok(())
}

/// Why `ops` fails, if it does in one of a few tries (prefetch timing varies).
fn fails(kind: Kind, setup: &Setup, ops: &[Op]) -> Option<String> {
    let tries = if setup.threads == 0 { 1 } else { 3 };
    (0..tries).find_map(|_| {
        run_case(kind, setup, ops, &Tally::default())
            .err()
            .map(|e| e.to_string())
    })
}

/// Finish what proptest's shrinking leaves: it simplifies the elements of a sequence
/// but removes few of them, and prefetch timing makes some of its attempts pass. Drop
/// single operations, and prefetch and read-ahead, while the case still fails.
fn minimize(
    kind: Kind,
    mut setup: Setup,
    mut ops: Vec<Op>,
    mut msg: String,
) -> (Setup, Vec<Op>, String) {
    let t0 = std::time::Instant::now();
    loop {
        let mut changed = false;
        for simpler in [
            Setup {
                threads: 0,
                ..setup.clone()
            },
            Setup {
                readahead: 0,
                ..setup.clone()
            },
        ] {
            if (simpler.threads, simpler.readahead) != (setup.threads, setup.readahead) {
                if let Some(m) = fails(kind, &simpler, &ops) {
                    (setup, msg, changed) = (simpler, m, true);
                }
            }
        }
        let mut i = 0;
        while i < ops.len() && t0.elapsed() < MINIMIZE_TIME {
            let mut fewer = ops.clone();
            fewer.remove(i);
            match fails(kind, &setup, &fewer) {
                Some(m) => (ops, msg, changed) = (fewer, m, true),
                None => i += 1,
            }
        }
        if !changed || t0.elapsed() >= MINIMIZE_TIME {
            return (setup, ops, msg);
        }
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

fn check(kind: Kind) {
    let config = Config {
        cases: cases(),
        // Failures are reported with their shrunk op sequence; nothing is written
        // into the source tree.
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let strategy = (
        setup_strategy(),
        proptest::collection::vec(op_strategy(), 1..64),
    );
    let tally = Tally::default();
    let t0 = std::time::Instant::now();
    let result = runner.run(&strategy, |(setup, ops)| {
        run_case(kind, &setup, &ops, &tally)
    });
    match result {
        Ok(()) => {}
        Err(TestError::Fail(why, (setup, ops))) => {
            let (setup, ops, msg) = minimize(kind, setup, ops, why.to_string());
            panic!(
                "{kind:?}: minimal failing sequence ({} ops):\n{msg}\n{setup:?}\n{ops:?}",
                ops.len()
            );
        }
        Err(e) => panic!("{kind:?}: {e}"),
    }
    let g = |c: &AtomicU64| c.load(Relaxed);
    println!(
        "{kind:?}: {} cases, {} ops in {:.1} s: {} reads ({} bytes equal to the export), {} pins ({} refused over budget), {} evictions, {} prefetch loads, {} bytes served back from a tier",
        g(&tally.cases),
        g(&tally.ops),
        t0.elapsed().as_secs_f64(),
        g(&tally.reads),
        g(&tally.bytes),
        g(&tally.pins),
        g(&tally.refused),
        g(&tally.evictions),
        g(&tally.prefetch_loads),
        g(&tally.tier_hit_bytes),
    );
}

#[test]
fn cawsf_mount_equals_export() {
    check(Kind::Cawsf);
}

#[test]
fn delta_mount_equals_export() {
    check(Kind::Delta);
}

#[test]
fn npy_dir_mount_equals_export() {
    check(Kind::Npy);
}

#[test]
fn npy_dir_zstd_mount_equals_export() {
    check(Kind::NpyZstd);
}
