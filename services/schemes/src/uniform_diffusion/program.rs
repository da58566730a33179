//! One DiffusionGemma request (upstream `DiffusionGemmaGenerationMixin.generate()` with its
//! `EntropyBoundSampler`): the prompt encoded into the request's paged cache, then canvases of
//! `canvas_length` tokens, each refined from uniform noise by the denoiser over the cache and,
//! once done, its argmax committed and encoded to extend the cache.
//!
//! A denoising step at `cur_step` (counting down from `N = max_denoising_steps`), as upstream:
//! `T = t_min + (t_max − t_min) · cur_step / N`, `pl = logits / T`; a sample of `softmax(pl)` at
//! every position and `argmax(pl)`; the entropies `H` of `pl`, sorted ascending, accept every
//! position whose lower-ranked entropies sum to at most `entropy_bound` (the lowest always);
//! accepted positions take their sample, every other position fresh uniform noise. The canvas
//! stops early when its argmax has not changed for `stability_threshold` steps and its mean
//! entropy is below `confidence_threshold`. The next step's self-conditioning reads `pl`.
//! Nothing is locked between steps: acceptance is decided anew each step.
//!
//! The committed canvas is the last step's argmax. A canvas holding an end-of-sequence token, or
//! reaching `max_new_tokens`, ends the request. Differences from upstream, by default (the
//! `whole_canvases` switch restores the first): the response stops at `max_new_tokens` and at the
//! first end-of-sequence or stop token instead of returning whole canvases padded after it; the
//! request's stop ids end it like end-of-sequence ids. Random draws are the request's own
//! (seeded) unless replayed: `replay_draws` holds, `canvas_length` values a row, upstream's draws
//! in upstream's order — a canvas's initial noise (drawn even when `initial_canvas` is given,
//! upstream's quirk), then per step the multinomial sample and the renoise draw.

use candle_core::Tensor;
use rand::{Rng, SeedableRng};
use wavefront_engine::{CanvasFrame, CellState, FinishReason, Outbox, Stats, TokenLogprob};
use wavefront_models::diffusion_gemma::{DgSeq, Mode};
use wavefront_models::transformer::cpu::{row_entropy, sample_row, RowEntropy};
use wavefront_models::transformer::KvCache;

use crate::migrate::RequestRng;
use crate::request::ReplayDraws;
use crate::sampling::{score, Filter};
use crate::SchemeError;

/// The sampler's settings, resolved and checked by the planner.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Settings {
    pub(crate) canvas: usize,
    pub(crate) steps: usize,
    pub(crate) t_max: f32,
    pub(crate) t_min: f32,
    pub(crate) entropy_bound: f32,
    /// `None`: no early stop.
    pub(crate) stop: Option<(usize, f32)>,
    pub(crate) eos: Vec<u32>,
    pub(crate) pad: u32,
    pub(crate) whole_canvases: bool,
    pub(crate) vocab: usize,
}

/// What one tick computes for a request.
#[derive(Debug)]
pub struct UdPlan {
    pub(crate) ids: Vec<u32>,
    pub(crate) start: usize,
    pub(crate) mode: Mode,
}

/// One denoising step as recorded (tests compare it with upstream's trace).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UdStep {
    pub canvas_index: usize,
    pub cur_step: usize,
    pub temperature: f32,
    /// The canvas the denoiser read.
    pub input: Vec<u32>,
    pub sample: Vec<u32>,
    pub accepted: Vec<bool>,
    pub argmax: Vec<u32>,
    pub entropy: Vec<f32>,
    pub mean_entropy: f32,
    pub next_canvas: Vec<u32>,
    pub stop: bool,
}

/// Where a request's random draws come from.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum Draws {
    Seeded(#[serde(with = "crate::migrate::rng")] Box<RequestRng>),
    /// Replayed rows (`canvas_length` ids each) and the next row.
    Replay(ReplayDraws, usize),
}

impl Draws {
    /// The next replayed row, if replaying.
    fn replayed(&mut self, what: &str) -> Result<Option<Vec<u32>>, SchemeError> {
        let Draws::Replay(r, at) = self else {
            return Ok(None);
        };
        if *at >= r.rows() {
            return Err(SchemeError::Draws(format!(
                "ran out at row {at} ({what}): the file holds {} rows",
                r.rows()
            )));
        }
        let row = r.data[*at * r.dim..(*at + 1) * r.dim]
            .iter()
            .map(|&x| x as u32)
            .collect();
        *at += 1;
        Ok(Some(row))
    }

    /// `n` uniform ids below `vocab` (upstream `randint(0, V, (B, L))`).
    fn noise(&mut self, n: usize, vocab: usize, what: &str) -> Result<Vec<u32>, SchemeError> {
        if let Some(row) = self.replayed(what)? {
            return Ok(row);
        }
        let Draws::Seeded(rng) = self else {
            unreachable!("replayed above")
        };
        Ok((0..n).map(|_| rng.random_range(0..vocab as u32)).collect())
    }

    /// A draw from each row of `softmax(pl)` (upstream `multinomial(softmax(pl), 1)`), rows of
    /// `width` with their statistics.
    fn sample(
        &mut self,
        pl: &[f32],
        width: usize,
        stats: &[RowEntropy],
    ) -> Result<Vec<u32>, SchemeError> {
        if let Some(row) = self.replayed("multinomial")? {
            return Ok(row);
        }
        let Draws::Seeded(rng) = self else {
            unreachable!("replayed above")
        };
        Ok(pl
            .chunks(width)
            .zip(stats)
            .map(|(row, st)| sample_row(row, st, rng.random::<f32>()) as u32)
            .collect())
    }
}

/// One request's decoding state.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct UdProgram {
    s: Settings,
    /// The prompt and every committed canvas.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_new: usize,
    stop_ids: Vec<u32>,
    /// Cache rows holding encoded tokens.
    encoded: usize,
    /// The key of the prompt's encoded rows (prompt sharing: they depend on its ids alone),
    /// computed once.
    #[serde(default)]
    key: Option<u64>,
    pub(crate) cache: KvCache,
    draws: Draws,
    /// The canvas being denoised, its index and step count-down, its last argmax and the
    /// stability history (the last argmax canvases, `None` before any).
    canvas: Vec<u32>,
    canvas_index: usize,
    cur_step: usize,
    argmax: Vec<u32>,
    history: Vec<Option<Vec<u32>>>,
    /// The previous step's self-conditioning input `[L, H]` (row-major), `None` at a canvas's
    /// first step.
    soft: Option<Vec<f32>>,
    /// A first canvas given by the request.
    initial_canvas: Vec<u32>,
    /// Generated tokens already streamed, and whether the response is complete.
    streamed: usize,
    done: bool,
    pub(crate) stats: Stats,
    pub(crate) stream_canvas: bool,
    kv_tables: usize,
    max_pages: usize,
    #[serde(skip)]
    record: Option<Vec<UdStep>>,
    /// Alternatives per token when the request asked for log-probabilities: a committed
    /// token's distribution is its canvas's last denoising step's tempered one,
    /// `softmax(logits / T)`, whose argmax it is (a pad after an end-of-sequence token, kept
    /// with `whole_canvases`, is scored under the same distribution).
    #[serde(default)]
    pub(crate) logprobs: Option<usize>,
    /// The log-probabilities of the generated tokens committed so far (with `logprobs`).
    #[serde(default)]
    scores: Vec<TokenLogprob>,
    /// The structured-output constraint after the committed canvases, when the request has one
    /// (it does not travel to another worker: `constrained` says it had one). The denoising
    /// runs unconstrained; a finished canvas is committed in position order, each position's
    /// argmax taken from its last step's tempered logits masked to the grammar.
    #[serde(skip)]
    pub(crate) guide: Option<crate::constraint::Guide>,
    #[serde(default)]
    pub(crate) constrained: bool,
}

/// `T` of step `cur` of `n`, in float32 as upstream computes it.
pub(crate) fn temperature(t_max: f32, t_min: f32, cur: usize, n: usize) -> f32 {
    let ratio = cur as f32 / n as f32;
    let span = (f64::from(t_max) - f64::from(t_min)) as f32;
    t_min + span * ratio
}

/// The positions `entropy_bound` accepts: sorted by entropy, those whose lower-ranked entropies
/// sum to at most the bound (float32 running sums, as upstream's `cumsum(H) − H`).
pub(crate) fn accept(entropy: &[f32], bound: f32) -> Vec<bool> {
    let mut order: Vec<usize> = (0..entropy.len()).collect();
    order.sort_by(|&a, &b| entropy[a].total_cmp(&entropy[b]).then(a.cmp(&b)));
    let mut keep = vec![false; entropy.len()];
    let mut sum = 0f32;
    for &i in &order {
        sum += entropy[i];
        keep[i] = sum - entropy[i] <= bound;
    }
    keep
}

impl UdProgram {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        s: Settings,
        prompt: &[u32],
        max_new: usize,
        stop_ids: Vec<u32>,
        seed: u64,
        replay: Option<ReplayDraws>,
        initial_canvas: Vec<u32>,
        kv_tables: usize,
        max_pages: usize,
    ) -> Self {
        let draws = match replay {
            Some(r) => Draws::Replay(r, 0),
            None => Draws::Seeded(Box::new(RequestRng::seed_from_u64(
                seed ^ 0x6764_6966_6675_7365,
            ))),
        };
        let history = match s.stop {
            Some((k, _)) => vec![None; k],
            None => Vec::new(),
        };
        Self {
            key: (prompt.len() > 1).then(|| crate::packing::key_of(&("diffusion-gemma", prompt))),
            tokens: prompt.to_vec(),
            prompt_len: prompt.len(),
            max_new,
            stop_ids,
            encoded: 0,
            cache: KvCache::new(),
            draws,
            canvas: Vec::new(),
            canvas_index: 0,
            cur_step: 0,
            argmax: Vec::new(),
            history,
            soft: None,
            initial_canvas,
            streamed: 0,
            done: false,
            stats: Stats::default(),
            stream_canvas: false,
            kv_tables,
            max_pages,
            record: None,
            logprobs: None,
            guide: None,
            constrained: false,
            scores: Vec::new(),
            s,
        }
    }

    /// Keeps a [`UdStep`] per denoising step.
    pub fn record_steps(&mut self) {
        self.record = Some(Vec::new());
    }

    pub fn steps(&self) -> &[UdStep] {
        self.record.as_deref().unwrap_or(&[])
    }

    /// Every committed token after the prompt (whole canvases, padded after an end of
    /// sequence), upstream's `sequences[:, P:]`.
    pub fn committed(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    /// Pages the cache holds after the next step.
    pub(crate) fn pages_needed(&self, page: usize) -> usize {
        if self.done {
            return 0;
        }
        let rows = self.tokens.len() + self.s.canvas;
        (self.kv_tables * rows.div_ceil(page)).min(self.max_pages)
    }

    /// The key of the prompt's encoded rows (the causal encoder's K/V depend on the ids
    /// alone); `None` for a prompt of no whole page of `page` rows before its last row.
    pub(crate) fn share_key(&self, page: usize) -> Option<u64> {
        self.key.filter(|_| self.prompt_len > page)
    }

    /// Whether the prompt is still being encoded.
    pub(crate) fn prompt_pending(&self) -> bool {
        self.encoded < self.prompt_len
    }

    /// Rows of `donor`'s cache this request, which has encoded nothing, may read as its own: the
    /// whole pages of `page` rows of the prompts' longest common prefix before its last row (the
    /// causal encoder's row of a position depends on the ids up to it alone).
    pub(crate) fn shareable(&self, donor: &UdProgram, page: usize) -> usize {
        let p = self.prompt_len;
        if self.encoded > 0 || !self.cache.is_empty() || donor.prompt_pending() {
            return 0;
        }
        crate::packing::common_prompt_rows(
            &self.tokens[..p],
            &donor.tokens[..donor.prompt_len],
            page,
        )
    }

    /// The cache holds the prompt's first `rows` encoded rows (another request's pages).
    pub(crate) fn skip_prompt(&mut self, rows: usize) -> Result<(), SchemeError> {
        if self.cache.len() != rows || rows >= self.prompt_len {
            return Err(SchemeError::inconsistent(
                "shared prompt rows do not fit the prompt",
            ));
        }
        self.encoded = rows;
        self.stats.add_counter("shared_prompt_tokens", rows as u64);
        Ok(())
    }

    /// Rows the next step computes, and whether they are a prompt's prefill (which may run in
    /// chunks).
    pub(crate) fn next_rows(&self) -> (usize, bool) {
        if self.encoded < self.tokens.len() {
            (
                self.tokens.len() - self.encoded,
                self.encoded < self.prompt_len,
            )
        } else {
            (self.s.canvas, false)
        }
    }

    /// The next step, at most `rows` rows of a prompt's prefill.
    pub(crate) fn plan(&mut self, rows: usize) -> Result<UdPlan, SchemeError> {
        if self.encoded < self.tokens.len() {
            let n = rows.clamp(1, self.tokens.len() - self.encoded);
            return Ok(UdPlan {
                ids: self.tokens[self.encoded..self.encoded + n].to_vec(),
                start: self.encoded,
                mode: Mode::Encode,
            });
        }
        if self.canvas.is_empty() {
            self.start_canvas()?;
        }
        Ok(UdPlan {
            ids: self.canvas.clone(),
            start: self.encoded,
            mode: Mode::Denoise,
        })
    }

    /// A fresh canvas: uniform noise (drawn even when the request gives the first canvas, as
    /// upstream does, so replayed draws stay aligned).
    fn start_canvas(&mut self) -> Result<(), SchemeError> {
        let noise = self
            .draws
            .noise(self.s.canvas, self.s.vocab, "initial canvas")?;
        self.canvas = if self.canvas_index == 0 && !self.initial_canvas.is_empty() {
            std::mem::take(&mut self.initial_canvas)
        } else {
            noise
        };
        self.argmax = self.canvas.clone();
        self.cur_step = self.s.steps;
        self.soft = None;
        for h in &mut self.history {
            *h = None;
        }
        Ok(())
    }

    /// The sequence of `plan` over this request's cache.
    pub(crate) fn sequence(
        &mut self,
        plan: &UdPlan,
        device: &candle_core::Device,
        dtype: candle_core::DType,
        hidden: usize,
    ) -> Result<DgSeq<'_>, SchemeError> {
        let soft = match (&self.soft, plan.mode) {
            (Some(s), Mode::Denoise) => Some(
                Tensor::from_vec(s.clone(), (self.s.canvas, hidden), device)?.to_dtype(dtype)?,
            ),
            _ => None,
        };
        Ok(DgSeq {
            ids: plan.ids.clone(),
            start: plan.start,
            mode: plan.mode,
            soft,
            cache: &mut self.cache,
        })
    }

    /// Applies a step: an encoder pass moves the encoded mark; a denoising step reads its
    /// logits `[L, V]` and returns the tempered logits the next step's self-conditioning needs
    /// (`None` when the canvas is finished).
    pub(crate) fn commit(
        &mut self,
        plan: &UdPlan,
        logits: Option<&Tensor>,
        outbox: &mut Outbox,
    ) -> Result<Option<Tensor>, SchemeError> {
        self.stats.forward_passes += 1;
        self.stats.push_series("active_rows", plan.ids.len() as u32);
        if plan.mode == Mode::Encode {
            self.encoded = plan.start + plan.ids.len();
            // The prompt's or a canvas's pass, however many chunks it ran in.
            if self.encoded == self.tokens.len() {
                self.stats.add_counter("encoder_passes", 1);
            }
            return Ok(None);
        }
        let logits =
            logits.ok_or_else(|| SchemeError::inconsistent("a denoising step without logits"))?;
        self.stats.add_counter("denoising_steps", 1);
        let t = temperature(self.s.t_max, self.s.t_min, self.cur_step, self.s.steps);
        // Divided in float32, as upstream's `logits / T` (not multiplied by 1/T).
        let pl = logits.broadcast_div(&Tensor::new(&[t], logits.device())?)?;
        let width = pl.dim(1)?;
        let host: Vec<f32> = pl.flatten_all()?.to_vec1()?;
        let stats = row_entropy(&host, width)?;
        let entropy: Vec<f32> = stats.iter().map(|s| s.entropy).collect();
        let argmax: Vec<u32> = stats.iter().map(|s| s.argmax as u32).collect();
        let sample = self.draws.sample(&host, width, &stats)?;
        let accepted = accept(&entropy, self.s.entropy_bound);
        let noise = self.draws.noise(self.s.canvas, self.s.vocab, "renoise")?;
        let next: Vec<u32> = (0..self.s.canvas)
            .map(|i| if accepted[i] { sample[i] } else { noise[i] })
            .collect();
        let mean = entropy.iter().sum::<f32>() / entropy.len() as f32;
        let stop = match self.s.stop {
            None => false,
            Some((k, threshold)) => {
                let stable = k == 0 || self.history.iter().all(|h| h.as_ref() == Some(&argmax));
                if k > 0 {
                    self.history.rotate_left(1);
                    *self.history.last_mut().expect("k > 0") = Some(argmax.clone());
                }
                stable && mean < threshold
            }
        };
        self.stats.push_series(
            "accepted_per_step",
            accepted.iter().filter(|&&a| a).count() as u32,
        );
        if let Some(r) = &mut self.record {
            r.push(UdStep {
                canvas_index: self.canvas_index,
                cur_step: self.cur_step,
                temperature: t,
                input: self.canvas.clone(),
                sample,
                accepted: accepted.clone(),
                argmax: argmax.clone(),
                entropy,
                mean_entropy: mean,
                next_canvas: next.clone(),
                stop,
            });
        }
        self.canvas = next;
        self.argmax = argmax;
        self.cur_step -= 1;
        if self.stream_canvas {
            outbox.canvas(self.snapshot(&accepted));
        }
        if stop || self.cur_step == 0 {
            if self.constrained {
                let Some(guide) = &mut self.guide else {
                    return Err(SchemeError::inconsistent(
                        "a structured-output request cannot continue on another worker",
                    ));
                };
                // The canvas committed in order under the grammar.
                let mut done = guide.complete();
                let mut scored = Vec::with_capacity(self.argmax.len());
                for (i, row) in host.chunks(width).enumerate() {
                    if done {
                        self.argmax[i] = guide.eos();
                        scored.push(TokenLogprob {
                            logprob: 0.0,
                            top: Vec::new(),
                        });
                        continue;
                    }
                    let mut masked = row.to_vec();
                    guide.mask(&mut masked).map_err(SchemeError::inconsistent)?;
                    let t = crate::sampling::argmax(&masked);
                    self.argmax[i] = t;
                    if let Some(top) = self.logprobs {
                        scored.push(score(&masked, t, Filter::model(), top));
                    }
                    done = guide.advance(t).map_err(SchemeError::inconsistent)?;
                }
                if self.logprobs.is_some() {
                    self.scores.extend(scored);
                }
                self.finish_canvas(outbox);
                return Ok(None);
            }
            if let Some(top) = self.logprobs {
                let first_eos = self.argmax.iter().position(|t| self.s.eos.contains(t));
                let scored: Vec<TokenLogprob> = host
                    .chunks(width)
                    .zip(&self.argmax)
                    .enumerate()
                    .map(|(i, (row, &a))| {
                        let t = if first_eos.is_some_and(|e| i > e) {
                            self.s.pad
                        } else {
                            a
                        };
                        score(row, t, Filter::model(), top)
                    })
                    .collect();
                self.scores.extend(scored);
            }
            self.finish_canvas(outbox);
            return Ok(None);
        }
        Ok(Some(pl))
    }

    /// Keeps the self-conditioning input of the next step.
    pub(crate) fn set_soft(&mut self, soft: Vec<f32>) {
        self.soft = Some(soft);
    }

    /// Commits the canvas's argmax; ends the request or moves to the next canvas.
    fn finish_canvas(&mut self, outbox: &mut Outbox) {
        let mut canvas = std::mem::take(&mut self.argmax);
        let first_eos = canvas.iter().position(|t| self.s.eos.contains(t));
        if let Some(e) = first_eos {
            for t in &mut canvas[e + 1..] {
                *t = self.s.pad;
            }
        }
        self.tokens.extend(&canvas);
        self.canvas.clear();
        self.soft = None;
        self.canvas_index += 1;
        self.stats.add_counter("canvases", 1);
        let generated = self.tokens.len() - self.prompt_len;
        let first_stop = self.tokens[self.prompt_len..]
            .iter()
            .position(|t| self.s.eos.contains(t) || self.stop_ids.contains(t));
        if self.s.whole_canvases {
            let done = first_eos.is_some() || generated >= self.max_new;
            self.stream(generated, outbox);
            if done {
                let reason = if first_eos.is_some() {
                    FinishReason::StopToken
                } else {
                    FinishReason::Length
                };
                self.finish(reason, outbox);
            }
            return;
        }
        match first_stop {
            Some(i) if i < self.max_new => {
                self.stream(i + 1, outbox);
                self.finish(FinishReason::StopToken, outbox);
            }
            _ if generated >= self.max_new => {
                self.stream(self.max_new, outbox);
                self.finish(FinishReason::Length, outbox);
            }
            _ => self.stream(generated, outbox),
        }
    }

    /// Sends generated tokens up to `upto` (exclusive, counted from the first generated one).
    fn stream(&mut self, upto: usize, outbox: &mut Outbox) {
        if upto > self.streamed {
            let from = self.prompt_len + self.streamed;
            let scored = self.logprobs.map(|_| {
                self.scores
                    .get(self.streamed..upto)
                    .unwrap_or_default()
                    .to_vec()
            });
            outbox.scored_tokens(self.tokens[from..self.prompt_len + upto].to_vec(), scored);
            self.streamed = upto;
        }
    }

    /// The canvas being denoised: accepted positions drafted, the others noise (shown as
    /// masked), after the committed canvases.
    fn snapshot(&self, accepted: &[bool]) -> CanvasFrame {
        let committed = self.tokens.len() - self.prompt_len;
        let mut frame = CanvasFrame {
            positions: (0..(committed + self.canvas.len()) as u32).collect(),
            tokens: self.tokens[self.prompt_len..].to_vec(),
            states: vec![CellState::Committed; committed],
            full: true,
            step: u32::try_from(self.stats.forward_passes).unwrap_or(u32::MAX),
        };
        for (i, &t) in self.canvas.iter().enumerate() {
            frame.tokens.push(t);
            frame.states.push(if accepted[i] {
                CellState::Drafted
            } else {
                CellState::Masked
            });
        }
        frame
    }

    pub(crate) fn finish(&mut self, reason: FinishReason, outbox: &mut Outbox) {
        self.done = true;
        outbox.finish(reason, std::mem::take(&mut self.stats));
    }
}
