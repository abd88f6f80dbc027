//! What each control request does to the mount: the daemon's [`Handler`]. Selectors
//! become chunk ranges of cached files; `pin`, `prefetch`, `evict`, `trace` and `route`
//! act on the chunk cache through them. Protocol framing and socket safety live in
//! `crate::control`; this file only knows the mount's files and cache.

use std::path::PathBuf;
use std::sync::Arc;

use crate::cache::{ChunkCache, ChunkKey};
use crate::control::reply::{
    EvictReply, MaterializeReply, PinReply, PingReply, PrefetchReply, Reply, RouteReply,
    RoutedShard, TraceOffReply, TraceOnReply, TracedLookup, UnpinReply,
};
use crate::control::{Handler, Request, Target};
use crate::fs::{file_id, MountFs};

/// Answers control requests from the mount's state.
pub(super) struct ControlHandler {
    fs: Arc<MountFs>,
    mountpoint: PathBuf,
    /// The archive's router; `Ok(None)` when it has no ROUTING, `Err` when it is unusable.
    router: Result<Option<crate::router::Router>, String>,
}

/// The file routes and `--pin-infra` name chunks of unless told otherwise.
const ROUTE_FILE: &str = "model.gguf";
/// Keyed shards a route returns when the request gives no `top_k`.
const DEFAULT_TOP_K: usize = 8;

/// The router's tokenizer accounted in the mount's cache budget.
struct CacheBudget(Arc<ChunkCache>);

impl crate::router::TokenizerBudget for CacheBudget {
    fn reserve(&self, bytes: u64) -> u64 {
        let n = self.0.reserve(bytes);
        // What the reads left free in the heap goes back too, so the load's peak does
        // not come on top of it.
        super::trim_heap();
        n
    }
    fn release(&self, bytes: u64) {
        self.0.uncharge(bytes);
    }
    fn charge(&self, bytes: u64) -> Result<(), String> {
        self.0
            .charge("the router's tokenizer", bytes)
            .map_err(|e| format!("cannot load the tokenizer for routes: {e}"))?;
        tracing::info!(
            "router: tokenizer loaded, {} charged to the cache budget",
            bytesize::ByteSize::b(bytes)
        );
        // Loading it freed twice what it keeps: hand that back now rather than at the
        // next periodic trim.
        super::trim_heap();
        Ok(())
    }
}

impl ControlHandler {
    /// The handler of the mount of `fs` at `mountpoint`. An unusable router is logged
    /// and kept as the error `route` answers with; the mount serves without it.
    pub(super) fn new(fs: Arc<MountFs>, mountpoint: PathBuf) -> ControlHandler {
        let router =
            match crate::router::Router::open(fs.archive().model(), fs.archive().routing_bytes()) {
                Ok(r) => Ok(r.map(|r| {
                    // The tokenizer, loaded on the first route, lives as long as the
                    // mount: its memory, and its load's, come out of the cache budget.
                    r.with_tokenizer_budget(Box::new(CacheBudget(fs.cache().clone())))
                })),
                Err(e) => {
                    tracing::warn!("router unavailable: {e}");
                    Err(e)
                }
            };
        ControlHandler {
            fs,
            mountpoint,
            router,
        }
    }

    /// (file id, file size, chunk range) of rows `row0..row1` of `tensor` in `file`.
    fn rows_chunks(
        &self,
        file: &str,
        tensor: usize,
        row0: u64,
        row1: u64,
    ) -> Result<(u32, u64, std::ops::Range<u64>), String> {
        let e = self
            .fs
            .entry_by_name(file)
            .filter(|e| e.cached)
            .ok_or_else(|| format!("no tensor file named {file} in this mount"))?;
        let t = &self.fs.archive().model().tensors[tensor];
        let (_, a, b) = e
            .file
            .tensor_ranges()
            .into_iter()
            .find(|r| r.0 == tensor)
            .ok_or_else(|| format!("{file} does not hold {}", t.name))?;
        // Row spans are contiguous bytes for every tensor the router splits (embeddings,
        // experts); a permuted Q/K projection is only ever routed whole.
        let rows = t.rows().max(1);
        let rb = (b - a) / rows;
        let (lo, hi) = if row0 == 0 && row1 >= rows {
            (a, b)
        } else {
            (a + row0 * rb, a + row1.min(rows) * rb)
        };
        let cs = self.fs.cache().chunk_size();
        Ok((file_id(e.ino), e.file.size, (lo / cs)..hi.div_ceil(cs)))
    }

    /// Pin infrastructure in model.gguf: 1-D tensors, the first `layers` layers and,
    /// given a prompt, the embedding blocks that hold its tokens (every block the router
    /// scores above 0); in a mixture of experts, everything but the experts (attention,
    /// norms, routers, shared experts, embeddings, output), so that only experts compete
    /// for the cache. All or nothing; returns the bytes reserved.
    pub(super) fn pin_infra(&self, layers: u32, prompt: Option<&str>) -> Result<u64, String> {
        let cache = self.fs.cache();
        let model = self.fs.archive().model();
        let mut spans = Vec::new();
        if let Some(p) = prompt {
            let router = match &self.router {
                Ok(Some(r)) => r,
                Ok(None) => return Err("the archive has no ROUTING section".into()),
                Err(e) => return Err(format!("router unavailable: {e}")),
            };
            let (_, key) = router.prompt_key(model, p)?;
            for r in router.rank(&key, usize::MAX) {
                let s = &router.routing.shards[r.shard];
                spans.push(self.rows_chunks(ROUTE_FILE, s.tensor as usize, s.row0, s.row1)?);
            }
        }
        use crate::model::names;
        let arch = model.arch.gguf_arch.as_deref().unwrap_or_default();
        let expert = |name: &str| names::hf_expert_to_gguf_in(arch, name).is_some();
        let moe = model.tensors.iter().any(|t| expert(&t.name));
        for (i, t) in model.tensors.iter().enumerate() {
            let early = names::layer_of(&t.name).is_some_and(|l| l < layers);
            let infra = moe && !expert(&t.name) && names::hf_to_gguf_in(arch, &t.name).is_some();
            if t.shape.len() <= 1 || early || infra {
                spans.push(self.rows_chunks(ROUTE_FILE, i, 0, t.rows())?);
            }
        }
        let mut done: Vec<ChunkKey> = Vec::new();
        for (f, size, r) in &spans {
            for index in r.clone() {
                let key = ChunkKey { file: *f, index };
                if cache.is_pinned(key) {
                    continue;
                }
                if let Err(e) = cache.pin(key, *size) {
                    for k in &done {
                        let _ = cache.unpin(*k);
                    }
                    return Err(format!(
                        "infrastructure does not fit the cache budget ({} chunks pinned before: {e})",
                        done.len()
                    ));
                }
                done.push(key);
            }
        }
        for (f, size, r) in spans {
            cache.prefetch_registered(f, size, r);
        }
        Ok(cache.stats().pinned_bytes)
    }

    fn route(
        &self,
        prompt: &str,
        top_k: Option<u32>,
        budget: Option<u64>,
        prefetch: bool,
        file: Option<&str>,
    ) -> Result<RouteReply, String> {
        let router = match &self.router {
            Ok(Some(r)) => r,
            Ok(None) => {
                return Err(
                    "this archive has no ROUTING section (convert it again to get routes)".into(),
                )
            }
            Err(e) => return Err(format!("router unavailable: {e}")),
        };
        let file = file.unwrap_or(ROUTE_FILE);
        let cache = self.fs.cache();
        let cs = cache.chunk_size();
        let model = self.fs.archive().model();
        let (tokens, key) = router.prompt_key(model, prompt)?;
        let k = top_k.map_or(DEFAULT_TOP_K, |k| k as usize);
        let ranked = router.rank(&key, k);
        // Keyed shards by score, then (with a budget) the others in forward-pass order,
        // while the distinct chunks they need fit the budget.
        let mut picks: Vec<(usize, Option<f32>)> =
            ranked.iter().map(|r| (r.shard, Some(r.score))).collect();
        if budget.is_some() {
            picks.extend(router.ordered().into_iter().map(|i| (i, None)));
        }
        let limit = budget.unwrap_or(u64::MAX);
        let mut seen = std::collections::HashSet::new();
        let (mut total, mut out, mut spans) = (0u64, Vec::new(), Vec::new());
        for (i, score) in picks {
            let s = &router.routing.shards[i];
            let (f, size, r) = self.rows_chunks(file, s.tensor as usize, s.row0, s.row1)?;
            let new_bytes: u64 = r
                .clone()
                .filter(|c| !seen.contains(&(f, *c)))
                .map(|c| (size - c * cs).min(cs))
                .sum();
            if total + new_bytes > limit {
                if score.is_some() {
                    continue; // a smaller keyed shard further down may still fit
                }
                break; // ordered shards stop at the first that does not fit
            }
            total += new_bytes;
            seen.extend(r.clone().map(|c| (f, c)));
            out.push(RoutedShard {
                rank: out.len() as u64 + 1,
                kind: s.kind.name().to_string(),
                tensor: model.tensors[s.tensor as usize].name.clone(),
                rows: [s.row0, s.row1],
                order: s.order,
                score: score.map(f64::from),
                cost: s.cost,
                chunks: [r.start, r.end],
            });
            spans.push((f, size, r));
        }
        let mut reply = RouteReply {
            file: file.to_string(),
            tokens,
            shards: out,
            chunk_bytes: total,
            queued_chunks: None,
            hinted_chunks: None,
        };
        if prefetch {
            // Each chunk once, in rank order (neighbouring shards share chunks).
            let mut once = std::collections::HashSet::new();
            let chunks: Vec<(u32, u64, u64)> = spans
                .iter()
                .flat_map(|(f, size, r)| r.clone().map(move |c| (*f, *size, c)))
                .filter(|&(f, _, c)| once.insert((f, c)))
                .collect();
            let hinted = cache.set_hints(
                chunks
                    .iter()
                    .map(|&(file, _, index)| ChunkKey { file, index }),
            );
            let mut queued = 0;
            for (f, size, c) in chunks {
                queued += cache.prefetch_registered(f, size, c..c + 1);
            }
            reply.queued_chunks = Some(queued as u64);
            reply.hinted_chunks = Some(hinted as u64);
        }
        Ok(reply)
    }

    /// (file id, file size, chunk range) for every chunk a target covers.
    fn chunks(&self, target: &Target) -> Result<Vec<(u32, u64, std::ops::Range<u64>)>, String> {
        let cs = self.fs.cache().chunk_size();
        let span = |size: u64, a: u64, b: u64| (a / cs)..b.min(size).div_ceil(cs);
        let model = self.fs.archive().model();
        match target {
            Target::File { file, range } => {
                let e = self
                    .fs
                    .entry_by_name(file)
                    .ok_or_else(|| format!("no file named {file} in this mount"))?;
                if !e.cached {
                    return Err(format!(
                        "{file} is served from memory and needs no prefetch"
                    ));
                }
                let (a, b) = range.unwrap_or((0, e.file.size));
                if a >= e.file.size {
                    return Err(format!(
                        "range starts at {a}, past the end of {file} ({} bytes)",
                        e.file.size
                    ));
                }
                Ok(vec![(file_id(e.ino), e.file.size, span(e.file.size, a, b))])
            }
            Target::Tensor(_) | Target::Layer(_) => {
                let want: Vec<usize> = match target {
                    Target::Tensor(name) => {
                        vec![model
                            .tensor_index(name)
                            .ok_or_else(|| format!("no tensor named {name}"))?]
                    }
                    Target::Layer(l) => {
                        let v: Vec<usize> = (0..model.tensors.len())
                            .filter(|&i| {
                                crate::model::names::layer_of(&model.tensors[i].name) == Some(*l)
                            })
                            .collect();
                        if v.is_empty() {
                            return Err(format!(
                                "no layer {l} (the model has {})",
                                model.arch.n_layers
                            ));
                        }
                        v
                    }
                    Target::File { .. } => unreachable!(),
                };
                // The tensor's bytes in every file that holds it.
                let mut out = Vec::new();
                for e in self.fs.tensor_files() {
                    for (t, a, b) in e.file.tensor_ranges() {
                        if want.contains(&t) {
                            out.push((file_id(e.ino), e.file.size, span(e.file.size, a, b)));
                        }
                    }
                }
                Ok(out)
            }
        }
    }

    /// Pins every chunk `target` covers, all or nothing, and starts loading them;
    /// returns how many this request pinned.
    fn pin(&self, target: &Target) -> Result<u64, String> {
        let cache = self.fs.cache();
        let spans = self.chunks(target)?;
        let mut done: Vec<ChunkKey> = Vec::new();
        for (f, size, r) in &spans {
            for index in r.clone() {
                let key = ChunkKey { file: *f, index };
                if let Err(e) = cache.pin(key, *size) {
                    // All or nothing: undo what this request pinned.
                    for k in &done {
                        let _ = cache.unpin(*k);
                    }
                    return Err(e.to_string());
                }
                done.push(key);
            }
        }
        // Pinned chunks are reserved; load them now rather than on first read.
        for (f, size, r) in spans {
            cache.prefetch_registered(f, size, r);
        }
        Ok(done.len() as u64)
    }

    /// Stops the read trace and returns its record, with the names of the files it
    /// names by id.
    fn trace_off(&self) -> TraceOffReply {
        let cache = self.fs.cache();
        let (events, dropped) = cache.trace_stop();
        let files = self
            .fs
            .tensor_files()
            .iter()
            .map(|e| (file_id(e.ino), e.name.clone()))
            .collect();
        let events = events
            .iter()
            .map(|e| TracedLookup(e.file, e.index, e.t_us, e.outcome.name().to_string()))
            .collect();
        TraceOffReply {
            tracing: false,
            chunk_size: cache.chunk_size(),
            files,
            events,
            dropped,
        }
    }
}

impl Handler for ControlHandler {
    fn handle(&self, req: Request) -> Result<Reply, String> {
        let cache = self.fs.cache();
        Ok(match req {
            Request::Ping => PingReply { pong: true }.into(),
            Request::Stat => super::stat::stat_reply(&self.fs, &self.mountpoint).into(),
            Request::Prefetch(t) => {
                let mut queued = 0;
                for (f, size, r) in self.chunks(&t)? {
                    queued += cache.prefetch_registered(f, size, r);
                }
                PrefetchReply {
                    queued_chunks: queued as u64,
                }
                .into()
            }
            Request::Pin(t) => PinReply {
                pinned_chunks: self.pin(&t)?,
            }
            .into(),
            Request::Unpin(t) => {
                let mut n = 0;
                for (f, _, r) in self.chunks(&t)? {
                    for index in r {
                        if cache.unpin(ChunkKey { file: f, index }).is_ok() {
                            n += 1;
                        }
                    }
                }
                UnpinReply { unpinned_chunks: n }.into()
            }
            Request::Evict(None) => EvictReply {
                freed_bytes: cache.evict_all_unpinned(),
            }
            .into(),
            Request::Evict(Some(t)) => {
                let mut freed = 0;
                for (f, _, r) in self.chunks(&t)? {
                    freed += cache.evict(r.map(|index| ChunkKey { file: f, index }));
                }
                EvictReply { freed_bytes: freed }.into()
            }
            Request::Trace { on: true } => {
                cache.trace_start();
                TraceOnReply { tracing: true }.into()
            }
            Request::Trace { on: false } => self.trace_off().into(),
            Request::Route {
                prompt,
                top_k,
                budget_bytes,
                prefetch,
                file,
            } => self
                .route(&prompt, top_k, budget_bytes, prefetch, file.as_deref())?
                .into(),
            Request::Materialize { file } => {
                let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
                let m = self
                    .fs
                    .materialize(file.as_deref(), threads)
                    .map_err(|e| e.to_string())?;
                MaterializeReply {
                    files: m.files.clone(),
                    missing_bytes: m.total_bytes,
                }
                .into()
            }
        })
    }
}
