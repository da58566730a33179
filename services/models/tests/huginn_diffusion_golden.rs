//! Diffusion-forcing golden cases (upstream `generate_diffusion_style`, Geiping et al. 2025,
//! Algorithm 2) driven through the packed model API, as a check of the KV cache under the
//! sampler's access pattern: wavefront writes at the cache length, compress-s4 overwrites, and
//! `truncate` after every freeze test. The loop below restates the README of
//! tests/fixtures/huginn step by step (including upstream's misaligned freeze criterion right
//! after a freeze) and compares each outer step with the recorded trace. All four cases run alone
//! and packed into the same calls.

mod common;

use anyhow::{ensure, Result};
use candle_core::{DType, Tensor};
use common::{fixture_model, Golden};
use wavefront_models::device::test_device;
use wavefront_models::{relative_change, Huginn, HuginnCache, SeqRows};

const CASES: [&str; 4] = [
    "diffusion_w8",
    "diffusion_w32",
    "diffusion_w32_noise0.5",
    "diffusion_w32_zeroinit",
];

struct Settings {
    max_new_tokens: usize,
    num_steps: usize,
    inner_recurrence: usize,
    exit_t: f32,
    ema_embeds: f64,
    state_noise_mixing: f64,
    headway: usize,
    max_wavefront: usize,
}

/// What one outer step did, in the trace's terms.
#[derive(Debug, PartialEq)]
struct StepRecord {
    wavefront_start: usize,
    wavefront_size: usize,
    input_tokens: Vec<u32>,
    decoded_tokens: Vec<u32>,
    exit_positions: Vec<usize>,
    frozen_len_after: usize,
    kv_len_after: usize,
}

struct Request {
    name: &'static str,
    s: Settings,
    cache: HuginnCache,
    draws: Option<Tensor>,
    next_draw: usize,
    prompt_len: usize,
    frozen: Vec<u32>,
    cur: Vec<u32>,
    /// Wavefront states, positions c.. (c = cache length).
    z: Tensor,
    z_prev: Tensor,
    c_old: usize,
    e_old: Option<Tensor>,
    /// Recurrences run per position (for the dampened noise mixer).
    counter: Vec<f64>,
    trace: Vec<StepRecord>,
    criteria: Vec<Vec<f32>>,
}

fn cat_rows(parts: &[Tensor]) -> Result<Tensor> {
    Ok(if parts.len() == 1 {
        parts[0].clone()
    } else {
        Tensor::cat(parts, 0)?
    })
}

fn split_rows(t: &Tensor, lens: &[usize]) -> Result<Vec<Tensor>> {
    let mut off = 0;
    let mut out = Vec::new();
    for &n in lens {
        out.push(t.narrow(0, off, n)?);
        off += n;
    }
    Ok(out)
}

impl Request {
    fn new(golden: &Golden, name: &'static str, dim: usize) -> Result<Self> {
        let c = &golden.case(name)["settings"];
        let u = |k: &str| c[k].as_u64().unwrap() as usize;
        let f = |k: &str| c[k].as_f64().unwrap();
        let s = Settings {
            max_new_tokens: u("max_new_tokens"),
            num_steps: u("num_steps"),
            inner_recurrence: u("inner_recurrence"),
            exit_t: f("exit_t") as f32,
            ema_embeds: f("ema_embeds"),
            state_noise_mixing: f("state_noise_mixing"),
            headway: u("headway"),
            max_wavefront: u("max_wavefront"),
        };
        let draws = if f("init_scale") == 0.0 {
            None
        } else {
            Some(golden.tensor(&format!("{name}.init_draws"))?.clone())
        };
        let prompt = golden.prompt_ids();
        let empty = Tensor::zeros((0, dim), DType::F32, &test_device())?;
        Ok(Self {
            name,
            cache: HuginnCache::new(c["cache_lookup_strategy"].as_str().unwrap().parse()?),
            draws,
            next_draw: 0,
            prompt_len: prompt.len(),
            frozen: prompt.clone(),
            cur: prompt,
            z: empty.clone(),
            z_prev: empty,
            c_old: 0,
            e_old: None,
            counter: Vec::new(),
            trace: Vec::new(),
            criteria: Vec::new(),
            s,
        })
    }

    /// The next `n` initial-state draws (recorded rows in call order, or zeros).
    fn draw(&mut self, n: usize, dim: usize) -> Result<Tensor> {
        Ok(match &self.draws {
            Some(d) => {
                let rows = d.narrow(0, self.next_draw, n)?;
                self.next_draw += n;
                rows
            }
            None => Tensor::zeros((n, dim), DType::F32, &test_device())?,
        })
    }

    fn done(&self) -> bool {
        self.frozen.len() - self.prompt_len >= self.s.max_new_tokens
    }

    fn counter_add(&mut self, from: usize, n: usize, by: f64) {
        if self.counter.len() < from + n {
            self.counter.resize(from + n, 0.0);
        }
        self.counter[from..from + n]
            .iter_mut()
            .for_each(|c| *c += by);
    }

    fn check(&self, golden: &Golden) -> Result<()> {
        let case = golden.case(self.name);
        let want: Vec<u32> = serde_json::from_value(case["new_tokens"].clone())?;
        let got = &self.frozen[self.prompt_len..];
        // Step by step first, so a divergence names the outer step where it began and the
        // freeze criteria it was decided on, against the threshold.
        let trace = case["trace"].as_array().unwrap();
        for (i, (t, got)) in trace.iter().zip(&self.trace).enumerate() {
            let v = |k: &str| -> Vec<u64> { serde_json::from_value(t[k].clone()).unwrap() };
            let want = StepRecord {
                wavefront_start: t["wavefront_start"].as_u64().unwrap() as usize,
                wavefront_size: t["wavefront_size"].as_u64().unwrap() as usize,
                input_tokens: v("input_tokens").into_iter().map(|x| x as u32).collect(),
                decoded_tokens: v("decoded_tokens").into_iter().map(|x| x as u32).collect(),
                exit_positions: v("exit_positions")
                    .into_iter()
                    .map(|x| x as usize)
                    .collect(),
                frozen_len_after: t["frozen_len_after"].as_u64().unwrap() as usize,
                kv_len_after: t["kv_len_after"].as_u64().unwrap() as usize,
            };
            let crit: Vec<f32> = serde_json::from_value::<Vec<f64>>(t["criterion"].clone())?
                .into_iter()
                .map(|x| x as f32)
                .collect();
            let mine = &self.criteria[i];
            ensure!(
                *got == want,
                "{} step {i}: got {got:?}, upstream {want:?}; criteria {mine:?}, upstream \
                 {crit:?}, exit threshold {}",
                self.name,
                self.s.exit_t
            );
            ensure!(
                mine.len() == crit.len(),
                "{} step {i}: criterion length",
                self.name
            );
            for (a, b) in mine.iter().zip(&crit) {
                ensure!(
                    (a - b).abs() <= 1e-4 + 1e-3 * b.abs(),
                    "{} step {i}: criterion {a} vs {b}",
                    self.name
                );
            }
        }
        ensure!(
            trace.len() == self.trace.len(),
            "{}: {} steps, upstream {}",
            self.name,
            self.trace.len(),
            trace.len()
        );
        ensure!(
            got == want.as_slice(),
            "{}: tokens {got:?}, upstream {want:?}",
            self.name
        );
        Ok(())
    }
}

/// Full prefill of every request: prompt through `num_steps` recurrences, greedy token, first
/// wavefront state and (with momentum) the cache-free prelude of prompt + token.
fn prefill(model: &Huginn, reqs: &mut [&mut Request]) -> Result<()> {
    let dim = model.config().n_embd;
    let lens: Vec<usize> = reqs.iter().map(|r| r.prompt_len).collect();
    let ids: Vec<u32> = reqs.iter().flat_map(|r| r.frozen.clone()).collect();
    let mut seqs: Vec<SeqRows> = reqs
        .iter_mut()
        .zip(&lens)
        .map(|(r, &n)| SeqRows::new(&mut r.cache, 0, n))
        .collect();
    let e = model.prelude(&model.embed(&ids)?, &mut seqs)?;
    drop(seqs);
    let mut state = cat_rows(
        &reqs
            .iter_mut()
            .zip(&lens)
            .map(|(r, &n)| r.draw(n, dim))
            .collect::<Result<Vec<_>>>()?,
    )?;
    let steps = reqs[0].s.num_steps;
    for t in 0..steps {
        let mut seqs: Vec<SeqRows> = reqs
            .iter_mut()
            .zip(&lens)
            .map(|(r, &n)| SeqRows::new(&mut r.cache, 0, n).at_recurrence(t))
            .collect();
        state = model.core_step(&state, &e, &mut seqs)?;
    }
    let mut seqs: Vec<SeqRows> = reqs
        .iter_mut()
        .zip(&lens)
        .map(|(r, &n)| SeqRows::new(&mut r.cache, 0, n))
        .collect();
    let logits = model.predict_from_latents(&state, &mut seqs)?;
    drop(seqs);
    for (r, logits) in reqs.iter_mut().zip(split_rows(&logits, &lens)?) {
        let l = r.prompt_len;
        let y = logits.get(l - 1)?.argmax(0)?.to_scalar::<u32>()?;
        r.frozen.push(y);
        r.cur = r.frozen.clone();
        let steps = r.s.num_steps as f64;
        r.counter_add(0, l + 1, steps);
        r.z = r.draw(1, dim)?;
        r.z_prev = r.z.clone();
        r.c_old = 0;
        if r.s.ema_embeds > 0.0 {
            let mut scratch = HuginnCache::new(r.cache.strategy());
            let ids = r.cur.clone();
            r.e_old = Some(model.prelude(
                &model.embed(&ids)?,
                &mut [SeqRows::new(&mut scratch, 0, ids.len())],
            )?);
        }
    }
    Ok(())
}

/// One outer step of every request, all packed into the same calls.
fn step(model: &Huginn, reqs: &mut [&mut Request]) -> Result<()> {
    let dim = model.config().n_embd;
    let starts: Vec<usize> = reqs.iter().map(|r| r.cache.len()).collect();
    let sizes: Vec<usize> = reqs.iter().map(|r| r.z.dim(0).unwrap()).collect();
    for (r, &c) in reqs.iter().zip(&starts) {
        ensure!(
            c + 1 == r.frozen.len(),
            "{}: cache length {c} vs frozen {}",
            r.name,
            r.frozen.len()
        );
    }
    let inputs: Vec<Vec<u32>> = reqs
        .iter()
        .zip(starts.iter().zip(&sizes))
        .map(|(r, (&c, &s))| r.cur[c..c + s].to_vec())
        .collect();

    // Prelude over the wavefront tokens, then embedding momentum.
    let mut seqs: Vec<SeqRows> = reqs
        .iter_mut()
        .zip(starts.iter().zip(&sizes))
        .map(|(r, (&c, &s))| SeqRows::new(&mut r.cache, c, s))
        .collect();
    let ids: Vec<u32> = inputs.concat();
    let e_new = split_rows(&model.prelude(&model.embed(&ids)?, &mut seqs)?, &sizes)?;
    drop(seqs);
    let mut injected = Vec::new();
    for (i, r) in reqs.iter_mut().enumerate() {
        let (c, s, eta) = (starts[i], sizes[i], r.s.ema_embeds);
        let mut e = (&e_new[i] * (1.0 - eta))?;
        if let Some(old) = &r.e_old {
            let off = c - r.c_old;
            let n = old.dim(0)?.saturating_sub(off).min(s);
            if n > 0 {
                let head = (e.narrow(0, 0, n)? + (old.narrow(0, off, n)? * eta)?)?;
                e = if n < s {
                    Tensor::cat(&[head, e.narrow(0, n, s - n)?], 0)?
                } else {
                    head
                };
            }
        }
        if eta > 0.0 {
            r.e_old = Some(e.clone());
        }
        injected.push(e);
        // Noise mixing, damped by each position's recurrence count.
        let beta = r.s.state_noise_mixing;
        if beta > 0.0 {
            let noise = r.draw(s, dim)?;
            let b: Vec<f32> = (0..s)
                .map(|p| (beta / (1.0 + r.counter.get(c + p).copied().unwrap_or(0.0))) as f32)
                .collect();
            let b = Tensor::from_vec(b, (s, 1), &test_device())?;
            r.z = (r.z.broadcast_mul(&(1.0 - &b)?)? + noise.broadcast_mul(&b)?)?;
        }
    }

    // Inner recurrences over the wavefront.
    let inner = reqs[0].s.inner_recurrence;
    let e = cat_rows(&injected)?;
    let mut z = cat_rows(&reqs.iter().map(|r| r.z.clone()).collect::<Vec<_>>())?;
    for t in 0..inner {
        let mut seqs: Vec<SeqRows> = reqs
            .iter_mut()
            .zip(starts.iter().zip(&sizes))
            .map(|(r, (&c, &s))| SeqRows::new(&mut r.cache, c, s).at_recurrence(t))
            .collect();
        z = model.core_step(&z, &e, &mut seqs)?;
    }
    let mut seqs: Vec<SeqRows> = reqs
        .iter_mut()
        .zip(starts.iter().zip(&sizes))
        .map(|(r, (&c, &s))| SeqRows::new(&mut r.cache, c, s))
        .collect();
    let logits = model.predict_from_latents(&z, &mut seqs)?;
    drop(seqs);
    let decoded: Vec<u32> = logits.argmax(1)?.to_vec1()?;
    let decoded = split_rows(&Tensor::new(decoded.as_slice(), &test_device())?, &sizes)?;

    for (i, r) in reqs.iter_mut().enumerate() {
        let (c, s) = (starts[i], sizes[i]);
        r.counter_add(c, s, inner as f64);
        let new: Vec<u32> = decoded[i].to_vec1()?;
        r.cur = r.frozen.clone();
        r.cur.extend_from_slice(&new);
        let fresh = r.draw(r.s.headway, dim)?;
        let mut zi = Tensor::cat(&[z.narrow(0, starts_offset(&sizes, i), s)?, fresh], 0)?;
        if zi.dim(0)? > r.s.max_wavefront {
            zi = zi.narrow(0, 0, r.s.max_wavefront)?;
            r.cur.truncate(c + r.s.max_wavefront);
        }
        // Freeze test against the previous states, indexed as upstream does.
        let off = c - r.c_old;
        let prev_rows = r.z_prev.dim(0)?;
        let n = prev_rows.saturating_sub(off).min(zi.dim(0)?);
        let crit: Vec<f32> = if n > 0 {
            relative_change(&zi.narrow(0, 0, n)?, &r.z_prev.narrow(0, off, n)?)?.to_vec1()?
        } else {
            Vec::new()
        };
        let exits: Vec<usize> = (0..crit.len()).filter(|&j| crit[j] < r.s.exit_t).collect();
        if let Some(&last) = exits.last() {
            let k = c + last + 1;
            r.frozen = r.cur[..k].to_vec();
            r.cache.truncate(k - 1);
            zi = zi.narrow(0, last, zi.dim(0)? - last)?;
        } else {
            r.cache.truncate(c);
        }
        r.z = zi.clone();
        r.z_prev = zi;
        r.c_old = c;
        r.criteria.push(crit);
        r.trace.push(StepRecord {
            wavefront_start: c,
            wavefront_size: s,
            input_tokens: inputs[i].clone(),
            decoded_tokens: new,
            exit_positions: exits.iter().map(|j| c + j).collect(),
            frozen_len_after: r.frozen.len(),
            kv_len_after: r.cache.len(),
        });
    }
    Ok(())
}

fn starts_offset(sizes: &[usize], i: usize) -> usize {
    sizes[..i].iter().sum()
}

fn run(model: &Huginn, reqs: &mut [Request]) -> Result<()> {
    prefill(model, &mut reqs.iter_mut().collect::<Vec<_>>())?;
    loop {
        let mut active: Vec<&mut Request> = reqs.iter_mut().filter(|r| !r.done()).collect();
        if active.is_empty() {
            return Ok(());
        }
        step(model, &mut active)?;
    }
}

#[test]
fn diffusion_cases_one_at_a_time() -> Result<()> {
    let golden = Golden::load()?;
    let model = fixture_model()?;
    let dim = model.config().n_embd;
    for name in CASES {
        let mut req = [Request::new(&golden, name, dim)?];
        run(&model, &mut req)?;
        req[0].check(&golden)?;
    }
    Ok(())
}

#[test]
fn diffusion_cases_packed_together() -> Result<()> {
    let golden = Golden::load()?;
    let model = fixture_model()?;
    let dim = model.config().n_embd;
    let mut reqs = CASES
        .iter()
        .map(|n| Request::new(&golden, n, dim))
        .collect::<Result<Vec<_>>>()?;
    run(&model, &mut reqs)?;
    for r in &reqs {
        r.check(&golden)?;
    }
    Ok(())
}
