//! The safetensors header and tensor table as the Hugging Face importer reads them
//! (src/import/hf.rs): the input is `model.safetensors` of a directory whose other
//! files are the tiny model's `config.json` and tokenizer; opened with
//! `cawsfs::import::open_source`, then every tensor's bytes and values are read.
use std::sync::OnceLock;

fn main() {
    static JSON: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    let json = JSON.get_or_init(cawsfs_fuzz::tiny::json_files);
    afl::fuzz!(|data: &[u8]| {
        let dir = cawsfs_fuzz::scratch();
        for (name, bytes) in json {
            std::fs::write(dir.path().join(name), bytes).unwrap();
        }
        std::fs::write(dir.path().join("model.safetensors"), data).unwrap();
        cawsfs_fuzz::open_source(dir.path());
    });
}
