//! The tensor table of META checked at open against the model, BLOCK_INDEX, SHARD_BANK
//! and CODEBOOKS (docs/FORMAT.md §3, §6): every later read indexes only into ranges
//! checked here.

use crate::archive::container::*;
use crate::archive::ArchiveError;
use crate::model::ModelDesc;

use super::format::*;
use super::TensorEntry;

/// The tensor table checked against the model, BLOCK_INDEX, SHARD_BANK and CODEBOOKS
/// (docs/FORMAT.md §3, §6).
pub(super) fn tensor_table(
    c: &Container,
    metas: Vec<MetaTensor>,
    model: &ModelDesc,
    index: &[IndexEntry],
    cb_rec: TocRecord,
    bank_rec: TocRecord,
) -> Result<Vec<TensorEntry>, ArchiveError> {
    if metas.len() != model.tensors.len() {
        return Err(c.invalid(format!(
            "tensor table has {} entries but the model has {} tensors",
            metas.len(),
            model.tensors.len()
        )));
    }
    let mut tensors = Vec::with_capacity(metas.len());
    let mut next_block: u64 = 0;
    // Each tensor's span of SHARD_BANK: tensors may be written in any order
    // (docs/FORMAT.md), but no two may overlap.
    let mut spans: Vec<((u64, u64), usize)> = Vec::with_capacity(metas.len());
    for (ti, (mt, d)) in metas.into_iter().zip(&model.tensors).enumerate() {
        let bad = |what: String| c.invalid(format!("tensor {}: {what}", mt.name));
        if mt.name != d.name {
            return Err(bad(format!(
                "table name disagrees with model tensor {ti} ({})",
                d.name
            )));
        }
        // Checked first: TensorDesc's helpers multiply without overflow checks.
        let numel = d.shape.iter().try_fold(1u64, |a, &x| a.checked_mul(x));
        if numel.is_none_or(|n| n > MAX_ELEMENTS) {
            return Err(bad(format!("absurd shape {:?}", d.shape)));
        }
        if mt.rows != d.rows() || mt.cols != d.cols() {
            return Err(bad(format!(
                "table says {}x{} but the model shape {:?} is {}x{}",
                mt.rows,
                mt.cols,
                d.shape,
                d.rows(),
                d.cols()
            )));
        }
        if mt.rows_per_block == 0 {
            return Err(bad("rows_per_block is 0".into()));
        }
        if mt.n_blocks != mt.rows.div_ceil(mt.rows_per_block) {
            return Err(bad(format!(
                "{} blocks but {} rows at {} rows per block need {}",
                mt.n_blocks,
                mt.rows,
                mt.rows_per_block,
                mt.rows.div_ceil(mt.rows_per_block)
            )));
        }
        if mt.first_block != next_block {
            return Err(bad(format!(
                "first_block is {} but should be {next_block}",
                mt.first_block
            )));
        }
        let end_block = next_block
            .checked_add(mt.n_blocks)
            .filter(|&e| e <= index.len() as u64)
            .ok_or_else(|| {
                bad(format!(
                    "blocks {}..+{} lie outside BLOCK_INDEX ({} entries)",
                    next_block,
                    mt.n_blocks,
                    index.len()
                ))
            })?;
        let entries = &index[next_block as usize..end_block as usize];
        if let Some(span) = block_entries(c, (ti, &mt), entries, bank_rec.size)? {
            spans.push((span, ti));
        }
        let g = &mt.global;
        let global_xxh3 = parse_hex64(&g.xxh3)
            .ok_or_else(|| bad(format!("global xxh3 {:?} is not 16 hex digits", g.xxh3)))?;
        let gend = g.offset.checked_add(g.csize).filter(|&e| e <= cb_rec.size);
        if gend.is_none() {
            return Err(bad(format!(
                "global blob at {}+{} lies outside CODEBOOKS ({} bytes)",
                g.offset, g.csize, cb_rec.size
            )));
        }
        if g.comp > COMP_LZ4 || (g.comp == COMP_RAW && g.usize != g.csize) {
            return Err(bad(format!(
                "global blob has comp {} csize {} usize {}",
                g.comp, g.csize, g.usize
            )));
        }
        let max_global = (mt.rows.saturating_add(mt.cols).saturating_add(1024))
            .saturating_mul(mt.cols)
            .saturating_mul(8)
            .saturating_add(16 << 20);
        if g.usize > max_global {
            return Err(bad(format!(
                "global blob usize {} exceeds the bound {max_global}",
                g.usize
            )));
        }
        tensors.push(TensorEntry {
            name: mt.name,
            codec: mt.codec,
            rows: mt.rows,
            cols: mt.cols,
            rows_per_block: mt.rows_per_block,
            first_block: next_block as usize,
            n_blocks: mt.n_blocks as usize,
            global: mt.global,
            global_xxh3,
        });
        next_block = end_block;
    }
    if next_block != index.len() as u64 {
        return Err(c.invalid(format!(
            "BLOCK_INDEX has {} entries but the tensor table uses {next_block}",
            index.len()
        )));
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        let (((_, end), a), ((start, _), b)) = (w[0], w[1]);
        if start < end {
            return Err(c.invalid(format!(
                "tensors {} and {} overlap in SHARD_BANK",
                tensors[a].name, tensors[b].name
            )));
        }
    }

    Ok(tensors)
}

/// Tensor `ti`'s BLOCK_INDEX entries: its own, compression valid, sizes bounded, records
/// inside SHARD_BANK (`bank_size` bytes), each after the one before. Returns the span
/// of SHARD_BANK its records lie in (None without blocks), for the check that no two
/// tensors' spans overlap.
fn block_entries(
    c: &Container,
    (ti, mt): (usize, &MetaTensor),
    entries: &[IndexEntry],
    bank_size: u64,
) -> Result<Option<(u64, u64)>, ArchiveError> {
    let prev_end = &mut 0u64;
    // Per-block usize bound: a corrupt entry must not make us allocate gigabytes.
    let max_block = mt
        .rows_per_block
        .min(mt.rows.max(1))
        .saturating_mul(mt.cols)
        .saturating_mul(16)
        .saturating_add(64 << 10);
    for (b, e) in entries.iter().enumerate() {
        let bad_block = |what: String| c.invalid(format!("tensor {} block {b}: {what}", mt.name));
        if e.tensor as usize != ti {
            return Err(bad_block(format!("index entry names tensor {}", e.tensor)));
        }
        if e.comp > COMP_LZ4 {
            return Err(bad_block(format!(
                "invalid compression code {} (or reserved bytes set)",
                e.comp
            )));
        }
        if e.comp == COMP_RAW && e.usize != e.csize {
            return Err(bad_block(format!(
                "raw block has csize {} but usize {}",
                e.csize, e.usize
            )));
        }
        if e.usize as u64 > max_block {
            return Err(bad_block(format!(
                "usize {} exceeds the bound {max_block} for its shape",
                e.usize
            )));
        }
        let end = e.offset.checked_add(REC_HEADER as u64 + e.csize as u64);
        match end {
            Some(end) if end <= bank_size && e.offset >= *prev_end => *prev_end = end,
            _ => {
                return Err(bad_block(format!(
                "record at {}+{} lies outside SHARD_BANK ({} bytes) or overlaps the previous one",
                e.offset,
                REC_HEADER as u64 + e.csize as u64,
                bank_size
            )))
            }
        }
    }
    Ok(entries.first().map(|e| (e.offset, *prev_end)))
}
