//! The payload of every success reply, one struct per verb: the daemon builds them, the
//! CLI reads them back (docs/CONTROL.md lists which verb answers with which).
//!
//! Plain numbers and strings only, so `control` stays independent of the cache and the
//! filesystem: the mount converts its figures into these. The declaration order of the
//! fields is the order of the keys on the wire (serde_json's `preserve_order`), so
//! reordering a field changes the protocol's bytes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `ping`: `{"pong":true}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PingReply {
    pub pong: bool,
}

/// `stat`. Every field is optional (docs/CONTROL.md): a missing one is `None` (or an
/// empty section) and the renderers show `-` for it, so a client can read a daemon that
/// reports less than this one; a `None` is left out of the reply, never sent as `null`.
/// `mountpoint` comes last because the daemon adds it after the cache's figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StatReply {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub archive_kind: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub archive_path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uptime_s: Option<f64>,
    pub cache: CacheStat,
    pub archive: ArchiveStat,
    pub files: Vec<FileStat>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mountpoint: Option<String>,
    /// The disk tier, when the mount has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<TierStat>,
    /// Where reconstruction runs (`--device`) and what it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<crate::reconstruct::DeviceStats>,
    /// The expert predictor of a mixture of experts (docs/MOE.md), when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<crate::cache::ExpertStats>,
    /// Requests to object storage, when the archive is an object there (docs/REMOTE.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fetch: Option<crate::archive::remote::FetchSnapshot>,
}

/// `stat`'s `tier` section (docs/TIER.md): counters since mount and the entries' state.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TierStat {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dir: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
    /// Bytes served from the tier instead of reconstructed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hit_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub written_bytes: Option<u64>,
    /// Reconstructed extents not written because the writer's queue was full.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dropped_extents: Option<u64>,
    /// Dropped extents made again and written once the writer's queue was empty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refilled_extents: Option<u64>,
    /// Reconstructed extents not written because the size bound was reached.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub over_bound_extents: Option<u64>,
    /// Extents that failed their checksum when read (reconstructed instead).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bad_extents: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub write_errors: Option<u64>,
    /// Bytes of this mount's files present in the tier (published).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub present_bytes: Option<u64>,
    /// This mount's files wholly present.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub whole_files: Option<u64>,
    /// Whether whole files are handed to the kernel: `on`, `off`, `pending` or
    /// `unavailable (why)`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub passthrough: Option<String>,
    /// Opens answered with FUSE passthrough: the kernel reads the tier file itself and
    /// none of those reads reach the daemon.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub passthrough_opens: Option<u64>,
    /// Sealed passthrough backing files found changed (their seal lifted); each is
    /// verified again before it is handed to the kernel again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tampered: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub materialize: Option<MaterializeStat>,
}

/// `stat`'s `cache` section: counters since mount (chunk lookups, bytes) and gauges.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CacheStat {
    /// Lookups served from cached chunks, prefetch hits included.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hits: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetch_hits: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub misses: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub coalesced: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reads: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_errors: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_served: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_loaded: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loads: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evictions: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_used: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned_resident_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub charged_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_bytes: Option<u64>,
    /// Loads that waited for room in the budget before starting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub room_waits: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chunk_size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entries: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub entry_overhead_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub readahead_triggers: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetch_loads: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetch_queue_len: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetch_skipped: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loads_in_flight: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route_hints: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tracing: Option<bool>,
    pub latency_us: LatencyStat,
    /// Chunk loads (reconstruction of one chunk each): how long producing a chunk takes,
    /// apart from how long reads waited.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load_latency_us: Option<LatencyStat>,
    /// Reads that waited for reconstruction, and how long they waited in all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stalls: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall_us: Option<u64>,
}

/// Latency in microseconds (whole reads, or chunk loads; percentiles are bucket upper
/// edges).
/// Integers except `mean`, as the daemon sends them: an `f64` field would print
/// `120.0` where the wire has `120`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LatencyStat {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mean: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p50: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p90: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p99: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max: Option<u64>,
}

/// `stat`'s `archive` section: what reads cost in archive bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ArchiveStat {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blocks_read: Option<u64>,
    /// Compressed bytes read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_read: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_decoded: Option<u64>,
    /// `bytes_read / cache.bytes_served`, 0 before anything was served.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_per_served: Option<f64>,
}

/// One virtual file in `stat`'s `files`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FileStat {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reads: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hits: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetch_hits: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub misses: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_served: Option<u64>,
    /// Opened with FUSE passthrough in this mount (its reads then bypass the daemon,
    /// so the counters above stop growing).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub passthrough: Option<bool>,
}

/// `prefetch`: chunks queued for background loading.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefetchReply {
    pub queued_chunks: u64,
}

/// `pin`: chunks this request pinned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinReply {
    pub pinned_chunks: u64,
}

/// `unpin`: chunks this request unpinned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnpinReply {
    pub unpinned_chunks: u64,
}

/// `evict`: bytes the evicted chunks held.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvictReply {
    pub freed_bytes: u64,
}

/// `trace` with `"on":true`: `{"tracing":true}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceOnReply {
    pub tracing: bool,
}

/// `trace` with `"on":false`: the record since `trace on`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceOffReply {
    /// `false`.
    pub tracing: bool,
    pub chunk_size: u64,
    /// File id → name. File ids are in the files' name order, so ordering by id keeps
    /// the order the daemon lists them in.
    pub files: BTreeMap<u32, String>,
    pub events: Vec<TracedLookup>,
    /// Events past the cap, counted but not kept.
    pub dropped: u64,
}

/// One traced chunk lookup, on the wire `[file id, chunk index, µs since trace on,
/// outcome]` with outcome `hit`, `prefetch_hit` or `miss`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TracedLookup(pub u32, pub u64, pub u64, pub String);

/// `route`: the shards a prompt routes to, best first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteReply {
    /// The virtual file whose chunks `shards[].chunks` name.
    pub file: String,
    /// The prompt as the model's tokenizer splits it.
    pub tokens: Vec<String>,
    pub shards: Vec<RoutedShard>,
    /// Bytes of the distinct chunks the shards cover.
    pub chunk_bytes: u64,
    /// Only with `"prefetch":true` (absent otherwise, not `null`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued_chunks: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hinted_chunks: Option<u64>,
}

/// One shard of a [`RouteReply`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoutedShard {
    /// 1-based.
    pub rank: u64,
    /// `embedding`, `expert` or `other`.
    pub kind: String,
    pub tensor: String,
    /// Half-open row span, Hugging Face row order.
    pub rows: [u64; 2],
    /// Place in a forward pass: 0 embedding, l+1 layer l, n_layers+1 after the last.
    pub order: u32,
    /// Cosine similarity with the prompt's key; `null` for shards without a key (sent,
    /// not left out). An `f64` holding the router's `f32`, as the wire always had it.
    pub score: Option<f64>,
    /// Bytes to reconstruct it.
    pub cost: u64,
    /// Half-open chunk range of `file`.
    pub chunks: [u64; 2],
}

/// Any success payload, for [`Handler`](super::Handler): serialized as the struct it
/// holds (untagged), its fields placed beside `"ok"`. Only built by the daemon; a
/// client knows which verb it sent and reads that verb's struct.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Reply {
    Ping(PingReply),
    Stat(Box<StatReply>),
    Prefetch(PrefetchReply),
    Pin(PinReply),
    Unpin(UnpinReply),
    Evict(EvictReply),
    TraceOn(TraceOnReply),
    TraceOff(TraceOffReply),
    Route(RouteReply),
    Materialize(MaterializeReply),
}

/// `materialize`: the files being filled and the bytes they lack.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MaterializeReply {
    pub files: Vec<String>,
    pub missing_bytes: u64,
}

/// `stat`'s `tier.materialize`: the last (or running) materialize.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MaterializeStat {
    pub files: Vec<String>,
    pub done_bytes: u64,
    pub total_bytes: u64,
    pub running: bool,
    pub elapsed_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

macro_rules! into_reply {
    ($($t:ty => $v:ident),* $(,)?) => {
        $(impl From<$t> for Reply {
            fn from(r: $t) -> Reply {
                Reply::$v(r.into())
            }
        })*
    };
}

into_reply!(
    PingReply => Ping,
    StatReply => Stat,
    PrefetchReply => Prefetch,
    PinReply => Pin,
    UnpinReply => Unpin,
    EvictReply => Evict,
    TraceOnReply => TraceOn,
    TraceOffReply => TraceOff,
    RouteReply => Route,
    MaterializeReply => Materialize,
);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Key order and the absent-vs-null rules are part of the protocol.
    #[test]
    fn wire_forms() {
        let r = RouteReply {
            file: "model.gguf".into(),
            tokens: vec!["Hi".into()],
            shards: vec![RoutedShard {
                rank: 1,
                kind: "other".into(),
                tensor: "t".into(),
                rows: [0, 1],
                order: 1,
                score: None,
                cost: 9,
                chunks: [2, 3],
            }],
            chunk_bytes: 10,
            queued_chunks: None,
            hinted_chunks: None,
        };
        assert_eq!(
            serde_json::to_string(&Reply::from(r.clone())).unwrap(),
            r#"{"file":"model.gguf","tokens":["Hi"],"shards":[{"rank":1,"kind":"other","tensor":"t","rows":[0,1],"order":1,"score":null,"cost":9,"chunks":[2,3]}],"chunk_bytes":10}"#
        );
        let back: RouteReply = serde_json::from_value(serde_json::to_value(&r).unwrap()).unwrap();
        assert_eq!(back, r);

        let t = TraceOffReply {
            tracing: false,
            chunk_size: 4096,
            files: [(4, "model.gguf".into()), (10, "z".into())].into(),
            events: vec![TracedLookup(4, 27, 1810, "miss".into())],
            dropped: 0,
        };
        let line = serde_json::to_string(&Reply::from(t.clone())).unwrap();
        assert_eq!(
            line,
            r#"{"tracing":false,"chunk_size":4096,"files":{"4":"model.gguf","10":"z"},"events":[[4,27,1810,"miss"]],"dropped":0}"#
        );
        assert_eq!(serde_json::from_str::<TraceOffReply>(&line).unwrap(), t);

        let s = StatReply {
            uptime_s: Some(1.5),
            mountpoint: Some("/m".into()),
            ..StatReply::default()
        };
        assert_eq!(
            serde_json::to_value(Reply::from(s)).unwrap(),
            json!({"uptime_s": 1.5, "cache": {"latency_us": {}}, "archive": {}, "files": [], "mountpoint": "/m"})
        );
    }

    /// A stat reply missing sections and fields reads as `None`s, not as an error.
    #[test]
    fn partial_stat_reads() {
        let s: StatReply = serde_json::from_value(json!({"cache": {"hits": 1}})).unwrap();
        assert_eq!(s.cache.hits, Some(1));
        assert_eq!(s.cache.misses, None);
        assert_eq!(s.archive, ArchiveStat::default());
        assert!(s.files.is_empty());
        assert_eq!(
            serde_json::from_value::<StatReply>(json!({})).unwrap(),
            StatReply::default()
        );
    }
}
