//! Layout tests against an in-memory row source that records what it was asked for.

use std::collections::BTreeMap;
use std::sync::Mutex;

use half::{bf16, f16};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::gguf::{self as g, HeaderOut};
use super::*;
use crate::gguf::quantize::quantize;
use crate::gguf::{GgmlType, GgufArray, GgufValue};
use crate::model::{ArchConfig, SourceType};
use crate::test_support::{self, tensor as td, tiny_arch};

struct Mock {
    /// Row-major values and column count per tensor.
    data: Vec<(Vec<f32>, u64)>,
    calls: Mutex<Vec<(usize, u64, u64)>>,
}

impl Mock {
    fn new(model: &ModelDesc, seed: u64) -> Mock {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let data = model
            .tensors
            .iter()
            .map(|t| {
                let v = (0..t.numel())
                    .map(|_| (rng.random::<f32>() - 0.5) * 3.0)
                    .collect();
                (v, t.cols())
            })
            .collect();
        Mock {
            data,
            calls: Mutex::new(Vec::new()),
        }
    }
    fn take_calls(&self) -> Vec<(usize, u64, u64)> {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }
    fn row(&self, t: usize, r: u64) -> &[f32] {
        let (v, c) = &self.data[t];
        &v[(r * c) as usize..((r + 1) * c) as usize]
    }
}

impl RowSource for Mock {
    fn read_rows(&self, tensor: usize, r0: u64, r1: u64, out: &mut [f32]) -> Result<(), ReadError> {
        self.calls.lock().unwrap().push((tensor, r0, r1));
        let (v, c) = &self.data[tensor];
        let rows = v.len() as u64 / c;
        if r0 > r1 || r1 > rows || out.len() as u64 != (r1 - r0) * c {
            return Err(ReadError::OutOfRange {
                tensor: tensor.to_string(),
                r0,
                r1,
            });
        }
        out.copy_from_slice(&v[(r0 * c) as usize..(r1 * c) as usize]);
        Ok(())
    }
}

/// Two layers, hidden 64, 4 heads of 16 sharing 2 KV heads, vocabulary 100.
fn arch() -> ArchConfig {
    ArchConfig {
        n_layers: 2,
        hidden_size: 64,
        intermediate_size: 96,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 16,
        vocab_size: 100,
        context_length: 2048,
        ..tiny_arch()
    }
}

fn test_model(tied: bool) -> ModelDesc {
    let bf = SourceType::BF16;
    let f32t = SourceType::F32;
    let mut tensors = vec![td("model.embed_tokens.weight", &[100, 64], bf)];
    for l in 0..2 {
        let p = format!("model.layers.{l}.");
        tensors.push(td(&format!("{p}self_attn.q_proj.weight"), &[64, 64], bf));
        tensors.push(td(&format!("{p}self_attn.k_proj.weight"), &[32, 64], bf));
        tensors.push(td(
            &format!("{p}self_attn.v_proj.weight"),
            &[32, 64],
            SourceType::F16,
        ));
        tensors.push(td(&format!("{p}self_attn.o_proj.weight"), &[64, 64], bf));
        tensors.push(td(&format!("{p}mlp.gate_proj.weight"), &[96, 64], bf));
        tensors.push(td(&format!("{p}mlp.up_proj.weight"), &[96, 64], bf));
        tensors.push(td(&format!("{p}mlp.down_proj.weight"), &[64, 96], bf));
        tensors.push(td(&format!("{p}input_layernorm.weight"), &[64], f32t));
        tensors.push(td(
            &format!("{p}post_attention_layernorm.weight"),
            &[64],
            f32t,
        ));
        tensors.push(td(&format!("{p}self_attn.rotary_emb.inv_freq"), &[8], f32t));
    }
    tensors.push(td("model.norm.weight", &[64], f32t));
    if !tied {
        tensors.push(td(
            "lm_head.weight",
            &[100, 64],
            SourceType::Ggml(GgmlType::Q8_0),
        ));
    }
    let arch = ArchConfig {
        tie_word_embeddings: tied,
        ..arch()
    };
    test_support::model(arch, tensors)
}

fn encode_all(vals: &[f32], dt: FloatType) -> Vec<u8> {
    match dt {
        FloatType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        FloatType::F16 => vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        FloatType::BF16 => vals
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
    }
}

fn materialize(f: &VirtualFile, src: &dyn RowSource) -> Vec<u8> {
    let mut buf = vec![0u8; f.size as usize + 10];
    let n = f.read_at(src, 0, &mut buf).unwrap();
    assert_eq!(n as u64, f.size);
    buf.truncate(n);
    buf
}

fn random_reads(f: &VirtualFile, src: &dyn RowSource, full: &[u8], seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for _ in 0..3000 {
        let off = rng.random_range(0..f.size + 4);
        let len = match rng.random_range(0..4) {
            0 => rng.random_range(0..8usize),
            1 => rng.random_range(0..300usize),
            2 => rng.random_range(0..5000usize),
            _ => rng.random_range(0..40000usize),
        };
        let mut buf = vec![0xAAu8; len];
        let n = f.read_at(src, off, &mut buf).unwrap();
        let s = (off as usize).min(full.len());
        let e = (off as usize).saturating_add(len).min(full.len());
        assert_eq!(n, e - s, "length at {off}+{len}");
        assert_eq!(&buf[..n], &full[s..e], "bytes at {off}+{len}");
    }
}

#[test]
fn safetensors_matches_the_reference_writer() {
    let model = test_model(false);
    let src = Mock::new(&model, 1);
    for dtype in [None, Some(FloatType::F32), Some(FloatType::BF16)] {
        let f = safetensors_file(&model, dtype).unwrap();
        let full = materialize(&f, &src);

        // The safetensors crate's own writer, fed the converted values, gives the same bytes.
        let owned: Vec<(String, ::safetensors::Dtype, Vec<usize>, Vec<u8>)> = model
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let ft = dtype.unwrap_or(t.source.float_view().unwrap());
                let st = match ft {
                    FloatType::F32 => ::safetensors::Dtype::F32,
                    FloatType::F16 => ::safetensors::Dtype::F16,
                    FloatType::BF16 => ::safetensors::Dtype::BF16,
                };
                let shape = t.shape.iter().map(|&d| d as usize).collect();
                (t.name.clone(), st, shape, encode_all(&src.data[i].0, ft))
            })
            .collect();
        let views: Vec<(String, ::safetensors::tensor::TensorView)> = owned
            .iter()
            .map(|(n, d, s, b)| {
                (
                    n.clone(),
                    ::safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        let reference = ::safetensors::serialize(views, Some(meta)).unwrap();
        assert_eq!(full.len(), reference.len());
        assert!(
            full == reference,
            "bytes differ from ::safetensors::serialize"
        );

        let st = ::safetensors::SafeTensors::deserialize(&full).unwrap();
        assert_eq!(st.len(), model.tensors.len());
        for (i, t) in model.tensors.iter().enumerate() {
            let v = st.tensor(&t.name).unwrap();
            let ft = dtype.unwrap_or(t.source.float_view().unwrap());
            assert_eq!(v.shape(), owned[i].2.as_slice());
            assert_eq!(v.data(), encode_all(&src.data[i].0, ft).as_slice());
        }
        let hlen = u64::from_le_bytes(full[..8].try_into().unwrap());
        assert_eq!(hlen % 8, 0);
        let ranges = f.tensor_ranges();
        assert_eq!(ranges.len(), model.tensors.len());
        assert_eq!(ranges[0].1, 8 + hlen);
        assert!(ranges.windows(2).all(|w| w[0].2 == w[1].1));
        assert_eq!(ranges.last().unwrap().2, f.size);

        random_reads(&f, &src, &full, 7);
    }
}

#[test]
fn small_reads_touch_only_overlapping_rows() {
    let model = test_support::model(
        arch(),
        vec![td("big.weight", &[1000, 512], SourceType::F16)],
    );
    let src = Mock::new(&model, 2);
    let f = safetensors_file(&model, None).unwrap();
    let (_, start, _) = f.tensor_ranges()[0];
    let row_bytes = 1024u64;
    src.take_calls();
    let mut buf = vec![0u8; 4096];
    // Unaligned 4 KiB read in the middle: rows 300..305 only.
    let off = start + 300 * row_bytes + 17;
    f.read_at(&src, off, &mut buf).unwrap();
    let calls = src.take_calls();
    let rows: u64 = calls.iter().map(|c| c.2 - c.1).sum();
    assert_eq!(calls, vec![(0, 300, 305)]);
    assert_eq!(rows, 5);
    let mut expect = Vec::new();
    for r in 300..305 {
        expect.extend(encode_all(src.row(0, r), FloatType::F16));
    }
    assert_eq!(&buf[..], &expect[17..17 + 4096]);

    // A read inside the header asks for nothing.
    f.read_at(&src, 0, &mut buf[..8]).unwrap();
    assert!(src.take_calls().is_empty());
}

#[test]
fn large_reads_run_in_bounded_row_runs() {
    let model = test_support::model(
        arch(),
        vec![td("big.weight", &[4096, 1024], SourceType::F32)],
    );
    let src = Mock::new(&model, 3);
    let f = safetensors_file(&model, Some(FloatType::F16)).unwrap();
    let (_, start, _) = f.tensor_ranges()[0];
    let mut buf = vec![0u8; 8 << 20];
    let n = f.read_at(&src, start, &mut buf).unwrap();
    assert_eq!(n, 8 << 20);
    let calls = src.take_calls();
    assert!(calls
        .iter()
        .all(|c| (c.2 - c.1) * 1024 * 4 <= SCRATCH_F32_BYTES));
    assert_eq!(calls.iter().map(|c| c.2 - c.1).sum::<u64>(), 4096);
    assert!(
        calls.len() as u64 <= (16 << 20) / SCRATCH_F32_BYTES,
        "{} runs",
        calls.len()
    );
    assert_eq!(
        &buf[..2048],
        encode_all(src.row(0, 0), FloatType::F16).as_slice()
    );
}

/// A stand-in for `GgufHeader` that records the metadata and tensor infos it was given,
/// so tests can check them directly (offsets aligned like the real one, a fake header
/// of aligned length). The real header is checked by the GGUF tests and end to end.
type Meta = Vec<(String, GgufValue)>;
type Infos = Vec<(String, Vec<u64>, GgmlType)>;
type Seen = Mutex<Option<(Meta, Infos)>>;

fn test_header(seen: &Seen) -> impl Fn(Meta, Infos, u64) -> Result<HeaderOut, String> + '_ {
    move |meta, tensors, align| {
        let mut entries = Vec::new();
        let mut pos = 0u64;
        for (_, ne, ty) in &tensors {
            let n: u64 = ne.iter().product::<u64>() * ty.block().1;
            entries.push((pos, n));
            pos = (pos + n).next_multiple_of(align);
        }
        let mut bytes = b"GGUF".to_vec();
        bytes.resize(3 * align as usize, 0);
        *seen.lock().unwrap() = Some((meta, tensors));
        Ok(HeaderOut {
            bytes,
            entries,
            data_size: pos,
        })
    }
}

#[test]
fn gguf_layout_names_order_types_and_permutation() {
    for tied in [false, true] {
        let model = test_model(tied);
        let src = Mock::new(&model, 4);
        let seen = Seen::default();
        let f = g::build(
            &model,
            &view::plan(&model, GgufView::Type(GgmlType::F16), &[]).unwrap(),
            &test_header(&seen),
        )
        .unwrap();
        let (meta, infos) = seen.lock().unwrap().take().unwrap();
        let names: Vec<&str> = infos.iter().map(|i| i.0.as_str()).collect();
        let mut expect = vec!["token_embd.weight".to_string()];
        for l in 0..2 {
            for s in [
                "attn_norm",
                "ffn_down",
                "ffn_gate",
                "ffn_up",
                "ffn_norm",
                "attn_k",
                "attn_output",
                "attn_q",
                "attn_v",
            ] {
                expect.push(format!("blk.{l}.{s}.weight"));
            }
        }
        expect.push("output_norm.weight".into());
        if !tied {
            expect.push("output.weight".into());
        }
        assert_eq!(names, expect);
        for (name, ne, ty) in &infos {
            let t = &model.tensors[model
                .tensor_index(&crate::model::names::gguf_to_hf("llama", name).unwrap())
                .unwrap()];
            let rev: Vec<u64> = t.shape.iter().rev().copied().collect();
            assert_eq!(ne, &rev);
            let want = if ne.len() == 1 {
                GgmlType::F32
            } else {
                GgmlType::F16
            };
            assert_eq!(*ty, want, "{name}");
        }
        let get = |k: &str| meta.iter().find(|(x, _)| x == k).map(|(_, v)| v.clone());
        assert_eq!(get("general.file_type"), Some(GgufValue::U32(1)));
        assert_eq!(get("llama.rope.dimension_count"), Some(GgufValue::U32(16)));
        assert_eq!(
            get("llama.attention.head_count_kv"),
            Some(GgufValue::U32(2))
        );

        let full = materialize(&f, &src);
        let ranges = f.tensor_ranges();
        assert_eq!(ranges.len(), infos.len());
        for (k, &(ti, s, e)) in ranges.iter().enumerate() {
            assert_eq!(s % 32, 0, "{}", infos[k].0);
            let t = &model.tensors[ti];
            let data = &full[s as usize..e as usize];
            let vals = &src.data[ti].0;
            if t.shape.len() == 1 {
                assert_eq!(data, encode_all(vals, FloatType::F32).as_slice());
                continue;
            }
            let (rows, cols) = (t.rows() as usize, t.cols() as usize);
            let heads = if t.name.ends_with("q_proj.weight") {
                Some(4)
            } else if t.name.ends_with("k_proj.weight") {
                Some(2)
            } else {
                None
            };
            // llama.cpp: w.reshape(n_head, 2, hd/2, cols).swapaxes(1, 2).reshape(rows, cols)
            let expect: Vec<f32> = match heads {
                None => vals.clone(),
                Some(h) => {
                    let hd = rows / h;
                    let mut out = Vec::with_capacity(vals.len());
                    for head in 0..h {
                        for i in 0..hd / 2 {
                            for j in 0..2 {
                                let r = head * hd + j * (hd / 2) + i;
                                out.extend_from_slice(&vals[r * cols..(r + 1) * cols]);
                            }
                        }
                    }
                    out
                }
            };
            assert_eq!(
                data,
                encode_all(&expect, FloatType::F16).as_slice(),
                "{}",
                t.name
            );
        }
        // Padding between tensors is zero.
        let mut covered = vec![false; full.len()];
        for &(_, s, e) in &ranges {
            covered[s as usize..e as usize]
                .iter_mut()
                .for_each(|c| *c = true);
        }
        assert!(full[96..]
            .iter()
            .zip(&covered[96..])
            .all(|(b, c)| *c || *b == 0));
        random_reads(&f, &src, &full, 11);
    }
}

#[test]
fn gguf_permuted_small_read_asks_only_for_its_source_rows() {
    let model = test_model(false);
    let src = Mock::new(&model, 5);
    let seen = Seen::default();
    let f = g::build(
        &model,
        &view::plan(&model, GgufView::Type(GgmlType::F32), &[]).unwrap(),
        &test_header(&seen),
    )
    .unwrap();
    let q = model
        .tensor_index("model.layers.1.self_attn.q_proj.weight")
        .unwrap();
    let (_, s, _) = f.tensor_ranges().into_iter().find(|r| r.0 == q).unwrap();
    // GGUF rows 17..19 of q (head 1 of 4, hd = 16) are HF rows 24 and 17: one from
    // each half of the head, and only those (reading the whole head decoded its blocks
    // again for the window after).
    let mut buf = vec![0u8; 2 * 256];
    src.take_calls();
    f.read_at(&src, s + 17 * 256, &mut buf).unwrap();
    assert_eq!(src.take_calls(), vec![(q, 17, 18), (q, 24, 25)]);
    let mut expect = encode_all(src.row(q, 16 + 8), FloatType::F32);
    expect.extend(encode_all(src.row(q, 16 + 1), FloatType::F32));
    assert_eq!(buf, expect);
}

#[test]
fn gguf_source_metadata_is_kept() {
    let mut model = test_model(true);
    model.gguf_meta = vec![
        (
            "general.architecture".into(),
            GgufValue::String("llama".into()),
        ),
        ("general.file_type".into(), GgufValue::U32(3)),
        ("general.alignment".into(), GgufValue::U32(64)),
        ("llama.block_count".into(), GgufValue::U32(2)),
        ("general.quantization_version".into(), GgufValue::U32(2)),
    ];
    let seen = Seen::default();
    g::build(
        &model,
        &view::plan(&model, GgufView::Type(GgmlType::BF16), &[]).unwrap(),
        &test_header(&seen),
    )
    .unwrap();
    let (meta, _) = seen.lock().unwrap().take().unwrap();
    assert_eq!(
        meta,
        vec![
            (
                "general.architecture".into(),
                GgufValue::String("llama".into())
            ),
            ("general.file_type".into(), GgufValue::U32(32)),
            ("llama.block_count".into(), GgufValue::U32(2)),
        ]
    );
}

fn hf_tokenizer_files() -> BTreeMap<String, Vec<u8>> {
    let mut vocab = serde_json::Map::new();
    let base = ["a", "b", "c", "Ġ", "ab", "Ġa", "abc", "1", "2"];
    for (i, t) in base.iter().enumerate() {
        vocab.insert(t.to_string(), serde_json::json!(i + 3));
    }
    let tj = serde_json::json!({
        "version": "1.0",
        "added_tokens": [
            {"id": 0, "content": "<|endoftext|>", "special": true},
            {"id": 1, "content": "<|im_start|>", "special": true},
            {"id": 2, "content": "<|im_end|>", "special": true},
            {"id": 12, "content": "<tool>", "special": false},
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]},
        "model": {"type": "BPE", "vocab": vocab, "merges": ["a b", ["ab", "c"], "Ġ a"]},
    });
    let tc = serde_json::json!({
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "add_bos_token": false,
        "chat_template": "{{ messages }}",
    });
    BTreeMap::from([
        (
            "tokenizer.json".to_string(),
            serde_json::to_vec(&tj).unwrap(),
        ),
        (
            "tokenizer_config.json".to_string(),
            serde_json::to_vec(&tc).unwrap(),
        ),
        (
            "config.json".to_string(),
            br#"{"_name_or_path": "org/Tiny-Model"}"#.to_vec(),
        ),
    ])
}

#[test]
fn hf_tokenizer_to_gguf_and_back() {
    let mut model = test_model(false);
    model.arch.vocab_size = 14;
    model.hf_files = hf_tokenizer_files();
    let seen = Seen::default();
    g::build(
        &model,
        &view::plan(&model, GgufView::Type(GgmlType::F16), &[]).unwrap(),
        &test_header(&seen),
    )
    .unwrap();
    let (meta, _) = seen.lock().unwrap().take().unwrap();
    let get = |k: &str| crate::gguf::meta_get(&meta, k).cloned();
    assert_eq!(
        get("general.name"),
        Some(GgufValue::String("Tiny-Model".into()))
    );
    assert_eq!(
        get("tokenizer.ggml.model"),
        Some(GgufValue::String("gpt2".into()))
    );
    assert_eq!(
        get("tokenizer.ggml.pre"),
        Some(GgufValue::String("smollm".into()))
    );
    let tokens = match get("tokenizer.ggml.tokens") {
        Some(GgufValue::Array(GgufArray::String(v))) => v,
        other => panic!("{other:?}"),
    };
    assert_eq!(tokens.len(), 14);
    assert_eq!(&tokens[0], "<|endoftext|>");
    assert_eq!(&tokens[5], "c");
    assert_eq!(&tokens[12], "<tool>");
    assert_eq!(&tokens[13], "[PAD13]");
    assert_eq!(
        get("tokenizer.ggml.token_type"),
        Some(GgufValue::Array(GgufArray::I32(vec![
            3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 4, 5
        ])))
    );
    assert_eq!(
        get("tokenizer.ggml.merges"),
        Some(GgufValue::Array(GgufArray::String(
            vec!["a b".to_string(), "ab c".into(), "Ġ a".into()].into()
        )))
    );
    assert_eq!(get("tokenizer.ggml.bos_token_id"), Some(GgufValue::U32(1)));
    assert_eq!(get("tokenizer.ggml.eos_token_id"), Some(GgufValue::U32(2)));
    assert_eq!(
        get("tokenizer.ggml.add_bos_token"),
        Some(GgufValue::Bool(false))
    );
    assert_eq!(
        get("tokenizer.chat_template"),
        Some(GgufValue::String("{{ messages }}".into()))
    );

    // Back: a GGUF-source model with that metadata derives HF files.
    let mut gm = test_model(true);
    gm.arch.vocab_size = 14;
    gm.gguf_meta = meta;
    let files = hf_metadata_files(&gm).unwrap();
    let names: Vec<&str> = files.iter().map(|f| f.0.as_str()).collect();
    assert_eq!(
        names,
        [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    let tj: serde_json::Value = serde_json::from_slice(&files[2].1).unwrap();
    assert_eq!(tj["model"]["vocab"]["abc"], 9);
    assert_eq!(tj["model"]["merges"][1], serde_json::json!(["ab", "c"]));
    assert_eq!(tj["pre_tokenizer"]["pretokenizers"][0]["type"], "Digits");
    assert_eq!(tj["added_tokens"].as_array().unwrap().len(), 4);
    assert_eq!(g::gguf_pre_tokenizer_name(&tj["pre_tokenizer"]), "smollm");
    let tc: serde_json::Value = serde_json::from_slice(&files[3].1).unwrap();
    assert_eq!(tc["bos_token"], "<|im_start|>");
    assert_eq!(tc["eos_token"], "<|im_end|>");
    let cfg: serde_json::Value = serde_json::from_slice(&files[0].1).unwrap();
    assert_eq!(cfg["architectures"][0], "LlamaForCausalLM");
    assert_eq!(cfg["rms_norm_eps"], serde_json::json!(1e-5));
    assert_eq!(cfg["tie_word_embeddings"], true);
    assert_eq!(cfg["torch_dtype"], "bfloat16");

    // A HF source returns its files verbatim.
    let verbatim = hf_metadata_files(&model).unwrap();
    assert_eq!(verbatim.len(), 3);
    assert_eq!(verbatim[0].0, "config.json");
}

#[test]
fn tokenizer_json_length_is_estimated_from_gguf_metadata() {
    // The router sets memory aside by this estimate before deriving and loading it.
    let n = 20_000;
    let tokens: Vec<String> = (0..n)
        .map(|i| format!("Ġw{}", i * 7919 % 100_003))
        .collect();
    let merges: Vec<String> = (1..n).map(|i| format!("Ġw {}", i * 31)).collect();
    let mut gm = test_model(true);
    gm.arch.vocab_size = n as u32;
    gm.gguf_meta = vec![
        (
            "tokenizer.ggml.model".into(),
            GgufValue::String("gpt2".into()),
        ),
        (
            "tokenizer.ggml.tokens".into(),
            GgufValue::Array(GgufArray::String(tokens.into())),
        ),
        (
            "tokenizer.ggml.merges".into(),
            GgufValue::Array(GgufArray::String(merges.into())),
        ),
    ];
    let files = hf_metadata_files(&gm).unwrap();
    let made = files
        .iter()
        .find(|f| f.0 == "tokenizer.json")
        .unwrap()
        .1
        .len() as f64;
    let estimate = crate::layout::tokenizer_json_len_estimate(&gm) as f64;
    assert!(
        (0.9..1.1).contains(&(estimate / made)),
        "{estimate} estimated, {made} made"
    );
    // A HF source's is its length; a HF source without one has none.
    let mut model = test_model(false);
    model.hf_files = hf_tokenizer_files();
    let len = model.hf_files["tokenizer.json"].len() as u64;
    assert_eq!(crate::layout::tokenizer_json_len_estimate(&model), len);
    model.hf_files.remove("tokenizer.json");
    assert_eq!(crate::layout::tokenizer_json_len_estimate(&model), 0);
}

#[test]
fn sentencepiece_tokenizer_is_refused() {
    let mut model = test_model(false);
    let tj = serde_json::json!({"model": {"type": "Unigram", "vocab": []}});
    model.hf_files = BTreeMap::from([(
        "tokenizer.json".to_string(),
        serde_json::to_vec(&tj).unwrap(),
    )]);
    let seen = Seen::default();
    let r = g::build(
        &model,
        &view::plan(&model, GgufView::Type(GgmlType::F16), &[]).unwrap(),
        &test_header(&seen),
    );
    match r {
        // No GGUF view then; the other views are served.
        Err(LayoutError::NoGguf(m)) => assert!(m.contains("byte-level BPE"), "{m}"),
        other => panic!("{:?}", other.map(|f| f.size)),
    }
}

#[test]
fn from_bytes_reads_back() {
    let f = VirtualFile::from_bytes("config.json", b"hello world".to_vec());
    let src = Mock {
        data: Vec::new(),
        calls: Mutex::new(Vec::new()),
    };
    let mut buf = [0u8; 5];
    assert_eq!(f.read_at(&src, 6, &mut buf).unwrap(), 5);
    assert_eq!(&buf, b"world");
    assert_eq!(f.read_at(&src, 11, &mut buf).unwrap(), 0);
    assert_eq!(f.read_at(&src, 9, &mut buf).unwrap(), 2);
    let empty = VirtualFile::from_bytes("e", Vec::new());
    assert_eq!(empty.read_at(&src, 0, &mut buf).unwrap(), 0);
    fn is_send_sync<T: Send + Sync + Clone>() {}
    is_send_sync::<VirtualFile>();
}

/// A model whose rows are multiples of 256 (K-quant blocks) and of 32, with rotary
/// permuted Q/K, tied embeddings and 1-D norms.
fn k_model(source: SourceType) -> ModelDesc {
    let arch = ArchConfig {
        n_layers: 1,
        hidden_size: 256,
        intermediate_size: 512,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
        vocab_size: 40,
        context_length: 2048,
        tie_word_embeddings: true,
        ..tiny_arch()
    };
    let p = "model.layers.0.";
    let tensors = vec![
        td("model.embed_tokens.weight", &[40, 256], source),
        td(&format!("{p}self_attn.q_proj.weight"), &[256, 256], source),
        td(&format!("{p}self_attn.k_proj.weight"), &[128, 256], source),
        td(&format!("{p}self_attn.v_proj.weight"), &[128, 256], source),
        td(&format!("{p}self_attn.o_proj.weight"), &[256, 256], source),
        td(&format!("{p}mlp.gate_proj.weight"), &[512, 256], source),
        td(&format!("{p}mlp.up_proj.weight"), &[512, 256], source),
        td(&format!("{p}mlp.down_proj.weight"), &[256, 512], source),
        td(
            &format!("{p}input_layernorm.weight"),
            &[256],
            SourceType::F32,
        ),
        td(
            &format!("{p}post_attention_layernorm.weight"),
            &[256],
            SourceType::F32,
        ),
        td("model.norm.weight", &[256], SourceType::F32),
    ];
    ModelDesc {
        arch,
        tensors,
        hf_files: BTreeMap::new(),
        gguf_meta: Vec::new(),
    }
}

/// Tensor `ti`'s rows in GGUF order (Q/K permuted), as the model serves them.
fn gguf_rows(model: &ModelDesc, src: &Mock, ti: usize) -> Vec<Vec<f32>> {
    let t = &model.tensors[ti];
    let heads = crate::model::names::rope_permute_heads(
        model.arch.gguf_arch.as_deref(),
        &t.name,
        model.arch.n_heads,
        model.arch.n_kv_heads,
    );
    (0..t.rows())
        .map(|g| {
            let s = match heads {
                Some(h) if t.rows() > 1 => crate::model::names::gguf_row_to_hf(g, t.rows(), h),
                _ => g,
            };
            src.row(ti, s).to_vec()
        })
        .collect()
}

/// Every byte of every tensor of a view, for random windows (1 byte to several rows,
/// straddling rows and tensors), equals the tensor's GGUF-order rows encoded whole in
/// the planned type: reads encode only what they overlap and still agree.
#[test]
fn quantized_views_match_whole_rows_encoded_for_any_window() {
    let model = k_model(SourceType::F16);
    let src = Mock::new(&model, 11);
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let types = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q6_K,
        GgmlType::Q5_K,
        GgmlType::Q5_1,
        GgmlType::Q5_0,
        GgmlType::Q4_K,
        GgmlType::Q4_1,
        GgmlType::Q4_0,
    ];
    for ty in types.into_iter().filter(|t| can_quantize(*t)) {
        let plan = view::plan(&model, GgufView::Type(ty), &[]).unwrap();
        for tv in &plan.tensors {
            let want = if model.tensors[tv.index].shape.len() < 2 {
                GgmlType::F32
            } else {
                ty
            };
            assert_eq!((tv.ty, tv.raw, tv.wanted), (want, false, None), "{ty:?}");
        }
        let f = gguf_file(&model, &plan).unwrap();
        // A load may hold its output plus the f32 rows it encodes.
        let (e, b) = ty.block();
        assert!(f.load_work_factor() * b >= b + 4 * e, "{ty:?}");
        for (ti, start, end) in f.tensor_ranges() {
            let tv = plan.tensors.iter().find(|tv| tv.index == ti).unwrap();
            let mut want = Vec::new();
            for row in gguf_rows(&model, &src, ti) {
                let mut b = vec![0u8; tv.ty.row_bytes(row.len() as u64).unwrap() as usize];
                quantize(tv.ty, &row, &mut b).unwrap();
                want.extend(b);
            }
            assert_eq!(want.len() as u64, end - start, "{ty:?} tensor {ti}");
            for _ in 0..40 {
                let a = rng.random_range(0..want.len());
                let n = rng.random_range(1..=(want.len() - a).min(3000));
                let mut buf = vec![0xAAu8; n];
                assert_eq!(f.read_at(&src, start + a as u64, &mut buf).unwrap(), n);
                assert!(buf == want[a..a + n], "{ty:?} tensor {ti} bytes {a}+{n}");
            }
        }
    }
}

/// A source holding ggml blocks: `read_rows` dequantizes them, `read_raw_rows` hands
/// them over as stored, the way a passthrough archive does.
struct RawMock {
    model: ModelDesc,
    rows: Vec<Vec<u8>>,
}

impl RawMock {
    fn new(model: ModelDesc, seed: u64) -> RawMock {
        let vals = Mock::new(&model, seed);
        let rows = model
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| match t.source {
                SourceType::Ggml(q) => {
                    let mut b = vec![0u8; (q.row_bytes(t.cols()).unwrap() * t.rows()) as usize];
                    quantize(q, &vals.data[i].0, &mut b).unwrap();
                    b
                }
                _ => Vec::new(),
            })
            .collect();
        RawMock { model, rows }
    }
}

impl RowSource for RawMock {
    fn read_rows(&self, tensor: usize, r0: u64, r1: u64, out: &mut [f32]) -> Result<(), ReadError> {
        let t = &self.model.tensors[tensor];
        let SourceType::Ggml(q) = t.source else {
            out.fill(0.5);
            return Ok(());
        };
        let rb = q.row_bytes(t.cols()).unwrap();
        let bytes = &self.rows[tensor][(r0 * rb) as usize..(r1 * rb) as usize];
        crate::gguf::quant::dequantize(q, bytes, out).unwrap();
        Ok(())
    }
    fn raw_format(&self, tensor: usize) -> Option<SourceType> {
        Some(self.model.tensors[tensor].source).filter(|s| matches!(s, SourceType::Ggml(_)))
    }
    fn read_raw_rows(
        &self,
        tensor: usize,
        r0: u64,
        r1: u64,
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        let SourceType::Ggml(q) = self.model.tensors[tensor].source else {
            return Err(ReadError::NotRaw(tensor.to_string()));
        };
        let rb = q.row_bytes(self.model.tensors[tensor].cols()).unwrap();
        out.copy_from_slice(&self.rows[tensor][(r0 * rb) as usize..(r1 * rb) as usize]);
        Ok(())
    }
}

/// `source` and `auto` serve stored ggml blocks as they are (rows re-permuted for Q/K,
/// blocks intact), 1-D tensors as F32, and say so in the plan.
#[test]
fn source_view_serves_stored_blocks_as_they_are() {
    let model = k_model(SourceType::Ggml(GgmlType::Q8_0));
    let src = RawMock::new(model.clone(), 3);
    let held: Vec<Held> = (0..model.tensors.len())
        .map(|i| match src.raw_format(i) {
            Some(f) => Held::Exact(f),
            None => Held::Lossy(None),
        })
        .collect();
    for view in [GgufView::Source, GgufView::Auto] {
        let plan = view::plan(&model, view, &held).unwrap();
        let f = gguf_file(&model, &plan).unwrap();
        for (ti, start, end) in f.tensor_ranges() {
            let t = &model.tensors[ti];
            let tv = plan.tensors.iter().find(|tv| tv.index == ti).unwrap();
            if t.shape.len() < 2 {
                assert_eq!((tv.ty, tv.raw), (GgmlType::F32, false));
                continue;
            }
            assert_eq!((tv.ty, tv.raw), (GgmlType::Q8_0, true), "{}", t.name);
            let rb = GgmlType::Q8_0.row_bytes(t.cols()).unwrap();
            let heads = crate::model::names::rope_permute_heads(
                Some("llama"),
                &t.name,
                model.arch.n_heads,
                model.arch.n_kv_heads,
            );
            let mut want = Vec::new();
            for g in 0..t.rows() {
                let s = heads.map_or(g, |h| crate::model::names::gguf_row_to_hf(g, t.rows(), h));
                want.extend_from_slice(&src.rows[ti][(s * rb) as usize..((s + 1) * rb) as usize]);
            }
            let mut got = vec![0u8; (end - start) as usize];
            f.read_at(&src, start, &mut got).unwrap();
            assert!(got == want, "{view} {}", t.name);
        }
    }
    // No stored blocks: source serves floats and says so.
    let floats = k_model(SourceType::F16);
    let held = vec![Held::Lossy(Some(0.05)); floats.tensors.len()];
    let plan = view::plan(&floats, GgufView::Source, &held).unwrap();
    assert!(plan.tensors.iter().all(|tv| !tv.raw));
    let notes = view::notes(&floats, &plan);
    assert!(
        notes.iter().any(|n| n.contains("no ggml blocks")),
        "{notes:?}"
    );
}

/// A type whose blocks do not divide a row falls back per tensor as llama-quantize
/// does (K → 32-block type, 32-block type → F16), with one note naming the tensor.
#[test]
fn views_fall_back_per_tensor_where_rows_do_not_fit() {
    let model = test_model(false); // rows of 64 and 96 values
    for (ty, to) in [
        (GgmlType::Q4_K, GgmlType::Q5_0),
        (GgmlType::Q5_K, GgmlType::Q5_1),
        (GgmlType::Q6_K, GgmlType::Q8_0),
    ] {
        if !can_quantize(ty) || !can_quantize(to) {
            continue;
        }
        let plan = view::plan(&model, GgufView::Type(ty), &[]).unwrap();
        let two_d: Vec<_> = plan
            .tensors
            .iter()
            .filter(|tv| model.tensors[tv.index].shape.len() >= 2)
            .collect();
        assert!(two_d.iter().all(|tv| tv.ty == to && tv.wanted == Some(ty)));
        let notes = view::notes(&model, &plan);
        assert_eq!(notes.len(), two_d.len());
        assert!(notes[0].contains(&two_d[0].gguf_name), "{}", notes[0]);
        gguf_file(&model, &plan).unwrap();
    }
    assert_eq!(fallback(GgmlType::Q8_0, 48), GgmlType::F16);
    assert_eq!(fallback(GgmlType::Q4_K, 48), GgmlType::F16);
    assert!(GgufView::parse("q4_k_x")
        .unwrap_err()
        .contains("valid: auto, source"));
}

/// Auto serves a lossy tensor from the llama-quantize mix whose main type's error is at
/// most half the archive's (Q5_K_M near NDSQ's 9 %, Q8_0 for 1-2 % and for any archive
/// less precise than Q8_0, F16 below), unknown
/// errors as Q8_0, stored blocks raw, and notes no fallbacks of its own.
#[test]
fn auto_picks_the_mix_by_the_archive_error() {
    let model = k_model(SourceType::F16);
    let q = |err: Option<f64>| {
        let held = vec![Held::Lossy(err); model.tensors.len()];
        let plan = view::plan(&model, GgufView::Auto, &held).unwrap();
        assert!(view::notes(&model, &plan).is_empty());
        let of = |n: &str| plan.tensors.iter().find(|t| t.gguf_name == n).unwrap().ty;
        (
            of("blk.0.attn_q.weight"),
            of("blk.0.ffn_down.weight"),
            of("blk.0.attn_norm.weight"),
        )
    };
    assert_eq!(
        q(Some(0.09)),
        (GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::F32)
    );
    assert_eq!(q(Some(0.05)).0, GgmlType::Q6_K);
    assert_eq!(q(Some(0.015)).0, GgmlType::Q8_0);
    assert_eq!(q(None).0, GgmlType::Q8_0);
    // Int8 rows (about 0.85 %): less precise than Q8_0 itself, so Q8_0, not F16.
    assert_eq!(q(Some(0.0085)).0, GgmlType::Q8_0);
    assert_eq!(q(Some(0.004)).0, GgmlType::F16);
    assert_eq!(q(Some(0.001)).0, GgmlType::F16);
    assert_eq!(q(Some(0.3)).0, GgmlType::Q4_K);
}

/// Auto serves NDSQ's scalar grids (groups of a multiple of 32) as the ggml type of
/// that grid, whatever the error; other groups go by the error as any lossy tensor.
#[test]
fn auto_serves_scalar_grids_as_their_ggml_type() {
    use crate::codec::SqParams;
    let model = k_model(SourceType::F16);
    let q = |bits, group, err| {
        let held = vec![Held::Grid(SqParams { bits, group }, err); model.tensors.len()];
        let plan = view::plan(&model, GgufView::Auto, &held).unwrap();
        let of = |n: &str| plan.tensors.iter().find(|t| t.gguf_name == n).unwrap().ty;
        (of("blk.0.attn_q.weight"), of("blk.0.attn_norm.weight"))
    };
    assert_eq!(q(4, 32, Some(1e-5)), (GgmlType::Q4_1, GgmlType::F32));
    assert_eq!(q(3, 64, Some(0.1)).0, GgmlType::Q4_1);
    assert_eq!(q(5, 32, None).0, GgmlType::Q5_1);
    // Longer groups do not line up with 32-value blocks.
    assert_eq!(q(5, 192, None).0, GgmlType::Q8_0);
    assert_eq!(q(4, 64, None).0, GgmlType::Q8_0);
    assert_eq!(q(6, 32, Some(0.01)).0, GgmlType::Q8_0);
    assert_eq!(q(8, 32, Some(0.001)).0, GgmlType::Q8_0);
    assert_eq!(q(4, 16, Some(0.09)).0, GgmlType::Q5_K);
    assert_eq!(q(4, 48, None).0, GgmlType::Q8_0);
}

#[test]
fn fingerprints_follow_what_a_file_is_made_of() {
    let model = k_model(SourceType::F16);
    let file = |ty| {
        gguf_file(
            &model,
            &view::plan(&model, GgufView::Type(ty), &[]).unwrap(),
        )
        .unwrap()
    };
    // Deterministic: the same model and view make the same fingerprint.
    assert_eq!(
        file(GgmlType::Q8_0).fingerprint(),
        file(GgmlType::Q8_0).fingerprint()
    );
    // Another type for the tensors (here also another size), another fingerprint;
    // F16 and BF16 have the same sizes and header layout but not the same bytes.
    let prints: Vec<u64> = [GgmlType::Q8_0, GgmlType::F16, GgmlType::BF16]
        .into_iter()
        .map(|t| file(t).fingerprint())
        .collect();
    assert!(prints[0] != prints[1] && prints[1] != prints[2] && prints[0] != prints[2]);
    assert_eq!(file(GgmlType::F16).size, file(GgmlType::BF16).size);
    // The safetensors view has its own.
    let st = safetensors_file(&model, Some(FloatType::F16)).unwrap();
    assert!(!prints.contains(&st.fingerprint()));
    // A file of literal bytes is fingerprinted by them.
    let a = VirtualFile::from_bytes("a", b"one".to_vec());
    assert_ne!(
        a.fingerprint(),
        VirtualFile::from_bytes("a", b"two".to_vec()).fingerprint()
    );
}

/// Serves an i64 tensor's stored bytes and an f32 tensor's values, as an archive does
/// for a plain-typed passthrough.
struct PlainMock {
    ids: Vec<i64>,
    weights: Vec<f32>,
}

impl RowSource for PlainMock {
    fn read_rows(&self, tensor: usize, r0: u64, r1: u64, out: &mut [f32]) -> Result<(), ReadError> {
        assert_eq!(
            tensor, 1,
            "a plain tensor is never read as f32 by the views"
        );
        out.copy_from_slice(&self.weights[(r0 * 4) as usize..(r1 * 4) as usize]);
        Ok(())
    }
    fn raw_format(&self, tensor: usize) -> Option<SourceType> {
        (tensor == 0).then_some(SourceType::Plain(crate::model::PlainType::I64))
    }
    fn read_raw_rows(
        &self,
        tensor: usize,
        r0: u64,
        r1: u64,
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        assert_eq!((tensor, r0, r1), (0, 0, 1));
        for (o, v) in out.chunks_exact_mut(8).zip(&self.ids) {
            o.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }
}

#[test]
fn plain_tensors_are_served_as_their_bytes_whatever_the_dtype() {
    use crate::model::PlainType;
    let model = ModelDesc {
        arch: ArchConfig {
            model_type: "bert".into(),
            gguf_arch: None,
            ..tiny_arch()
        },
        tensors: vec![
            td(
                "embeddings.position_ids",
                &[1, 5],
                SourceType::Plain(PlainType::I64),
            ),
            td("w", &[3, 4], SourceType::F32),
        ],
        hf_files: BTreeMap::new(),
        gguf_meta: Vec::new(),
    };
    let src = PlainMock {
        ids: vec![0, 1, -2, i64::MAX, i64::MIN],
        weights: (0..12).map(|i| i as f32 * 0.5).collect(),
    };
    for dtype in [None, Some(FloatType::F16), Some(FloatType::BF16)] {
        let f = safetensors_file(&model, dtype).unwrap();
        let mut buf = vec![0u8; f.size as usize];
        assert_eq!(f.read_at(&src, 0, &mut buf).unwrap(), buf.len());
        let st = ::safetensors::SafeTensors::deserialize(&buf).unwrap();
        let ids = st.tensor("embeddings.position_ids").unwrap();
        assert_eq!(ids.dtype(), ::safetensors::Dtype::I64);
        assert_eq!(ids.shape(), &[1, 5]);
        let want: Vec<u8> = src.ids.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(ids.data(), &want[..]);
        let w = st.tensor("w").unwrap();
        let ft = dtype.unwrap_or(FloatType::F32);
        assert_eq!(w.data().len(), 12 * ft.size());
    }
    // No GGUF names for this architecture: the plan says so in one line.
    let held = vec![Held::Exact(SourceType::F32); 2];
    match gguf_plan(&model, GgufView::Auto, &held) {
        Err(LayoutError::NoGguf(why)) => {
            assert!(why.contains("\"bert\"") && !why.contains('\n'), "{why}")
        }
        other => panic!("expected NoGguf, got {other:?}"),
    }
}

#[test]
fn safetensors_shards_split_in_model_order_within_the_size() {
    // Five 2-row f32 tensors of 4, 4, 10, 2 and 2 columns: 32, 32, 80, 16, 16 bytes.
    let widths = [4u64, 4, 10, 2, 2];
    let model = test_support::model(
        tiny_arch(),
        widths
            .iter()
            .enumerate()
            .map(|(i, &c)| td(&format!("t{i}"), &[2, c], SourceType::F32))
            .collect(),
    );
    let (files, index) = safetensors_view(&model, None, 64).unwrap();
    let names: Vec<&str> = files.iter().map(|f| f.name.as_str()).collect();
    // 32+32 fill the first; 80 is larger than the bound and goes alone; 16+16.
    assert_eq!(
        names,
        [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors"
        ]
    );
    let index: serde_json::Value = serde_json::from_slice(&index.unwrap()).unwrap();
    assert_eq!(index["metadata"]["total_size"], 176);
    let map = index["weight_map"].as_object().unwrap();
    let shard_of = |t: &str| map[t].as_str().unwrap().to_string();
    assert_eq!(shard_of("t0"), names[0]);
    assert_eq!(shard_of("t1"), names[0]);
    assert_eq!(shard_of("t2"), names[1]);
    assert_eq!(shard_of("t3"), names[2]);
    assert_eq!(shard_of("t4"), names[2]);
    // At or under the bound: one model.safetensors, no index.
    let (files, index) = safetensors_view(&model, None, 176).unwrap();
    assert_eq!(files.len(), 1);
    assert_eq!(files[0].name, "model.safetensors");
    assert!(index.is_none());
}

#[test]
fn gemma2_norms_are_served_plus_one_and_named_for_gemma() {
    // test_model's tensors under Gemma 2: its post-attention norm is its own tensor
    // there, and every norm weight is served as 1 + w (the other tensors as they are).
    let mut model = test_model(true);
    model.arch.model_type = "gemma2".into();
    model.arch.gguf_arch = Some("gemma2".into());
    model
        .tensors
        .retain(|t| !t.name.ends_with("rotary_emb.inv_freq"));
    let src = Mock::new(&model, 9);
    let held = vec![Held::Exact(SourceType::F32); model.tensors.len()];
    let plan = gguf_plan(&model, GgufView::Type(GgmlType::F32), &held).unwrap();
    let f = gguf_file(&model, &plan).unwrap();
    let bytes = materialize(&f, &src);
    let r = crate::gguf::reader::parse_header(&bytes).unwrap();
    let by_name = |n: &str| r.tensors.iter().find(|t| t.name == n).unwrap();
    assert!(r
        .tensors
        .iter()
        .any(|t| t.name == "blk.0.post_attention_norm.weight"));
    assert!(!r.tensors.iter().any(|t| t.name == "blk.0.ffn_norm.weight"));
    for (hf, gguf, add) in [
        (
            "model.layers.1.input_layernorm.weight",
            "blk.1.attn_norm.weight",
            1.0,
        ),
        ("model.norm.weight", "output_norm.weight", 1.0),
        (
            "model.layers.0.self_attn.k_proj.weight",
            "blk.0.attn_k.weight",
            0.0,
        ),
    ] {
        let i = model.tensor_index(hf).unwrap();
        let t = by_name(gguf);
        let at = (r.data_offset + t.offset) as usize;
        let got: Vec<f32> = bytes[at..at + src.data[i].0.len() * 4]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let want: Vec<f32> = src.data[i].0.iter().map(|v| v + add).collect();
        assert_eq!(got, want, "{hf}");
    }
}

/// GPT-2: its Conv1D weights (`[in, out]`) are served transposed, as llama.cpp's
/// converter writes them: the header gives `ne = [in, out]` and row `r` of the data is
/// column `r` of the stored tensor, for any window; the rest is served as stored.
#[test]
fn gpt2_conv1d_weights_are_served_transposed_for_any_window() {
    let arch = ArchConfig {
        model_type: "gpt2".into(),
        gguf_arch: Some("gpt2".into()),
        n_layers: 1,
        hidden_size: 64,
        intermediate_size: 256,
        n_heads: 2,
        n_kv_heads: 2,
        head_dim: 32,
        vocab_size: 40,
        context_length: 16,
        tie_word_embeddings: true,
        ..tiny_arch()
    };
    let (f32_, f16_) = (SourceType::F32, SourceType::F16);
    let tensors = vec![
        td("transformer.wte.weight", &[40, 64], f16_),
        td("transformer.wpe.weight", &[16, 64], f16_),
        td("transformer.h.0.ln_1.weight", &[64], f32_),
        td("transformer.h.0.attn.c_attn.weight", &[64, 192], f16_),
        td("transformer.h.0.attn.c_attn.bias", &[192], f32_),
        td("transformer.h.0.attn.c_proj.weight", &[64, 64], f16_),
        td("transformer.h.0.mlp.c_fc.weight", &[64, 256], f16_),
        td("transformer.h.0.mlp.c_proj.weight", &[256, 64], f16_),
        td("transformer.ln_f.weight", &[64], f32_),
    ];
    let model = ModelDesc {
        arch,
        tensors,
        hf_files: BTreeMap::new(),
        gguf_meta: Vec::new(),
    };
    // A matrix larger than a read may hold whole is refused in one line.
    let mut big = model.clone();
    big.tensors[6].shape = vec![8192, 8200];
    let plan = view::plan(&big, GgufView::Type(GgmlType::F16), &[]).unwrap();
    let e = gguf_file(&big, &plan).unwrap_err().to_string();
    assert!(
        e.contains("c_fc.weight: 8200x8192 is too large to serve transposed"),
        "{e}"
    );
    let src = Mock::new(&model, 3);
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for ty in [GgmlType::F32, GgmlType::Q8_0] {
        let plan = view::plan(&model, GgufView::Type(ty), &[]).unwrap();
        let f = gguf_file(&model, &plan).unwrap();
        let mut bytes = vec![0u8; f.size as usize];
        f.read_at(&src, 0, &mut bytes).unwrap();
        let h = crate::gguf::reader::parse_header(&bytes).unwrap();
        let names: Vec<&str> = h.tensors.iter().map(|t| t.name.as_str()).collect();
        let mut first = names[..2].to_vec();
        first.sort();
        assert_eq!(first, ["position_embd.weight", "token_embd.weight"]);
        assert_eq!(names.last(), Some(&"output_norm.weight"));
        for (ti, start, end) in f.tensor_ranges() {
            let t = &model.tensors[ti];
            let gname = crate::model::names::hf_to_gguf_in("gpt2", &t.name).unwrap();
            let info = h.tensors.iter().find(|i| i.name == gname).unwrap();
            let tr = gname.ends_with("attn_qkv.weight")
                || gname.ends_with("attn_output.weight")
                || gname.ends_with("ffn_up.weight")
                || gname.ends_with("ffn_down.weight");
            let served_rows: Vec<Vec<f32>> = if tr {
                assert_eq!(info.ne, t.shape, "{gname}");
                (0..t.cols())
                    .map(|c| (0..t.rows()).map(|r| src.row(ti, r)[c as usize]).collect())
                    .collect()
            } else {
                assert_eq!(info.ne, t.shape.iter().rev().copied().collect::<Vec<_>>());
                (0..t.rows()).map(|r| src.row(ti, r).to_vec()).collect()
            };
            // Norms, biases and positions in F32 (ggml adds position rows to F32).
            let want_ty = if t.shape.len() < 2 || gname == "position_embd.weight" {
                GgmlType::F32
            } else {
                ty
            };
            assert_eq!(info.ty, want_ty, "{gname}");
            let mut want = Vec::new();
            for row in served_rows {
                let mut b = vec![0u8; want_ty.row_bytes(row.len() as u64).unwrap() as usize];
                quantize(want_ty, &row, &mut b).unwrap();
                want.extend(b);
            }
            assert_eq!(want.len() as u64, end - start, "{gname}");
            assert!(
                bytes[start as usize..end as usize] == want[..],
                "{gname} {ty:?}"
            );
            for _ in 0..30 {
                let a = rng.random_range(0..want.len());
                let n = rng.random_range(1..=(want.len() - a).min(2000));
                let mut buf = vec![0xAAu8; n];
                assert_eq!(f.read_at(&src, start + a as u64, &mut buf).unwrap(), n);
                assert!(buf == want[a..a + n], "{gname} {ty:?} bytes {a}+{n}");
            }
        }
    }
}

/// A LongRoPE Phi-3 whose factor lists do not fit its rotary dimensions gets no GGUF
/// view, said in one line (llama.cpp's converter refuses it too); fitting ones become
/// two F32 tensors at the end of the file.
#[test]
fn phi3_longrope_factors_are_checked_and_made_tensors() {
    let mut model = k_model(SourceType::F16);
    model.arch.model_type = "phi3".into();
    model.arch.gguf_arch = Some("phi3".into());
    let config = |n: usize| {
        let f: Vec<f64> = (0..n).map(|i| 1.0 + i as f64 / 8.0).collect();
        serde_json::to_vec(&serde_json::json!({
            "max_position_embeddings": 2048, "original_max_position_embeddings": 512,
            "rope_scaling": {"type": "longrope", "long_factor": f, "short_factor": f}}))
        .unwrap()
    };
    // 4 heads of 64: 32 factors.
    model.hf_files.insert("config.json".into(), config(31));
    let plan = view::plan(&model, GgufView::Type(GgmlType::F16), &[]).unwrap();
    let e = gguf_file(&model, &plan).unwrap_err();
    assert!(matches!(e, LayoutError::NoGguf(_)), "{e:?}");
    assert!(
        e.to_string().contains("have 31 and 31 values, not 32"),
        "{e}"
    );
    model.hf_files.insert("config.json".into(), config(32));
    let f = gguf_file(&model, &plan).unwrap();
    let mut bytes = vec![0u8; f.size as usize];
    f.read_at(&Mock::new(&model, 1), 0, &mut bytes).unwrap();
    let h = crate::gguf::reader::parse_header(&bytes).unwrap();
    let t = h
        .tensors
        .iter()
        .find(|t| t.name == "rope_factors_short.weight")
        .unwrap();
    assert_eq!((t.ne.clone(), t.ty), (vec![32], GgmlType::F32));
    let at = (h.data_offset + t.offset) as usize;
    let got: Vec<f32> = bytes[at..at + 128]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(got[9], 1.0 + 9.0 / 8.0);
}

/// Mixtral: a layer's experts are one 3-D GGUF tensor, `ne = [cols, rows, n_expert]`,
/// expert `e`'s rows at index `e`, in expert order whatever the archive's order; the
/// router is F32 in a quantized view; a stack missing an expert is refused in one line;
/// each expert's tensors are found by layer and number.
#[test]
fn moe_experts_are_stacked_in_expert_order() {
    let mut model = test_model(true);
    model.arch.model_type = "mixtral".into();
    model
        .tensors
        .retain(|t| !t.name.contains("mlp.") && !t.name.ends_with("rotary_emb.inv_freq"));
    let bf = SourceType::BF16;
    for l in 0..2 {
        let p = format!("model.layers.{l}.block_sparse_moe.");
        model
            .tensors
            .push(td(&format!("{p}gate.weight"), &[3, 64], bf));
        // Experts 2, 0, 1: the stack orders them.
        for e in [2, 0, 1] {
            model
                .tensors
                .push(td(&format!("{p}experts.{e}.w1.weight"), &[96, 64], bf));
            model
                .tensors
                .push(td(&format!("{p}experts.{e}.w2.weight"), &[64, 96], bf));
            model
                .tensors
                .push(td(&format!("{p}experts.{e}.w3.weight"), &[96, 64], bf));
        }
    }
    let src = Mock::new(&model, 11);
    let held = vec![Held::Exact(SourceType::F32); model.tensors.len()];
    let plan = gguf_plan(&model, GgufView::Type(GgmlType::F32), &held).unwrap();
    let f = gguf_file(&model, &plan).unwrap();
    let bytes = materialize(&f, &src);
    let r = crate::gguf::reader::parse_header(&bytes).unwrap();
    assert!(!r.tensors.iter().any(|t| t.name.contains("ffn_gate.")));
    for l in 0..2 {
        for (w, g, ne) in [
            ("w1", "ffn_gate_exps", [64, 96, 3]),
            ("w2", "ffn_down_exps", [96, 64, 3]),
            ("w3", "ffn_up_exps", [64, 96, 3]),
        ] {
            let t = r
                .tensors
                .iter()
                .find(|t| t.name == format!("blk.{l}.{g}.weight"))
                .unwrap();
            assert_eq!(t.ne, ne, "{}", t.name);
            let per = 96 * 64 * 4;
            for e in 0..3 {
                let hf = format!("model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight");
                let i = model.tensor_index(&hf).unwrap();
                let at = (r.data_offset + t.offset) as usize + e * per;
                let got: Vec<f32> = bytes[at..at + per]
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                assert_eq!(got, src.data[i].0, "{hf}");
            }
        }
    }
    random_reads(&f, &src, &bytes, 5);
    // A quantized view keeps the router in F32 and quantizes the stacks as one tensor.
    let plan = gguf_plan(&model, GgufView::Type(GgmlType::Q8_0), &held).unwrap();
    let ty = |n: &str| plan.tensors.iter().find(|tv| tv.gguf_name == n).unwrap();
    assert_eq!(ty("blk.0.ffn_gate_inp.weight").ty, GgmlType::F32);
    let stack = ty("blk.1.ffn_down_exps.weight");
    assert_eq!((stack.ty, stack.parts.len()), (GgmlType::Q8_0, 3));
    // `inspect`'s view of them: 2 layers of 3 experts, each its three matrices.
    let x = super::ExpertTensors::of(&model);
    assert_eq!((x.tensors.len(), x.per_token), (18, None));
    let per = x.per_expert(|i| model.tensors[i].numel());
    let keys: Vec<(u32, u32)> = per.iter().map(|(k, _)| *k).collect();
    assert_eq!(keys, [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]);
    assert!(per.iter().all(|(_, n)| *n == 3 * 96 * 64));
    // Without expert 1 of layer 0's w2, no GGUF view, in one line.
    model
        .tensors
        .retain(|t| t.name != "model.layers.0.block_sparse_moe.experts.1.w2.weight");
    let held = vec![Held::Exact(SourceType::F32); model.tensors.len()];
    let e = gguf_plan(&model, GgufView::Type(GgmlType::F32), &held).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("blk.0.ffn_down_exps.weight") && !msg.contains('\n'),
        "{msg}"
    );
}

#[test]
fn permuted_windows_read_one_run_per_half_they_touch() {
    // 2 heads of 8 rows (halves of 4): GGUF row 2i of a head is its row i, 2i + 1 is
    // row 4 + i.
    assert_eq!(super::read::source_runs(0..16, 16, 2), vec![(0, 16)]);
    assert_eq!(super::read::source_runs(0..8, 16, 2), vec![(0, 8)]);
    assert_eq!(super::read::source_runs(0..3, 16, 2), vec![(0, 2), (4, 5)]);
    // Rows 5..8 of head 0 are its rows 6, 3, 7; rows 8..11 are head 1's 8, 12, 9.
    assert_eq!(
        super::read::source_runs(5..11, 16, 2),
        vec![(3, 4), (6, 10), (12, 13)]
    );
}
