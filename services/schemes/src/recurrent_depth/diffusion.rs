//! Diffusion forcing for recurrent-depth models, packed across requests.
//!
//! Geiping et al. 2025, "Efficient Parallel Samplers for Recurrent-Depth Models and Their
//! Connection to Diffusion Language Models", Algorithm 2 (upstream `generate_diffusion_style`;
//! exact semantics restated in tests/fixtures/huginn/README.md). Instead of iterating one token to
//! convergence, a *wavefront* of positions `c .. c+S-1` (c = cache length = last frozen position)
//! advances together: each outer step runs the prelude over the wavefront's current token
//! guesses, mixes the embeddings with the previous step's (momentum `ema_embeds`), optionally
//! mixes fresh noise into the states (`state_noise_mixing`, damped by each position's recurrence
//! count), runs `inner_recurrence` core steps and the coda, and decodes a guess for every position
//! `c+1 .. c+S`. `headway` fresh states extend the wavefront (capped at `max_wavefront`, a
//! "standing wave"). Positions whose state moved less than `exit_t` (relative L2 change since the
//! previous step) freeze, up to the last converged one; KV entries of unfrozen positions are
//! dropped with [`HuginnCache::truncate`] and recomputed next step.
//!
//! The first tick of a request is the full prefill: the prompt through `num_steps` recurrences
//! and a greedy first token. The cache must share its core slots across recurrences
//! (`latest-m4-compress-s4`, upstream's default), so frozen positions keep the KV of the step in
//! which they froze.
//!
//! [`FreezeTest::Upstream`] reproduces the reference code's criterion, which right after a
//! freeze compares each position with the previous state of a position `c - c_old` further on;
//! [`FreezeTest::Aligned`] compares each position with its own previous state.
//!
//! **Headway above 1**: the `headway - 1` positions beyond the last decoded guess have no token
//! yet; upstream feeds uniformly random token ids there, here they come from a per-request RNG
//! seeded with the request's seed (so they are reproducible and batch invariant).
//!
//! **Continuous compute** (upstream `continuous_compute`): the `headway` new positions start
//! from copies of the last `headway` states of the wavefront (after this step's core
//! iterations) instead of fresh draws, as upstream does; the position after the prompt still
//! starts from a fresh draw. No golden covers it.
//!
//! A request stops after [`MAX_SAMPLER_STEPS`] outer steps (upstream `max_diffusion_steps`)
//! with whatever froze so far (finish reason `length`), so a setting that never converges
//! cannot hold its slots forever.
//!
//! Statistics: counters `sampler_steps` (outer steps after the prefill) and `standing_waves`
//! (steps whose wavefront hit `max_wavefront`); series `wavefront_size` (positions iterated in
//! each outer step), `recurrence_steps_per_token` (entry j: core iterations received by
//! position `L + j - 1`, whose state decoded the j-th new token; entry 0 is the prefill's
//! `num_steps`) and `recurrence_per_position` (upstream's per-position counter, prompt
//! included); `forward_passes` counts the prefill and every outer step.
//!
//! One tick advances every active request by one outer step; all requests share each prelude,
//! core and coda call (prefills and wavefronts of different sizes pack together).

use candle_core::{DType, Device, Tensor, D};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use wavefront_engine::{FinishReason, Outbox, Stats};
use wavefront_models::{relative_change, Huginn, HuginnCache, SeqRows};

use super::draws::DrawSource;
use crate::request::FreezeTest;
use crate::sampling::TokenSampler;

/// Outer steps after which a request stops (upstream `max_diffusion_steps`).
pub const MAX_SAMPLER_STEPS: u64 = 4096;

/// Resolved sampler settings of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct DiffusionSettings {
    /// Recurrences of the prefill.
    pub num_steps: usize,
    /// Core steps per outer step (r').
    pub inner_recurrence: usize,
    /// Freeze threshold on the relative state change.
    pub exit_t: f32,
    /// Embedding momentum η.
    pub ema_embeds: f64,
    /// Noise mixing β.
    pub state_noise_mixing: f64,
    /// New positions per outer step.
    pub headway: usize,
    /// Largest wavefront.
    pub max_wavefront: usize,
    pub freeze_test: FreezeTest,
    /// New positions start from the wavefront's last states instead of fresh draws.
    pub continuous_compute: bool,
    /// Token ids of placeholder guesses (headway above 1) are drawn below this.
    pub vocab_size: usize,
}

/// The wavefront of a request past its prefill.
#[derive(Debug)]
struct Wave {
    /// States of positions `c ..` (c = cache length).
    z: Tensor,
    /// States after the previous step, starting at position `prev_start`.
    z_prev: Tensor,
    prev_start: usize,
    /// Wavefront start of the previous step.
    c_old: usize,
    /// Mixed embeddings of the previous step, starting at `c_old` (momentum only).
    e_old: Option<Tensor>,
    /// Core recurrences each position has run.
    counter: Vec<u32>,
}

/// One request's diffusion-forcing state.
#[derive(Debug)]
pub struct DiffusionProgram {
    pub(crate) cache: HuginnCache,
    pub(crate) settings: DiffusionSettings,
    pub(crate) draws: DrawSource,
    pub(crate) sampler: TokenSampler,
    pub(crate) max_new_tokens: usize,
    pub(crate) stop_token_ids: Vec<u32>,
    pub(crate) prompt_len: usize,
    /// Prompt and frozen tokens.
    pub(crate) frozen: Vec<u32>,
    /// `frozen` plus the latest guesses for the wavefront.
    pub(crate) cur: Vec<u32>,
    /// Frozen tokens already streamed.
    pub(crate) emitted: usize,
    wave: Option<Wave>,
    /// Placeholder tokens for positions past the last guess (headway above 1).
    placeholders: Box<StdRng>,
    sampler_steps: u64,
    pub(crate) stats: Stats,
    /// Slots (pages of latent states) the wavefront's states take.
    pub(crate) latent_pages: usize,
}

impl DiffusionProgram {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        prompt_ids: Vec<u32>,
        cache: HuginnCache,
        settings: DiffusionSettings,
        draws: DrawSource,
        sampler: TokenSampler,
        seed: u64,
        max_new_tokens: usize,
        stop_token_ids: Vec<u32>,
    ) -> Self {
        Self {
            placeholders: Box::new(StdRng::seed_from_u64(seed ^ 0x4845_4144_5741_5901)),
            sampler_steps: 0,
            cache,
            settings,
            draws,
            sampler,
            max_new_tokens,
            stop_token_ids,
            prompt_len: prompt_ids.len(),
            cur: prompt_ids.clone(),
            frozen: prompt_ids,
            emitted: 0,
            wave: None,
            stats: Stats::default(),
            latent_pages: 0,
        }
    }

    /// Moves the wavefront's states to `device` (host memory while preempted, back on resume).
    pub(crate) fn move_latents(&mut self, device: &candle_core::Device) -> candle_core::Result<()> {
        if let Some(w) = &mut self.wave {
            w.z = w.z.to_device(device)?;
            w.z_prev = w.z_prev.to_device(device)?;
            if let Some(e) = &w.e_old {
                w.e_old = Some(e.to_device(device)?);
            }
        }
        Ok(())
    }

    /// Positions the next tick runs: the prompt (prefill), then the wavefront.
    pub fn next_rows(&self) -> usize {
        match &self.wave {
            None => self.prompt_len,
            Some(w) => w.z.dim(0).unwrap_or(0),
        }
    }

    /// Tokens frozen after the prompt.
    pub fn generated(&self) -> &[u32] {
        &self.frozen[self.prompt_len..]
    }

    /// Streams newly frozen tokens and finishes on a stop token or at `max_new_tokens`.
    /// Upstream may freeze a few positions past `max_new_tokens` in the last step; they are
    /// not emitted.
    fn emit(&mut self, outbox: &mut Outbox) {
        let generated = &self.frozen[self.prompt_len..];
        let end = generated.len().min(self.max_new_tokens);
        let fresh = &generated[self.emitted.min(end)..end];
        let stop = fresh.iter().position(|t| self.stop_token_ids.contains(t));
        let take = stop.map_or(fresh.len(), |i| i + 1);
        outbox.tokens(fresh[..take].to_vec());
        self.emitted += take;
        let reason = if stop.is_some() {
            Some(FinishReason::StopToken)
        } else if self.emitted >= self.max_new_tokens {
            Some(FinishReason::Length)
        } else {
            None
        };
        if let Some(reason) = reason {
            self.finish(outbox, reason);
        }
    }

    /// Ends the request with its statistics (frozen positions, recurrence per position).
    pub(crate) fn finish(&mut self, outbox: &mut Outbox, reason: FinishReason) {
        let mut stats = std::mem::take(&mut self.stats);
        // Positions the sampler froze (upstream may freeze a few past max_new_tokens).
        stats.add_counter(
            "frozen_positions",
            (self.frozen.len() - self.prompt_len) as u64,
        );
        if let Some(w) = &self.wave {
            let n = self.frozen.len().min(w.counter.len());
            stats
                .series
                .insert("recurrence_per_position".into(), w.counter[..n].to_vec());
            // Token j (position L + j) was decoded from position L + j - 1.
            let per_token = (0..self.emitted)
                .map(|j| w.counter.get(self.prompt_len + j - 1).copied().unwrap_or(0))
                .collect();
            stats
                .series
                .insert("recurrence_steps_per_token".into(), per_token);
        }
        outbox.finish(reason, stats);
    }
}

/// One active diffusion-forcing request as the tick sees it.
pub type Entry<'a> = crate::tick::Entry<'a, DiffusionProgram>;

/// What a request runs in this tick.
struct Plan {
    start: usize,
    len: usize,
    core_steps: usize,
    prefill: bool,
}

fn msg(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

fn cat_rows(parts: &[Tensor]) -> candle_core::Result<Tensor> {
    if parts.len() == 1 {
        Ok(parts[0].clone())
    } else {
        Tensor::cat(parts, 0)
    }
}

fn offsets(lens: &[usize]) -> Vec<usize> {
    lens.iter()
        .scan(0, |acc, &n| {
            let o = *acc;
            *acc += n;
            Some(o)
        })
        .collect()
}

/// `rows` draws of `program` as a `[rows, dim]` tensor on `device`.
fn draw(
    p: &mut DiffusionProgram,
    rows: usize,
    dim: usize,
    bf16: bool,
    device: &Device,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    let data = p
        .draws
        .next(rows, dim, bf16)
        .map_err(candle_core::Error::Msg)?;
    Tensor::from_vec(data, (rows, dim), &Device::Cpu)?
        .to_device(device)?
        .to_dtype(dtype)
}

/// Runs one outer step (or the prefill) of every program in `batch` in packed calls.
pub fn tick(model: &Huginn, batch: &mut [Entry<'_>]) -> candle_core::Result<()> {
    let block_size = model.config().block_size;
    // Requests whose next wavefront would leave the RoPE table stop here.
    let mut entries: Vec<&mut Entry<'_>> = Vec::with_capacity(batch.len());
    for e in batch.iter_mut() {
        let p = &mut *e.program;
        if let Some(w) = &p.wave {
            if p.cache.len() + w.z.dim(0)? > block_size {
                p.finish(e.outbox, FinishReason::ContextLimit);
                continue;
            }
        }
        entries.push(e);
    }
    if entries.is_empty() {
        return Ok(());
    }
    let device = model.device().clone();
    let dtype = model.dtype();
    let dim = model.config().n_embd;

    let plans: Vec<Plan> = entries
        .iter()
        .map(|e| {
            let p = &e.program;
            match &p.wave {
                None => Plan {
                    start: 0,
                    len: p.prompt_len,
                    core_steps: p.settings.num_steps,
                    prefill: true,
                },
                Some(w) => Plan {
                    start: p.cache.len(),
                    len: w.z.dim(0).unwrap_or(0),
                    core_steps: p.settings.inner_recurrence,
                    prefill: false,
                },
            }
        })
        .collect();
    let lens: Vec<usize> = plans.iter().map(|pl| pl.len).collect();
    let offs = offsets(&lens);
    let ids: Vec<u32> = entries
        .iter()
        .zip(&plans)
        .flat_map(|(e, pl)| e.program.cur[pl.start..pl.start + pl.len].to_vec())
        .collect();

    // Prelude over prompts and wavefronts.
    let e_new = {
        let mut seqs: Vec<SeqRows> = entries
            .iter_mut()
            .zip(&plans)
            .map(|(e, pl)| SeqRows::new(&mut e.program.cache, pl.start, pl.len))
            .collect();
        model
            .prelude(&model.embed(&ids).map_err(msg)?, &mut seqs)
            .map_err(msg)?
    };

    // Injected embeddings (with momentum) and states (fresh, or noise-mixed) per request.
    let mut injected = Vec::with_capacity(entries.len());
    let mut states = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter_mut().enumerate() {
        let p = &mut *e.program;
        let pl = &plans[i];
        let e_i = e_new.narrow(0, offs[i], pl.len)?;
        if pl.prefill {
            injected.push(e_i);
            states.push(draw(p, pl.len, dim, false, &device, dtype)?);
            continue;
        }
        let (eta, beta) = (p.settings.ema_embeds, p.settings.state_noise_mixing);
        let w = p.wave.as_mut().expect("planned as a wavefront");
        let mut e_mix = if eta > 0.0 {
            (&e_i * (1.0 - eta))?
        } else {
            e_i
        };
        if let Some(old) = &w.e_old {
            let off = pl.start - w.c_old;
            let n = old.dim(0)?.saturating_sub(off).min(pl.len);
            if n > 0 {
                let head = (e_mix.narrow(0, 0, n)? + (old.narrow(0, off, n)? * eta)?)?;
                e_mix = if n < pl.len {
                    Tensor::cat(&[head, e_mix.narrow(0, n, pl.len - n)?], 0)?
                } else {
                    head
                };
            }
        }
        if eta > 0.0 {
            w.e_old = Some(e_mix.clone());
        }
        injected.push(e_mix);
        let mut z = w.z.clone();
        if beta > 0.0 {
            let b: Vec<f32> = (0..pl.len)
                .map(|k| {
                    (beta / (1.0 + f64::from(w.counter.get(pl.start + k).copied().unwrap_or(0))))
                        as f32
                })
                .collect();
            let b = Tensor::from_vec(b, (pl.len, 1), &Device::Cpu)?
                .to_device(&device)?
                .to_dtype(dtype)?;
            let data = p
                .draws
                .next(pl.len, dim, false)
                .map_err(candle_core::Error::Msg)?;
            let noise = Tensor::from_vec(data, (pl.len, dim), &Device::Cpu)?
                .to_device(&device)?
                .to_dtype(dtype)?;
            z = (z.broadcast_mul(&(1.0 - &b)?)? + noise.broadcast_mul(&b)?)?;
        }
        states.push(z);
    }

    // Core steps: request i takes part in its first `core_steps` calls.
    let max_steps = plans.iter().map(|pl| pl.core_steps).max().unwrap_or(0);
    for t in 0..max_steps {
        let members: Vec<usize> = (0..plans.len())
            .filter(|&i| plans[i].core_steps > t)
            .collect();
        let s = cat_rows(
            &members
                .iter()
                .map(|&i| states[i].clone())
                .collect::<Vec<_>>(),
        )?;
        let inj = cat_rows(
            &members
                .iter()
                .map(|&i| injected[i].clone())
                .collect::<Vec<_>>(),
        )?;
        let next = {
            let mut seqs: Vec<SeqRows> = entries
                .iter_mut()
                .zip(&plans)
                .filter(|(_, pl)| pl.core_steps > t)
                .map(|(e, pl)| {
                    SeqRows::new(&mut e.program.cache, pl.start, pl.len).at_recurrence(t)
                })
                .collect();
            model.core_step(&s, &inj, &mut seqs).map_err(msg)?
        };
        let mut row = 0;
        for &i in &members {
            states[i] = next.narrow(0, row, plans[i].len)?;
            row += plans[i].len;
        }
    }

    // Coda over every row (its KV is read by later steps); head on the rows that are decoded:
    // the last prompt row of a prefill, every row of a wavefront.
    let hidden = {
        let mut seqs: Vec<SeqRows> = entries
            .iter_mut()
            .zip(&plans)
            .map(|(e, pl)| SeqRows::new(&mut e.program.cache, pl.start, pl.len))
            .collect();
        model.coda(&cat_rows(&states)?, &mut seqs).map_err(msg)?
    };
    let mut rows: Vec<u32> = Vec::new();
    let mut decoded_lens = Vec::with_capacity(plans.len());
    for (i, pl) in plans.iter().enumerate() {
        let first = if pl.prefill { pl.len - 1 } else { 0 };
        rows.extend((offs[i] + first..offs[i] + pl.len).map(|r| r as u32));
        decoded_lens.push(pl.len - first);
    }
    let logits = model
        .lm_head(&hidden.index_select(&Tensor::new(rows.as_slice(), &device)?, 0)?)
        .map_err(msg)?;
    let decoded: Vec<u32> = if entries.iter().all(|e| e.program.sampler.is_greedy()) {
        logits.argmax(D::Minus1)?.to_dtype(DType::U32)?.to_vec1()?
    } else {
        let all = logits.to_vec2::<f32>()?;
        let mut out = Vec::with_capacity(all.len());
        let mut k = 0;
        for (e, &n) in entries.iter_mut().zip(&decoded_lens) {
            for row in &all[k..k + n] {
                out.push(e.program.sampler.sample(row));
            }
            k += n;
        }
        out
    };
    let decoded_offs = offsets(&decoded_lens);

    // Wavefronts: new guesses, headway, cap; freeze criteria for all requests in one call.
    let mut next_z: Vec<Option<Tensor>> = Vec::with_capacity(entries.len());
    let mut pairs: Vec<(usize, usize)> = Vec::new(); // (request, rows compared)
    let (mut new_parts, mut prev_parts) = (Vec::new(), Vec::new());
    for (i, e) in entries.iter_mut().enumerate() {
        let p = &mut *e.program;
        let pl = &plans[i];
        if pl.prefill {
            next_z.push(None);
            continue;
        }
        let c = pl.start;
        let headway = p.settings.headway;
        let guesses = &decoded[decoded_offs[i]..decoded_offs[i] + decoded_lens[i]];
        p.cur.truncate(p.frozen.len());
        p.cur.extend_from_slice(guesses);
        let vocab = p.settings.vocab_size as u32;
        for _ in 1..headway {
            let t = p.placeholders.random_range(0..vocab);
            p.cur.push(t);
        }
        let fresh = if p.settings.continuous_compute && pl.len >= headway {
            states[i].narrow(0, pl.len - headway, headway)?
        } else {
            draw(p, headway, dim, true, &device, dtype)?
        };
        let w = p.wave.as_mut().expect("planned as a wavefront");
        add_recurrences(&mut w.counter, c, pl.len, pl.core_steps);
        let mut z = Tensor::cat(&[&states[i], &fresh], 0)?;
        let max_w = p.settings.max_wavefront;
        if z.dim(0)? > max_w {
            z = z.narrow(0, 0, max_w)?;
            p.cur.truncate(c + max_w);
            p.stats.add_counter("standing_waves", 1);
        }
        let off = match p.settings.freeze_test {
            FreezeTest::Upstream => c - w.c_old,
            FreezeTest::Aligned => c - w.prev_start,
        };
        let n = w.z_prev.dim(0)?.saturating_sub(off).min(z.dim(0)?);
        if n > 0 {
            new_parts.push(z.narrow(0, 0, n)?);
            prev_parts.push(w.z_prev.narrow(0, off, n)?);
        }
        pairs.push((i, n));
        next_z.push(Some(z));
    }
    let crit: Vec<f32> = if new_parts.is_empty() {
        Vec::new()
    } else {
        relative_change(&cat_rows(&new_parts)?, &cat_rows(&prev_parts)?)
            .map_err(msg)?
            .to_vec1()?
    };

    // Commit wavefronts.
    let mut k = 0;
    for (i, n) in pairs {
        let e = &mut entries[i];
        let p = &mut *e.program;
        let c = plans[i].start;
        let crit_i = &crit[k..k + n];
        k += n;
        let mut z = next_z[i].take().expect("wavefront state");
        let exit_t = p.settings.exit_t;
        let w = p.wave.as_mut().expect("planned as a wavefront");
        match crit_i.iter().rposition(|&v| v < exit_t) {
            Some(last) => {
                let frozen_to = c + last + 1;
                p.frozen = p.cur[..frozen_to].to_vec();
                p.cache.truncate(frozen_to - 1);
                z = z.narrow(0, last, z.dim(0)? - last)?;
                w.prev_start = frozen_to - 1;
            }
            None => {
                p.cache.truncate(c);
                w.prev_start = c;
            }
        }
        w.z_prev = z.clone();
        w.z = z;
        w.c_old = c;
        p.stats.forward_passes += 1;
        p.stats.recurrence_steps += plans[i].core_steps as u64;
        p.stats.add_counter("sampler_steps", 1);
        p.stats.push_series("wavefront_size", plans[i].len as u32);
        p.sampler_steps += 1;
        p.emit(e.outbox);
        if p.sampler_steps >= MAX_SAMPLER_STEPS && !e.outbox.is_done() {
            p.finish(e.outbox, FinishReason::Length);
        }
    }

    // Commit prefills: first token, first wavefront state, cache-free prelude for momentum.
    let mut momentum: Vec<usize> = Vec::new();
    for (i, e) in entries.iter_mut().enumerate() {
        let pl = &plans[i];
        if !pl.prefill {
            continue;
        }
        let p = &mut *e.program;
        let y = decoded[decoded_offs[i]];
        p.frozen.push(y);
        p.cur = p.frozen.clone();
        let mut counter = Vec::new();
        add_recurrences(&mut counter, 0, p.prompt_len + 1, pl.core_steps);
        let z = draw(p, 1, dim, false, &device, dtype)?;
        p.wave = Some(Wave {
            z: z.clone(),
            z_prev: z,
            prev_start: p.prompt_len,
            c_old: 0,
            e_old: None,
            counter,
        });
        p.stats.forward_passes += 1;
        p.stats.recurrence_steps += pl.core_steps as u64;
        if p.settings.ema_embeds > 0.0 {
            momentum.push(i);
        }
        p.emit(e.outbox);
    }
    if !momentum.is_empty() {
        let mut scratch: Vec<HuginnCache> = momentum
            .iter()
            .map(|&i| HuginnCache::new(entries[i].program.cache.strategy()))
            .collect();
        let ids: Vec<u32> = momentum
            .iter()
            .flat_map(|&i| entries[i].program.cur.clone())
            .collect();
        let lens: Vec<usize> = momentum
            .iter()
            .map(|&i| entries[i].program.cur.len())
            .collect();
        let e_old = {
            let mut seqs: Vec<SeqRows> = scratch
                .iter_mut()
                .zip(&lens)
                .map(|(cache, &n)| SeqRows::new(cache, 0, n))
                .collect();
            model
                .prelude(&model.embed(&ids).map_err(msg)?, &mut seqs)
                .map_err(msg)?
        };
        for ((&i, o), &n) in momentum.iter().zip(offsets(&lens)).zip(&lens) {
            if let Some(w) = entries[i].program.wave.as_mut() {
                w.e_old = Some(e_old.narrow(0, o, n)?);
            }
        }
    }
    Ok(())
}

fn add_recurrences(counter: &mut Vec<u32>, from: usize, n: usize, by: usize) {
    if counter.len() < from + n {
        counter.resize(from + n, 0);
    }
    for c in &mut counter[from..from + n] {
        *c += by as u32;
    }
}

impl super::HuginnPlanner {
    /// Validates diffusion-forcing parameters and builds the program.
    pub(super) fn prepare_diffusion(
        &self,
        spec: crate::request::GenerateSpec,
        d: &crate::request::DiffusionForcingParams,
    ) -> Result<wavefront_engine::Prepared<super::Program>, wavefront_engine::RequestError> {
        use wavefront_models::CacheStrategy;
        let bad = |m: String| Err(wavefront_engine::RequestError::InvalidArgument(m));
        let max_steps = super::MAX_NUM_STEPS;
        let num_steps = d.num_steps.unwrap_or(self.cfg.mean_recurrence);
        if num_steps == 0 || num_steps > max_steps {
            return bad(format!(
                "diffusion_forcing.num_steps must be in 1..={max_steps}, got {num_steps}"
            ));
        }
        if d.inner_recurrence == 0 || d.inner_recurrence > max_steps {
            return bad(format!(
                "diffusion_forcing.inner_recurrence must be in 1..={max_steps}, got {}",
                d.inner_recurrence
            ));
        }
        if !d.exit_t.is_finite() || d.exit_t <= 0.0 || d.exit_t > 1.0 {
            return bad(format!(
                "diffusion_forcing.exit_t must be in (0, 1], got {}",
                d.exit_t
            ));
        }
        if !d.ema_embeds.is_finite() || !(0.0..1.0).contains(&d.ema_embeds) {
            return bad(format!(
                "diffusion_forcing.ema_embeds must be in [0, 1), got {}",
                d.ema_embeds
            ));
        }
        if !d.state_noise_mixing.is_finite() || !(0.0..=1.0).contains(&d.state_noise_mixing) {
            return bad(format!(
                "diffusion_forcing.state_noise_mixing must be in [0, 1], got {}",
                d.state_noise_mixing
            ));
        }
        if d.max_wavefront < 2 || d.max_wavefront > self.cfg.block_size {
            return bad(format!(
                "diffusion_forcing.max_wavefront must be in 2..={} (a wavefront of one position never freezes), got {}",
                self.cfg.block_size, d.max_wavefront
            ));
        }
        if d.headway == 0 || d.headway > d.max_wavefront {
            return bad(format!(
                "diffusion_forcing.headway must be in 1..=max_wavefront ({}), got {}",
                d.max_wavefront, d.headway
            ));
        }
        if !d.init_scale.is_finite() || !(0.0..=100.0).contains(&d.init_scale) {
            return bad(format!(
                "diffusion_forcing.init_scale must be in [0, 100], got {}",
                d.init_scale
            ));
        }
        let strategy: CacheStrategy = d.cache_lookup_strategy.parse().map_err(|e| {
            wavefront_engine::RequestError::InvalidArgument(format!(
                "diffusion_forcing.cache_lookup_strategy: {e}"
            ))
        })?;
        let core = self.cfg.n_layers_in_recurrent_block;
        if !matches!(strategy, CacheStrategy::Compress { stride, .. } if stride == core) {
            return bad(format!(
                "diffusion_forcing.cache_lookup_strategy must share core KV slots across recurrences \
                 (`latest-m4-compress-s{core}`), got `{}`",
                d.cache_lookup_strategy
            ));
        }
        let draws = match (&spec.replay_draws, d.init_scale) {
            (_, 0.0) => DrawSource::Zeros,
            // Rows are consumed in upstream's call order; running out fails the request.
            (Some(r), _) => DrawSource::replay(r.clone()),
            (None, s) => DrawSource::seeded(
                spec.sampling.seed,
                self.cfg.init_std(f64::from(s)),
                self.cfg.embed_scale(),
            ),
        };
        // K/V pages: the wavefront may run up to `max_wavefront` positions past the frozen ones
        // (never past the context). Latent pages: the wavefront's states (see the module doc).
        let positions = (spec.prompt_ids.len() + spec.max_new_tokens + d.max_wavefront)
            .min(self.cfg.block_size);
        let latent_pages = self.latent_slots(d.max_wavefront).div_ceil(self.page);
        let max_slots = self.kv_pages(positions, strategy, num_steps) + latent_pages;
        let prompt_tokens = spec.prompt_ids.len();
        let settings = DiffusionSettings {
            num_steps,
            inner_recurrence: d.inner_recurrence,
            exit_t: d.exit_t,
            ema_embeds: f64::from(d.ema_embeds),
            state_noise_mixing: f64::from(d.state_noise_mixing),
            headway: d.headway,
            max_wavefront: d.max_wavefront,
            freeze_test: d.freeze_test,
            continuous_compute: d.continuous_compute,
            vocab_size: self.cfg.vocab_size,
        };
        let mut program = DiffusionProgram::new(
            spec.prompt_ids,
            self.cache(strategy),
            settings,
            draws,
            TokenSampler::new(spec.sampling),
            spec.sampling.seed,
            spec.max_new_tokens,
            spec.stop_token_ids,
        );
        program.latent_pages = latent_pages;
        Ok(self.prepared(super::Program::Diffusion(program), max_slots, prompt_tokens))
    }
}
