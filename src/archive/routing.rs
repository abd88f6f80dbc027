//! The ROUTING section's binary layout (seed 000 §4.2, docs/FORMAT.md §7):
//! `dim u16, n u32, shard_ids [n]u32, costs [n]f32, keys [n][dim]f32`; empty = no routes.

use super::ArchiveError;

/// Per-shard router keys and costs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routing {
    pub dim: u16,
    pub shard_ids: Vec<u32>,
    pub costs: Vec<f32>,
    /// `shard_ids.len() × dim` values, row-major.
    pub keys: Vec<f32>,
}

impl Routing {
    pub fn len(&self) -> usize {
        self.shard_ids.len()
    }
    pub fn is_empty(&self) -> bool {
        self.shard_ids.is_empty()
    }
    /// Key of route `i` (`dim` values).
    pub fn key(&self, i: usize) -> &[f32] {
        let d = self.dim as usize;
        &self.keys[i * d..(i + 1) * d]
    }
}

fn invalid(reason: String) -> ArchiveError {
    ArchiveError::Invalid {
        path: "ROUTING".into(),
        reason,
    }
}

/// Serialize `r`; an empty routing (no routes) serializes to no bytes.
/// Panics if the vectors' lengths disagree (a caller bug, not file input).
pub fn encode_routing(r: &Routing) -> Vec<u8> {
    let n = r.shard_ids.len();
    assert_eq!(r.costs.len(), n, "routing: costs length");
    assert_eq!(r.keys.len(), n * r.dim as usize, "routing: keys length");
    if n == 0 {
        return Vec::new();
    }
    let n32 = u32::try_from(n).expect("routing: more than u32::MAX routes");
    let mut out = Vec::with_capacity(6 + 8 * n + 4 * r.keys.len());
    out.extend_from_slice(&r.dim.to_le_bytes());
    out.extend_from_slice(&n32.to_le_bytes());
    for s in &r.shard_ids {
        out.extend_from_slice(&s.to_le_bytes());
    }
    for c in &r.costs {
        out.extend_from_slice(&c.to_le_bytes());
    }
    for k in &r.keys {
        out.extend_from_slice(&k.to_le_bytes());
    }
    out
}

/// Parse ROUTING bytes; every length is checked against the input before allocating.
pub fn parse_routing(bytes: &[u8]) -> Result<Routing, ArchiveError> {
    if bytes.is_empty() {
        return Ok(Routing::default());
    }
    if bytes.len() < 6 {
        return Err(invalid(format!(
            "truncated: {} bytes, the header needs 6",
            bytes.len()
        )));
    }
    let dim = u16::from_le_bytes([bytes[0], bytes[1]]);
    let n = u32::from_le_bytes([bytes[2], bytes[3], bytes[4], bytes[5]]) as u64;
    // 6 + 4n + 4n + 4·n·dim, in u64 (cannot overflow: n < 2^32, dim < 2^16).
    let need = 6 + 8 * n + 4 * n * dim as u64;
    if need != bytes.len() as u64 {
        return Err(invalid(format!(
            "size mismatch: dim {dim} and {n} routes need {need} bytes, section has {}",
            bytes.len()
        )));
    }
    let n = n as usize;
    let words = |start: usize, count: usize| {
        bytes[start..start + 4 * count]
            .chunks_exact(4)
            .map(|c| [c[0], c[1], c[2], c[3]])
    };
    let shard_ids = words(6, n).map(u32::from_le_bytes).collect();
    let costs = words(6 + 4 * n, n).map(f32::from_le_bytes).collect();
    let keys = words(6 + 8 * n, n * dim as usize)
        .map(f32::from_le_bytes)
        .collect();
    Ok(Routing {
        dim,
        shard_ids,
        costs,
        keys,
    })
}
