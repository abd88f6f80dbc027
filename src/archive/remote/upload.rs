//! `convert -o s3://…`: a written archive uploaded as a multipart upload
//! (docs/REMOTE.md, "Uploading").

use std::io::Read;
use std::path::Path;

use super::{invalid, one_line, parse, runtime, store_for};
use crate::archive::ArchiveError;

/// Parts of a multipart upload, and how many are in flight at once.
const UPLOAD_PART: usize = 16 << 20;
const UPLOAD_IN_FLIGHT: usize = 4;

/// Upload the local file `src` to the object `url` names (`s3://` only), as a multipart
/// upload of 16 MiB parts, 4 in flight; aborted on failure, so no partial object is
/// left. Returns the bytes uploaded.
pub fn upload(src: &Path, url: &Path) -> Result<u64, ArchiveError> {
    let (parsed, display) = parse(url)?;
    if parsed.scheme() != "s3" {
        return Err(invalid(
            &display,
            "archives are uploaded to s3:// only (an HTTP server takes no uploads)",
        ));
    }
    let ((store, _), location) = store_for(&parsed).map_err(|r| invalid(&display, r))?;
    let mut file = std::fs::File::open(src).map_err(|e| crate::error::FileError::io(src, e))?;
    runtime().block_on(async {
        let fail =
            |e: object_store::Error| invalid(&display, format!("upload failed: {}", one_line(&e)));
        let up = object_store::ObjectStoreExt::put_multipart(&*store, &location)
            .await
            .map_err(fail)?;
        let mut w = object_store::WriteMultipart::new_with_chunk_size(up, UPLOAD_PART);
        let mut buf = vec![0u8; UPLOAD_PART];
        let mut sent = 0u64;
        loop {
            let n = match file.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => {
                    let _ = w.abort().await;
                    return Err(crate::error::FileError::io(src, e));
                }
            };
            if let Err(e) = w.wait_for_capacity(UPLOAD_IN_FLIGHT).await {
                return Err(fail(e));
            }
            w.write(&buf[..n]);
            sent += n as u64;
        }
        w.finish().await.map_err(fail)?;
        Ok(sent)
    })
}
