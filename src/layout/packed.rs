//! Literal bytes of a virtual file (a GGUF or safetensors header, `tokenizer.json`)
//! kept compressed in memory: they live as long as the mount, and the vocabulary in
//! them is most of the daemon's fixed memory (3.5 MB of `tokenizer.json` plus 1.8 MB
//! of GGUF header for a 49 k-token model). Independent zstd frames of [`FRAME`] bytes
//! let a read decompress only the frames it overlaps.

use std::sync::RwLock;

/// Uncompressed bytes per frame: a read of `n` bytes decompresses at most
/// `n / FRAME + 2` frames.
const FRAME: usize = 64 << 10;
/// Below this, frames are not worth their bookkeeping: kept as they are.
const MIN_PACKED: usize = 2 * FRAME;
/// Fast level: packing runs on every mount (level 3 packed `tokenizer.json` 1 % smaller
/// in 25 % more time).
const LEVEL: i32 = 1;

/// Literal bytes, raw until [`Packed::pack`] compresses them. A mount's GGUF header is
/// packed in the background once the mount is up: compressing it at setup was more than
/// half of the time a restart spent building the layouts (test model: 15.4 ms, 6.4 ms
/// without; docs/MOUNT.md, "Disk tier"), for bytes that a file served by passthrough
/// never reads through the daemon.
#[derive(Debug)]
pub(super) struct Packed {
    len: usize,
    state: RwLock<State>,
}

#[derive(Clone, Debug)]
enum State {
    Raw(Box<[u8]>),
    Frames {
        /// Frame `i` is `data[ends[i-1]..ends[i]]` (`ends[-1]` = 0), stored
        /// uncompressed when zstd does not make it smaller.
        data: Box<[u8]>,
        ends: Box<[usize]>,
    },
}

impl Clone for Packed {
    fn clone(&self) -> Packed {
        Packed {
            len: self.len,
            state: RwLock::new(self.state().clone()),
        }
    }
}

impl Packed {
    /// The bytes as they are; [`Packed::pack`] compresses them later.
    pub(super) fn raw(bytes: Vec<u8>) -> Packed {
        Packed {
            len: bytes.len(),
            state: RwLock::new(State::Raw(bytes.into_boxed_slice())),
        }
    }

    /// Compress the bytes into frames if they are still raw and large enough to be
    /// worth it. Reads meanwhile see the raw bytes; afterwards the frames.
    pub(super) fn pack(&self) {
        let frames = match &*self.state() {
            State::Raw(bytes) if bytes.len() >= MIN_PACKED => frames(bytes),
            _ => return,
        };
        // Two packers of one file: the second's frames are the same bytes.
        *self.state.write().unwrap_or_else(|e| e.into_inner()) = frames;
    }

    /// Whether the bytes are held compressed.
    #[cfg(test)]
    pub(super) fn is_packed(&self) -> bool {
        matches!(&*self.state(), State::Frames { .. })
    }

    fn state(&self) -> std::sync::RwLockReadGuard<'_, State> {
        // Nothing panics while holding the lock; a poisoned one still holds whole bytes.
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Copy bytes `[rel, rel + out.len())` into `out` (the range is inside).
    pub(super) fn read(&self, rel: usize, out: &mut [u8]) {
        let state = self.state();
        let (data, ends) = match &*state {
            State::Raw(b) => return out.copy_from_slice(&b[rel..rel + out.len()]),
            State::Frames { data, ends } => (data, ends),
        };
        let len = self.len;
        let mut frame_buf = Vec::new();
        let mut dctx = None;
        let mut done = 0;
        while done < out.len() {
            let pos = rel + done;
            let i = pos / FRAME;
            let raw_len = FRAME.min(len - i * FRAME);
            let stored = &data[if i == 0 { 0 } else { ends[i - 1] }..ends[i]];
            let frame: &[u8] = if stored.len() == raw_len {
                stored
            } else {
                frame_buf.clear();
                frame_buf.reserve(raw_len);
                // Our own frames, compressed above from exactly raw_len bytes: only an
                // allocation failure could stop this, and that aborts anyway.
                let d = dctx
                    .get_or_insert_with(|| zstd::bulk::Decompressor::new().expect("zstd context"));
                d.decompress_to_buffer(stored, &mut frame_buf)
                    .expect("a frame packed at mount decompresses");
                &frame_buf
            };
            let off = pos - i * FRAME;
            let take = (raw_len - off).min(out.len() - done);
            out[done..done + take].copy_from_slice(&frame[off..off + take]);
            done += take;
        }
    }
}

/// `bytes` as independent zstd frames of [`FRAME`] bytes.
fn frames(bytes: &[u8]) -> State {
    let mut data = Vec::new();
    let mut ends = Vec::with_capacity(bytes.len().div_ceil(FRAME));
    // One context for every frame: a fresh one per frame allocates its tables anew,
    // and with the daemon's fixed mmap threshold the large ones are fresh zeroed pages.
    let mut cctx = zstd::bulk::Compressor::new(LEVEL).ok();
    for frame in bytes.chunks(FRAME) {
        // Compressing into memory cannot fail; a frame zstd cannot shrink stays raw.
        let packed = match cctx.as_mut() {
            Some(c) => c.compress(frame),
            None => zstd::bulk::compress(frame, LEVEL),
        };
        match packed {
            Ok(z) if z.len() < frame.len() => data.extend_from_slice(&z),
            _ => data.extend_from_slice(frame),
        }
        ends.push(data.len());
    }
    State::Frames {
        data: data.into_boxed_slice(),
        ends: ends.into_boxed_slice(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_range_reads_back() {
        // Compressible text with an incompressible stretch, not a multiple of FRAME.
        let mut bytes: Vec<u8> = (0..300_000u32)
            .map(|i| b"tokenizer merges "[i as usize % 17])
            .collect();
        let mut x = 0x9E37_79B9u32;
        for b in &mut bytes[70_000..140_000] {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            *b = x as u8;
        }
        let p = Packed::raw(bytes.clone());
        let read_all = |p: &Packed| {
            for (rel, n) in [
                (0, 1),
                (0, bytes.len()),
                (FRAME - 1, 2),
                (FRAME, FRAME),
                (65_000, 150_000),
                (bytes.len() - 5, 5),
                (123_457, 0),
            ] {
                let mut out = vec![0; n];
                p.read(rel, &mut out);
                assert!(out == bytes[rel..rel + n], "{rel}+{n}");
            }
        };
        read_all(&p);
        assert!(!p.is_packed());
        p.pack();
        assert!(p.is_packed());
        assert_eq!(p.len(), bytes.len());
        let State::Frames { data, .. } = &*p.state() else {
            unreachable!()
        };
        assert!(data.len() < bytes.len() / 3, "{} bytes packed", data.len());
        read_all(&p);
        read_all(&p.clone());
        let small = Packed::raw(b"{\"a\":1}".to_vec());
        small.pack();
        assert!(!small.is_packed());
        let mut out = [0; 3];
        small.read(2, &mut out);
        assert_eq!(&out, b"a\":");
    }
}
