//! Autoregressive golden cases (upstream `generate_minimal` and
//! `generate_with_adaptive_compute`) driven through the packed model API: every `ar_*` case of
//! tests/fixtures/huginn, run one request at a time and all requests packed into the same calls,
//! with the recorded initial-state draws replayed. This checks the KV-cache strategies (`full`,
//! `latest-m4-compress-s4`, `latest-m4-compress-s16`, and the `latest-m4` fallback of adaptive
//! exits) end to end, and that packing does not change any request's result.

mod common;

use anyhow::{ensure, Result};
use candle_core::{DType, Tensor};
use common::{assert_close, fixture_model, Golden};
use wavefront_models::device::test_device;
use wavefront_models::{relative_change, Huginn, HuginnCache, SeqRows};

const CASES: [&str; 8] = [
    "ar_static_s4_full",
    "ar_static_s8_full",
    "ar_static_s4_share4",
    "ar_static_s8_share4",
    "ar_static_s8_share16",
    "ar_static_s8_full_zeroinit",
    "ar_adaptive_latest_m4",
    "ar_adaptive_latest_m4_share4",
];

/// One request of the reference AR loop.
struct Request {
    name: &'static str,
    cache: HuginnCache,
    /// Tokens not yet run (the prompt first, then the last sampled token).
    pending: Vec<u32>,
    /// Recurrences per token (static) or the maximum (adaptive).
    num_steps: usize,
    exit_threshold: Option<f32>,
    /// Recorded initial states, row p = position p (None: zeros).
    draws: Option<Tensor>,
    max_new_tokens: usize,
    tokens: Vec<u32>,
    steps: Vec<usize>,
    exit_values: Vec<Vec<f32>>,
    next_logits: Vec<Tensor>,
}

impl Request {
    fn new(golden: &Golden, name: &'static str) -> Result<Self> {
        let c = golden.case(name);
        let adaptive = c["criterion"].as_str() == Some("latent-diff");
        let num_steps = if adaptive {
            c["max_steps"].as_u64()
        } else {
            c["num_steps"].as_u64()
        };
        let init_scale = c["init_scale"].as_f64().unwrap_or(1.0);
        let draws = if init_scale == 0.0 {
            None
        } else {
            Some(golden.tensor(&format!("{name}.init_draws"))?.clone())
        };
        Ok(Self {
            name,
            cache: HuginnCache::new(c["cache_lookup_strategy"].as_str().unwrap().parse()?),
            pending: golden.prompt_ids(),
            num_steps: num_steps.unwrap() as usize,
            exit_threshold: adaptive.then(|| c["exit_threshold"].as_f64().unwrap() as f32),
            draws,
            max_new_tokens: c["new_tokens"].as_array().unwrap().len(),
            tokens: Vec::new(),
            steps: Vec::new(),
            exit_values: Vec::new(),
            next_logits: Vec::new(),
        })
    }

    fn done(&self) -> bool {
        self.tokens.len() >= self.max_new_tokens
    }

    fn check(&self, golden: &Golden) -> Result<()> {
        let c = golden.case(self.name);
        let want: Vec<u32> = serde_json::from_value(c["new_tokens"].clone())?;
        ensure!(
            self.tokens == want,
            "{}: tokens {:?}, upstream {:?}",
            self.name,
            self.tokens,
            want
        );
        if self.exit_threshold.is_some() {
            let want: Vec<usize> = serde_json::from_value(c["steps_per_token"].clone())?;
            ensure!(
                self.steps == want,
                "{}: steps {:?}, upstream {:?}",
                self.name,
                self.steps,
                want
            );
            let want: Vec<Vec<f32>> = serde_json::from_value(c["exit_values_per_token"].clone())?;
            // On a GPU a packed row is summed in another order than alone (cuBLAS picks its
            // kernel by row count), and the random core's recurrence amplifies that along the
            // iterations: at token 14 of ar_adaptive_latest_m4 joining late, an H200 measured
            // 0.8985 against 0.9001 (0.18%) early in the token's iterations and 0.4363 against
            // 0.4391 (0.62%) later, with every token and step count still upstream's.
            let rel = if test_device().is_cuda() { 1e-2 } else { 1e-3 };
            for (t, (got, want)) in self.exit_values.iter().zip(&want).enumerate() {
                ensure!(
                    got.len() == want.len(),
                    "{}: token {t} exit values",
                    self.name
                );
                for (g, w) in got.iter().zip(want) {
                    ensure!(
                        (g - w).abs() <= 1e-4 + rel * w.abs(),
                        "{}: token {t} exit value {g} vs {w}",
                        self.name
                    );
                }
            }
        }
        if let Some(want) = golden
            .tensors
            .get(&format!("{}.next_token_logits", self.name))
        {
            let got = Tensor::stack(&self.next_logits, 0)?;
            assert_close(
                &format!("{} next_token_logits", self.name),
                &got,
                want,
                1e-4,
            )?;
        }
        Ok(())
    }
}

fn cat_rows(parts: &[Tensor]) -> Result<Tensor> {
    Ok(if parts.len() == 1 {
        parts[0].clone()
    } else {
        Tensor::cat(parts, 0)?
    })
}

/// One token for every request of `reqs`, all packed into the same model calls.
fn tick(model: &Huginn, reqs: &mut [&mut Request]) -> Result<()> {
    let dim = model.config().n_embd;
    let starts: Vec<usize> = reqs.iter().map(|r| r.cache.len()).collect();
    let lens: Vec<usize> = reqs.iter().map(|r| r.pending.len()).collect();
    let ids: Vec<u32> = reqs.iter().flat_map(|r| r.pending.clone()).collect();

    let emb = model.embed(&ids)?;
    let mut seqs: Vec<SeqRows> = reqs
        .iter_mut()
        .enumerate()
        .map(|(i, r)| SeqRows::new(&mut r.cache, starts[i], lens[i]))
        .collect();
    let injected = model.prelude(&emb, &mut seqs)?;
    drop(seqs);

    let mut offset = 0;
    let mut inj = Vec::new();
    let mut states = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        inj.push(injected.narrow(0, offset, lens[i])?);
        offset += lens[i];
        states.push(match &r.draws {
            Some(d) => d.narrow(0, starts[i], lens[i])?,
            None => Tensor::zeros((lens[i], dim), DType::F32, &test_device())?,
        });
    }

    let mut steps = vec![0usize; reqs.len()];
    let mut iterating = vec![true; reqs.len()];
    let mut exit_values = vec![Vec::new(); reqs.len()];
    for t in 0.. {
        let members: Vec<usize> = (0..reqs.len()).filter(|&i| iterating[i]).collect();
        if members.is_empty() {
            break;
        }
        let s = cat_rows(
            &members
                .iter()
                .map(|&i| states[i].clone())
                .collect::<Vec<_>>(),
        )?;
        let e = cat_rows(&members.iter().map(|&i| inj[i].clone()).collect::<Vec<_>>())?;
        let mut seqs: Vec<SeqRows> = reqs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| iterating[*i])
            .map(|(i, r)| SeqRows::new(&mut r.cache, starts[i], lens[i]).at_recurrence(t))
            .collect();
        let next = model.core_step(&s, &e, &mut seqs)?;
        drop(seqs);
        let change: Vec<f32> = relative_change(&next, &s)?.to_vec1()?;
        let mut row = 0;
        for &i in &members {
            let n = lens[i];
            states[i] = next.narrow(0, row, n)?;
            steps[i] += 1;
            let v = change[row..row + n].iter().sum::<f32>() / n as f32;
            row += n;
            let exited = match reqs[i].exit_threshold {
                Some(eps) => {
                    exit_values[i].push(v);
                    v < eps
                }
                None => false,
            };
            if exited || steps[i] >= reqs[i].num_steps {
                iterating[i] = false;
            }
        }
    }

    let mut seqs: Vec<SeqRows> = reqs
        .iter_mut()
        .enumerate()
        .map(|(i, r)| SeqRows::new(&mut r.cache, starts[i], lens[i]))
        .collect();
    let hidden = model.coda(&cat_rows(&states)?, &mut seqs)?;
    drop(seqs);
    let mut last = Vec::new();
    let mut offset = 0;
    for &n in &lens {
        offset += n;
        last.push(offset as u32 - 1);
    }
    let logits =
        model.lm_head(&hidden.index_select(&Tensor::new(last.as_slice(), &test_device())?, 0)?)?;
    let next: Vec<u32> = logits.argmax(1)?.to_vec1()?;
    for (i, r) in reqs.iter_mut().enumerate() {
        r.tokens.push(next[i]);
        r.steps.push(steps[i]);
        r.exit_values.push(std::mem::take(&mut exit_values[i]));
        r.next_logits.push(logits.get(i)?);
        r.pending = vec![next[i]];
    }
    Ok(())
}

fn run(model: &Huginn, reqs: &mut [Request]) -> Result<()> {
    loop {
        let mut active: Vec<&mut Request> = reqs.iter_mut().filter(|r| !r.done()).collect();
        if active.is_empty() {
            return Ok(());
        }
        tick(model, &mut active)?;
    }
}

#[test]
fn ar_cases_one_at_a_time() -> Result<()> {
    let golden = Golden::load()?;
    let model = fixture_model()?;
    for name in CASES {
        let mut req = [Request::new(&golden, name)?];
        run(&model, &mut req)?;
        req[0].check(&golden)?;
    }
    Ok(())
}

#[test]
fn ar_cases_packed_together() -> Result<()> {
    let golden = Golden::load()?;
    let model = fixture_model()?;
    let mut reqs = CASES
        .iter()
        .map(|n| Request::new(&golden, n))
        .collect::<Result<Vec<_>>>()?;
    run(&model, &mut reqs)?;
    for r in &reqs {
        r.check(&golden)?;
    }
    Ok(())
}

#[test]
fn ar_requests_joining_late_are_unaffected() -> Result<()> {
    // Requests at different stages share calls: prefill rows of one request next to decode rows
    // of others.
    let golden = Golden::load()?;
    let model = fixture_model()?;
    let mut reqs = CASES
        .iter()
        .map(|n| Request::new(&golden, n))
        .collect::<Result<Vec<_>>>()?;
    let mut round = 0;
    loop {
        let mut active: Vec<&mut Request> = reqs
            .iter_mut()
            .enumerate()
            .filter(|(i, r)| !r.done() && *i <= round)
            .map(|(_, r)| r)
            .collect();
        if active.is_empty() && round >= CASES.len() {
            break;
        }
        if !active.is_empty() {
            tick(&model, &mut active)?;
        }
        round += 1;
    }
    for r in &reqs {
        r.check(&golden)?;
    }
    Ok(())
}
