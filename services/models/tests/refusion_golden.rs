//! Golden tests of the ReFusion / Qwen3 model against outputs of the upstream PyTorch code
//! (tests/fixtures/refusion, see its README): logits at non-contiguous position ids in one call
//! and split over a cache, the cached K/V of every layer, RoPE really fed by the position ids,
//! parallel slot rows over one shared prefix and the stitched cache they leave, packing
//! invariance, the checkpoint layout, family detection and the tokenizer.

mod support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use support::{assert_close, max_abs_diff, packing_atol, with_each_attention};
use wavefront_models::device::{test_device, test_parallel};
use wavefront_models::transformer::{
    Collective, Keys, KvCache, LocalCollective, MaskRule, SeqInput, TensorParallel,
};
use wavefront_models::{detect_family, ModelFamily, ModelFiles, Qwen3, Qwen3Config, TextTokenizer};

fn fixture_dir() -> PathBuf {
    wavefront_models::device::test_fixture("refusion")
}

fn model() -> Result<Qwen3> {
    model_on_ranks(1)
}

/// The fixture split over `world` in-process tensor-parallel ranks (1: not split).
fn model_on_ranks(world: usize) -> Result<Qwen3> {
    model_with(&TensorParallel::local(world))
}

/// The fixture split as `tp` says.
fn model_with(tp: &TensorParallel) -> Result<Qwen3> {
    let files = ModelFiles::from_dir(fixture_dir())?;
    let cfg = Qwen3Config::from_json(files.config_json())?;
    Ok(Qwen3::load_parallel(
        files.var_builder(DType::F32, &test_device())?,
        cfg,
        tp,
    )?)
}

struct Golden {
    tensors: HashMap<String, Tensor>,
    json: serde_json::Value,
}

impl Golden {
    fn load() -> Result<Self> {
        let dir = fixture_dir();
        Ok(Self {
            tensors: candle_core::safetensors::load(dir.join("golden.safetensors"), &Device::Cpu)?,
            json: serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json"))?)?,
        })
    }

    fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .with_context(|| format!("golden tensor {name}"))
    }

    /// Rows of an integer tensor `[B, L]`.
    fn rows(&self, name: &str) -> Result<Vec<Vec<u32>>> {
        Ok(self.tensor(name)?.to_dtype(DType::U32)?.to_vec2()?)
    }

    fn ids(&self, name: &str) -> Result<Vec<u32>> {
        Ok(self.rows(name)?.concat())
    }
}

/// The README's tolerances: logits 1e-4, cached K/V 1e-5.
const LOGITS_ATOL: f32 = 1e-4;
const KV_ATOL: f32 = 1e-5;

/// Rows appended to `cache` (buffer indices after its own), causal.
fn appended<'a>(cache: &'a mut KvCache, positions: &[u32]) -> SeqInput<'a> {
    let start = cache.len() as u32;
    SeqInput {
        index: (start..start + positions.len() as u32).collect(),
        positions: positions.to_vec(),
        mask: MaskRule::Causal,
        keys: Keys::Buffer {
            len: cache.len() + positions.len(),
            cache,
        },
    }
}

fn logits(model: &Qwen3, ids: &[u32], seqs: &mut [SeqInput]) -> Result<Tensor> {
    let hidden = model.forward(ids, seqs)?;
    Ok(model.logits(&hidden)?)
}

#[test]
fn forward_at_non_contiguous_positions_matches_upstream() -> Result<()> {
    let golden = Golden::load()?;
    with_each_attention(model, |m| check_forward(&golden, m, ""))
}

/// Logits in one call, split over the cache and at contiguous positions against upstream; with
/// one rank also every layer's cached K/V (with more, a layer's K/V is spread over the ranks'
/// cache layers).
fn check_forward(golden: &Golden, model: &Qwen3, label: &str) -> Result<()> {
    let ids = golden.ids("fwd.input_ids")?;
    let pos = golden.ids("fwd.position_ids")?;
    let mut cache = KvCache::new();
    let full = logits(model, &ids, &mut [appended(&mut cache, &pos)])?;
    assert_close(
        &format!("{label}logits_full"),
        &full,
        golden.tensor("fwd.logits_full")?,
        LOGITS_ATOL,
    )?;
    ensure!(cache.len() == 16);
    for layer in (0..2).filter(|_| label.is_empty()) {
        let (k, v) = cache.layer_kv(layer)?;
        let want_k = golden.tensor(&format!("fwd.cache.layer{layer}.key"))?;
        let want_v = golden.tensor(&format!("fwd.cache.layer{layer}.value"))?;
        assert_close(&format!("layer {layer} key"), &k, want_k, KV_ATOL)?;
        assert_close(&format!("layer {layer} value"), &v, want_v, KV_ATOL)?;
    }

    // Split over the cache at the README's split point.
    let split = golden.json["forward"]["split_at"]
        .as_u64()
        .context("split_at")? as usize;
    let mut cache = KvCache::new();
    let first = logits(
        model,
        &ids[..split],
        &mut [appended(&mut cache, &pos[..split])],
    )?;
    let second = logits(
        model,
        &ids[split..],
        &mut [appended(&mut cache, &pos[split..])],
    )?;
    assert_close(
        &format!("{label}logits_call1"),
        &first,
        golden.tensor("fwd.logits_call1")?,
        LOGITS_ATOL,
    )?;
    assert_close(
        &format!("{label}logits_call2"),
        &second,
        golden.tensor("fwd.logits_call2")?,
        LOGITS_ATOL,
    )?;

    // Position ids reach RoPE: contiguous positions give upstream's other logits.
    let contiguous: Vec<u32> = (0..16).collect();
    let mut cache = KvCache::new();
    let c = logits(model, &ids, &mut [appended(&mut cache, &contiguous)])?;
    assert_close(
        &format!("{label}logits_contiguous_positions"),
        &c,
        golden.tensor("fwd.logits_contiguous_positions")?,
        LOGITS_ATOL,
    )?;
    ensure!(max_abs_diff(&c, &full)? > 1.0, "position ids had no effect");
    Ok(())
}

#[test]
fn parallel_slots_on_a_shared_prefix_and_the_stitched_cache_match_upstream() -> Result<()> {
    let golden = Golden::load()?;
    with_each_attention(model, |m| check_parallel_slots(&golden, m))
}

/// Tensor parallelism over 2 and 4 in-process ranks (heads and MLP columns split, the fixture's
/// 2 key/value heads replicated on 4 ranks): the forward at non-contiguous positions, the split
/// over a cache, the parallel slot rows over a shared prefix and the stitched cache all give
/// upstream's logits, and the one-rank logits, within the README's logits tolerance.
#[test]
fn tensor_parallel_ranks_match_upstream_and_one_rank() -> Result<()> {
    let golden = Golden::load()?;
    let one = model()?;
    let ids = golden.ids("fwd.input_ids")?;
    let pos = golden.ids("fwd.position_ids")?;
    let single = logits(&one, &ids, &mut [appended(&mut KvCache::new(), &pos)])?;
    for world in [1, 2, 4] {
        let Some(tp) = test_parallel(world) else {
            continue;
        };
        // Each rank's attention over its own heads, with both kernels.
        with_each_attention(
            || model_with(&tp),
            |split| {
                let label = format!("{world} ranks: ");
                check_forward(&golden, split, &label)?;
                check_parallel_slots(&golden, split)?;
                let got = logits(split, &ids, &mut [appended(&mut KvCache::new(), &pos)])?;
                assert_close(
                    &format!("{label}against one rank"),
                    &got,
                    &single,
                    LOGITS_ATOL,
                )
            },
        )?;
    }
    Ok(())
}

/// A collective that places every rank on the test device explicitly and, like NCCL, is called
/// even at one rank, counting its calls.
#[derive(Debug)]
struct Placing {
    inner: LocalCollective,
    place: Device,
    calls: AtomicUsize,
}

impl Collective for Placing {
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_reduce_sum(
        &self,
        partials: Vec<Tensor>,
    ) -> Result<Tensor, wavefront_models::ModelError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.all_reduce_sum(partials)
    }
    fn device(&self, _rank: usize) -> Option<&Device> {
        Some(&self.place)
    }
    fn skips_one_rank(&self) -> bool {
        false
    }
}

/// The path a library collective takes (ranks placed on their devices, the sum taken through
/// the collective at one rank too): two sums per block per call, every logit unchanged.
#[test]
fn a_collective_called_at_one_rank_changes_nothing() -> Result<()> {
    let golden = Golden::load()?;
    let ids = golden.ids("fwd.input_ids")?;
    let pos = golden.ids("fwd.position_ids")?;
    let one = model()?;
    let want = logits(&one, &ids, &mut [appended(&mut KvCache::new(), &pos)])?;
    for world in [1, 2] {
        let comm = Arc::new(Placing {
            inner: LocalCollective::new(world),
            place: test_device(),
            calls: AtomicUsize::new(0),
        });
        let placed = model_with(&TensorParallel::with(comm.clone()))?;
        let got = logits(&placed, &ids, &mut [appended(&mut KvCache::new(), &pos)])?;
        let layers = one.config().num_hidden_layers;
        ensure!(
            comm.calls.load(Ordering::Relaxed) == 2 * layers,
            "{world} ranks: {} sums for {layers} blocks",
            comm.calls.load(Ordering::Relaxed)
        );
        if world == 1 {
            ensure!(
                max_abs_diff(&got, &want)? == 0.0,
                "one rank through the collective"
            );
        } else {
            assert_close("2 placed ranks", &got, &want, LOGITS_ATOL)?;
        }
    }
    Ok(())
}

/// Two slot rows packed over one shared prefix cache, their K/V stitched after it, and the next
/// call over the stitched cache, against upstream.
fn check_parallel_slots(golden: &Golden, model: &Qwen3) -> Result<()> {
    let mut prefix = KvCache::new();
    logits(
        model,
        &golden.ids("par.prefix_input_ids")?,
        &mut [appended(
            &mut prefix,
            &golden.ids("par.prefix_position_ids")?,
        )],
    )?;
    // Both rows in one packed call, each over the shared prefix and itself only.
    let rows = golden.rows("par.rows_input_ids")?;
    let rows_pos = golden.rows("par.rows_position_ids")?;
    let mut suffixes = [KvCache::new(), KvCache::new()];
    let got = {
        let [s0, s1] = &mut suffixes;
        let mut seqs: Vec<SeqInput> = [s0, s1]
            .into_iter()
            .zip(&rows_pos)
            .map(|(suffix, pos)| SeqInput {
                index: (8..12).collect(),
                positions: pos.clone(),
                mask: MaskRule::Causal,
                keys: Keys::Shared {
                    prefix: &prefix,
                    suffix,
                },
            })
            .collect();
        logits(model, &rows.concat(), &mut seqs)?
    };
    ensure!(prefix.len() == 8, "the shared prefix was written");
    let want = golden.tensor("par.rows_logits")?.reshape((8, 512))?;
    assert_close("rows_logits", &got, &want, LOGITS_ATOL)?;

    // Stitch row 0's then row 1's K/V after the prefix and decode the masks on top.
    let mut stitched = prefix.clone();
    stitched.append(&[(&suffixes[0], 0, 4), (&suffixes[1], 0, 4)])?;
    ensure!(stitched.len() == 16 && prefix.len() == 8);
    let next = logits(
        model,
        &golden.ids("par.next_input_ids")?,
        &mut [appended(
            &mut stitched,
            &golden.ids("par.next_position_ids")?,
        )],
    )?;
    let want = golden.tensor("par.next_logits_stitched_cache")?;
    assert_close("next_logits_stitched_cache", &next, want, LOGITS_ATOL)?;

    // The fresh sequential forward differs, as upstream's README reports.
    let mut fresh = KvCache::new();
    let all = logits(
        model,
        &golden.ids("par.fresh_input_ids")?,
        &mut [appended(&mut fresh, &golden.ids("par.fresh_position_ids")?)],
    )?;
    let tail = all.narrow(0, 16, 4)?;
    assert_close(
        "next_logits_fresh_sequential",
        &tail,
        golden.tensor("par.next_logits_fresh_sequential")?,
        LOGITS_ATOL,
    )?;
    ensure!(max_abs_diff(&tail, &next)? > 1.0);
    Ok(())
}

#[test]
fn a_sequence_computes_the_same_packed_with_others() -> Result<()> {
    let golden = Golden::load()?;
    with_each_attention(model, |model| {
        let ids = golden.ids("fwd.input_ids")?;
        let pos = golden.ids("fwd.position_ids")?;
        let mut alone_cache = KvCache::new();
        let alone = logits(model, &ids, &mut [appended(&mut alone_cache, &pos)])?;
        // The same rows between two other sequences, one of them on a warm cache.
        let mut warm = KvCache::new();
        logits(model, &[1, 2, 3], &mut [appended(&mut warm, &[0, 1, 2])])?;
        let (mut a, mut b) = (KvCache::new(), KvCache::new());
        let packed_ids: Vec<u32> = [&[7u32, 8][..], &ids, &[9, 10, 11]].concat();
        let packed = logits(
            model,
            &packed_ids,
            &mut [
                appended(&mut a, &[5, 9]),
                appended(&mut b, &pos),
                appended(&mut warm, &[3, 4, 5]),
            ],
        )?;
        let d = max_abs_diff(&packed.narrow(0, 2, 16)?, &alone)?;
        // Exact up to 1e-5 on the CPU; on a GPU, the README's bound against upstream.
        let atol = packing_atol(&test_device(), 1e-5, LOGITS_ATOL);
        ensure!(d <= atol, "packing changed the logits by {d:e} > {atol:e}");
        let (k, _) = b.layer_kv(1)?;
        let (k_alone, _) = alone_cache.layer_kv(1)?;
        // 1e-6 on the CPU; on a GPU the README's cached K/V bound (2.4e-6 measured on an H200).
        let kv_atol = packing_atol(&test_device(), 1e-6, KV_ATOL);
        let dk = max_abs_diff(&k, &k_alone)?;
        ensure!(
            dk <= kv_atol,
            "packing changed the cached keys by {dk:e} > {kv_atol:e}"
        );
        Ok(())
    })
}

#[test]
fn checkpoint_layout_config_family_and_tokenizer() -> Result<()> {
    let golden = Golden::load()?;
    let files = ModelFiles::from_dir(fixture_dir())?;
    let cfg = Qwen3Config::from_json(files.config_json())?;
    assert_eq!(cfg.head_dim(), 16);
    assert_eq!(cfg.kv_heads(), 2);
    assert_eq!(cfg.mask_token_id, Some(511));
    assert_eq!(cfg.eos_token_ids(), vec![486]);
    let mut want: Vec<(String, Vec<usize>)> = golden.json["tensors"]
        .as_array()
        .context("tensors")?
        .iter()
        .map(|t| {
            (
                t[0].as_str().unwrap_or_default().to_owned(),
                serde_json::from_value(t[1].clone()).unwrap_or_default(),
            )
        })
        .collect();
    want.sort();
    let mut got = cfg.checkpoint_tensors();
    got.sort();
    assert_eq!(got, want);

    assert_eq!(files.family()?, ModelFamily::SlotDiffusion);
    let plain_qwen3 =
        serde_json::json!({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]});
    let err = detect_family(&plain_qwen3).unwrap_err().to_string();
    ensure!(err.contains("mask_token_id"), "{err}");

    for (key, value) in [
        (
            "rope_scaling",
            serde_json::json!({"type": "yarn", "factor": 4.0}),
        ),
        ("hidden_act", serde_json::json!("gelu")),
        ("use_sliding_window", serde_json::json!(true)),
        ("num_key_value_heads", serde_json::json!(3)),
    ] {
        let mut json: serde_json::Value = serde_json::from_str(files.config_json())?;
        json[key] = value;
        let err = Qwen3Config::from_json(&json.to_string())
            .unwrap_err()
            .to_string();
        ensure!(
            err.contains(key) || err.contains("n_kv_heads"),
            "{key}: {err}"
        );
    }

    let tok = TextTokenizer::from_file(fixture_dir().join("tokenizer.json"))?;
    for case in golden.json["tokenizer_cases"].as_array().context("cases")? {
        let text = case["text"].as_str().context("text")?;
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone())?;
        assert_eq!(tok.encode(text, true)?, want, "{text:?}");
    }
    Ok(())
}
