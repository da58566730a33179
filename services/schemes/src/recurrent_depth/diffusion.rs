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
//! (`latest-m4-compress-s{C}` for a core of C layers, the default; upstream's default
//! `latest-m4-compress-s4` on Huginn-0125), so frozen positions keep the KV of the step in
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

use crate::migrate::RequestRng;
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use wavefront_engine::{FinishReason, Outbox, Stats, TokenLogprob};
use wavefront_models::{relative_change, Huginn, HuginnCache, SeqRows};

use super::draws::DrawSource;
use super::packed::{cat_rows, core_call, next_tokens, offsets, seq_rows, NextToken};
use crate::request::FreezeTest;
use crate::sampling::{guided_pick, TokenSampler};
use crate::SchemeError;

/// Outer steps after which a request stops (upstream `max_diffusion_steps`).
pub const MAX_SAMPLER_STEPS: u64 = 4096;

/// Resolved sampler settings of one request.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
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

/// The wavefront of a request past its prefill. Its states and momentum embeddings live in the
/// request cache's latent pages ([`HuginnCache::write_latents`]): this holds their row counts.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Wave {
    /// States of positions `c ..` (c = cache length): latent rows `0..rows`. They are also the
    /// states after the previous step that the freeze test compares with, from `prev_start`.
    rows: usize,
    prev_start: usize,
    /// Wavefront start of the previous step.
    c_old: usize,
    /// Mixed embeddings of the previous step, starting at `c_old` (momentum only): latent rows
    /// `0..e_rows` of the value half.
    e_rows: Option<usize>,
    /// Core recurrences each position has run.
    counter: Vec<u32>,
}

/// One request's diffusion-forcing state.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
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
    #[serde(with = "crate::migrate::rng")]
    placeholders: Box<RequestRng>,
    sampler_steps: u64,
    pub(crate) stats: Stats,
    /// The most slots (pages of latent states) the wavefront's states take: its cap's.
    pub(crate) latent_pages: usize,
    /// Latent states a page holds, and the occupancy multiplier the pages are sized with.
    pub(crate) latent_page: (usize, f64),
    /// The log-probability of each position's latest guess, by position (requests that asked
    /// for them): a frozen token keeps the one of the step that froze it.
    #[serde(default)]
    scores: std::collections::BTreeMap<usize, TokenLogprob>,
    /// The structured-output constraint after the frozen tokens, when the request has one (it
    /// does not travel to another worker: `constrained` says it had one).
    #[serde(skip)]
    pub(crate) guide: Option<crate::constraint::Guide>,
    #[serde(default)]
    pub(crate) constrained: bool,
    /// Generated tokens once the constrained output is complete (none after them stream).
    #[serde(default)]
    complete_len: Option<usize>,
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
            placeholders: Box::new(RequestRng::seed_from_u64(seed ^ 0x4845_4144_5741_5901)),
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
            latent_page: (wavefront_models::transformer::PAGE_SIZE, 1.0),
            scores: Default::default(),
            guide: None,
            constrained: false,
            complete_len: None,
        }
    }

    /// Latent pages the wavefront's states take after the next tick at most: the first state
    /// after the prefill, then the wave plus its headway (up to the cap). Positions that freeze
    /// leave the wave, and their pages go back to the pool once the wave is smaller than the
    /// pages it holds (`Family::reclaim`).
    pub(crate) fn latent_pages_needed(&self) -> usize {
        let rows = match &self.wave {
            None => 1,
            Some(w) => (w.rows + self.settings.headway).min(self.settings.max_wavefront.max(1)),
        };
        let (page, multiplier) = self.latent_page;
        let slots = (rows as f64 * multiplier.max(1.0)).ceil() as usize;
        slots.div_ceil(page.max(1)).min(self.latent_pages)
    }

    /// Positions the next tick runs: the prompt (prefill), then the wavefront.
    pub fn next_rows(&self) -> usize {
        match &self.wave {
            None => self.prompt_len,
            Some(w) => w.rows,
        }
    }

    /// Whether the next wavefront would run past `block_size` positions (the RoPE table).
    pub(crate) fn leaves_context(&self, block_size: usize) -> bool {
        self.wave
            .as_ref()
            .is_some_and(|w| self.cache.len() + w.rows > block_size)
    }

    /// Tokens frozen after the prompt.
    pub fn generated(&self) -> &[u32] {
        &self.frozen[self.prompt_len..]
    }

    /// Advances the guide through the tokens frozen from position `from` on; notes where the
    /// output completes.
    fn advance_guide(&mut self, from: usize) -> Result<(), SchemeError> {
        let Some(g) = &mut self.guide else {
            return Ok(());
        };
        if self.complete_len.is_some() {
            return Ok(());
        }
        for p in from..self.frozen.len() {
            if g.advance(self.frozen[p])
                .map_err(SchemeError::inconsistent)?
            {
                self.complete_len = Some(p + 1 - self.prompt_len);
                break;
            }
        }
        Ok(())
    }

    /// Streams newly frozen tokens and finishes on a stop token or at `max_new_tokens`.
    /// Upstream may freeze a few positions past `max_new_tokens` in the last step; they are
    /// not emitted.
    fn emit(&mut self, outbox: &mut Outbox) {
        let generated = &self.frozen[self.prompt_len..];
        let end = generated
            .len()
            .min(self.max_new_tokens)
            .min(self.complete_len.unwrap_or(usize::MAX));
        let fresh = &generated[self.emitted.min(end)..end];
        let stop = fresh.iter().position(|t| self.stop_token_ids.contains(t));
        let take = stop.map_or(fresh.len(), |i| i + 1);
        let first = self.prompt_len + self.emitted.min(end);
        let scored = self.sampler.logprobs().map(|_| {
            (first..first + take)
                .map(|p| {
                    debug_assert!(self.scores.contains_key(&p), "position {p} unscored");
                    self.scores.remove(&p).unwrap_or_default()
                })
                .collect()
        });
        outbox.scored_tokens(fresh[..take].to_vec(), scored);
        self.emitted += take;
        let reason = if stop.is_some() || self.complete_len.is_some_and(|n| self.emitted >= n) {
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

/// What one request runs this tick, as plain data ([`DiffusionProgram::plan`]): its prefill or
/// one outer step of its wavefront, with every random draw the step takes already drawn from
/// the request's own source (in the order the step uses them).
#[derive(Debug, Clone)]
pub struct DfPlan {
    /// Position of the first row.
    pub start: usize,
    /// Token ids of the rows: the prompt, or the wavefront's current guesses.
    pub ids: Vec<u32>,
    pub core_steps: usize,
    pub prefill: bool,
    /// Initial states of the rows: fresh draws (prefill) or the wavefront's states.
    pub states: DfStates,
    /// State noise mixing: per-row weights `b` and `rows × n_embd` noise draws.
    pub noise: Option<(Vec<f32>, Vec<f32>)>,
    /// Embedding momentum: η, and the previous step's mixed embeddings with the offset of this
    /// step's first row in them.
    pub momentum: Option<(f64, Option<(Tensor, usize)>)>,
    /// Momentum right after the prefill: the buffer (prompt and first token) whose cache-free
    /// prelude is the previous step's embeddings of the first outer step.
    pub momentum_seed: Option<Vec<u32>>,
    /// States of the `headway` positions that extend the wavefront: drawn, or (continuous
    /// compute with a wavefront at least `headway` long) the last rows' states after the step.
    pub fresh: Option<Vec<f32>>,
    pub headway: usize,
    pub max_wavefront: usize,
    /// The freeze test's previous states and the offset of this step's first row in them.
    pub previous: Option<(Tensor, usize)>,
    /// Prefill: the first wavefront state, drawn after the prompt's.
    pub first_state: Option<Vec<f32>>,
    /// Tokens come from the argmax on the device rather than the request's sampler.
    pub greedy: bool,
    /// Heads the latent rows are split into in the cache's pages (the model's).
    pub heads: usize,
}

/// Initial states of a plan's rows.
#[derive(Debug, Clone)]
pub enum DfStates {
    /// `rows × n_embd` fresh draws.
    Drawn(Vec<f32>),
    /// The wavefront's states.
    Wave(Tensor),
}

/// What the packed forwards produced for one plan ([`DiffusionProgram::commit`] applies it).
#[derive(Debug, Clone)]
pub struct DfOutput {
    /// The head's verdict on every decoded row: the prefill's last row, every row of a
    /// wavefront.
    pub decoded: Vec<NextToken>,
    /// The wavefront's next states (this step's, then the fresh ones, capped), and whether the
    /// cap cut it (a standing wave).
    pub next: Option<(Tensor, bool)>,
    /// The freeze criterion of each compared row.
    pub criterion: Vec<f32>,
    /// This step's mixed embeddings (momentum).
    pub mixed: Option<Tensor>,
    /// The prefill's first wavefront state.
    pub first_state: Option<Tensor>,
}

impl DiffusionProgram {
    /// The plan of the next tick: the prefill, or one outer step of the wavefront (its states
    /// and momentum embeddings read from the cache's latent pages).
    pub fn plan(&mut self, dim: usize, heads: usize) -> Result<DfPlan, SchemeError> {
        let greedy = !self.sampler.wants_logits() && !self.constrained;
        let Some(w) = &self.wave else {
            let len = self.prompt_len;
            let states = self.draws.next(len, dim, false)?;
            let first = self.draws.next(1, dim, false)?;
            return Ok(DfPlan {
                start: 0,
                ids: self.cur[..len].to_vec(),
                core_steps: self.settings.num_steps,
                prefill: true,
                states: DfStates::Drawn(states),
                noise: None,
                momentum: None,
                momentum_seed: None,
                fresh: None,
                headway: self.settings.headway,
                max_wavefront: self.settings.max_wavefront,
                previous: None,
                first_state: Some(first),
                greedy,
                heads,
            });
        };
        let (start, len) = (self.cache.len(), w.rows);
        let (z, e_old) = self.cache.read_latents(len, w.e_rows.unwrap_or(0))?;
        let (eta, beta) = (self.settings.ema_embeds, self.settings.state_noise_mixing);
        let behind = |from: usize| {
            start.checked_sub(from).ok_or_else(|| {
                SchemeError::inconsistent(format!(
                    "the wavefront starts at {start}, before its previous step's {from}"
                ))
            })
        };
        let since_c_old = behind(w.c_old)?;
        let momentum = (eta > 0.0).then(|| {
            let old = e_old.map(|old| (old, since_c_old));
            (eta, old)
        });
        let momentum_seed = (eta > 0.0 && w.e_rows.is_none()).then(|| self.cur.clone());
        let previous_off = match self.settings.freeze_test {
            FreezeTest::Upstream => since_c_old,
            FreezeTest::Aligned => behind(w.prev_start)?,
        };
        let previous = Some((z.clone(), previous_off));
        let weights: Vec<f32> = (0..len)
            .map(|k| {
                (beta / (1.0 + f64::from(w.counter.get(start + k).copied().unwrap_or(0)))) as f32
            })
            .collect();
        let states = DfStates::Wave(z);
        let noise = if beta > 0.0 {
            Some((weights, self.draws.next(len, dim, false)?))
        } else {
            None
        };
        let headway = self.settings.headway;
        let fresh = if self.settings.continuous_compute && len >= headway {
            None
        } else {
            Some(self.draws.next(headway, dim, true)?)
        };
        Ok(DfPlan {
            start,
            ids: self.cur[start..start + len].to_vec(),
            core_steps: self.settings.inner_recurrence,
            prefill: false,
            states,
            noise,
            momentum,
            momentum_seed,
            fresh,
            headway,
            max_wavefront: self.settings.max_wavefront,
            previous,
            first_state: None,
            greedy,
            heads,
        })
    }

    /// Applies what `plan` produced: the prefill's first token and first wavefront, or the
    /// step's guesses, the wavefront's growth, the freeze of converged positions (their KV
    /// kept, the rest dropped to be recomputed), statistics and the newly frozen tokens.
    pub fn commit(
        &mut self,
        plan: &DfPlan,
        out: DfOutput,
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError> {
        // Row `i` guesses the token at `frozen.len() + i` (the prefill's one row, the first
        // position after the prompt).
        let first = self.frozen.len();
        if self.constrained && self.guide.is_none() {
            return Err(SchemeError::inconsistent(
                "a structured-output request cannot continue on another worker",
            ));
        }
        // Constrained: the guesses are masked left to right, each after the guesses before it
        // (a copy of the guide, which itself stands after the frozen tokens); once that copy is
        // complete the later guesses are the end-of-sequence token.
        let mut look = self.guide.clone();
        let mut look_done = false;
        let mut tokens = Vec::with_capacity(out.decoded.len());
        for (i, n) in out.decoded.into_iter().enumerate() {
            tokens.push(match n {
                NextToken::Argmax(t) => t,
                NextToken::Logits(_) if look_done => {
                    let eos = look.as_ref().map_or(0, |g| g.eos());
                    self.scores.insert(
                        first + i,
                        TokenLogprob {
                            logprob: 0.0,
                            top: Vec::new(),
                        },
                    );
                    eos
                }
                NextToken::Logits(row) => {
                    let (t, s, done) = guided_pick(&mut self.sampler, look.as_mut(), &row)?;
                    look_done = done;
                    if let Some(s) = s {
                        self.scores.insert(first + i, s);
                    }
                    t
                }
            });
        }
        if plan.prefill {
            let y = *tokens
                .first()
                .ok_or_else(|| SchemeError::inconsistent("the prefill decoded no row"))?;
            self.frozen.push(y);
            self.advance_guide(first)?;
            self.cur = self.frozen.clone();
            let mut counter = Vec::new();
            add_recurrences(&mut counter, 0, self.prompt_len + 1, plan.core_steps);
            let z = out
                .first_state
                .ok_or_else(|| SchemeError::inconsistent("the prefill made no first state"))?;
            self.cache.write_latents(&z, None, plan.heads)?;
            self.wave = Some(Wave {
                rows: 1,
                prev_start: self.prompt_len,
                c_old: 0,
                e_rows: None,
                counter,
            });
            self.stats.forward_passes += 1;
            self.stats.recurrence_steps += plan.core_steps as u64;
            self.emit(outbox);
            return Ok(());
        }
        let (c, len) = (plan.start, plan.ids.len());
        self.cur.truncate(self.frozen.len());
        self.cur.extend_from_slice(&tokens);
        let vocab = self.settings.vocab_size as u32;
        for _ in 1..plan.headway {
            let t = self.placeholders.random_range(0..vocab);
            self.cur.push(t);
        }
        let (mut z, standing) = out
            .next
            .ok_or_else(|| SchemeError::inconsistent("a wavefront step made no next states"))?;
        if standing {
            self.cur.truncate(c + plan.max_wavefront);
            self.stats.add_counter("standing_waves", 1);
        }
        let exit_t = self.settings.exit_t;
        let w = self
            .wave
            .as_mut()
            .ok_or_else(|| SchemeError::inconsistent("a wavefront step without a wavefront"))?;
        add_recurrences(&mut w.counter, c, len, plan.core_steps);
        let zlen = z.dim(0)?;
        let mut froze_from = None;
        match out.criterion.iter().rposition(|&v| v < exit_t) {
            Some(last) => {
                let frozen_to = c + last + 1;
                froze_from = Some(self.frozen.len());
                self.frozen = self.cur[..frozen_to].to_vec();
                self.cache.truncate(frozen_to - 1);
                z = z.narrow(0, last, zlen - last)?;
                w.prev_start = frozen_to - 1;
            }
            None => {
                self.cache.truncate(c);
                w.prev_start = c;
            }
        }
        // Without momentum there are no embeddings to keep (`mixed` is `None` at every step).
        let e_rows = match &out.mixed {
            Some(e) => Some(e.dim(0)?),
            None => None,
        };
        w.rows = z.dim(0)?;
        w.e_rows = e_rows;
        w.c_old = c;
        self.cache
            .write_latents(&z, out.mixed.as_ref(), plan.heads)?;
        if let Some(from) = froze_from {
            self.advance_guide(from)?;
        }
        self.stats.forward_passes += 1;
        self.stats.recurrence_steps += plan.core_steps as u64;
        self.stats.add_counter("sampler_steps", 1);
        self.stats.push_series("wavefront_size", len as u32);
        self.sampler_steps += 1;
        self.emit(outbox);
        if self.sampler_steps >= MAX_SAMPLER_STEPS && !outbox.is_done() {
            self.finish(outbox, FinishReason::Length);
        }
        Ok(())
    }
}

/// Host rows `rows × dim` as a tensor on `device` in `dtype`.
fn rows_tensor(
    data: &[f32],
    dim: usize,
    device: &Device,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    Tensor::from_slice(data, (data.len() / dim, dim), &Device::Cpu)?
        .to_device(device)?
        .to_dtype(dtype)
}

/// The packed forwards of `plans` (one per cache of `caches`): the cache-free preludes that seed
/// momentum, one prelude call over every row, one core call per recurrence over the plans still
/// iterating, one coda call, one head call over every decoded row, and one freeze criterion
/// over every compared row. Writes each plan's KV into its cache.
pub fn run(
    model: &Huginn,
    plans: &[&DfPlan],
    caches: &mut [&mut HuginnCache],
) -> Result<Vec<DfOutput>, SchemeError> {
    let device = model.device().clone();
    let dtype = model.dtype();
    let dim = model.config().n_embd;
    let lens: Vec<usize> = plans.iter().map(|pl| pl.ids.len()).collect();
    let starts: Vec<usize> = plans.iter().map(|pl| pl.start).collect();
    let offs = offsets(&lens);
    let ids: Vec<u32> = plans.iter().flat_map(|pl| pl.ids.iter().copied()).collect();

    // Momentum right after a prefill: the previous step's embeddings are the cache-free
    // prelude of the buffer.
    let seeded: Vec<usize> = (0..plans.len())
        .filter(|&i| plans[i].momentum_seed.is_some())
        .collect();
    let mut seeds: Vec<Option<Tensor>> = vec![None; plans.len()];
    if !seeded.is_empty() {
        let bufs: Vec<&Vec<u32>> = seeded
            .iter()
            .map(|&i| plans[i].momentum_seed.as_ref().expect("seeded"))
            .collect();
        let mut scratch: Vec<HuginnCache> = seeded
            .iter()
            .map(|&i| HuginnCache::new(caches[i].strategy()))
            .collect();
        let seed_ids: Vec<u32> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
        let seed_lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        let e_old = {
            let mut seqs: Vec<SeqRows> = scratch
                .iter_mut()
                .zip(&seed_lens)
                .map(|(cache, &n)| SeqRows::new(cache, 0, n))
                .collect();
            model.prelude(&model.embed(&seed_ids)?, &mut seqs)?
        };
        for ((&i, o), &n) in seeded.iter().zip(offsets(&seed_lens)).zip(&seed_lens) {
            seeds[i] = Some(e_old.narrow(0, o, n)?);
        }
    }

    // Prelude over prompts and wavefronts.
    let e_new = {
        let mut seqs = seq_rows(caches, &starts, &lens);
        model.prelude(&model.embed(&ids)?, &mut seqs)?
    };

    // Injected embeddings (with momentum) and states (fresh, or noise-mixed) per plan.
    let mut injected = Vec::with_capacity(plans.len());
    let mut states = Vec::with_capacity(plans.len());
    let mut mixed: Vec<Option<Tensor>> = vec![None; plans.len()];
    for (i, pl) in plans.iter().enumerate() {
        let n = lens[i];
        let e_i = e_new.narrow(0, offs[i], n)?;
        let mut e_mix = match pl.momentum {
            Some((eta, _)) => (&e_i * (1.0 - eta))?,
            None => e_i,
        };
        if let Some((eta, old)) = &pl.momentum {
            let old = match (&seeds[i], old) {
                (Some(seed), _) => Some((seed.clone(), pl.start)),
                (None, Some((t, off))) => Some((t.clone(), *off)),
                (None, None) => None,
            };
            if let Some((old, off)) = old {
                let k = old.dim(0)?.saturating_sub(off).min(n);
                if k > 0 {
                    let head = (e_mix.narrow(0, 0, k)? + (old.narrow(0, off, k)? * *eta)?)?;
                    e_mix = if k < n {
                        Tensor::cat(&[head, e_mix.narrow(0, k, n - k)?], 0)?
                    } else {
                        head
                    };
                }
            }
            mixed[i] = Some(e_mix.clone());
        }
        injected.push(e_mix);
        let mut z = match &pl.states {
            DfStates::Drawn(v) => rows_tensor(v, dim, &device, dtype)?,
            DfStates::Wave(z) => z.clone(),
        };
        if let Some((b, noise)) = &pl.noise {
            let b = Tensor::from_slice(b, (n, 1), &Device::Cpu)?
                .to_device(&device)?
                .to_dtype(dtype)?;
            let noise = rows_tensor(noise, dim, &device, dtype)?;
            z = (z.broadcast_mul(&(1.0 - &b)?)? + noise.broadcast_mul(&b)?)?;
        }
        states.push(z);
    }

    // Core steps: plan i takes part in its first `core_steps` calls.
    let max_steps = plans.iter().map(|pl| pl.core_steps).max().unwrap_or(0);
    for t in 0..max_steps {
        let members: Vec<usize> = (0..plans.len())
            .filter(|&i| plans[i].core_steps > t)
            .collect();
        core_call(
            model,
            caches,
            &starts,
            &lens,
            &mut states,
            &injected,
            &members,
            t,
        )?;
    }

    // Coda over every row (its KV is read by later steps); head on the rows that are decoded:
    // the last prompt row of a prefill, every row of a wavefront.
    let hidden = {
        let mut seqs = seq_rows(caches, &starts, &lens);
        model.coda(&cat_rows(&states)?, &mut seqs)?
    };
    let mut rows: Vec<u32> = Vec::new();
    let mut decoded_lens = Vec::with_capacity(plans.len());
    for (i, pl) in plans.iter().enumerate() {
        let first = if pl.prefill { lens[i] - 1 } else { 0 };
        rows.extend((offs[i] + first..offs[i] + lens[i]).map(|r| r as u32));
        decoded_lens.push(lens[i] - first);
    }
    let logits =
        model.lm_head(&hidden.index_select(&Tensor::new(rows.as_slice(), &device)?, 0)?)?;
    let mut decoded = next_tokens(&logits, plans.iter().all(|pl| pl.greedy))?;

    // Next wavefront states: this step's and the fresh ones, capped; the freeze criteria of
    // every plan in one call.
    let mut next: Vec<Option<(Tensor, bool)>> = Vec::with_capacity(plans.len());
    let mut compared = Vec::with_capacity(plans.len());
    let (mut new_parts, mut prev_parts) = (Vec::new(), Vec::new());
    for (i, pl) in plans.iter().enumerate() {
        if pl.prefill {
            next.push(None);
            compared.push(0);
            continue;
        }
        let n = lens[i];
        let fresh = match &pl.fresh {
            Some(v) => rows_tensor(v, dim, &device, dtype)?,
            None => states[i].narrow(0, n - pl.headway, pl.headway)?,
        };
        let mut z = Tensor::cat(&[&states[i], &fresh], 0)?;
        let standing = z.dim(0)? > pl.max_wavefront;
        if standing {
            z = z.narrow(0, 0, pl.max_wavefront)?;
        }
        let k = match &pl.previous {
            Some((prev, off)) => {
                let k = prev.dim(0)?.saturating_sub(*off).min(z.dim(0)?);
                if k > 0 {
                    new_parts.push(z.narrow(0, 0, k)?);
                    prev_parts.push(prev.narrow(0, *off, k)?);
                }
                k
            }
            None => 0,
        };
        compared.push(k);
        next.push(Some((z, standing)));
    }
    let crit: Vec<f32> = if new_parts.is_empty() {
        Vec::new()
    } else {
        relative_change(&cat_rows(&new_parts)?, &cat_rows(&prev_parts)?)?.to_vec1()?
    };

    let mut outputs = Vec::with_capacity(plans.len());
    let mut at = 0;
    let mut tail = decoded.split_off(0).into_iter();
    for (i, pl) in plans.iter().enumerate() {
        let decoded: Vec<_> = tail.by_ref().take(decoded_lens[i]).collect();
        let criterion = crit[at..at + compared[i]].to_vec();
        at += compared[i];
        let first_state = match &pl.first_state {
            Some(v) => Some(rows_tensor(v, dim, &device, dtype)?),
            None => None,
        };
        outputs.push(DfOutput {
            decoded,
            next: next[i].take(),
            criterion,
            mixed: mixed[i].take(),
            first_state,
        });
    }
    Ok(outputs)
}

fn add_recurrences(counter: &mut Vec<u32>, from: usize, n: usize, by: usize) {
    if counter.len() < from + n {
        counter.resize(from + n, 0);
    }
    for c in &mut counter[from..from + n] {
        *c += by as u32;
    }
}

/// Plans and commits on fake outputs: the prefill, a wavefront step that freezes some
/// positions, a standing wave, and the end of a request, with no model in the loop.
#[cfg(test)]
mod commit_tests {
    use anyhow::{bail, ensure, Result};
    use candle_core::{Device, Tensor};
    use wavefront_engine::{Event, FinishReason, Outbox};

    use super::{DfOutput, DfStates, DiffusionProgram};
    use crate::recurrent_depth::ar::NextToken;
    use crate::recurrent_depth::test_support::{diffusion, fixture_config, prompt};
    use crate::recurrent_depth::{HuginnPlanner, Program};
    use crate::request::{FreezeTest, GenerateSpec, SchemeParams};
    use crate::served::Planner;

    fn program(max_new: usize, max_wavefront: usize) -> Result<DiffusionProgram> {
        let planner = HuginnPlanner::new(fixture_config()?, "f".into(), None);
        let scheme = SchemeParams::DiffusionForcing(diffusion(max_wavefront, FreezeTest::Aligned));
        match planner
            .prepare(GenerateSpec::greedy(prompt(4, 0), max_new, 3, scheme))?
            .program
        {
            Program::Diffusion(p) => Ok(p),
            Program::Ar(_) => bail!("not a diffusion-forcing request"),
        }
    }

    #[test]
    fn the_default_cache_shares_the_models_core_slots() -> Result<()> {
        // A core of 2 layers (the trained Huginn's): the default is `latest-m4-compress-s2`,
        // and upstream's `latest-m4-compress-s4` (Huginn-0125's core of 4) is refused.
        let mut cfg = fixture_config()?;
        cfg.n_layers_in_recurrent_block = 2;
        let planner = HuginnPlanner::new(cfg, "f".into(), None);
        let mut params = diffusion(8, FreezeTest::Aligned);
        let request =
            |p| GenerateSpec::greedy(prompt(4, 0), 4, 3, SchemeParams::DiffusionForcing(p));
        ensure!(planner.prepare(request(params.clone())).is_ok());
        params.cache_lookup_strategy = "latest-m4-compress-s4".into();
        let err = match planner.prepare(request(params)) {
            Err(e) => e.to_string(),
            Ok(_) => bail!("compress-s4 was accepted over a core of 2"),
        };
        ensure!(
            err.contains("(`latest-m4-compress-s2`, the default)"),
            "{err}"
        );
        Ok(())
    }

    fn zeros(rows: usize, dim: usize) -> Result<Tensor> {
        Ok(Tensor::zeros(
            (rows, dim),
            candle_core::DType::F32,
            &Device::Cpu,
        )?)
    }

    fn tokens(o: &Outbox) -> Vec<u32> {
        o.events()
            .iter()
            .flat_map(|e| match e {
                Event::Tokens(t) => t.clone(),
                _ => Vec::new(),
            })
            .collect()
    }

    /// Latent pages follow the wave: one for the first state, then the wave plus its headway
    /// (up to the cap), fewer again once positions freeze and the wave shrinks.
    #[test]
    fn latent_pages_grow_with_the_wave_and_come_back_as_it_shrinks() -> Result<()> {
        let mut p = program(64, 40)?;
        // The cap: 40 states in pages of 16.
        ensure!(p.latent_pages == 3);
        ensure!(p.latent_pages_needed() == 1);
        let wave = |rows: usize| -> Result<super::Wave> {
            Ok(super::Wave {
                rows,
                prev_start: 0,
                c_old: 0,
                e_rows: None,
                counter: Vec::new(),
            })
        };
        for (rows, pages) in [(1, 1), (16, 2), (31, 2), (32, 3), (39, 3), (40, 3), (5, 1)] {
            p.wave = Some(wave(rows)?);
            ensure!(
                p.latent_pages_needed() == pages,
                "a wave of {rows} (headway 1): {} pages, want {pages}",
                p.latent_pages_needed()
            );
        }
        Ok(())
    }

    #[test]
    fn the_prefill_freezes_its_token_and_starts_a_wavefront_of_one() -> Result<()> {
        let (dim, heads) = (fixture_config()?.n_embd, fixture_config()?.n_heads);
        let mut p = program(6, 8)?;
        let plan = p.plan(dim, heads).map_err(anyhow::Error::msg)?;
        ensure!(plan.prefill && plan.ids == prompt(4, 0) && plan.first_state.is_some());
        ensure!(matches!(&plan.states, DfStates::Drawn(v) if v.len() == 4 * dim));
        let mut outbox = Outbox::default();
        let out = DfOutput {
            decoded: vec![NextToken::Argmax(9)],
            next: None,
            criterion: Vec::new(),
            mixed: None,
            first_state: Some(zeros(1, dim)?),
        };
        p.commit(&plan, out, &mut outbox)
            .map_err(anyhow::Error::msg)?;
        ensure!(tokens(&outbox) == [9] && p.next_rows() == 1 && p.generated() == [9]);
        // The first state is stored in the cache's latent pages, not in the program.
        ensure!(p.cache.latent_pages() == 1);
        let (z, e) = p.cache.read_latents(1, 0)?;
        ensure!(z.dims() == [1, dim] && e.is_none());
        // Without a model nothing was cached, and a wavefront cannot start before the prompt.
        ensure!(p.plan(dim, heads).is_err());
        Ok(())
    }

    #[test]
    fn a_step_freezes_up_to_the_last_converged_position_and_a_standing_wave_is_counted(
    ) -> Result<()> {
        let (dim, heads) = (fixture_config()?.n_embd, fixture_config()?.n_heads);
        let mut p = program(2, 2)?;
        let mut outbox = Outbox::default();
        let prefill = p.plan(dim, heads).map_err(anyhow::Error::msg)?;
        let out = DfOutput {
            decoded: vec![NextToken::Argmax(9)],
            next: None,
            criterion: Vec::new(),
            mixed: None,
            first_state: Some(zeros(1, dim)?),
        };
        p.commit(&prefill, out, &mut outbox)
            .map_err(anyhow::Error::msg)?;
        // The step the model would run next: the wavefront of one position after the prompt
        // (which the model would have cached), one fresh state for headway 1.
        let mut step = prefill.clone();
        step.prefill = false;
        step.start = 4;
        step.ids = vec![9];
        step.core_steps = 2;
        step.first_state = None;
        // Nothing converged: nothing freezes.
        let out = |crit: Vec<f32>, standing| -> Result<DfOutput> {
            Ok(DfOutput {
                decoded: vec![NextToken::Argmax(11)],
                next: Some((zeros(2, dim)?, standing)),
                criterion: crit,
                mixed: None,
                first_state: None,
            })
        };
        p.commit(&step, out(vec![1.0], false)?, &mut outbox)
            .map_err(anyhow::Error::msg)?;
        ensure!(tokens(&outbox) == [9] && p.generated() == [9]);
        // The next wave (two states) replaced the first in the latent pages.
        ensure!(p.next_rows() == 2 && p.cache.read_latents(2, 0).is_ok());
        // The second compared row converged: positions up to it freeze, 11 streams, and the
        // request (max_new_tokens 2) ends with its statistics.
        p.commit(&step, out(vec![1.0, 0.0], true)?, &mut outbox)
            .map_err(anyhow::Error::msg)?;
        ensure!(tokens(&outbox) == [9, 11]);
        let Some(Event::Finished { reason, stats }) = outbox.events().last() else {
            bail!("not finished: {:?}", outbox.events());
        };
        ensure!(*reason == FinishReason::Length);
        ensure!(stats.forward_passes == 3 && stats.counters["sampler_steps"] == 2);
        ensure!(stats.counters["standing_waves"] == 1);
        ensure!(stats.series["wavefront_size"] == [1, 1]);
        Ok(())
    }
}
