//! How a tensor's values lie in its files: the [`Geo`] of each kind, the byte ranges of
//! a row block in each file, and the check of a quantized tensor's file shapes
//! (docs/NPYDIR.md §2).

use std::path::Path;

use super::files::DataFile;
use crate::archive::container::invalid;
use crate::archive::ArchiveError;
use crate::model::SourceType;

/// How a tensor's values lie in its files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Geo {
    /// `c` values per q row, `g` scale groups per q row.
    Int8 {
        c: u64,
        g: u64,
    },
    Int4 {
        c: u64,
        g: u64,
    },
    /// Passthrough of elements of `format` (f16, f32 or a plain type); None until the
    /// file's header is read.
    Pt {
        format: Option<SourceType>,
    },
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Geometry {
    pub rows: u64,
    pub cols: u64,
    pub rows_per_block: u64,
    pub geo: Geo,
}

impl Geometry {
    pub(super) fn n_blocks(&self) -> usize {
        self.rows.div_ceil(self.rows_per_block) as usize
    }
    /// Byte ranges (within the data region) of row block `b` in each data file
    /// (`[q, s]` or `[pt]`), and the element range the decoded values cover.
    pub(super) fn block_ranges(&self, b: usize) -> (Vec<(u64, u64)>, u64, u64) {
        let r0 = b as u64 * self.rows_per_block;
        let r1 = (r0 + self.rows_per_block).min(self.rows);
        let (e0, e1) = (r0 * self.cols, r1 * self.cols);
        match self.geo {
            Geo::Int8 { c, g } | Geo::Int4 { c, g } => {
                let (qa, qb) = (e0 / c, e1.div_ceil(c));
                let qw = if matches!(self.geo, Geo::Int8 { .. }) {
                    c
                } else {
                    c / 2
                };
                (
                    vec![(qa * qw, qb * qw), (qa * g * 4, qb * g * 4)],
                    qa * c,
                    qb * c,
                )
            }
            Geo::Pt { format } => {
                let sz = format.map_or(0, |f| f.served_size());
                (vec![(e0 * sz, e1 * sz)], e0, e1)
            }
        }
    }
}

/// Check a quantized tensor's files against its element count; returns its [`Geo`].
pub(super) fn check_quant(
    dir: &Path,
    numel: u64,
    q: &DataFile,
    s: &DataFile,
    int4: bool,
) -> Result<Geo, ArchiveError> {
    let qp = dir.join(&q.rel);
    let [n, w] = q.header.shape[..] else {
        return Err(invalid(
            &qp,
            format!("shape {:?} is not 2-D", q.header.shape),
        ));
    };
    let c = if int4 { w * 2 } else { w };
    if c == 0 || n.checked_mul(c) != Some(numel) {
        return Err(invalid(
            &qp,
            format!(
                "shape {:?} does not hold the {numel} elements of the tensor's shape",
                q.header.shape
            ),
        ));
    }
    let g = match s.header.shape[..] {
        [sn] if !int4 && sn == n => 1,
        [sn, g] if sn == n && g >= 1 && c % g == 0 => g,
        _ => {
            return Err(invalid(
                &dir.join(&s.rel),
                format!(
                    "scale shape {:?} does not fit values of shape {:?} (expected {}[{n}, groups dividing {c}])",
                    s.header.shape,
                    q.header.shape,
                    if int4 { String::new() } else { format!("[{n}] or ") }
                ),
            ))
        }
    };
    Ok(if int4 {
        Geo::Int4 { c, g }
    } else {
        Geo::Int8 { c, g }
    })
}
