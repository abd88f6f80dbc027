//! An in-memory [`SourceModel`] for unit tests: a model description and each tensor's
//! values as f32 (its raw bytes are those values little-endian).

use super::{ImportError, SourceModel};
use crate::model::ModelDesc;

pub(crate) struct MemSource {
    pub desc: ModelDesc,
    pub data: Vec<Vec<f32>>,
}

impl SourceModel for MemSource {
    fn desc(&self) -> &ModelDesc {
        &self.desc
    }
    fn raw(&self, i: usize) -> Result<Vec<u8>, ImportError> {
        Ok(self.data[i].iter().flat_map(|x| x.to_le_bytes()).collect())
    }
    fn f32(&self, i: usize) -> Result<Vec<f32>, ImportError> {
        Ok(self.data[i].clone())
    }
}
