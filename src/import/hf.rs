//! Hugging Face directory importer. STUB: to be implemented.

use std::path::Path;

use super::{ImportError, SourceModel};
use crate::model::ModelDesc;

pub struct HfSource {
    desc: ModelDesc,
}

impl HfSource {
    pub fn open(path: &Path) -> Result<HfSource, ImportError> {
        let _ = path;
        todo!()
    }
}

impl SourceModel for HfSource {
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
