//! The JSON of a Hugging Face model directory: `config.json`, `tokenizer.json`,
//! `tokenizer_config.json`, `generation_config.json`, `model.safetensors.index.json`.
//! The input is a list of files (`cawsfs_fuzz::decode_files`); a directory without a
//! `model.safetensors` of its own gets the tiny model's. Opened with
//! `cawsfs::import::open_source`; when it opens, tensors are read, the virtual files
//! are built (tokenizer.json → GGUF vocabulary and merges, config → GGUF metadata) and
//! the tokenizer is loaded and run.
fn main() {
    afl::fuzz!(|data: &[u8]| cawsfs_fuzz::targets::hf_json(data));
}
