//! The disk tier as the mounted filesystem uses it: opening each file's entry,
//! `materialize`, and the refill of extents the writer dropped. Reads consult it in
//! `load_chunk` (the parent module); passthrough of whole files is `super::passthrough`.

use crate::cache::Chunk;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::*;

/// The disk tier as the filesystem uses it: entries are read before reconstructing,
/// and what is reconstructed is offered to the writer.
pub struct FsTier {
    pub dir: PathBuf,
    pub max_bytes: u64,
    pub(super) writer: tier::Writer,
    /// Bytes served from the tier instead of reconstructed.
    pub(super) hit_bytes: AtomicU64,
    /// Extents that failed their check and were reconstructed.
    pub(super) bad_extents: AtomicU64,
    /// Opens answered with FUSE passthrough (the kernel reads the data file itself).
    pub(super) passthrough_opens: AtomicU64,
    /// Sealed backing files found changed (their seal lifted, docs/TIER.md).
    pub(super) tampered: AtomicU64,
    /// Set once a backing file could not be sealed (logged once).
    pub(super) unsealable: AtomicBool,
    /// Whether whole files are handed to the kernel, or why not.
    pub(super) passthrough: Mutex<Passthrough>,
    /// The last (or running) `materialize`.
    materializing: Mutex<Option<Arc<Materializing>>>,
    /// Extents the writer dropped and [`MountFs::refill_tier`] made again.
    refilled_extents: AtomicU64,
    /// Set by [`MountFs::stop_tier`]: no more refills.
    pub(super) stopping: AtomicBool,
    refill_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Sealed backing files watched for changes (None where inotify is not available:
    /// then changes are seen at opens and releases only).
    pub(super) seal_watch: Option<tier::SealWatch>,
    pub(super) seal_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Held while a seal is checked and a changed file put right: the watcher and the
    /// FUSE adapter's opens may find the same change at once.
    pub(super) repairing: Mutex<()>,
}

/// How long an unmount may spend writing the copies the disk tier's writer dropped.
const STOP_REFILL: std::time::Duration = std::time::Duration::from_secs(20);

/// Why an extent was not queued for the tier.
enum NotQueued {
    /// Reconstructing it failed (one line).
    Read(String),
    /// The size bound is reached, or the writer is closing.
    Full,
}

impl std::fmt::Display for NotQueued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotQueued::Read(why) => f.write_str(why),
            NotQueued::Full => f.write_str("the disk tier's size bound was reached"),
        }
    }
}

/// A `materialize` run: whole files reconstructed into the disk tier in the
/// background, so that their next open is a passthrough open.
pub struct Materializing {
    pub files: Vec<String>,
    /// Bytes missing from the tier when it started.
    pub total_bytes: u64,
    pub done_bytes: AtomicU64,
    pub running: AtomicBool,
    pub error: Mutex<Option<String>>,
    started: Instant,
    elapsed_ms: AtomicU64,
}

impl Materializing {
    /// Seconds it ran (so far, while running).
    pub fn elapsed_s(&self) -> f64 {
        if self.running.load(Ordering::Acquire) {
            self.started.elapsed().as_secs_f64()
        } else {
            self.elapsed_ms.load(Ordering::Relaxed) as f64 / 1000.0
        }
    }

    fn fail(&self, why: String) {
        self.error.lock().unwrap().get_or_insert(why);
    }

    fn failed(&self) -> bool {
        self.error.lock().unwrap().is_some()
    }
}

/// Why `materialize` could not start.
#[derive(Debug, thiserror::Error)]
pub enum MaterializeError {
    #[error("this mount has no disk tier (mounted with --no-disk-cache, or its directory could not be opened)")]
    NoTier,
    #[error("no file named {0} in this mount's disk tier")]
    NoFile(String),
    #[error("a materialize is already running ({0})")]
    Running(String),
    #[error("the disk tier's bound leaves {room} bytes; {files} need {need} more (raise --disk-cache-size, or free space with `cawsfs tier gc`)")]
    NoRoom { files: String, need: u64, room: u64 },
    #[error("cannot start the materialize thread: {0}")]
    Thread(std::io::Error),
}

impl FsTier {
    /// Queue a chunk the cache has just loaded for `entry`, unless it was read from
    /// the tier (listed there): the writer keeps a reference, and a full queue drops it.
    pub(super) fn keep(&self, entry: &Arc<tier::Entry>, idx: u64, chunk: &Arc<Chunk>) {
        if !entry.has(idx) {
            self.writer.offer(entry, idx, chunk.clone());
        }
    }

    pub fn writer_stats(&self) -> tier::WriterStats {
        self.writer.stats()
    }
    pub fn hit_bytes(&self) -> u64 {
        self.hit_bytes.load(Ordering::Relaxed)
    }
    pub fn refilled_extents(&self) -> u64 {
        self.refilled_extents.load(Ordering::Relaxed)
    }
    pub fn bad_extents(&self) -> u64 {
        self.bad_extents.load(Ordering::Relaxed)
    }
    pub fn passthrough_opens(&self) -> u64 {
        self.passthrough_opens.load(Ordering::Relaxed)
    }
    pub fn tampered(&self) -> u64 {
        self.tampered.load(Ordering::Relaxed)
    }
    pub fn passthrough(&self) -> Passthrough {
        self.passthrough.lock().unwrap().clone()
    }
    /// The last (or running) `materialize`, if any.
    pub fn materializing(&self) -> Option<Arc<Materializing>> {
        self.materializing.lock().unwrap().clone()
    }
}

impl MountFs {
    /// Write what the disk tier has queued and publish its entries (at unmount).
    pub fn flush_tier(&self) {
        if let Some(t) = &self.tier {
            t.writer.flush();
        }
    }

    /// Before the daemon exits: stop the refill (waiting for the extent it is making),
    /// write and publish what is queued, then the copies the writer dropped (from the
    /// cache, else reconstructed; for at most [`STOP_REFILL`]), so that a file read
    /// whole before the unmount is whole in the tier even when the reads outran the
    /// writer and the refill had no idle moment to catch up.
    /// Exiting with the refill or the writer in the middle of an extent kept the tier
    /// files open (and locked) after the main thread had exited, so `cawsfs umount`
    /// returned while they were still in use.
    pub fn stop_tier(&self) {
        let Some(t) = &self.tier else { return };
        t.stopping.store(true, Ordering::Relaxed);
        let refill = t.refill_thread.lock().unwrap().take();
        if let Some(h) = refill {
            h.thread().unpark();
            let _ = h.join();
        }
        // Before the seals are lifted at unmount, which the watcher would see.
        let watcher = t.seal_thread.lock().unwrap().take();
        if let Some(h) = watcher {
            let _ = h.join();
        }
        t.writer.flush();
        let deadline = std::time::Instant::now() + STOP_REFILL;
        let done = self.refill(Some(deadline));
        t.refilled_extents.fetch_add(done, Ordering::Relaxed);
        t.writer.flush();
        let left = t.writer.take_dropped_when_idle().len();
        if left > 0 {
            tracing::info!(
                "disk tier: {left} dropped extents not written in {} s at unmount; \
                 the next mount reconstructs them",
                STOP_REFILL.as_secs()
            );
        }
    }

    /// Make again the extents whose copies the tier's writer dropped (its queue was
    /// full), once its queue is empty, so that a file read whole ends up whole in the
    /// tier and its next open is a passthrough one. Returns how many were written.
    pub fn refill_tier(&self) -> u64 {
        let Some(t) = &self.tier else { return 0 };
        let done = self.refill(None);
        t.refilled_extents.fetch_add(done, Ordering::Relaxed);
        done
    }

    /// The refill's work: every dropped extent, until the tier stops (`None`: the
    /// background refill) or the deadline passes (at unmount).
    fn refill(&self, deadline: Option<std::time::Instant>) -> u64 {
        let Some(t) = &self.tier else { return 0 };
        let dropped = t.writer.take_dropped_when_idle();
        let mut done = 0;
        for (te, x) in dropped {
            let over = match deadline {
                None => t.stopping.load(Ordering::Relaxed),
                Some(d) => std::time::Instant::now() > d,
            };
            if over {
                break;
            }
            let Some(e) = self
                .entries
                .iter()
                .find(|e| e.tier.as_ref().is_some_and(|t| Arc::ptr_eq(t, &te)))
            else {
                continue;
            };
            // A read may have written it since.
            let Some(len) = te.extent_len(x).ok().filter(|_| !te.has(x)) else {
                continue;
            };
            match self.extent_to_tier(e, &te, x, len) {
                Ok(()) => done += 1,
                Err(NotQueued::Full) => break,
                // The read path has logged what went wrong; the extent stays missing.
                Err(NotQueued::Read(_)) => continue,
            }
        }
        done
    }

    /// Queue extent `x` of `e` (`len` bytes) for the tier, waiting for room in the
    /// writer's queue: the chunk cache's chunk when it still holds it (extents are
    /// chunks; one a full queue dropped usually is), else reconstructed.
    fn extent_to_tier(
        &self,
        e: &Entry,
        te: &Arc<tier::Entry>,
        x: u64,
        len: usize,
    ) -> Result<(), NotQueued> {
        let t = self.tier.as_ref().expect("called with a tier entry");
        let key = crate::cache::ChunkKey {
            file: file_id(e.ino),
            index: x,
        };
        if let Some(chunk) = self.cache.resident(key).filter(|c| c.len() == len) {
            return if t.writer.offer_wait(te, x, chunk) {
                Ok(())
            } else {
                Err(NotQueued::Full)
            };
        }
        let buf = self
            .reconstruct_extent(e, x, len)
            .map_err(NotQueued::Read)?;
        if !t.writer.offer_wait(te, x, Arc::new(buf)) {
            return Err(NotQueued::Full);
        }
        Ok(())
    }

    /// Extent `x` of `e` (`len` bytes) reconstructed from the archive, page-aligned like
    /// the cache's chunks so that it is written with O_DIRECT; the error in one line.
    pub(super) fn reconstruct_extent(
        &self,
        e: &Entry,
        x: u64,
        len: usize,
    ) -> Result<Chunk, String> {
        let mut buf = Chunk::zeroed(len);
        match e
            .file
            .read_at(&*self.archive, x * self.cache.chunk_size(), &mut buf)
        {
            Ok(n) if n == len => Ok(buf),
            Ok(n) => Err(format!(
                "{}: short read at extent {x} ({n} of {len} bytes)",
                e.name
            )),
            Err(err) => Err(format!("{}: {err}", e.name)),
        }
    }

    /// Run [`MountFs::refill_tier`] every quarter second on a thread of its own until
    /// the filesystem is dropped.
    pub fn start_tier_refill(self: &Arc<Self>) -> std::io::Result<()> {
        let Some(t) = &self.tier else { return Ok(()) };
        let fs = Arc::downgrade(self);
        let h = std::thread::Builder::new()
            .name("cawsfs-tier-refill".into())
            .spawn(move || loop {
                // Unparked early by `stop_tier`.
                std::thread::park_timeout(std::time::Duration::from_millis(250));
                match fs.upgrade() {
                    Some(fs)
                        if !fs
                            .tier
                            .as_ref()
                            .is_some_and(|t| t.stopping.load(Ordering::Relaxed)) =>
                    {
                        fs.refill_tier();
                    }
                    _ => break,
                }
            })?;
        *t.refill_thread.lock().unwrap() = Some(h);
        Ok(())
    }

    /// Start reconstructing into the disk tier every extent it lacks of `file` (every
    /// tensor file when None), on `threads` threads in the background; progress is
    /// in the returned record (and `stat`). Reads go on meanwhile; extents are written
    /// through the tier's writer, waiting for its queue rather than dropping copies.
    pub fn materialize(
        self: &Arc<Self>,
        file: Option<&str>,
        threads: usize,
    ) -> Result<Arc<Materializing>, MaterializeError> {
        let t = self.tier.as_ref().ok_or(MaterializeError::NoTier)?;
        let mut slot = t.materializing.lock().unwrap();
        if let Some(m) = slot.as_ref().filter(|m| m.running.load(Ordering::Acquire)) {
            return Err(MaterializeError::Running(m.files.join(", ")));
        }
        let picked: Vec<usize> = (0..self.entries.len())
            .filter(|&i| self.entries[i].tier.is_some())
            .filter(|&i| file.is_none_or(|f| self.entries[i].name == f))
            .collect();
        if let (Some(f), true) = (file, picked.is_empty()) {
            return Err(MaterializeError::NoFile(f.to_string()));
        }
        let (mut work, mut total, mut charge) = (Vec::new(), 0u64, 0u64);
        for &i in &picked {
            let te = self.entries[i]
                .tier
                .as_ref()
                .expect("picked with a tier entry");
            for x in (0..te.spec().n_extents()).filter(|&x| !te.has(x)) {
                let len = te.extent_len(x).unwrap_or(0) as u64;
                total += len;
                charge += tier::disk_charge(len);
                work.push((i, x));
            }
        }
        let files: Vec<String> = picked
            .iter()
            .map(|&i| self.entries[i].name.clone())
            .collect();
        let room = t.writer.room();
        if charge > room {
            return Err(MaterializeError::NoRoom {
                files: files.join(", "),
                need: charge,
                room,
            });
        }
        let job = Arc::new(Materializing {
            files,
            total_bytes: total,
            done_bytes: AtomicU64::new(0),
            running: AtomicBool::new(true),
            error: Mutex::new(None),
            started: Instant::now(),
            elapsed_ms: AtomicU64::new(0),
        });
        let (fs, j) = (self.clone(), job.clone());
        std::thread::Builder::new()
            .name("cawsfs-materialize".into())
            .spawn(move || fs.run_materialize(&j, &picked, &work, threads.max(1)))
            .map_err(MaterializeError::Thread)?;
        *slot = Some(job.clone());
        Ok(job)
    }

    fn run_materialize(
        &self,
        job: &Materializing,
        picked: &[usize],
        work: &[(usize, u64)],
        threads: usize,
    ) {
        let t = self.tier.as_ref().expect("materialize checked the tier");
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    while !job.failed() {
                        let Some(&(i, x)) = work.get(next.fetch_add(1, Ordering::Relaxed)) else {
                            break;
                        };
                        let e = &self.entries[i];
                        let te = e.tier.as_ref().expect("picked with a tier entry");
                        let len = te.extent_len(x).unwrap_or(0);
                        // A read may have filled it meanwhile.
                        if !te.has(x) {
                            if let Err(why) = self.extent_to_tier(e, te, x, len) {
                                job.fail(why.to_string());
                                break;
                            }
                        }
                        job.done_bytes.fetch_add(len as u64, Ordering::Relaxed);
                    }
                });
            }
        });
        t.writer.flush();
        if !job.failed() {
            for &i in picked {
                let te = self.entries[i]
                    .tier
                    .as_ref()
                    .expect("picked with a tier entry");
                if !te.is_whole() {
                    job.fail(format!(
                        "{}: {} of {} bytes in the tier after writing (write errors are in the log)",
                        self.entries[i].name,
                        te.present_bytes(),
                        te.spec().size
                    ));
                }
            }
        }
        job.elapsed_ms
            .store(job.started.elapsed().as_millis() as u64, Ordering::Relaxed);
        job.running.store(false, Ordering::Release);
        match job.error.lock().unwrap().as_deref() {
            None => tracing::info!(
                "materialize: {} whole in the disk tier ({} bytes written in {:.1} s)",
                job.files.join(", "),
                job.total_bytes,
                job.elapsed_s()
            ),
            Some(why) => tracing::warn!("materialize of {} failed: {why}", job.files.join(", ")),
        }
    }
}

/// Open the tier's entry of every cached file and its writer; trim the directory to
/// its bound, keeping this mount's entries.
pub(super) fn open_tier(
    archive: &dyn Store,
    entries: &mut [Entry],
    t: &TierOptions,
    opts: &FsOptions,
) -> Result<Arc<FsTier>, SetupError> {
    let identity = archive.identity();
    // What changes a file's bytes besides the archive (docs/TIER.md, "Identity").
    let view = format!(
        "gguf={:?} safetensors={:?}",
        opts.gguf_type, opts.safetensors_dtype
    );
    tier::open_dir(&t.dir)?;
    let mut keys = Vec::new();
    for e in entries.iter_mut().filter(|e| e.cached) {
        let spec = tier::EntrySpec {
            archive: identity,
            file: e.name.clone(),
            size: e.file.size,
            extent: opts.chunk_size,
            view: view.clone(),
            layout: e.file.fingerprint(),
        };
        // One bad entry costs its file the tier, not the mount.
        let (entry, found) = match tier::Entry::open(&t.dir, spec) {
            Ok(x) => x,
            Err(err) => {
                tracing::warn!("disk tier: {err}; {} is served without the tier", e.name);
                continue;
            }
        };
        match &found {
            tier::Found::Dropped(why) => tracing::warn!(
                "disk tier: entry {} for {} was unusable ({why}); starting it again",
                entry.data_path().display(),
                e.name
            ),
            tier::Found::Existing(_) => tracing::info!(
                "disk tier: {} has {} of {} bytes in {}",
                e.name,
                entry.present_bytes(),
                e.file.size,
                entry.data_path().display()
            ),
            tier::Found::New => {}
        }
        if !matches!(found, tier::Found::Existing(_)) {
            tier::write_label(
                &entry,
                &tier::Label {
                    file: e.name.clone(),
                    view: view.clone(),
                    archive: archive.path().display().to_string(),
                },
            );
        }
        keys.push(entry.key());
        e.tier = Some(Arc::new(entry));
    }
    let gc = tier::gc(&t.dir, t.max_bytes, &keys)?;
    for e in &gc.removed {
        tracing::info!(
            "disk tier: removed entry {} ({}) to stay within {} bytes",
            e.key,
            e.label.as_ref().map_or("?", |l| l.file.as_str()),
            t.max_bytes
        );
    }
    if !gc.busy.is_empty() {
        tracing::info!(
            "disk tier: {} entries over the bound are open in other mounts; kept",
            gc.busy.len()
        );
    }
    // New extents fill what the bound leaves (other mounts' later writes are not seen).
    let used: u64 = tier::list(&t.dir)?
        .iter()
        .map(|e| e.disk_bytes + tier::ENTRY_OVERHEAD)
        .sum();
    let room = t.max_bytes.saturating_sub(used);
    // Copies wait here, outside the cache budget: a sixteenth of it (one chunk at
    // least, 256 MiB at most, so that runs of 64 MiB fit four times); what a full
    // queue drops is made again later (`MountFs::refill_tier`).
    let queue = (opts.cache_bytes / 16).clamp(opts.chunk_size, 256 << 20);
    Ok(Arc::new(FsTier {
        dir: t.dir.clone(),
        max_bytes: t.max_bytes,
        writer: tier::Writer::start(queue, room).map_err(SetupError::TierWriter)?,
        hit_bytes: AtomicU64::new(0),
        bad_extents: AtomicU64::new(0),
        passthrough_opens: AtomicU64::new(0),
        tampered: AtomicU64::new(0),
        unsealable: AtomicBool::new(false),
        passthrough: Mutex::new(Passthrough::Pending),
        materializing: Mutex::new(None),
        refilled_extents: AtomicU64::new(0),
        stopping: AtomicBool::new(false),
        refill_thread: Mutex::new(None),
        seal_watch: match tier::SealWatch::new() {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::info!("disk tier: cannot watch sealed files ({e}); changes are seen at opens and releases");
                None
            }
        },
        seal_thread: Mutex::new(None),
        repairing: Mutex::new(()),
    }))
}
