//! Streaming writer of the delta archive (docs/FORMAT-DELTA.md): blobs go to DATA as
//! they are added (bases first, then tensors in model order); `finish` appends
//! BLOB_INDEX, ROUTING and META, writes the header/TOC and renames the temporary file to
//! the output ([`ContainerWriter`]; dropped unfinished, it leaves nothing behind).

use std::path::Path;

use xxhash_rust::xxh3::xxh3_64;

use super::format::*;
use crate::archive::{ArchiveError, Compression};
use crate::model::{ModelDesc, SourceType};

pub struct DeltaWriter {
    w: ContainerWriter,
    index: Vec<u8>,
    n_entries: u64,
    bases: Vec<MetaBase>,
    tensors: Vec<MetaTensor>,
}

impl DeltaWriter {
    fn invalid(&self, reason: String) -> ArchiveError {
        self.w.invalid(reason)
    }

    /// Blocks are stored raw unless compression saves at least `fraction` of them.
    pub fn set_min_saving(&mut self, fraction: f64) {
        self.w.set_min_saving(fraction);
    }

    pub fn create(path: &Path, compression: Compression) -> Result<DeltaWriter, ArchiveError> {
        Ok(DeltaWriter {
            w: ContainerWriter::create(path, compression)?,
            index: Vec::new(),
            n_entries: 0,
            bases: Vec::new(),
            tensors: Vec::new(),
        })
    }

    /// Compress `blobs` in parallel and append them in order; returns the index of the
    /// first entry and the stored bytes in total.
    fn put_blobs(
        &mut self,
        kind: u8,
        owner: u32,
        first_block: u32,
        blobs: &[&[u8]],
    ) -> Result<(u64, u64), ArchiveError> {
        for b in blobs {
            if b.len() > u32::MAX as usize {
                return Err(self.invalid(format!(
                    "{} of {} bytes exceeds the 4 GiB blob limit",
                    kind_name(kind),
                    b.len()
                )));
            }
        }
        let packed = self.w.compress_all(blobs);
        let first = self.n_entries;
        let mut stored_total = 0;
        for (i, ((comp, stored), raw)) in packed.iter().zip(blobs).enumerate() {
            BlobEntry {
                offset: self.w.append(&[], stored)?,
                csize: stored.len() as u32,
                usize: raw.len() as u32,
                xxh3: xxh3_64(stored),
                comp: *comp,
                kind,
                owner,
                block: first_block + i as u32,
            }
            .write(&mut self.index);
            self.n_entries += 1;
            stored_total += stored.len() as u64;
        }
        Ok((first, stored_total))
    }

    /// Add a base; returns (base index, stored bytes).
    #[allow(clippy::too_many_arguments)]
    pub fn add_base(
        &mut self,
        ty: &str,
        cluster: u32,
        layers: Vec<u32>,
        rows: u64,
        cols: u64,
        rows_per_block: u64,
        blocks: &[Vec<u8>],
    ) -> Result<(u32, u64), ArchiveError> {
        if !self.tensors.is_empty() {
            return Err(self.invalid("bases must be added before tensors".into()));
        }
        let idx = self.bases.len() as u32;
        let refs: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
        let (first, stored) = self.put_blobs(KIND_BASE, idx, 0, &refs)?;
        self.bases.push(MetaBase {
            ty: ty.to_string(),
            cluster,
            layers,
            rows,
            cols,
            rows_per_block,
            first_blob: first,
            n_blocks: blocks.len() as u64,
        });
        Ok((idx, stored))
    }

    fn check_order(&self, tensor: usize) -> Result<u32, ArchiveError> {
        self.w.tensor_index(tensor, self.tensors.len())
    }

    /// Add a passthrough tensor; returns its stored bytes.
    pub fn add_passthrough(
        &mut self,
        tensor: usize,
        name: &str,
        format: SourceType,
        rows_per_block: u64,
        blocks: &[Vec<u8>],
    ) -> Result<u64, ArchiveError> {
        let t = self.check_order(tensor)?;
        let refs: Vec<&[u8]> = blocks.iter().map(Vec::as_slice).collect();
        let (first, stored) = self.put_blobs(KIND_PASS, t, 0, &refs)?;
        self.tensors.push(MetaTensor::Passthrough {
            name: name.to_string(),
            format,
            rows_per_block,
            first_blob: first,
            n_blocks: blocks.len() as u64,
        });
        Ok(stored)
    }

    /// Add a delta matrix (U blocks, then its Vᵀ blob); returns its stored bytes.
    #[allow(clippy::too_many_arguments)]
    pub fn add_delta(
        &mut self,
        tensor: usize,
        name: &str,
        base: u32,
        rank: u64,
        rows_per_block: u64,
        u_blocks: &[Vec<u8>],
        vt: &[u8],
    ) -> Result<u64, ArchiveError> {
        let t = self.check_order(tensor)?;
        let refs: Vec<&[u8]> = u_blocks.iter().map(Vec::as_slice).collect();
        let (first, su) = self.put_blobs(KIND_U, t, 0, &refs)?;
        let (vt_blob, sv) = self.put_blobs(KIND_VT, t, 0, &[vt])?;
        self.tensors.push(MetaTensor::Delta {
            name: name.to_string(),
            base: base as u64,
            rank,
            rows_per_block,
            first_blob: first,
            n_blocks: u_blocks.len() as u64,
            vt_blob,
        });
        Ok(su + sv)
    }

    /// Write the index, ROUTING, META and the header. Returns the archive's size.
    pub fn finish(
        self,
        model: &ModelDesc,
        base_dtype: BaseDtype,
        extra: serde_json::Value,
        routing: &[u8],
    ) -> Result<u64, ArchiveError> {
        self.w.check_count(self.tensors.len(), model)?;
        let n_layers = model.arch.n_layers;
        let n_bases = self.bases.len() as u32;
        let mut fields = Vec::with_capacity(12);
        fields.extend_from_slice(&n_layers.to_le_bytes());
        fields.extend_from_slice(&n_bases.to_le_bytes());
        fields.extend_from_slice(&[base_dtype.code(), DTYPE_F16, 0, 0]);
        let layout = Layout {
            magic: &MAGIC,
            fields: &fields,
            data_ty: SEC_DATA,
            index_ty: SEC_BLOB_INDEX,
            routing_ty: SEC_ROUTING,
            name_of: section_name,
        };
        let meta = MetaSpec {
            format: FORMAT,
            model,
            kind: MetaKindOut {
                n_layers,
                base_dtype,
                delta_dtype: "f16",
                bases: &self.bases,
                tensors: &self.tensors,
            },
            extra: &extra,
        };
        let no_more = |_: &mut Sections<'_>| Ok(());
        self.w.finish(layout, no_more, (&self.index, routing), meta)
    }
}
