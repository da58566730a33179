//! Hostile model directories: truncated or lying `config.json`, `armt_config.json`,
//! `model.safetensors` (and its shard index) and `tokenizer.json`, built from the real fixtures
//! (tests/fixtures/{huginn,llada,armt,refusion}) and loaded the way the server loads them
//! (`wavefront_schemes::load_model`: the family from the config, the config parsed and
//! validated, the weights mapped and every tensor read). Every case must fail with an error that
//! names the file and the field or tensor to blame; none may panic (each load runs under
//! `catch_unwind`, a panic fails the test with its message) and none may allocate what the files
//! claim: the lying sizes below would need terabytes, so an attempt would abort the whole binary.
//!
//! The property tests run 32 cases each; `PROPTEST_CASES=N` runs N (a long fuzzing run).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Device};
use proptest::prelude::*;
use serde_json::{json, Value};
use wavefront_models::{
    Armt, ArmtConfig, DiffusionGemma, DiffusionGemmaConfig, Huginn, HuginnConfig, Llada,
    LladaConfig, ModelError, ModelFamily, ModelFiles, Qwen3, Qwen3Config,
};

const FAMILIES: [&str; 4] = ["huginn", "llada", "armt", "refusion"];
/// The fixture files a model directory is made of (goldens and READMEs are left behind).
const MODEL_FILES: [&str; 6] = [
    "config.json",
    "armt_config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
];
const CONFIG: &str = "config.json";
const WEIGHTS: &str = "model.safetensors";
const TOKENIZER: &str = "tokenizer.json";

/// A copy of a fixture's model files in a fresh directory under the system temp dir, removed
/// on drop.
struct ModelDir(PathBuf);

impl ModelDir {
    fn copy(family: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "wavefront-hostile-{}-{}-{family}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create temp model dir");
        let src = wavefront_models::device::test_fixture(family);
        for name in MODEL_FILES {
            let from = src.join(name);
            if from.is_file() {
                std::fs::copy(&from, dir.join(name)).expect("copy fixture file");
            }
        }
        Self(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.path(name)).expect("read model file")
    }

    fn write(&self, name: &str, bytes: impl AsRef<[u8]>) {
        std::fs::write(self.path(name), bytes).expect("write model file");
    }

    fn remove(&self, name: &str) {
        std::fs::remove_file(self.path(name)).expect("remove model file");
    }

    fn json(&self, name: &str) -> Value {
        serde_json::from_slice(&self.read(name)).expect("fixture JSON")
    }

    fn write_json(&self, name: &str, v: &Value) {
        self.write(name, serde_json::to_vec_pretty(v).expect("JSON"));
    }
}

impl Drop for ModelDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What `wavefront_schemes::load_model` does with a directory before its engine runs: the
/// family from the config, the family's config parsed and validated, the weights mapped and the
/// model built from them (float32 on the CPU, as by default).
fn load_model(dir: &Path) -> Result<(), ModelError> {
    let files = ModelFiles::from_dir(dir)?;
    let family = files.family()?;
    let cpu = Device::Cpu;
    match family {
        ModelFamily::RecurrentDepth => {
            let cfg = HuginnConfig::from_json(files.config_json())?;
            Huginn::load(files.var_builder(DType::F32, &cpu)?, cfg)?;
        }
        ModelFamily::MaskedDiffusion => {
            let cfg = LladaConfig::from_json(files.config_json())?;
            Llada::load(files.var_builder(DType::F32, &cpu)?, cfg)?;
        }
        ModelFamily::SlotDiffusion => {
            let cfg = Qwen3Config::from_json(files.config_json())?;
            Qwen3::load(files.var_builder(DType::F32, &cpu)?, cfg)?;
        }
        ModelFamily::RecurrentMemory => {
            // As `wavefront_schemes::recurrent_memory::config`.
            let armt = files.armt_config_json().ok_or_else(|| ModelError::Config {
                key: wavefront_models::files::ARMT_CONFIG.into(),
                reason: "an ARMT directory needs its armt_config.json".into(),
            })?;
            let cfg = ArmtConfig::from_json(files.config_json(), armt)?;
            Armt::load(files.var_builder(DType::F32, &cpu)?, cfg)?;
        }
        ModelFamily::UniformDiffusion => {
            let cfg = DiffusionGemmaConfig::from_json(files.config_json())?;
            DiffusionGemma::load(files.var_builder(DType::F32, &cpu)?, cfg)?;
        }
        other => {
            return Err(ModelError::Unsupported(format!(
                "family {other:?} is not served"
            )))
        }
    }
    Ok(())
}

/// Runs `f`, turning a panic into a failure that quotes it.
fn no_panic<T>(what: &str, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "non-string panic payload".into());
            panic!("{what}: the load panicked instead of returning an error: {msg}")
        }
    }
}

/// Loads `dir` without panicking; the error's message, or `None` if it loaded.
fn try_load(what: &str, dir: &ModelDir) -> Option<String> {
    no_panic(what, || load_model(&dir.0)).err().map(|e| {
        let msg = e.to_string();
        assert!(!msg.trim().is_empty(), "{what}: empty error message");
        msg
    })
}

/// Loads `dir`, which must fail with a message naming every one of `needles`.
fn expect_err(what: &str, dir: &ModelDir, needles: &[&str]) -> String {
    let msg = try_load(what, dir).unwrap_or_else(|| panic!("{what}: loaded without an error"));
    for n in needles {
        assert!(
            msg.contains(n),
            "{what}: the error does not name `{n}`: {msg}"
        );
    }
    msg
}

/// Every numeric key of a JSON object (one level of nesting, as `init_values.std`), as paths.
fn numeric_keys(v: &Value) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    if let Value::Object(m) = v {
        for (k, x) in m {
            match x {
                Value::Number(_) => out.push(vec![k.clone()]),
                Value::Object(inner) => {
                    for (k2, x2) in inner {
                        if x2.is_number() {
                            out.push(vec![k.clone(), k2.clone()]);
                        }
                    }
                }
                _ => {}
            }
        }
    }
    out
}

fn set_path(v: &mut Value, path: &[String], x: Value) {
    let mut cur = v;
    for k in &path[..path.len() - 1] {
        cur = &mut cur[k.as_str()];
    }
    cur[path[path.len() - 1].as_str()] = x;
}

/// The dimension keys of each family's config.json (read as sizes), present in the fixture or
/// not.
fn dimension_keys(family: &str) -> &'static [&'static str] {
    match family {
        "huginn" => &[
            "n_embd",
            "n_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "padded_vocab_size",
            "n_layers_in_prelude",
            "n_layers_in_recurrent_block",
            "n_layers_in_coda",
            "block_size",
            "mean_recurrence",
        ],
        "llada" => &[
            "d_model",
            "n_heads",
            "n_kv_heads",
            "n_layers",
            "mlp_hidden_size",
            "mlp_ratio",
            "vocab_size",
            "embedding_size",
            "max_sequence_length",
            "block_group_size",
        ],
        _ => &[
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "num_hidden_layers",
            "max_position_embeddings",
        ],
    }
}

/// The settings of `armt_config.json` read as sizes.
const ARMT_KEYS: [&str; 3] = ["segment_size", "num_mem_tokens", "d_mem"];

/// Values no real model has; the positive ones would need terabytes of RoPE table, caches or
/// weights if taken at their word.
fn huge_and_bad_values() -> Vec<Value> {
    vec![
        json!(1u64 << 40),
        json!(1u64 << 32),
        json!(u64::MAX),
        json!(usize::MAX / 2 + 1),
        json!(0),
        json!(-1),
        json!(i64::MIN),
        json!(1e300),
        json!(64.5),
        json!("64"),
        json!(null),
        json!(true),
        json!([64]),
        json!({"value": 64}),
    ]
}

/// The fixtures load as they are (so a failure below is the corruption's).
#[test]
fn pristine_fixtures_load() {
    for family in FAMILIES {
        let dir = ModelDir::copy(family);
        if let Some(e) = try_load(family, &dir) {
            panic!("{family}: the unmodified fixture does not load: {e}");
        }
    }
}

#[test]
fn huge_zero_negative_and_mistyped_dimensions_are_refused() {
    for family in FAMILIES {
        for key in dimension_keys(family) {
            for value in huge_and_bad_values() {
                // `null` is a valid "absent" for optional keys; 0 is fine for the coda depth.
                let optional = value.is_null();
                let dir = ModelDir::copy(family);
                let mut cfg = dir.json(CONFIG);
                cfg[*key] = value.clone();
                dir.write_json(CONFIG, &cfg);
                let what = format!("{family}: config.json {key} = {value}");
                match try_load(&what, &dir) {
                    Some(msg) => assert!(
                        msg.contains(key) || msg.contains(CONFIG),
                        "{what}: the error names neither the key nor config.json: {msg}"
                    ),
                    None => assert!(
                        optional || (value == json!(0) && *key == "n_layers_in_coda"),
                        "{what}: loaded"
                    ),
                }
            }
        }
    }
    for key in ARMT_KEYS {
        for value in huge_and_bad_values() {
            let dir = ModelDir::copy("armt");
            let mut cfg = dir.json("armt_config.json");
            cfg[key] = value.clone();
            dir.write_json("armt_config.json", &cfg);
            let what = format!("armt: armt_config.json {key} = {value}");
            expect_err(&what, &dir, &[key]);
        }
    }
}

/// DiffusionGemma's sizes live in `text_config` (and `canvas_length` at the top): each one huge,
/// zero, negative or mistyped is refused naming it or config.json, never a panic or an
/// allocation taken at its word.
#[test]
fn diffusion_gemma_text_config_sizes_are_refused() {
    let keys = [
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts",
        "top_k_experts",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "global_head_dim",
        "num_global_key_value_heads",
        "sliding_window",
        "vocab_size",
        "max_position_embeddings",
    ];
    for key in keys {
        for value in huge_and_bad_values() {
            let dir = ModelDir::copy("diffusion_gemma");
            let mut cfg = dir.json(CONFIG);
            cfg["text_config"][key] = value.clone();
            dir.write_json(CONFIG, &cfg);
            let what = format!("diffusion_gemma: text_config.{key} = {value}");
            if let Some(msg) = try_load(&what, &dir) {
                assert!(
                    msg.contains(key) || msg.contains(CONFIG) || msg.contains("head_dim"),
                    "{what}: the error names neither the key nor config.json: {msg}"
                );
            } else {
                // Only a null for an optional key (the full layers' own sizes fall back).
                assert!(value.is_null() && key.contains("global"), "{what}: loaded");
            }
        }
    }
    for value in huge_and_bad_values() {
        let dir = ModelDir::copy("diffusion_gemma");
        let mut cfg = dir.json(CONFIG);
        cfg["canvas_length"] = value.clone();
        dir.write_json(CONFIG, &cfg);
        let what = format!("diffusion_gemma: canvas_length = {value}");
        assert!(try_load(&what, &dir).is_some(), "{what}: loaded");
    }
}

#[test]
fn huge_max_positions_are_refused_before_any_table_is_built() {
    // The weights do not say how long a context is: only the config's bound can stop a RoPE
    // table (or a cache) of 2^40 positions from being allocated.
    for (family, key) in [
        ("huginn", "block_size"),
        ("llada", "max_sequence_length"),
        ("armt", "max_position_embeddings"),
        ("refusion", "max_position_embeddings"),
    ] {
        for value in [1u64 << 40, 1 << 34, u64::MAX] {
            let dir = ModelDir::copy(family);
            let mut cfg = dir.json(CONFIG);
            cfg[key] = json!(value);
            dir.write_json(CONFIG, &cfg);
            expect_err(&format!("{family}: {key} = {value}"), &dir, &[key, CONFIG]);
        }
    }
}

#[test]
fn lying_float_settings_are_refused() {
    for (family, keys) in [
        ("huginn", &["rope_base", "norm_eps"][..]),
        ("llada", &["rope_theta", "rms_norm_eps"][..]),
        ("armt", &["rope_theta", "rms_norm_eps"][..]),
        ("refusion", &["rope_theta", "rms_norm_eps"][..]),
    ] {
        for key in keys {
            for value in [
                json!(0.0),
                json!(-1.0),
                json!(1e300),
                json!("1e4"),
                json!([1]),
            ] {
                let dir = ModelDir::copy(family);
                let mut cfg = dir.json(CONFIG);
                cfg[*key] = value.clone();
                dir.write_json(CONFIG, &cfg);
                expect_err(&format!("{family}: {key} = {value}"), &dir, &[key]);
            }
        }
    }
}

#[test]
fn armt_hardcoded_constants_are_bounded() {
    for value in [json!(1u64 << 40), json!(u64::MAX), json!(0), json!(-3)] {
        let dir = ModelDir::copy("armt");
        let mut cfg = dir.json("armt_config.json");
        cfg["_hardcoded"]["nu"] = value.clone();
        dir.write_json("armt_config.json", &cfg);
        expect_err(&format!("armt: _hardcoded.nu = {value}"), &dir, &["nu"]);
    }
}

#[test]
fn broken_config_documents_are_refused() {
    for family in FAMILIES {
        let dir = ModelDir::copy(family);
        let original = dir.read(CONFIG);
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("empty", Vec::new()),
            ("half", original[..original.len() / 2].to_vec()),
            ("not an object", b"[1, 2, 3]".to_vec()),
            ("a number", b"4096".to_vec()),
            ("non-UTF-8", {
                let mut b = original.clone();
                b[original.len() / 3] = 0xff;
                b[original.len() / 3 + 1] = 0xfe;
                b
            }),
            ("deep nesting", {
                let mut b = vec![b'['; 100_000];
                b.extend(vec![b']'; 100_000]);
                b
            }),
        ];
        for (what, bytes) in cases {
            dir.write(CONFIG, &bytes);
            expect_err(&format!("{family}: config.json {what}"), &dir, &[CONFIG]);
        }
    }
}

#[test]
fn missing_files_are_named() {
    for family in FAMILIES {
        let dir = ModelDir::copy(family);
        dir.remove(CONFIG);
        expect_err(&format!("{family}: no config.json"), &dir, &[CONFIG]);

        let dir = ModelDir::copy(family);
        dir.remove(WEIGHTS);
        expect_err(&format!("{family}: no weights"), &dir, &[WEIGHTS]);

        // An index naming a shard that is not there, and one that names none.
        let dir = ModelDir::copy(family);
        dir.remove(WEIGHTS);
        let index = "model.safetensors.index.json";
        dir.write_json(
            index,
            &json!({"weight_map": {"x.weight": "model-00001-of-00002.safetensors"}}),
        );
        expect_err(
            &format!("{family}: missing shard"),
            &dir,
            &["model-00001-of-00002.safetensors"],
        );
        dir.write_json(index, &json!({"weight_map": {}}));
        expect_err(&format!("{family}: empty index"), &dir, &[index]);
        dir.write(index, b"{\"weight_map\": {\"x\": ");
        expect_err(&format!("{family}: truncated index"), &dir, &[index]);
    }
    let dir = ModelDir::copy("armt");
    dir.remove("armt_config.json");
    expect_err("armt: no armt_config.json", &dir, &["armt_config.json"]);
}

#[test]
fn broken_tokenizers_are_refused_by_name() {
    for family in ["huginn", "llada", "refusion"] {
        let dir = ModelDir::copy(family);
        let original = dir.read(TOKENIZER);
        for (what, bytes) in [
            ("empty", Vec::new()),
            ("truncated", original[..original.len() / 2].to_vec()),
            ("garbage", vec![0xffu8; 4096]),
            ("not a tokenizer", b"{\"model\": 5}".to_vec()),
        ] {
            dir.write(TOKENIZER, &bytes);
            let files = ModelFiles::from_dir(&dir.0).expect("the rest of the directory reads");
            let what = format!("{family}: tokenizer.json {what}");
            let err = no_panic(&what, || files.tokenizer())
                .err()
                .unwrap_or_else(|| panic!("{what}: loaded"))
                .to_string();
            assert!(err.contains(TOKENIZER), "{what}: {err}");
            // The server serves token ids without it: the model itself still loads.
            assert_eq!(try_load(&what, &dir), None, "{what}");
        }
        let dir = ModelDir::copy(family);
        dir.remove(TOKENIZER);
        let files = ModelFiles::from_dir(&dir.0).expect("reads without a tokenizer");
        let err = files.tokenizer().expect_err("no tokenizer").to_string();
        assert!(err.contains(TOKENIZER), "{family}: {err}");
    }
}

/// tokenizer.json whose ids lie (beyond any vocabulary, colliding) or whose merges name
/// unknown tokens: refused or usable, never a panic when loaded or used.
#[test]
fn lying_tokenizer_ids_do_not_panic() {
    type Edit = fn(&mut Value);
    let edits: [(&str, Edit); 6] = [
        ("added token id u32::MAX", |t| {
            t["added_tokens"][0]["id"] = json!(u32::MAX)
        }),
        ("added token id past u32", |t| {
            t["added_tokens"][0]["id"] = json!(1u64 << 40)
        }),
        ("vocab id u32::MAX", |t| {
            let vocab = t["model"]["vocab"].as_object_mut().unwrap();
            let first = vocab.keys().next().unwrap().clone();
            vocab.insert(first, json!(u32::MAX));
        }),
        ("colliding vocab ids", |t| {
            for (_, id) in t["model"]["vocab"].as_object_mut().unwrap() {
                *id = json!(7);
            }
        }),
        ("merges of unknown tokens", |t| {
            t["model"]["merges"] = json!([["zzz", "qqq"], "a b c d"]);
        }),
        ("no model", |t| {
            t.as_object_mut().unwrap().remove("model");
        }),
    ];
    for family in ["huginn", "llada", "refusion"] {
        for (what, edit) in edits {
            let dir = ModelDir::copy(family);
            let mut tok = dir.json(TOKENIZER);
            edit(&mut tok);
            dir.write_json(TOKENIZER, &tok);
            let what = format!("{family}: tokenizer.json {what}");
            let files = ModelFiles::from_dir(&dir.0).expect("reads");
            no_panic(&what, || {
                if let Ok(t) = files.tokenizer() {
                    let _ = t.vocab_size();
                    let _ = t.encode("hello world, <|endoftext|> ünïcode", true);
                    let _ = t.decode(&[0, 1, 7, u32::MAX], false);
                    let _ = t.min_tokens(&"x".repeat(1000));
                }
            });
        }
    }
}

/// A safetensors file taken apart: its header (a JSON object) and its data bytes.
struct Checkpoint {
    header: serde_json::Map<String, Value>,
    data: Vec<u8>,
}

impl Checkpoint {
    fn parse(bytes: &[u8]) -> Self {
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
        let header = serde_json::from_slice(&bytes[8..8 + n]).expect("fixture header");
        Self {
            header,
            data: bytes[8 + n..].to_vec(),
        }
    }

    fn to_bytes(&self) -> Vec<u8> {
        let header = serde_json::to_vec(&self.header).expect("JSON");
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend(header);
        out.extend(&self.data);
        out
    }

    /// Tensor names, largest first (the embedding or head: read early by every loader).
    fn names_by_size(&self) -> Vec<String> {
        let mut v: Vec<(u64, String)> = self
            .header
            .iter()
            .filter(|(k, _)| *k != "__metadata__")
            .map(|(k, t)| {
                let o = &t["data_offsets"];
                (o[1].as_u64().unwrap() - o[0].as_u64().unwrap(), k.clone())
            })
            .collect();
        v.sort_by(|a, b| b.cmp(a));
        v.into_iter().map(|(_, k)| k).collect()
    }

    /// The name of a tensor every loader reads (not Huginn's unused `freqs_cis`).
    fn loaded_tensor(&self) -> String {
        self.names_by_size()
            .into_iter()
            .find(|n| n != "freqs_cis")
            .expect("a tensor")
    }
}

#[test]
fn lying_safetensors_headers_are_refused() {
    for family in FAMILIES {
        let fixture = ModelDir::copy(family);
        let original = fixture.read(WEIGHTS);
        let ckpt = Checkpoint::parse(&original);
        let name = ckpt.loaded_tensor();
        let t = ckpt.header[&name].clone();
        let (start, end) = (
            t["data_offsets"][0].as_u64().unwrap(),
            t["data_offsets"][1].as_u64().unwrap(),
        );
        let n_header = u64::from_le_bytes(original[..8].try_into().unwrap());
        let file_len = original.len() as u64;

        // The length prefix lies.
        for claim in [
            u64::MAX,
            1 << 40,
            file_len,
            file_len - 7,
            n_header + 1,
            n_header - 1,
            0,
            1,
        ] {
            let dir = ModelDir::copy(family);
            let mut b = original.clone();
            b[..8].copy_from_slice(&claim.to_le_bytes());
            dir.write(WEIGHTS, &b);
            expect_err(
                &format!("{family}: header length {claim}"),
                &dir,
                &[WEIGHTS],
            );
        }

        // One tensor's entry lies (the data stays as it is).
        let mut lies: Vec<(String, Value)> = vec![
            ("shape larger than its data".into(), {
                let mut t = t.clone();
                t["shape"][0] = json!(t["shape"][0].as_u64().unwrap() * 2);
                t
            }),
            ("shape of 2^40 rows".into(), {
                let mut t = t.clone();
                t["shape"][0] = json!(1u64 << 40);
                t
            }),
            ("shape product overflowing".into(), {
                let mut t = t.clone();
                t["shape"] = json!([u64::MAX, u64::MAX, 2]);
                t
            }),
            ("shape of u64::MAX elements".into(), {
                let mut t = t.clone();
                t["shape"] = json!([u64::MAX]);
                t
            }),
            ("negative dimension".into(), {
                let mut t = t.clone();
                t["shape"][0] = json!(-1);
                t
            }),
            ("offsets past the end".into(), {
                let mut t = t.clone();
                t["data_offsets"] = json!([start, 1u64 << 40]);
                t
            }),
            ("offsets at u64::MAX".into(), {
                let mut t = t.clone();
                t["data_offsets"] = json!([u64::MAX - 4, u64::MAX]);
                t
            }),
            ("reversed offsets".into(), {
                let mut t = t.clone();
                t["data_offsets"] = json!([end, start]);
                t
            }),
            ("offsets overlapping the previous tensor".into(), {
                let mut t = t.clone();
                t["data_offsets"] = json!([start.saturating_sub(4), end - 4]);
                t
            }),
            ("one offset".into(), {
                let mut t = t.clone();
                t["data_offsets"] = json!([start]);
                t
            }),
            ("no offsets".into(), {
                let mut t = t.clone();
                t.as_object_mut().unwrap().remove("data_offsets");
                t
            }),
        ];
        for dtype in [
            json!("F33"),
            json!(""),
            json!("f32"),
            json!(32),
            json!(null),
            json!("F64"),
            json!("F16"),
            json!("BOOL"),
            json!("F4"),
            json!("U64"),
        ] {
            let mut t = t.clone();
            t["dtype"] = dtype.clone();
            lies.push((format!("dtype {dtype}"), t));
        }
        for (what, lie) in lies {
            let dir = ModelDir::copy(family);
            let mut c = Checkpoint::parse(&original);
            c.header.insert(name.clone(), lie);
            dir.write(WEIGHTS, c.to_bytes());
            expect_err(&format!("{family}: {name}: {what}"), &dir, &[WEIGHTS]);
        }

        // Two tensors claim the same bytes.
        let names = ckpt.names_by_size();
        let dir = ModelDir::copy(family);
        let mut c = Checkpoint::parse(&original);
        let other = c.header[&names[1]].clone();
        c.header.insert(names[2].clone(), other);
        dir.write(WEIGHTS, c.to_bytes());
        expect_err(&format!("{family}: overlapping tensors"), &dir, &[WEIGHTS]);

        // Consistent files whose tensors are not what the config says: the same bytes under
        // another shape, under another dtype, a tensor left out.
        let consistent: Vec<(String, Value, Vec<u8>)> = {
            let shape: Vec<u64> = serde_json::from_value(t["shape"].clone()).unwrap();
            let elems: u64 = shape.iter().product();
            vec![
                (
                    "transposed".into(),
                    json!({"dtype": "F32", "shape": shape.iter().rev().collect::<Vec<_>>()}),
                    Vec::new(),
                ),
                (
                    "flattened".into(),
                    json!({"dtype": "F32", "shape": [elems]}),
                    Vec::new(),
                ),
                (
                    "as bf16".into(),
                    json!({"dtype": "BF16", "shape": [elems * 2]}),
                    Vec::new(),
                ),
                (
                    "as u8".into(),
                    json!({"dtype": "U8", "shape": [elems * 4]}),
                    Vec::new(),
                ),
            ]
        };
        for (what, entry, _) in consistent {
            let dir = ModelDir::copy(family);
            let mut c = Checkpoint::parse(&original);
            let mut e = entry;
            e["data_offsets"] = json!([start, end]);
            c.header.insert(name.clone(), e);
            dir.write(WEIGHTS, c.to_bytes());
            expect_err(&format!("{family}: {name} {what}"), &dir, &[&name]);
        }
        // Renamed away: the loader names the tensor it misses.
        let dir = ModelDir::copy(family);
        let mut c = Checkpoint::parse(&original);
        let moved = c.header.remove(&name).unwrap();
        c.header.insert(format!("{name}.renamed"), moved);
        dir.write(WEIGHTS, c.to_bytes());
        expect_err(&format!("{family}: {name} missing"), &dir, &[&name]);

        // Not a header at all.
        for (what, bytes) in [
            ("empty", Vec::new()),
            ("seven bytes", vec![0u8; 7]),
            ("a header of garbage", {
                let mut b = 64u64.to_le_bytes().to_vec();
                b.extend([0xffu8; 64]);
                b
            }),
            ("a JSON array header", {
                let mut b = 2u64.to_le_bytes().to_vec();
                b.extend(b"[]");
                b
            }),
        ] {
            let dir = ModelDir::copy(family);
            dir.write(WEIGHTS, &bytes);
            expect_err(&format!("{family}: weights {what}"), &dir, &[WEIGHTS]);
        }
    }
}

fn proptest_config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(32);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// An arbitrary JSON number: any u64, any i64, any finite f64, or a boundary value.
fn any_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u64>().prop_map(|x| json!(x)),
        any::<i64>().prop_map(|x| json!(x)),
        any::<f64>()
            .prop_filter("finite", |x| x.is_finite())
            .prop_map(|x| json!(x)),
        prop::sample::select(vec![
            0u64,
            1,
            2,
            3,
            1 << 31,
            1 << 32,
            1 << 40,
            1 << 62,
            u64::MAX
        ])
        .prop_map(|x| json!(x)),
    ]
}

fn fixture_bytes(family: &str, name: &str) -> Vec<u8> {
    std::fs::read(wavefront_models::device::test_fixture(family).join(name)).expect("fixture")
}

proptest! {
    #![proptest_config(proptest_config())]

    /// One numeric field of a real config.json (or of armt_config.json) set to an arbitrary
    /// number: the load returns (an error, or a model when the value happens to be usable),
    /// never panics or aborts.
    #[test]
    fn one_numeric_config_field_set_to_anything(
        family in prop::sample::select(FAMILIES.to_vec()),
        armt_file in any::<bool>(),
        pick in any::<prop::sample::Index>(),
        value in any_number(),
    ) {
        let file = if family == "armt" && armt_file { "armt_config.json" } else { CONFIG };
        let dir = ModelDir::copy(family);
        let mut cfg = dir.json(file);
        let mut keys = numeric_keys(&cfg);
        if file == CONFIG {
            // Keys a family reads but its fixture leaves out.
            for k in dimension_keys(family) {
                if cfg.get(*k).is_none() {
                    keys.push(vec![k.to_string()]);
                }
            }
        }
        let key = pick.get(&keys).clone();
        set_path(&mut cfg, &key, value.clone());
        dir.write_json(file, &cfg);
        let what = format!("{family}: {file} {} = {value}", key.join("."));
        if let Some(msg) = try_load(&what, &dir) {
            let leaf = key.last().unwrap().as_str();
            prop_assert!(
                [leaf, file, "safetensors"].iter().any(|n| msg.contains(n)),
                "{}: the error names neither the key nor a file: {}", what, msg
            );
        }
    }

    /// config.json cut at an arbitrary byte: refused, naming the file.
    #[test]
    fn config_truncated_anywhere(
        family in prop::sample::select(FAMILIES.to_vec()),
        cut in any::<prop::sample::Index>(),
    ) {
        let original = fixture_bytes(family, CONFIG);
        // Cut strictly inside the document (its closing brace and newline are the last bytes).
        let at = cut.index(original.len().saturating_sub(2));
        let dir = ModelDir::copy(family);
        dir.write(CONFIG, &original[..at]);
        expect_err(&format!("{family}: config.json cut at {at}"), &dir, &[CONFIG]);
    }

    /// model.safetensors cut at an arbitrary byte: refused, naming the file.
    #[test]
    fn weights_truncated_anywhere(
        family in prop::sample::select(FAMILIES.to_vec()),
        cut in any::<prop::sample::Index>(),
    ) {
        let original = fixture_bytes(family, WEIGHTS);
        let at = cut.index(original.len());
        let dir = ModelDir::copy(family);
        dir.write(WEIGHTS, &original[..at]);
        expect_err(&format!("{family}: weights cut at {at}"), &dir, &[WEIGHTS]);
    }

    /// Random bytes of the safetensors header (length prefix included) flipped: an error or,
    /// when the flips happen to leave a usable file, a model; never a panic.
    #[test]
    fn weights_header_bytes_flipped(
        family in prop::sample::select(FAMILIES.to_vec()),
        flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 1..8),
    ) {
        let mut bytes = fixture_bytes(family, WEIGHTS);
        let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        for (at, mask) in &flips {
            bytes[at.index(header_end)] ^= mask;
        }
        let dir = ModelDir::copy(family);
        dir.write(WEIGHTS, &bytes);
        let what = format!("{family}: header flips {flips:?}");
        if let Some(msg) = try_load(&what, &dir) {
            prop_assert!(msg.contains("safetensors"), "{}: {}", what, msg);
        }
    }

    /// One tensor's shape, dtype or offsets replaced by arbitrary values.
    #[test]
    fn one_tensor_entry_set_to_anything(
        family in prop::sample::select(FAMILIES.to_vec()),
        pick in any::<prop::sample::Index>(),
        field in 0usize..3,
        dims in prop::collection::vec(any_number(), 0..5),
        dtype in prop::sample::select(vec![
            "F32", "F16", "BF16", "F64", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64",
            "BOOL", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "C64", "X", "",
        ]),
    ) {
        let original = fixture_bytes(family, WEIGHTS);
        let mut c = Checkpoint::parse(&original);
        let names = c.names_by_size();
        let name = pick.get(&names).clone();
        let entry = c.header.get_mut(&name).unwrap();
        match field {
            0 => entry["shape"] = Value::Array(dims.clone()),
            1 => entry["data_offsets"] = Value::Array(dims.iter().take(2).cloned().collect()),
            _ => entry["dtype"] = json!(dtype),
        }
        let dir = ModelDir::copy(family);
        dir.write(WEIGHTS, c.to_bytes());
        let what = format!("{family}: {name} field {field}: {dims:?} {dtype}");
        if let Some(msg) = try_load(&what, &dir) {
            prop_assert!(msg.contains("safetensors"), "{}: {}", what, msg);
        }
    }

    /// tokenizer.json cut anywhere: `tokenizer()` refuses it naming the file, without panicking.
    #[test]
    fn tokenizer_truncated_anywhere(
        family in prop::sample::select(vec!["huginn", "llada", "refusion"]),
        cut in any::<prop::sample::Index>(),
    ) {
        let original = fixture_bytes(family, TOKENIZER);
        let at = cut.index(original.len().saturating_sub(2));
        let dir = ModelDir::copy(family);
        dir.write(TOKENIZER, &original[..at]);
        let files = ModelFiles::from_dir(&dir.0).expect("reads");
        let what = format!("{family}: tokenizer.json cut at {at}");
        let err = no_panic(&what, || files.tokenizer()).err();
        let err = err.unwrap_or_else(|| panic!("{what}: loaded")).to_string();
        prop_assert!(err.contains(TOKENIZER), "{}: {}", what, err);
    }
}
