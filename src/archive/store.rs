//! One interface over the three archive kinds (`.cawsf`, delta, npy-dir): what the
//! CLI, `export` and the mount need from an opened archive, whatever its format.
//! Everything above this module sees a [`Store`]: the model description, rows of any
//! tensor, checksums to verify, and what reads have cost.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::model::{ModelDesc, ReadError, RowSource};

/// Which format an archive is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    Cawsf,
    Delta,
    NpyDir,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Cawsf => "cawsf",
            Kind::Delta => "delta",
            Kind::NpyDir => "npy-dir",
        }
    }
}

/// One part of an archive as `inspect` lists it: a section of a container file, or a
/// file of a directory.
#[derive(Clone, Debug)]
pub struct SectionInfo {
    pub kind: String,
    pub offset: u64,
    pub size: u64,
    pub flags: u32,
}

/// What `inspect` shows about one tensor.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TensorSummary {
    /// Short human label of how the tensor is stored ("ndsq r4 pq2x256", "int8", ...).
    pub codec: String,
    pub rows_per_block: u64,
    pub n_blocks: usize,
    /// Bytes the tensor occupies in the archive (its share of shared parts excluded).
    pub stored_bytes: u64,
    /// ‖W−Ŵ‖/‖W‖ measured at conversion, when known.
    pub rel_err: Option<f64>,
    /// The reconstructed values lie on an affine grid of `bits` bits per `group`
    /// values of a row (NDSQ with scalar R, no L and no S; only D's diagonal may be
    /// off it), which a ggml type of the same grid holds almost exactly.
    pub grid: Option<crate::codec::SqParams>,
}

/// Read cost counters every kind keeps: blocks (or files) fetched, their stored bytes
/// and their decompressed bytes. The mount reports these as "archive bytes read".
#[derive(Default)]
pub struct ReadCounters {
    blocks: AtomicU64,
    stored_bytes: AtomicU64,
    payload_bytes: AtomicU64,
}

impl ReadCounters {
    pub fn record(&self, stored: u64, payload: u64) {
        self.blocks.fetch_add(1, Relaxed);
        self.stored_bytes.fetch_add(stored, Relaxed);
        self.payload_bytes.fetch_add(payload, Relaxed);
    }
    pub fn snapshot(&self) -> ReadCounterSnapshot {
        ReadCounterSnapshot {
            blocks: self.blocks.load(Relaxed),
            stored_bytes: self.stored_bytes.load(Relaxed),
            payload_bytes: self.payload_bytes.load(Relaxed),
        }
    }
}

/// A snapshot of [`ReadCounters`].
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ReadCounterSnapshot {
    pub blocks: u64,
    pub stored_bytes: u64,
    pub payload_bytes: u64,
}

/// An opened archive of any kind.
pub trait Store: RowSource {
    fn kind(&self) -> Kind;
    /// The file or directory it was opened from.
    fn path(&self) -> &Path;
    fn model(&self) -> &ModelDesc;
    /// Panics if `tensor` is not an index into `model().tensors` (a caller bug).
    fn tensor_summary(&self, tensor: usize) -> TensorSummary;
    /// The archive's parts: sections of a container file, or the files of a directory.
    fn parts(&self) -> Vec<SectionInfo>;
    /// What the archive's bytes are, from its own checksums rather than its path: equal
    /// for copies, different for any change that can change what is served (the disk
    /// tier's entries are keyed by it, docs/TIER.md).
    fn identity(&self) -> u128;
    /// Every integrity failure, one line each. Empty = archive intact.
    fn verify_all(&self) -> Vec<String>;
    /// Whether [`Store::verify_all`] already decodes every block (then
    /// [`decode_failures`] has nothing to add).
    fn verify_decodes(&self) -> bool {
        false
    }
    fn read_counters(&self) -> ReadCounterSnapshot;
    /// The requests made so far, when the archive is an object in storage.
    fn fetch_stats(&self) -> Option<super::remote::FetchSnapshot> {
        None
    }
    /// Conversion report and other free-form metadata (JSON null when none).
    fn extra(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    /// (absolute file offset, stored length) of each block of a tensor, when blocks
    /// live in one file (used by `inspect --blocks` and corruption tests).
    fn block_locations(&self, _tensor: usize) -> Vec<(u64, u64)> {
        Vec::new()
    }
    /// Decompressed ROUTING bytes (docs/FORMAT.md); empty when the archive has none.
    fn routing_bytes(&self) -> &[u8] {
        &[]
    }
}

/// `rel_err[name]` of a conversion report kept in an archive's extra metadata.
pub fn rel_err_of(extra: &serde_json::Value, name: &str) -> Option<f64> {
    extra.get("rel_err")?.get(name)?.as_f64()
}

/// The argument checks of [`RowSource::read_rows`] every kind makes: rows `r0..r1` of a
/// `rows`×`cols` tensor into `out_len` values. Rows outside the tensor are
/// `OutOfRange`; a buffer of the wrong size is a caller bug (InvalidInput).
pub fn check_read(
    name: &str,
    (rows, cols): (u64, u64),
    (r0, r1): (u64, u64),
    out_len: usize,
) -> Result<(), ReadError> {
    if r0 > r1 || r1 > rows {
        return Err(ReadError::OutOfRange {
            tensor: name.to_string(),
            r0,
            r1,
        });
    }
    // rows·cols is bounded at open, so this cannot overflow.
    let want = (r1 - r0) * cols;
    if out_len as u64 != want {
        return Err(ReadError::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "read_rows: out has {out_len} values, rows {r0}..{r1} of tensor {name} need {want}"
            ),
        )));
    }
    Ok(())
}

/// One row block's share of a read: (block, its first row, its row count, rows
/// `lo..hi` relative to the block, the slice of the output they fill).
pub type BlockJob<'a, T> = (usize, u64, u64, u64, u64, &'a mut [T]);

/// Split a read of rows `r0..r1` (`r0 < r1 ≤ rows`, checked) of a tensor cut into
/// `rpb`-row blocks into one job per overlapping block; each row is `unit` items of
/// `out`.
pub fn block_jobs<T>(
    (rows, rpb): (u64, u64),
    (r0, r1): (u64, u64),
    unit: usize,
    out: &mut [T],
) -> Vec<BlockJob<'_, T>> {
    let b0 = (r0 / rpb) as usize;
    let b1 = ((r1 - 1) / rpb) as usize;
    let mut jobs = Vec::with_capacity(b1 - b0 + 1);
    let mut rest = out;
    for b in b0..=b1 {
        let first = b as u64 * rpb;
        let last = (first + rpb).min(rows);
        let (lo, hi) = (r0.max(first), r1.min(last));
        let (mine, tail) = rest.split_at_mut((hi - lo) as usize * unit);
        rest = tail;
        jobs.push((b, first, last - first, lo - first, hi - first, mine));
    }
    jobs
}

/// Every row block of every tensor decoded as a read would (codec parameters, global
/// blobs, shared bases), one line per failure: what `verify` adds to the checksums,
/// since an archive whose checksums match can still hold parameters no read can use.
pub fn decode_failures(store: &dyn Store) -> Vec<String> {
    use rayon::prelude::*;
    let model = store.model();
    let jobs: Vec<(usize, u64, u64)> = (0..model.tensors.len())
        .flat_map(|t| {
            let rows = model.tensors[t].rows();
            let rpb = store.tensor_summary(t).rows_per_block.max(1);
            (0..rows.div_ceil(rpb)).map(move |b| (t, b * rpb, ((b + 1) * rpb).min(rows)))
        })
        .collect();
    jobs.par_iter()
        .filter_map(|&(t, r0, r1)| {
            let cols = model.tensors[t].cols();
            let mut out = vec![0f32; ((r1 - r0) * cols) as usize];
            store
                .read_rows(t, r0, r1, &mut out)
                .err()
                .map(|e| e.to_string())
        })
        .collect()
}

/// Bytes of verified, decoded blocks a [`BlockMemo`] keeps at most, by default.
pub const BLOCK_MEMO_BYTES: usize = 4 << 20;

static MEMO_CAP: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(BLOCK_MEMO_BYTES);

/// Bound every [`BlockMemo`] of this process at `bytes` (the mount sizes it from its
/// cache budget: the memo is memory outside that budget). A sequential pass needs only
/// the blocks cut at the edges of the chunks in flight, a few per reader.
pub fn set_block_memo_bytes(bytes: usize) {
    MEMO_CAP.store(bytes, std::sync::atomic::Ordering::Relaxed);
}

fn memo_cap() -> usize {
    MEMO_CAP.load(std::sync::atomic::Ordering::Relaxed)
}

/// Row blocks read only in part (their checked, decompressed payloads, or what a kind
/// decodes them to), kept until the rest of their rows is read, so that the next read
/// of the same block (a sequential pass cuts blocks at every chunk boundary) neither
/// reads, checks nor decodes it again. Only blocks that passed their checks enter; a
/// block is dropped once reads have taken as many rows as it has (a sequential pass
/// keeps only the blocks cut at the boundaries of chunks in flight), or when the bound
/// ([`set_block_memo_bytes`], [`BLOCK_MEMO_BYTES`] by default) is reached (least
/// recently used first); one larger than a quarter of it is not kept.
pub struct BlockMemo<T = u8> {
    inner: std::sync::Mutex<MemoInner<T>>,
}

struct MemoEntry<T> {
    data: std::sync::Arc<Vec<T>>,
    /// Rows of the block no read has taken yet.
    left: u64,
}

struct MemoInner<T> {
    lru: lru::LruCache<(usize, usize), MemoEntry<T>>,
    bytes: usize,
}

impl<T> Default for BlockMemo<T> {
    fn default() -> Self {
        BlockMemo {
            inner: std::sync::Mutex::new(MemoInner {
                lru: lru::LruCache::unbounded(),
                bytes: 0,
            }),
        }
    }
}

impl<T> BlockMemo<T> {
    /// Block `key` (tensor, block) for a read of `rows` of its `block_rows` rows: from
    /// the memo, else from `load` (and kept when the read takes only some rows).
    pub fn get_or_load<E>(
        &self,
        key: (usize, usize),
        rows: (u64, u64),
        load: impl FnOnce() -> Result<Vec<T>, E>,
    ) -> Result<std::sync::Arc<Vec<T>>, E> {
        if let Some(data) = self.get(key, rows.0) {
            return Ok(data);
        }
        Ok(self.keep(key, rows, load()?))
    }

    /// Block `key` from the memo for a read of `rows` of its rows.
    pub fn get(&self, key: (usize, usize), rows: u64) -> Option<std::sync::Arc<Vec<T>>> {
        let mut m = self.lock();
        let e = m.lru.get_mut(&key)?;
        let data = e.data.clone();
        // Approximate: a row read twice counts twice, which only drops the block early
        // (it is then read again), never serves it wrongly.
        e.left = e.left.saturating_sub(rows);
        if e.left == 0 {
            m.bytes -= std::mem::size_of_val(data.as_slice());
            m.lru.pop(&key);
        }
        Some(data)
    }

    /// Block `key`, just loaded for a read of `rows` of its `block_rows` rows: kept when
    /// the read takes only some rows.
    pub fn keep(
        &self,
        key: (usize, usize),
        (rows, block_rows): (u64, u64),
        data: Vec<T>,
    ) -> std::sync::Arc<Vec<T>> {
        let data = std::sync::Arc::new(data);
        let size = std::mem::size_of_val(data.as_slice());
        let cap = memo_cap();
        if rows < block_rows && size <= cap / 4 {
            let mut m = self.lock();
            let entry = MemoEntry {
                data: data.clone(),
                left: block_rows - rows,
            };
            match m.lru.put(key, entry) {
                Some(old) => m.bytes = m.bytes - std::mem::size_of_val(old.data.as_slice()) + size,
                None => m.bytes += size,
            }
            while m.bytes > cap {
                match m.lru.pop_lru() {
                    Some((_, old)) => m.bytes -= std::mem::size_of_val(old.data.as_slice()),
                    None => break,
                }
            }
        }
        data
    }

    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemoInner<T>> {
        // The memo holds no invariant a panic elsewhere could break.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}
