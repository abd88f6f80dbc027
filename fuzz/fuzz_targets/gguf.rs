//! GGUF reader and importer: `cawsfs::gguf::reader::parse_header` on the bytes, then the
//! file opened as a source model (`cawsfs::import::open_source`: header, metadata →
//! architecture, tensor plan); when it opens, every tensor's raw bytes and dequantized
//! values are read (all 13 ggml types), and the virtual files derived from it (GGUF
//! metadata → tokenizer.json, config.json). Seeds: GGUF files the layout wrote from the
//! tiny model (F16/F32/BF16) and ones with quantized tensors.
fn main() {
    afl::fuzz!(|data: &[u8]| cawsfs_fuzz::targets::gguf(data));
}
