//! Golden tests of Fast-dLLM's cache modes and threshold rule against the upstream fixture
//! (tests/fixtures/fast_dllm, see its README): all 55 greedy runs of `generate`,
//! `generate_with_prefix_cache` and `generate_with_dual_cache` on the LLaDA fixture's
//! checkpoint, each alone and all packed into the same ticks: tokens, forwards, the rows each
//! forward computed, the positions and tokens each committed, and the logits of the recorded
//! cached calls; and the sampled run with upstream's uniforms replayed. Upstream's extra cached forward is reproduced with `upstream_calls` and
//! skipped without it (same tokens, fewer forwards); the cached modes that crash upstream with
//! one step per block are served.

use anyhow::{ensure, Context, Result};
use serde_json::Value;

use super::test_support::*;
use super::MdProgram;
use crate::request::{GenerateSpec, KvCacheMode, LowConfidenceParams, SchemeParams};

struct FastGolden {
    json: Value,
    tensors: std::collections::HashMap<String, candle_core::Tensor>,
}

impl FastGolden {
    fn load() -> Result<Self> {
        let dir = wavefront_models::device::test_fixture("fast_dllm");
        Ok(Self {
            json: serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json"))?)?,
            tensors: candle_core::safetensors::load(
                dir.join("golden.safetensors"),
                &candle_core::Device::Cpu,
            )?,
        })
    }

    /// The greedy runs (the sampled one draws from torch's generator).
    fn greedy_runs(&self) -> Vec<&Value> {
        self.json["runs"]
            .as_array()
            .expect("runs")
            .iter()
            .filter(|r| r["temperature"].as_f64() == Some(0.0))
            .collect()
    }

    fn prompt(&self, run: &Value) -> Vec<u32> {
        let p = &self.json["prompts"][run["prompt"].as_str().expect("prompt")];
        let ids = if p.is_array() { p } else { &p["ids"] };
        serde_json::from_value(ids.clone()).expect("prompt ids")
    }
}

fn u(v: &Value) -> usize {
    v.as_u64().expect("a count") as usize
}

fn mode(run: &Value) -> KvCacheMode {
    match run["method"].as_str().expect("method") {
        "generate" => KvCacheMode::None,
        "generate_with_prefix_cache" => KvCacheMode::Prefix,
        "generate_with_dual_cache" => KvCacheMode::Dual,
        other => panic!("method {other}"),
    }
}

fn run_spec(golden: &FastGolden, run: &Value, upstream_calls: bool) -> GenerateSpec {
    run_spec_with(golden, run, upstream_calls, None)
}

fn run_spec_with(
    golden: &FastGolden,
    run: &Value,
    upstream_calls: bool,
    surelock: Option<crate::SureLockParams>,
) -> GenerateSpec {
    let cache = mode(run);
    let mut s = spec(
        golden.prompt(run),
        u(&run["gen_length"]),
        0,
        SchemeParams::LowConfidence(LowConfidenceParams {
            kv_cache: cache,
            threshold: run["threshold"].as_f64().map(|t| t as f32),
            upstream_calls: upstream_calls && cache != KvCacheMode::None,
            surelock,
            ..low_confidence(u(&run["block_length"]), u(&run["steps"]))
        }),
    );
    // Upstream has no end-of-sequence handling (none of these runs commits one).
    s.stop_token_ids.clear();
    s
}

fn positions(v: &Value) -> Vec<usize> {
    serde_json::from_value(v.clone()).expect("positions")
}

fn sorted_pairs(p: &[usize], t: &[u32]) -> Vec<(usize, u32)> {
    let mut v: Vec<_> = p.iter().copied().zip(t.iter().copied()).collect();
    v.sort_unstable();
    v
}

/// Checks a program that ran `run` with upstream's calls: tokens, forwards, rows per forward,
/// commits per forward.
fn check(run: &Value, p: &MdProgram) -> Result<()> {
    let name = run["name"].as_str().unwrap_or("?");
    let want: Vec<u32> = serde_json::from_value(run["output_ids"].clone())?;
    ensure!(
        p.tokens() == want.as_slice(),
        "{name}: tokens {:?}, upstream {want:?}",
        p.tokens()
    );
    let trace = run["trace"].as_array().context("trace")?;
    ensure!(
        p.steps().len() == u(&run["nfe"]) && trace.len() == p.steps().len(),
        "{name}: {} forwards, upstream {}",
        p.steps().len(),
        run["nfe"]
    );
    let mut rows = 0;
    for (t, (got, want)) in p.steps().iter().zip(trace).enumerate() {
        let q = positions(&want["query_positions"]);
        let expected: Vec<u32> = (q[0] as u32..q[1] as u32).collect();
        ensure!(
            got.rows == expected,
            "{name} call {t} ({}): computed rows {:?}, upstream [{}, {})",
            want["kind"],
            got.rows,
            q[0],
            q[1]
        );
        rows += got.rows.len();
        let tokens: Vec<u32> = serde_json::from_value(want["committed_tokens"].clone())?;
        let want_pairs = sorted_pairs(&positions(&want["committed_positions"]), &tokens);
        ensure!(
            sorted_pairs(&got.committed, &got.tokens) == want_pairs,
            "{name} call {t}: committed {:?}, upstream {want_pairs:?}",
            sorted_pairs(&got.committed, &got.tokens)
        );
        // The confidences that ranked them (float64 softmaxes of float32 logits). The fixture
        // suggests 1e-6, for logits equal to PyTorch's to float32 rounding; ours differ from
        // them by up to about 1e-4 (summation order; within the 5e-4 logit tolerance), which
        // moves a confidence by up to 1.6e-5 over these runs (28% of commits beyond 1e-6).
        let conf: Vec<f64> = serde_json::from_value(want["committed_confidences"].clone())?;
        let want_conf: std::collections::HashMap<usize, f64> =
            positions(&want["committed_positions"])
                .into_iter()
                .zip(conf)
                .collect();
        for (p, c) in got.committed.iter().zip(&got.scores) {
            let diff = (c - want_conf[p]).abs();
            ensure!(
                diff <= 5e-5,
                "{name} call {t} position {p}: confidence off by {diff}"
            );
        }
    }
    ensure!(
        rows == u(&run["rows_computed_total"]),
        "{name}: {rows} rows"
    );
    Ok(())
}

fn programs(golden: &FastGolden, runs: &[&Value], upstream_calls: bool) -> Result<Vec<MdProgram>> {
    let (_, planner) = fixture()?;
    runs.iter()
        .map(|r| program(&planner, run_spec(golden, r, upstream_calls)))
        .collect()
}

#[test]
fn every_greedy_run_matches_upstream_alone_and_packed() -> Result<()> {
    let golden = FastGolden::load()?;
    let (model, _) = fixture()?;
    let runs = golden.greedy_runs();
    ensure!(runs.len() == 55, "{} greedy runs", runs.len());
    for r in &runs {
        let mut ps = programs(&golden, &[r], true)?;
        run(&model, &mut ps)?;
        check(r, &ps[0])?;
    }
    // All 55 in the same ticks: different prompts, cache modes, blocks and rules share each
    // forward, and each request still computes its own rows from its own cache.
    let mut ps = programs(&golden, &runs, true)?;
    run(&model, &mut ps)?;
    for (r, p) in runs.iter().zip(&ps) {
        check(r, p).context("packed")?;
    }
    Ok(())
}

/// Without `upstream_calls`, the cached forward upstream makes after a full forward that
/// finished its block is skipped: the same tokens, that many fewer forwards and rows.
#[test]
fn without_upstream_calls_the_wasted_forward_is_skipped() -> Result<()> {
    let golden = FastGolden::load()?;
    let (model, _) = fixture()?;
    let runs = golden.greedy_runs();
    let mut ps = programs(&golden, &runs, false)?;
    run(&model, &mut ps)?;
    let mut skipped = 0;
    for (r, p) in runs.iter().zip(&ps) {
        let name = r["name"].as_str().unwrap_or("?");
        let want: Vec<u32> = serde_json::from_value(r["output_ids"].clone())?;
        ensure!(p.tokens() == want.as_slice(), "{name}: tokens differ");
        let trace = r["trace"].as_array().context("trace")?;
        // Upstream's wasted calls: cached calls that follow a full call which left no mask in
        // its block.
        let wasted = trace
            .iter()
            .enumerate()
            .filter(|(t, call)| {
                call["kind"] != "full"
                    && call["committed_positions"]
                        .as_array()
                        .is_some_and(Vec::is_empty)
                    && trace[t - 1]["kind"] == "full"
            })
            .count();
        ensure!(
            p.steps().len() + wasted == u(&r["nfe"]),
            "{name}: {} forwards, upstream {} with {wasted} wasted",
            p.steps().len(),
            r["nfe"]
        );
        ensure!(
            p.steps().iter().all(|s| !s.committed.is_empty()),
            "{name}: a forward committed nothing"
        );
        skipped += wasted;
    }
    ensure!(skipped > 0, "no run exercised the wasted forward");
    Ok(())
}

/// The logits of the recorded cached calls (prefix: the block and everything after it over the
/// cached prefix; dual: the block alone between cached prefix and suffix) are upstream's,
/// within the fixture's tolerance, at every position the step read.
#[test]
fn cached_forwards_reproduce_upstreams_approximate_logits() -> Result<()> {
    let golden = FastGolden::load()?;
    let (model, _) = fixture()?;
    let runs = golden.greedy_runs();
    let mut checked = 0;
    for r in &runs {
        let name = r["name"].as_str().unwrap_or("?");
        let recorded: Vec<(usize, String)> = (0..u(&r["nfe"]))
            .map(|t| (t, format!("{name}.call{t}.logits")))
            .filter(|(_, k)| golden.tensors.contains_key(k))
            .collect();
        if recorded.is_empty() {
            continue;
        }
        let mut ps = programs(&golden, &[r], true)?;
        run(&model, &mut ps)?;
        let trace = r["trace"].as_array().context("trace")?;
        for (t, key) in recorded {
            let want: Vec<Vec<f32>> = golden.tensors[&key].to_vec2()?;
            let start = positions(&trace[t]["query_positions"])[0];
            let got = &ps[0].steps()[t].logits;
            ensure!(!got.is_empty(), "{key}: no logits read");
            for (pos, row) in got {
                let diff = row
                    .iter()
                    .zip(&want[pos - start])
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                ensure!(diff <= 5e-4, "{key} position {pos}: max abs diff {diff}");
            }
            checked += 1;
        }
    }
    ensure!(checked == 4, "{checked} recorded calls compared");
    Ok(())
}

/// One step per block without a threshold crashes upstream's cached functions (IndexError);
/// here the block's full forward commits the whole block, and the tokens are the exact ones.
#[test]
fn one_step_per_block_with_a_cache_is_served_exactly() -> Result<()> {
    let (model, planner) = fixture()?;
    // The fixture's raw prompt (no end-of-sequence in its 32 tokens, so every block decodes).
    let raw = vec![448, 47, 355, 268, 341, 328, 388, 260];
    let lc = |kv_cache, upstream_calls| {
        let mut s = spec(
            raw.clone(),
            32,
            0,
            SchemeParams::LowConfidence(LowConfidenceParams {
                kv_cache,
                upstream_calls,
                ..low_confidence(8, 4)
            }),
        );
        s.stop_token_ids.clear();
        s
    };
    let mut ps = vec![
        program(&planner, lc(KvCacheMode::None, false))?,
        program(&planner, lc(KvCacheMode::Prefix, false))?,
        program(&planner, lc(KvCacheMode::Dual, false))?,
        program(&planner, lc(KvCacheMode::Dual, true))?,
    ];
    run(&model, &mut ps)?;
    for p in &ps[1..] {
        ensure!(p.tokens() == ps[0].tokens(), "{:?}", p.tokens());
    }
    // With upstream's calls, each block but the last adds its wasted cached forward (after the
    // last block the response has ended: nothing is left to wait for).
    let forwards: Vec<usize> = ps.iter().map(|p| p.steps().len()).collect();
    ensure!(forwards == [4, 4, 4, 7], "forwards {forwards:?}");
    Ok(())
}

/// SureLock on a cached run: one row cache holds the locked rows and the cached ones. With
/// `surelock_eps` 0 (its bookkeeping, no lock) every cached run is still upstream's, row for
/// row; with locks, the forwards compute fewer rows than the cache alone and the answers stay
/// well formed.
#[test]
fn surelock_composes_with_the_cache() -> Result<()> {
    let golden = FastGolden::load()?;
    let (model, planner) = fixture()?;
    let runs: Vec<&Value> = golden
        .greedy_runs()
        .into_iter()
        .filter(|r| mode(r) != KvCacheMode::None)
        .collect();
    let mut ps = runs
        .iter()
        .map(|r| {
            program(
                &planner,
                run_spec_with(&golden, r, true, surelock(0.0, None)),
            )
        })
        .collect::<Result<Vec<_>>>()?;
    run(&model, &mut ps)?;
    for (r, p) in runs.iter().zip(&ps) {
        check(r, p).context("surelock_eps 0")?;
    }
    let (mut locked, mut fewer) = (0, 0);
    for r in &runs {
        let mut ps = vec![
            program(&planner, run_spec(&golden, r, false))?,
            program(
                &planner,
                run_spec_with(&golden, r, false, surelock(5e-2, None)),
            )?,
        ];
        run(&model, &mut ps)?;
        let rows = |p: &MdProgram| p.steps().iter().map(|s| s.rows.len()).sum::<usize>();
        ensure!(rows(&ps[1]) <= rows(&ps[0]) || ps[1].steps().len() != ps[0].steps().len());
        ensure!(
            !ps[1].tokens().contains(&460),
            "a mask left in {}",
            r["name"]
        );
        locked += ps[1].locked().len();
        fewer += usize::from(rows(&ps[1]) < rows(&ps[0]));
    }
    ensure!(
        locked > 0 && fewer > 0,
        "no lock saved a row ({locked} locks)"
    );
    Ok(())
}

/// The sampled run (`torch.manual_seed(1234)`, temperature 1, prefix cache, threshold 0.5):
/// with upstream's own uniforms replayed (`ln(-ln U)` of the stored `U`, per forward and block
/// position), every token, forward, row and commit is upstream's.
#[test]
fn the_sampled_run_matches_upstream_with_its_draws_replayed() -> Result<()> {
    let golden = FastGolden::load()?;
    let (model, planner) = fixture()?;
    let runs = golden.json["runs"].as_array().context("runs")?;
    let r = runs
        .iter()
        .find(|r| r["temperature"].as_f64() == Some(1.0))
        .context("the sampled run")?;
    let name = r["name"].as_str().context("name")?;
    let u = golden
        .tensors
        .get(&format!("{name}.gumbel_u"))
        .context("gumbel_u")?;
    let dim = u.dim(2)?;
    let noise: Vec<f32> = u
        .flatten_all()?
        .to_vec1::<f64>()?
        .into_iter()
        .map(|u| (-u.ln()).ln() as f32)
        .collect();
    let mut s = run_spec(&golden, r, true);
    s.sampling.temperature = 1.0;
    s.replay_draws = Some(std::sync::Arc::new(crate::ReplayDraws { dim, data: noise }));
    let mut ps = vec![program(&planner, s)?];
    run(&model, &mut ps)?;
    check(r, &ps[0])
}

/// Fast-dLLM's cached modes over bf16 K/V pages (`--kv-cache-dtype bf16`): every cached greedy
/// run of the fixture, served, produces what it produces alone when the runs join one
/// another's ticks (prefix and dual caches of different blocks and rules in one forward, their
/// pages rounded to bf16 as they are written); most decode upstream's float32 tokens.
#[test]
fn cached_runs_over_bf16_pages_are_served_alike_alone_and_joining() -> Result<()> {
    use crate::options::{KvCacheDtype, LoadOptions};
    let golden = FastGolden::load()?;
    let runs: Vec<&Value> = golden
        .greedy_runs()
        .into_iter()
        .filter(|r| mode(r) != KvCacheMode::None)
        .collect();
    let specs: Vec<GenerateSpec> = runs.iter().map(|r| run_spec(&golden, r, false)).collect();
    let served = crate::registry::load_model(
        fixture_files()?,
        LoadOptions {
            name: "llada-fixture".into(),
            max_active: specs.len(),
            kv_cache_dtype: KvCacheDtype::Bf16,
            ..LoadOptions::default()
        },
    )?;
    let alone =
        crate::test_support::assert_joining_requests_match_alone(served.as_ref(), &specs, |_| {
            true
        })?;
    let same = runs
        .iter()
        .zip(&alone)
        .filter(|(r, o)| {
            // Upstream's output is the prompt and the generated tokens.
            let ids: Vec<u32> = serde_json::from_value(r["output_ids"].clone()).unwrap_or_default();
            ids.get(golden.prompt(r).len()..) == Some(o.tokens.as_slice())
        })
        .count();
    ensure!(
        2 * same >= runs.len(),
        "{same} of {} cached runs decode upstream's tokens over bf16 pages",
        runs.len()
    );
    served.shutdown();
    Ok(())
}
