//! `cawsfs export`: stream a virtual file into a real one through the same
//! [`VirtualFile::read_at`] the mount serves, so the two are byte-identical.

use std::io::Write;
use std::path::Path;

use rayon::prelude::*;

use crate::layout::VirtualFile;
use crate::model::{ReadError, RowSource};

/// Bytes produced per read; several are produced in parallel, then written in order.
const CHUNK: u64 = 8 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("{file}: {source}")]
    Read {
        file: String,
        #[source]
        source: ReadError,
    },
    #[error("{path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// Write `vf` to `path` (via `path.tmp` and a rename, so a failure leaves no partial
/// file). An existing `path` that is not a regular file (`/dev/null`, a FIFO, a
/// terminal) is written in place: renaming over it would replace the device.
/// `progress(bytes_done)` is called after each batch.
pub fn export_file(
    vf: &VirtualFile,
    src: &dyn RowSource,
    path: &Path,
    progress: &dyn Fn(u64),
) -> Result<(), ExportError> {
    let werr = |source| ExportError::Write {
        path: path.display().to_string(),
        source,
    };
    let meta = std::fs::metadata(path).ok();
    if meta.as_ref().is_some_and(|m| m.is_dir()) {
        return Err(werr(std::io::Error::new(
            std::io::ErrorKind::IsADirectory,
            "is a directory; name the file to write",
        )));
    }
    let special = meta.is_some_and(|m| !m.is_file());
    let tmp = if special {
        path.to_path_buf()
    } else {
        path.with_extension("tmp")
    };
    let written = write_via(vf, src, &tmp, progress).map_err(|e| match e {
        ExportError::Write { source, .. } => werr(source),
        e => e,
    });
    if special {
        return written.map(drop);
    }
    let renamed = written
        .and_then(|file| file.sync_all().map_err(werr))
        .and_then(|()| std::fs::rename(&tmp, path).map_err(werr));
    if renamed.is_err() {
        // A failed export leaves nothing behind under either name.
        let _ = std::fs::remove_file(&tmp);
    }
    renamed
}

/// Stream `vf` into a new file at `tmp`; returns it, flushed, unsynced.
fn write_via(
    vf: &VirtualFile,
    src: &dyn RowSource,
    tmp: &Path,
    progress: &dyn Fn(u64),
) -> Result<std::fs::File, ExportError> {
    let werr = |source| ExportError::Write {
        path: tmp.display().to_string(),
        source,
    };
    let file = std::fs::File::create(tmp).map_err(werr)?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    let batch = (rayon::current_num_threads() as u64 * 2).max(2);
    let n_chunks = vf.size.div_ceil(CHUNK);
    // One buffer per chunk of a batch, reused: fresh ones cost page faults and zeroing
    // on every batch (a tenth of a one-thread export's CPU). `read_at` fills what it
    // returns, and only that is written.
    let mut bufs: Vec<(Vec<u8>, Result<usize, ReadError>)> = (0..batch.min(n_chunks))
        .map(|_| (Vec::new(), Ok(0)))
        .collect();
    let mut c = 0;
    while c < n_chunks {
        let end = (c + batch).min(n_chunks);
        bufs.par_iter_mut()
            .take((end - c) as usize)
            .enumerate()
            .for_each(|(j, (buf, got))| {
                let off = (c + j as u64) * CHUNK;
                let len = CHUNK.min(vf.size - off) as usize;
                buf.resize(len, 0);
                *got = vf.read_at(src, off, buf);
            });
        for (buf, got) in bufs.iter_mut().take((end - c) as usize) {
            let got = std::mem::replace(got, Ok(0)).map_err(|source| ExportError::Read {
                file: vf.name.clone(),
                source,
            })?;
            out.write_all(&buf[..got]).map_err(werr)?;
        }
        c = end;
        progress((c * CHUNK).min(vf.size));
    }
    out.into_inner().map_err(|e| werr(e.into_error()))
}
