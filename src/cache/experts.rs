//! One step ahead for a mixture of experts (docs/MOE.md, "One step ahead"): which
//! experts of layer l+1 follow the experts read in layer l, learned from the demand
//! reads of one file, and used to queue the next layer's experts while this layer's
//! are read. Separate because it is a side channel of the read path, like the trace:
//! it only orders work, and a wrong guess costs a wasted load, never a wrong byte.
//!
//! A *step* is the run of demand reads that stay in one layer's experts; the step's
//! set is the experts those reads touched. When the reads move on to another layer,
//! the step ends: if it was layer l+1 right after layer l, each expert of l's set
//! counts one more step, and each (expert of l, expert of l+1) pair one more
//! transition. `P(e' | e)` = transitions / steps of `e`. The first time a step reads an
//! expert `e` of layer l, the experts `e'` of layer l+1 with the highest `P(e' | e)`
//! over every expert of the set so far are queued: those that follow [`LIFT`] times as
//! often as `e'` is read at all (within [`MIN_P`] and [`MAX_P`]), at most the model's
//! experts per token in all. Counts are halved per expert once
//! its steps reach [`DECAY_AT`], so they stay bounded and follow a changing workload.

use super::lock;
use super::sync::Mutex;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use xxhash_rust::xxh3::xxh3_64;

/// Steps of an expert after which its row of counts is halved.
pub const DECAY_AT: u32 = 4096;
/// Steps of an expert before its transitions are trusted.
pub const MIN_STEPS: u32 = 4;
/// The most a step must read of an expert for it to count as read, and how far a
/// sequential run that began before an expert must reach into it: a quarter of the
/// smallest expert piece, at most this. The kernel's windows reach into the experts
/// beside the ones a token uses (a few hundred KiB where they meet), and those
/// neighbours, taken for routing, made steps of 3 to 5 experts for 2 routed.
pub const MIN_READ: u64 = 4 << 20;
/// The least `P(e' | e)` an expert is queued for.
pub const MIN_P: f32 = 0.2;
/// `P(e' | e)` that always suffices: with many experts per token (2 of 4) twice the
/// rate would ask for more than certainty.
pub const MAX_P: f32 = 0.6;
/// How many times more often than its own rate an expert must follow for it to be
/// queued: with Mixtral's 2 of 8 and uniform routing every `P(e' | e)` is about the
/// rate, 0.25 when the daemon sees every expert read (less when the page cache holds
/// some), and noise lifts some a little above it.
pub const LIFT: f32 = 2.0;
/// The most (layers × experts × experts) a predictor keeps: 16 MiB of counts.
pub const MAX_CELLS: u64 = 1 << 23;

const MAGIC: &[u8; 8] = b"CAWSXPR1";

/// What the predictor does with what it learns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertMode {
    /// Learn and queue the predicted experts.
    Prefetch,
    /// Learn and score predictions without queueing them (for comparison).
    Learn,
}

/// Where one file's experts lie: the byte extents of each (layer, expert).
#[derive(Clone, Debug)]
pub struct ExpertMap {
    layers: u32,
    experts: u32,
    used: u32,
    /// (start, end, unit), sorted, disjoint; unit = layer × experts + expert.
    extents: Vec<(u64, u64, u32)>,
    /// Each unit's extents.
    units: Vec<Vec<Range<u64>>>,
    /// Every extent start and end, sorted, without repeats (read-ahead fences).
    bounds: Vec<u64>,
    /// Bytes a step must read of an expert for it to count as read ([`MIN_READ`]).
    min_read: u64,
}

impl ExpertMap {
    /// A map of `experts` experts per layer, `used` of them per token, from
    /// `(layer, expert, byte range)` extents (several per expert: gate, up, down).
    pub fn new(
        experts: u32,
        used: u32,
        extents: impl IntoIterator<Item = (u32, u32, Range<u64>)>,
    ) -> Result<ExpertMap, String> {
        let mut ext: Vec<(u32, u32, Range<u64>)> =
            extents.into_iter().filter(|x| !x.2.is_empty()).collect();
        let layers = ext.iter().map(|x| x.0 + 1).max().unwrap_or(0);
        if experts == 0 || layers == 0 {
            return Err("no expert extents".into());
        }
        let cells = u64::from(layers) * u64::from(experts) * u64::from(experts);
        if cells > MAX_CELLS {
            return Err(format!(
                "{layers} layers of {experts} experts need {cells} transition counts, more than {MAX_CELLS}"
            ));
        }
        if let Some(x) = ext.iter().find(|x| x.1 >= experts) {
            return Err(format!(
                "expert {} of layer {} is not below {experts}",
                x.1, x.0
            ));
        }
        ext.sort_by_key(|x| x.2.start);
        if let Some(w) = ext.windows(2).find(|w| w[0].2.end > w[1].2.start) {
            return Err(format!(
                "extents of layer {} expert {} and layer {} expert {} overlap",
                w[0].0, w[0].1, w[1].0, w[1].1
            ));
        }
        let mut units = vec![Vec::new(); (layers * experts) as usize];
        let mut bounds = Vec::with_capacity(ext.len() * 2);
        let extents: Vec<(u64, u64, u32)> = ext
            .into_iter()
            .map(|(l, e, r)| {
                let unit = l * experts + e;
                units[unit as usize].push(r.clone());
                bounds.extend([r.start, r.end]);
                (r.start, r.end, unit)
            })
            .collect();
        bounds.dedup();
        let smallest = extents.iter().map(|x| x.1 - x.0).min();
        let min_read = smallest.map_or(1, |s| (s / 4).clamp(1, MIN_READ));
        let used = used.clamp(1, experts);
        Ok(ExpertMap {
            layers,
            experts,
            used,
            extents,
            units,
            bounds,
            min_read,
        })
    }

    pub fn layers(&self) -> u32 {
        self.layers
    }

    pub fn experts(&self) -> u32 {
        self.experts
    }

    /// The unit whose extent holds byte `at`.
    fn unit_at(&self, at: u64) -> Option<u32> {
        self.extent_at(at).map(|x| x.2)
    }

    /// The extent (start, end, unit) that holds byte `at`.
    fn extent_at(&self, at: u64) -> Option<(u64, u64, u32)> {
        let i = self.extents.partition_point(|x| x.0 <= at).checked_sub(1)?;
        let x = self.extents[i];
        (x.0..x.1).contains(&at).then_some(x)
    }

    /// Where sequential read-ahead of a run of reads `run_start .. end` stops, in bytes
    /// (None: no fence). A reader going through the file (`scanning`) gets read-ahead
    /// to keep up with it. Otherwise a run
    /// that ends in an expert gets none: the kernel asks for what the client faults on
    /// and reads ahead itself, and part of the expert is often still in its page
    /// cache, so reading on to the expert's end reconstructed 1.5 x the bytes the kernel
    /// asked for (docs/MOE.md). A run in the rest of the file reads ahead up to the
    /// next expert.
    pub(super) fn fence(&self, run_start: u64, end: u64) -> Option<u64> {
        if self.scanning(run_start, end) {
            return None;
        }
        if self.unit_at(end - 1).is_some() {
            return Some(end);
        }
        self.bounds
            .get(self.bounds.partition_point(|&b| b < end))
            .copied()
    }

    /// Bytes of `range` that lie in an expert's extents.
    fn expert_bytes_in(&self, range: Range<u64>) -> u64 {
        let first = self.extents.partition_point(|x| x.1 <= range.start);
        self.extents[first..]
            .iter()
            .take_while(|x| x.0 < range.end)
            .map(|x| x.1.min(range.end) - x.0.max(range.start))
            .sum()
    }

    /// Whether a sequential run `run_start .. end` is a reader going through the file
    /// (a load, a copy), not one reading the experts it uses: it has read more whole
    /// regions between boundaries than a token's experts make. A token reads each of
    /// its experts' pieces whole (the kernel's windows then run on a little past both
    /// ends), and two of them may lie side by side in a stack.
    fn scanning(&self, run_start: u64, end: u64) -> bool {
        let crossed = self.bounds.partition_point(|&b| b < end)
            - self.bounds.partition_point(|&b| b < run_start);
        crossed > self.used as usize + 1
    }
}

/// The predictor's counters, summed over the files that have one.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ExpertStats {
    /// Files with an expert predictor.
    pub files: u64,
    /// Whether predicted experts are queued (false: learned and scored only).
    pub prefetch: bool,
    /// Layer steps seen (runs of reads in one layer's experts).
    pub steps: u64,
    /// Steps that followed the step of the layer before (learned from, scored).
    pub transitions: u64,
    /// Experts predicted (queued, in prefetch mode).
    pub predicted: u64,
    /// Experts predicted for the steps that were scored: those right after the step of
    /// the layer before, neither of them a batch's (more than twice the experts a
    /// token uses).
    pub predicted_scored: u64,
    /// Of those, the experts the step then read.
    pub predicted_read: u64,
    /// Experts read in scored steps.
    pub read: u64,
    /// Bytes of the experts read in all steps (each expert's whole extents, once per
    /// step): what the routing asked the daemon for.
    pub read_bytes: u64,
    /// predicted_read / predicted_scored (0 before any).
    pub precision: f64,
    /// predicted_read / read (0 before any scored step).
    pub recall: f64,
    /// Chunks queued for predicted experts.
    pub queued_chunks: u64,
    /// Learned counts loaded at mount (steps they hold).
    pub loaded_steps: u64,
    /// Chunk bytes reconstructed (demand and prefetch) inside the experts' extents.
    pub loaded_expert_bytes: u64,
    /// Chunk bytes reconstructed outside them: the infrastructure's misses (attention,
    /// norms, routers, embeddings), which issue 15's bound adds to the routed experts.
    pub loaded_infra_bytes: u64,
}

#[derive(Default)]
struct Counters {
    steps: AtomicU64,
    transitions: AtomicU64,
    predicted: AtomicU64,
    predicted_scored: AtomicU64,
    predicted_read: AtomicU64,
    read: AtomicU64,
    read_bytes: AtomicU64,
    queued_chunks: AtomicU64,
    loaded_steps: AtomicU64,
    loaded_expert_bytes: AtomicU64,
    loaded_infra_bytes: AtomicU64,
}

/// Experts of one layer.
#[derive(Clone, Debug, Default)]
struct Step {
    /// None: no step yet.
    layer: Option<u32>,
    set: Vec<u32>,
}

struct Learned {
    /// `[layer][from][to]`: transitions from expert `from` of `layer` to `to` of the next.
    counts: Vec<u16>,
    /// `[layer][from]`: steps of `from` that were followed by the next layer's step.
    steps: Vec<u16>,
    cur: Step,
    prev: Step,
    /// What was predicted for `cur`'s layer during the step before.
    expected: Step,
    /// What is predicted for the layer after `cur`'s.
    ahead: Step,
    /// Bytes read so far of experts not yet counted as read (unit, bytes).
    pending: Vec<(u32, u64)>,
    dirty: bool,
}

/// One file's predictor.
pub(super) struct Predictor {
    map: ExpertMap,
    mode: ExpertMode,
    learned: Mutex<Learned>,
    counters: Counters,
}

impl Predictor {
    pub(super) fn new(map: ExpertMap, mode: ExpertMode) -> Predictor {
        let (l, e) = (map.layers as usize, map.experts as usize);
        Predictor {
            learned: Mutex::new(Learned {
                counts: vec![0; l * e * e],
                steps: vec![0; l * e],
                cur: Step::default(),
                prev: Step::default(),
                expected: Step::default(),
                ahead: Step::default(),
                pending: Vec::new(),
                dirty: false,
            }),
            map,
            mode,
            counters: Counters::default(),
        }
    }

    pub(super) fn map(&self) -> &ExpertMap {
        &self.map
    }

    /// Take in a demand read of `offset .. offset + len`, part of a sequential run that
    /// began at `run_start`; returns the byte ranges of the experts to queue now (none
    /// in learn mode).
    pub(super) fn observe(&self, run_start: u64, offset: u64, len: u64) -> Vec<Range<u64>> {
        // A reader going through the whole file teaches nothing about routing.
        if self.map.scanning(run_start.min(offset), offset + len) {
            return Vec::new();
        }
        // The kernel reads around a faulting page: the middle of a read is what it
        // was for.
        let Some((start, _, unit)) = self.map.extent_at(offset + len / 2) else {
            return Vec::new();
        };
        // The kernel's read-ahead runs on from the tensor before into an expert's first
        // bytes (from a layer's attention into the next layer's first expert, from one
        // expert into its neighbour): a run that began before this extent and has not
        // gone past its first min_read bytes is that, not routing (a run's first read
        // is the fault's own window). Taken for routing, such a read started the next
        // layer's step early and hid the layer read in between.
        if run_start < start && run_start < offset && offset + len < start + self.map.min_read {
            return Vec::new();
        }
        let (layer, expert) = (unit / self.map.experts, unit % self.map.experts);
        let mut g = lock(&self.learned);
        // The layer before the current one is done: a read of it now is the kernel's
        // read-ahead arriving late, not routing (with two layers it may also be the
        // next token's first).
        if self.map.layers > 2 && g.cur.layer.is_some_and(|c| c == layer + 1) {
            return Vec::new();
        }
        if g.cur.layer == Some(layer) && g.cur.set.contains(&expert) {
            return Vec::new();
        }
        // Only an expert read beyond the windows' reach counts (MIN_READ).
        match g.pending.iter().position(|p| p.0 == unit) {
            Some(i) if g.pending[i].1 + len >= self.map.min_read => {
                g.pending.swap_remove(i);
            }
            Some(i) => {
                g.pending[i].1 += len;
                return Vec::new();
            }
            None if len >= self.map.min_read => {}
            None => {
                // Bounded: what a layer's neighbours leave behind is dropped as
                // the steps move on, and a batch touches at most every expert.
                if g.pending.len() >= 4 * self.map.experts as usize {
                    g.pending.remove(0);
                }
                g.pending.push((unit, len));
                return Vec::new();
            }
        }
        let bytes: u64 = self.map.units[unit as usize]
            .iter()
            .map(|r| r.end - r.start)
            .sum();
        if g.cur.layer == Some(layer) {
            g.cur.set.push(expert);
            self.counters.read_bytes.fetch_add(bytes, Relaxed);
        } else {
            self.counters.read_bytes.fetch_add(bytes, Relaxed);
            tracing::trace!("expert step: layer {:?} {:?}", g.cur.layer, g.cur.set);
            self.end_step(&mut g);
            // Partial reads of layers already passed were the windows' spill.
            let e = self.map.experts;
            g.pending.retain(|p| p.0 / e >= layer);
            g.expected = std::mem::take(&mut g.ahead);
            g.prev = std::mem::replace(
                &mut g.cur,
                Step {
                    layer: Some(layer),
                    set: vec![expert],
                },
            );
            self.counters.steps.fetch_add(1, Relaxed);
        }
        let picks = self.predict(&mut g, layer);
        drop(g);
        if self.mode == ExpertMode::Learn {
            return Vec::new();
        }
        let (l1, e) = (layer + 1, self.map.experts);
        picks
            .into_iter()
            .flat_map(|x| self.map.units[(l1 * e + x) as usize].iter().cloned())
            .collect()
    }

    /// Score and learn from the step that ends now.
    fn end_step(&self, g: &mut Learned) {
        let (Some(cl), Some(pl)) = (g.cur.layer, g.prev.layer) else {
            return;
        };
        // A batch of tokens (a prompt) reads most experts of every layer: which
        // followed which cannot be told apart, and guesses are not scored on it.
        let wide = 2 * self.map.used as usize;
        if pl + 1 != cl || g.prev.set.len() > wide || g.cur.set.len() > wide {
            return;
        }
        let c = &self.counters;
        c.transitions.fetch_add(1, Relaxed);
        c.read.fetch_add(g.cur.set.len() as u64, Relaxed);
        if g.expected.layer == Some(cl) {
            let hit = g.expected.set.iter().filter(|x| g.cur.set.contains(x));
            c.predicted_read.fetch_add(hit.count() as u64, Relaxed);
            c.predicted_scored
                .fetch_add(g.expected.set.len() as u64, Relaxed);
        }
        let e = self.map.experts as usize;
        for &from in &g.prev.set {
            let row = pl as usize * e + from as usize;
            if u32::from(g.steps[row]) + 1 >= DECAY_AT {
                g.steps[row] /= 2;
                for c in &mut g.counts[row * e..(row + 1) * e] {
                    *c /= 2;
                }
            }
            g.steps[row] += 1;
            for &to in &g.cur.set {
                g.counts[row * e + to as usize] += 1;
            }
        }
        g.dirty = true;
    }

    /// The experts of `layer + 1` to queue now that `g.cur` (in `layer`) has grown.
    fn predict(&self, g: &mut Learned, layer: u32) -> Vec<u32> {
        let next = layer + 1;
        if next >= self.map.layers {
            return Vec::new();
        }
        if g.ahead.layer != Some(next) {
            g.ahead = Step {
                layer: Some(next),
                set: Vec::new(),
            };
        }
        let room = (self.map.used as usize).saturating_sub(g.ahead.set.len());
        if room == 0 {
            return Vec::new();
        }
        let e = self.map.experts as usize;
        let mut best = vec![0f32; e];
        for &from in &g.cur.set {
            let row = layer as usize * e + from as usize;
            let n = u32::from(g.steps[row]);
            if n < MIN_STEPS {
                continue;
            }
            for (to, b) in best.iter_mut().enumerate() {
                *b = b.max(f32::from(g.counts[row * e + to]) / n as f32);
            }
        }
        // How often each expert of the next layer is read at all: the daemon sees only
        // what the page cache lacks, so both that rate and P(e' | e) fall with how much
        // the kernel holds, and a prediction is what beats the rate by LIFT.
        let base = &g.counts[layer as usize * e * e..(layer as usize + 1) * e * e];
        let steps: u32 = g.steps[layer as usize * e..(layer as usize + 1) * e]
            .iter()
            .map(|&n| u32::from(n))
            .sum();
        let rate = |to: usize| {
            let n: u32 = (0..e).map(|from| u32::from(base[from * e + to])).sum();
            n as f32 / steps.max(1) as f32
        };
        let mut cand: Vec<u32> = (0..e as u32)
            .filter(|&x| {
                let floor = (LIFT * rate(x as usize)).clamp(MIN_P, MAX_P);
                best[x as usize] >= floor && !g.ahead.set.contains(&x)
            })
            .collect();
        cand.sort_by(|a, b| best[*b as usize].total_cmp(&best[*a as usize]));
        cand.truncate(room);
        g.ahead.set.extend(&cand);
        self.counters
            .predicted
            .fetch_add(cand.len() as u64, Relaxed);
        cand
    }

    pub(super) fn queued(&self, chunks: u64) {
        self.counters.queued_chunks.fetch_add(chunks, Relaxed);
    }

    /// Count a chunk reconstructed over `range` of the file, as expert bytes or
    /// infrastructure bytes.
    pub(super) fn loaded(&self, range: Range<u64>) {
        let experts = self.map.expert_bytes_in(range.clone());
        let c = &self.counters;
        c.loaded_expert_bytes.fetch_add(experts, Relaxed);
        c.loaded_infra_bytes
            .fetch_add(range.end - range.start - experts, Relaxed);
    }

    pub(super) fn add_stats(&self, s: &mut ExpertStats) {
        let c = &self.counters;
        s.files += 1;
        s.prefetch |= self.mode == ExpertMode::Prefetch;
        s.steps += c.steps.load(Relaxed);
        s.transitions += c.transitions.load(Relaxed);
        s.predicted += c.predicted.load(Relaxed);
        s.predicted_scored += c.predicted_scored.load(Relaxed);
        s.predicted_read += c.predicted_read.load(Relaxed);
        s.read += c.read.load(Relaxed);
        s.read_bytes += c.read_bytes.load(Relaxed);
        s.queued_chunks += c.queued_chunks.load(Relaxed);
        s.loaded_steps += c.loaded_steps.load(Relaxed);
        s.loaded_expert_bytes += c.loaded_expert_bytes.load(Relaxed);
        s.loaded_infra_bytes += c.loaded_infra_bytes.load(Relaxed);
    }

    /// What was learned, in the format of docs/MOE.md ("Learned transitions"), for
    /// `key` (the caller's name for this file and archive); None when nothing changed
    /// since the last save or load.
    pub(super) fn save(&self, key: u128) -> Option<Vec<u8>> {
        let mut g = lock(&self.learned);
        if !g.dirty {
            return None;
        }
        g.dirty = false;
        let mut out = Vec::with_capacity(40 + g.counts.len() * 2 + g.steps.len() * 2);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&key.to_le_bytes());
        out.extend_from_slice(&self.map.layers.to_le_bytes());
        out.extend_from_slice(&self.map.experts.to_le_bytes());
        for v in g.steps.iter().chain(&g.counts) {
            out.extend_from_slice(&v.to_le_bytes());
        }
        let sum = xxh3_64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        Some(out)
    }

    /// Take back what [`save`](Self::save) wrote for `key`; an error says why the
    /// bytes are not this file's (nothing is taken then).
    pub(super) fn load(&self, key: u128, bytes: &[u8]) -> Result<(), String> {
        let (l, e) = (self.map.layers as usize, self.map.experts as usize);
        let want = 8 + 16 + 8 + (l * e + l * e * e) * 2 + 8;
        if bytes.len() != want {
            return Err(format!("{} bytes, not the {want} expected", bytes.len()));
        }
        let (body, sum) = bytes.split_at(want - 8);
        if xxh3_64(body).to_le_bytes() != sum {
            return Err("checksum mismatch".into());
        }
        if &body[..8] != MAGIC {
            return Err("not a cawsfs expert predictor file".into());
        }
        let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().expect("4"));
        if body[8..24] != key.to_le_bytes() {
            return Err("learned for another archive or view".into());
        }
        if (u32_at(24), u32_at(28)) != (self.map.layers, self.map.experts) {
            return Err("learned for another shape".into());
        }
        let mut vals = body[32..]
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]));
        let steps: Vec<u16> = vals.by_ref().take(l * e).collect();
        let counts: Vec<u16> = vals.collect();
        if let Some(i) = (0..l * e).find(|&r| {
            steps[r] >= DECAY_AT as u16 || counts[r * e..(r + 1) * e].iter().any(|&c| c > steps[r])
        }) {
            return Err(format!("row {i} holds more transitions than steps"));
        }
        let n: u64 = steps.iter().map(|&s| u64::from(s)).sum();
        let mut g = lock(&self.learned);
        g.steps = steps;
        g.counts = counts;
        g.dirty = false;
        self.counters.loaded_steps.store(n, Relaxed);
        Ok(())
    }
}

impl ExpertStats {
    /// Fill in the ratios from the counts.
    pub(super) fn finish(&mut self) {
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        self.precision = ratio(self.predicted_read, self.predicted_scored);
        self.recall = ratio(self.predicted_read, self.read);
    }
}

#[cfg(all(test, not(feature = "shuttle")))]
#[path = "experts_tests.rs"]
mod tests;
