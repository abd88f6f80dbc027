//! GGUF importer. STUB: to be implemented.

use std::path::Path;

use super::{ImportError, SourceModel};
use crate::model::ModelDesc;

pub struct GgufSource {
    desc: ModelDesc,
}

impl GgufSource {
    pub fn open(path: &Path) -> Result<GgufSource, ImportError> {
        let _ = path;
        todo!()
    }
}

impl SourceModel for GgufSource {
    fn desc(&self) -> &ModelDesc {
        &self.desc
    }
    fn raw(&self, i: usize) -> Result<Vec<u8>, ImportError> {
        let _ = i;
        todo!()
    }
    fn f32(&self, i: usize) -> Result<Vec<f32>, ImportError> {
        let _ = i;
        todo!()
    }
}
