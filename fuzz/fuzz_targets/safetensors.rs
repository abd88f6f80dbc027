//! The safetensors header and tensor table as the Hugging Face importer reads them
//! (src/import/hf.rs): the input is `model.safetensors` of a directory whose other
//! files are the tiny model's `config.json` and tokenizer; opened with
//! `cawsfs::import::open_source`, then every tensor's bytes and values are read.
fn main() {
    afl::fuzz!(|data: &[u8]| cawsfs_fuzz::targets::safetensors(data));
}
