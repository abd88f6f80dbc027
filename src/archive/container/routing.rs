//! The ROUTING section's binary layout, version 2 (docs/FORMAT.md §7): a header, one
//! 40-byte record per shard (tensor, row span, kind, order, cost) and the shards'
//! sparse keys. Empty bytes = no routes. What the keys mean is `router`'s business.

use super::ArchiveError;

pub const ROUTING_MAGIC: [u8; 4] = *b"RTNG";
pub const ROUTING_VERSION: u32 = 2;
/// Hash scheme 1: XXH3-64 of the token string, index = h mod dim, sign = bit 63.
pub const HASH_XXH3_TOKEN: u32 = 1;
pub const MAX_DIM: u32 = 1 << 24;
pub const MAX_SHARDS: u32 = 1 << 24;
pub const MAX_NNZ: u64 = 1 << 32;
const HEADER: usize = 32;
const RECORD: usize = 40;
const ENTRY: usize = 8;

/// What a shard is, and so where its key (if any) comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardKind {
    /// A block of token-embedding rows; key = the tokens in it.
    Embedding,
    /// One tensor of a mixture-of-experts expert; key = the tokens its gate prefers.
    Expert,
    /// Anything else: order and cost, no key.
    Other,
}

impl ShardKind {
    fn code(self) -> u8 {
        match self {
            ShardKind::Embedding => 0,
            ShardKind::Expert => 1,
            ShardKind::Other => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            ShardKind::Embedding => "embedding",
            ShardKind::Expert => "expert",
            ShardKind::Other => "other",
        }
    }
}

/// One shard: rows `row0..row1` of `tensor`, with its (sparse) key.
#[derive(Clone, Debug, PartialEq)]
pub struct Shard {
    pub tensor: u32,
    pub kind: ShardKind,
    pub order: u32,
    pub row0: u64,
    pub row1: u64,
    pub cost: u64,
    /// (index, value), indices strictly increasing; empty = no key.
    pub key: Vec<(u32, f32)>,
}

/// Per-shard router keys and costs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routing {
    pub dim: u32,
    pub shards: Vec<Shard>,
}

impl Routing {
    pub fn len(&self) -> usize {
        self.shards.len()
    }
    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }
}

fn invalid(reason: String) -> ArchiveError {
    ArchiveError::Invalid {
        path: "ROUTING".into(),
        reason,
    }
}

/// Serialize `r`; an empty routing (no shards) serializes to no bytes.
/// Panics on a malformed key or out-of-bound counts (a caller bug, not file input).
pub fn encode_routing(r: &Routing) -> Vec<u8> {
    if r.shards.is_empty() {
        return Vec::new();
    }
    assert!(r.dim >= 1 && r.dim <= MAX_DIM, "routing: dim {}", r.dim);
    assert!(
        r.shards.len() <= MAX_SHARDS as usize,
        "routing: too many shards"
    );
    let nnz: usize = r.shards.iter().map(|s| s.key.len()).sum();
    assert!(nnz as u64 <= MAX_NNZ, "routing: too many key entries");
    let mut out = Vec::with_capacity(HEADER + RECORD * r.shards.len() + ENTRY * nnz);
    out.extend_from_slice(&ROUTING_MAGIC);
    out.extend_from_slice(&ROUTING_VERSION.to_le_bytes());
    out.extend_from_slice(&r.dim.to_le_bytes());
    out.extend_from_slice(&(r.shards.len() as u32).to_le_bytes());
    out.extend_from_slice(&(nnz as u64).to_le_bytes());
    out.extend_from_slice(&HASH_XXH3_TOKEN.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    for s in &r.shards {
        assert!(s.row0 < s.row1, "routing: empty row span");
        out.extend_from_slice(&s.tensor.to_le_bytes());
        out.extend_from_slice(&[s.kind.code(), 0, 0, 0]);
        out.extend_from_slice(&s.order.to_le_bytes());
        out.extend_from_slice(&(s.key.len() as u32).to_le_bytes());
        out.extend_from_slice(&s.row0.to_le_bytes());
        out.extend_from_slice(&s.row1.to_le_bytes());
        out.extend_from_slice(&s.cost.to_le_bytes());
    }
    for s in &r.shards {
        for w in s.key.windows(2) {
            assert!(w[0].0 < w[1].0, "routing: key indices not increasing");
        }
        for &(i, v) in &s.key {
            assert!(
                i < r.dim && v.is_finite() && v != 0.0,
                "routing: bad key entry"
            );
            out.extend_from_slice(&i.to_le_bytes());
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

// The parser checks every record's extent against the input before reading its fields,
// so a field outside the input is a bug here, not bad input.
fn u32_at(b: &[u8], at: usize) -> u32 {
    super::u32_at(b, at).expect("field inside a record already bounds-checked")
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    super::u64_at(b, at).expect("field inside a record already bounds-checked")
}

/// Parse ROUTING bytes; every count is checked against the input before allocating.
pub fn parse_routing(bytes: &[u8]) -> Result<Routing, ArchiveError> {
    if bytes.is_empty() {
        return Ok(Routing::default());
    }
    if bytes.len() < HEADER {
        return Err(invalid(format!(
            "truncated: {} bytes, the header needs {HEADER}",
            bytes.len()
        )));
    }
    if bytes[0..4] != ROUTING_MAGIC {
        return Err(invalid(
            "bad magic (not a version-2 ROUTING block; version 1 is not read)".into(),
        ));
    }
    let version = u32_at(bytes, 4);
    if version != ROUTING_VERSION {
        return Err(invalid(format!("unsupported ROUTING version {version}")));
    }
    let (dim, n, nnz, hash) = (
        u32_at(bytes, 8),
        u32_at(bytes, 12),
        u64_at(bytes, 16),
        u32_at(bytes, 24),
    );
    if !(1..=MAX_DIM).contains(&dim) {
        return Err(invalid(format!("dim {dim} is not in 1..={MAX_DIM}")));
    }
    if n > MAX_SHARDS || nnz > MAX_NNZ {
        return Err(invalid(format!(
            "{n} shards / {nnz} key entries is too many"
        )));
    }
    if hash != HASH_XXH3_TOKEN {
        return Err(invalid(format!("unknown key hash scheme {hash}")));
    }
    // Cannot overflow: n < 2^24, nnz ≤ 2^32.
    let need = HEADER as u64 + RECORD as u64 * n as u64 + ENTRY as u64 * nnz;
    if need != bytes.len() as u64 {
        return Err(invalid(format!(
            "size mismatch: {n} shards and {nnz} key entries need {need} bytes, section has {}",
            bytes.len()
        )));
    }
    let mut shards = Vec::with_capacity(n as usize);
    let mut entry = HEADER + RECORD * n as usize;
    let mut total: u64 = 0;
    for i in 0..n as usize {
        let r = HEADER + RECORD * i;
        let kind = match bytes[r + 4] {
            0 => ShardKind::Embedding,
            1 => ShardKind::Expert,
            2 => ShardKind::Other,
            k => return Err(invalid(format!("shard {i}: unknown kind {k}"))),
        };
        let key_len = u32_at(bytes, r + 12) as u64;
        let (row0, row1) = (u64_at(bytes, r + 16), u64_at(bytes, r + 24));
        if row0 >= row1 {
            return Err(invalid(format!("shard {i}: empty row span {row0}..{row1}")));
        }
        total += key_len;
        if total > nnz {
            return Err(invalid(format!(
                "shard {i}: keys add up to more than the {nnz} entries stored"
            )));
        }
        let mut key = Vec::with_capacity(key_len as usize);
        for _ in 0..key_len {
            let (idx, v) = (
                u32_at(bytes, entry),
                f32::from_le_bytes(bytes[entry + 4..entry + 8].try_into().expect("4 bytes")),
            );
            entry += ENTRY;
            if idx >= dim || !v.is_finite() || v == 0.0 {
                return Err(invalid(format!("shard {i}: bad key entry ({idx}, {v})")));
            }
            if key.last().is_some_and(|&(p, _)| p >= idx) {
                return Err(invalid(format!("shard {i}: key indices not increasing")));
            }
            key.push((idx, v));
        }
        shards.push(Shard {
            tensor: u32_at(bytes, r),
            kind,
            order: u32_at(bytes, r + 8),
            row0,
            row1,
            cost: u64_at(bytes, r + 32),
            key,
        });
    }
    if total != nnz {
        return Err(invalid(format!(
            "keys hold {total} entries, the header says {nnz}"
        )));
    }
    Ok(Routing { dim, shards })
}
