//! Autoregressive decoding of a recurrent-depth model, packed across requests.
//!
//! Per token (upstream `generate_minimal` and
//! `generate_with_adaptive_compute`): run the prelude over the positions not
//! yet in the cache (the whole prompt first, then one token), draw a fresh
//! initial state per position, iterate the core block, then coda and head on
//! the last position.
//! - **static**: exactly `num_steps` core iterations;
//! - **adaptive exit**: after each iteration, `v = mean over the processed
//!   positions of ||s_new - s|| / ||s_new||`; stop as soon as `v < exit_threshold`
//!   (at most `num_steps`). A token writes core K/V only for the recurrences
//!   it ran; later tokens read its deepest one (`latest-m4` lookup).
//!
//! **Continuous compute** (upstream `continuous_compute`, "warm-start state /
//! continuous CoT"): the prompt's positions start from fresh draws as usual;
//! every later position starts from the final raw state of the position
//! before it (the state its token was decoded from: after `num_steps`
//! iterations, or at the adaptive exit) instead of a fresh draw, so no draws
//! are consumed after the prompt. This is upstream's intent; its two AR loops
//! disagree on the state copied (`generate_with_adaptive_compute` copies the
//! raw state as here, `generate_minimal` copies `latent_states`, i.e. the
//! state after the final norm `ln_f`); no golden covers either.
//!
//! One step advances a request by one token (or a chunk of its prefill). The steps of every
//! request in a tick share each prelude, core and coda call ([`run`]); at core iteration `t` only the
//! requests still iterating take part, so static requests with different
//! `num_steps` and adaptive requests that exit early pack together.

use candle_core::{Device, Tensor};
use wavefront_engine::{FinishReason, Outbox, Stats, TokenLogprob};
use wavefront_models::{relative_change, Huginn, HuginnCache};

use super::draws::DrawSource;
pub use super::packed::NextToken;
use super::packed::{cat_rows, core_call, next_tokens, seq_rows};
use crate::packing::ends_after;
use crate::sampling::{guided_pick, score_hidden, TokenSampler};
use crate::SchemeError;

/// One request's autoregressive decoding state.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct ArProgram {
    pub(crate) cache: HuginnCache,
    /// Tokens not yet run through the model (prompt at first, then the last token).
    pub(crate) pending: Vec<u32>,
    pub(crate) num_steps: usize,
    pub(crate) exit_threshold: Option<f32>,
    pub(crate) continuous_compute: bool,
    /// Continuous compute: the last processed position's final state `[1, E]`, the initial
    /// state of the next position.
    #[serde(with = "wavefront_models::state::opt_tensor")]
    pub(crate) warm_state: Option<Tensor>,
    pub(crate) draws: DrawSource,
    pub(crate) sampler: TokenSampler,
    pub(crate) max_new_tokens: usize,
    pub(crate) stop_token_ids: Vec<u32>,
    pub(crate) generated: usize,
    pub(crate) stats: Stats,
    /// With `prompt_logprobs`: the prompt's entries so far (position 0's first), until the
    /// prefill ends and they are sent.
    #[serde(default)]
    pub(crate) prompt_scores: Option<Vec<TokenLogprob>>,
    /// The structured-output constraint, when the request has one (it does not travel to
    /// another worker: `constrained` says it had one).
    #[serde(skip)]
    pub(crate) guide: Option<crate::constraint::Guide>,
    #[serde(default)]
    pub(crate) constrained: bool,
    /// The prompt's ids (prompt sharing compares them).
    #[serde(default)]
    pub(crate) prompt: Vec<u32>,
    /// The prompt-sharing key of the prefill's rows (the planner's), `None` when they are
    /// this request's own.
    #[serde(default)]
    pub(crate) key: Option<u64>,
    /// The key of what the prefill's rows depend on besides the ids (recurrences, cache layout,
    /// initial states), `None` when they are this request's own: prompts that only begin
    /// alike share their common prefix's pages when it is the same.
    #[serde(default)]
    pub(crate) settings: Option<u64>,
}

/// What one request runs this tick, as plain data ([`ArProgram::plan`]): positions, token ids,
/// initial states, recurrences and exit rule, and whether the head reads its last row.
#[derive(Debug, Clone)]
pub struct ArPlan {
    /// Position of the first row (the cache's length).
    pub start: usize,
    /// Token ids of the positions run this tick (all pending ones, or a chunk of a prefill).
    pub ids: Vec<u32>,
    /// Whether every pending position runs, so a token is chosen from the last row.
    pub reads: bool,
    /// Recurrences to run (static), or at most (adaptive exit).
    pub num_steps: usize,
    pub exit_threshold: Option<f32>,
    pub init: ArInit,
    /// The token comes from the argmax (reduced on the device) rather than the request's
    /// sampler over the full logits row.
    pub greedy: bool,
    /// The prompt is being scored: every row's target (the next prompt token, none for the
    /// prompt's last row) and the alternatives asked for.
    pub score: Option<(Vec<Option<u32>>, usize)>,
}

/// Initial states of a plan's positions.
#[derive(Debug, Clone)]
pub enum ArInit {
    /// Fresh draws, `rows × n_embd` host values, each request from its own source.
    Drawn(Vec<f32>),
    /// Continuous compute: the final state `[1, E]` of the position before.
    Warm(Tensor),
}

/// What the packed forwards produced for one plan ([`ArProgram::commit`] applies it).
#[derive(Debug, Clone)]
pub struct ArOutput {
    /// Recurrences the positions ran.
    pub steps: usize,
    /// The head's verdict on the last row (`None` for a chunk of a prefill).
    pub next: Option<NextToken>,
    /// The last position's final state `[1, E]` (continuous compute, whole plans only).
    pub last_state: Option<Tensor>,
    /// Every row's entry (plans that score their rows).
    pub scored: Option<Vec<TokenLogprob>>,
}

impl ArProgram {
    /// Whether the prompt's rows are still being computed.
    pub(crate) fn prompt_pending(&self) -> bool {
        self.cache.len() < self.prompt.len()
    }

    /// Positions of `donor`'s cache this request, which has run nothing, may read as its own:
    /// the whole pages of `page` positions of the prompts' longest common prefix before its
    /// last position, when the rows' other inputs agree (`settings`) and the donor's prompt is
    /// computed and in its slots.
    pub(crate) fn shareable(&self, donor: &ArProgram, page: usize) -> usize {
        let fresh = self.cache.is_empty() && self.pending == self.prompt && self.generated == 0;
        if !fresh
            || self.key.is_none()
            || self.settings.is_none()
            || donor.settings != self.settings
            || donor.prompt_pending()
            || donor.cache.is_swapped()
        {
            return 0;
        }
        // A position's rows depend on the ids up to it: the prompts' longest common prefix.
        crate::packing::common_prompt_rows(&self.prompt, &donor.prompt, page)
    }

    /// The cache holds the prompt's first `rows` positions (another request's pages): they are
    /// not run again, and their initial states are drawn and dropped, so the rest of the
    /// request's draws are the ones it takes alone.
    pub(crate) fn skip_prompt(&mut self, rows: usize, dim: usize) -> Result<(), SchemeError> {
        if self.cache.len() != rows || rows >= self.pending.len() {
            return Err(SchemeError::inconsistent(
                "shared prompt rows do not fit the prompt",
            ));
        }
        self.draws.next(rows, dim, false)?;
        self.pending.drain(..rows);
        self.stats.add_counter("shared_prompt_tokens", rows as u64);
        Ok(())
    }

    /// The plan of the next `rows` pending positions (a chunk of a static prefill when fewer
    /// than it has). Takes the positions' initial states: draws from the request's source, or
    /// its warm state.
    pub fn plan(&mut self, rows: usize, dim: usize) -> Result<ArPlan, SchemeError> {
        let n = rows.min(self.pending.len());
        if n == 0 {
            return Err(SchemeError::inconsistent("an AR plan of no rows"));
        }
        let init = match self.warm_state.take() {
            Some(w) if n == 1 => ArInit::Warm(w),
            Some(_) => {
                return Err(SchemeError::inconsistent(
                    "a warm state seeds exactly one new position",
                ))
            }
            None => ArInit::Drawn(self.draws.next(n, dim, false)?),
        };
        Ok(ArPlan {
            start: self.cache.len(),
            ids: self.pending[..n].to_vec(),
            reads: n == self.pending.len(),
            num_steps: self.num_steps,
            exit_threshold: self.exit_threshold,
            init,
            greedy: !self.sampler.wants_logits() && !self.constrained,
            // Row j predicts the position after it: the chunk's next id, or the first of the
            // prompt's rest; the prompt's last row predicts no prompt token.
            score: self.prompt_scores.as_ref().map(|_| {
                let targets = (0..n).map(|j| self.pending.get(j + 1).copied()).collect();
                (targets, self.sampler.params().prompt_logprobs.unwrap_or(0))
            }),
        })
    }

    /// Applies what `plan` produced: a chunk of a prefill leaves the rest pending; otherwise
    /// the token is chosen (the argmax, or a draw of the request's sampler), streamed, and the
    /// request finishes on a stop token or at `max_new_tokens`.
    pub fn commit(
        &mut self,
        plan: &ArPlan,
        out: ArOutput,
        outbox: &mut Outbox,
    ) -> Result<(), SchemeError> {
        self.stats.forward_passes += 1;
        if let (Some(scores), Some(scored)) = (&mut self.prompt_scores, out.scored) {
            let n = plan.ids.len();
            if scores.is_empty() {
                scores.push(TokenLogprob::unscored());
            }
            scores.extend(scored.into_iter().take(n - usize::from(plan.reads)));
        }
        let Some(next) = out.next else {
            if plan.reads {
                return Err(SchemeError::inconsistent(
                    "the head read no row of a whole plan",
                ));
            }
            // A chunk of the prefill: its positions are cached, the rest runs next.
            self.pending.drain(..plan.ids.len());
            return Ok(());
        };
        if let Some(scores) = self.prompt_scores.take() {
            outbox.prompt_logprobs(scores);
            if self.max_new_tokens == 0 {
                // Scored only: no token is chosen.
                outbox.finish(FinishReason::Length, std::mem::take(&mut self.stats));
                return Ok(());
            }
        }
        if self.continuous_compute {
            self.warm_state = Some(
                out.last_state
                    .ok_or_else(|| SchemeError::inconsistent("no final state to continue from"))?,
            );
        }
        if self.constrained && self.guide.is_none() {
            return Err(SchemeError::inconsistent(
                "a structured-output request cannot continue on another worker",
            ));
        }
        let (tok, scored, complete) = match next {
            NextToken::Argmax(t) => (t, None, false),
            NextToken::Logits(row) => guided_pick(&mut self.sampler, self.guide.as_mut(), &row)?,
        };
        self.stats.recurrence_steps += out.steps as u64;
        self.stats.push_series("steps_per_token", out.steps as u32);
        self.generated += 1;
        self.pending.clear();
        self.pending.push(tok);
        outbox.scored_tokens(vec![tok], scored.map(|s| vec![s]));
        let reason = ends_after(
            tok,
            &self.stop_token_ids,
            self.generated,
            self.max_new_tokens,
        )
        .or(complete.then_some(FinishReason::StopToken));
        if let Some(reason) = reason {
            let stats = std::mem::take(&mut self.stats);
            outbox.finish(reason, stats);
        }
        Ok(())
    }
}

/// Whether `p`'s next call may run in chunks: a prefill at a static recurrence (an adaptive
/// exit averages the latent change over the positions of the call, so it runs whole).
pub(crate) fn chunkable(p: &ArProgram) -> bool {
    p.pending.len() > 1 && p.exit_threshold.is_none()
}

/// The packed forwards of `plans` (one per cache of `caches`): one prelude call over every
/// row, one core call per recurrence over the plans still iterating, one coda call, one head
/// call over the last rows of whole plans. Writes each plan's K/V into its cache.
pub fn run(
    model: &Huginn,
    plans: &[&ArPlan],
    caches: &mut [&mut HuginnCache],
) -> Result<Vec<ArOutput>, SchemeError> {
    let device = model.device().clone();
    let dtype = model.dtype();
    let dim = model.config().n_embd;
    let lens: Vec<usize> = plans.iter().map(|p| p.ids.len()).collect();
    let starts: Vec<usize> = plans.iter().map(|p| p.start).collect();
    let ids: Vec<u32> = plans.iter().flat_map(|p| p.ids.iter().copied()).collect();

    // Prelude over every row of every plan.
    let emb = model.embed(&ids)?;
    let injected = {
        let mut seqs = seq_rows(caches, &starts, &lens);
        model.prelude(&emb, &mut seqs)?
    };

    // Initial states: the drawn rows of every plan in one host-to-device copy; warm states as
    // they are.
    let drawn: Vec<f32> = plans
        .iter()
        .flat_map(|p| match &p.init {
            ArInit::Drawn(v) => v.as_slice(),
            ArInit::Warm(_) => &[],
        })
        .copied()
        .collect();
    let drawn = if drawn.is_empty() {
        None
    } else {
        let rows = drawn.len() / dim;
        Some(
            Tensor::from_vec(drawn, (rows, dim), &Device::Cpu)?
                .to_device(&device)?
                .to_dtype(dtype)?,
        )
    };
    let offsets: Vec<usize> = lens
        .iter()
        .scan(0, |acc, &n| {
            let o = *acc;
            *acc += n;
            Some(o)
        })
        .collect();
    let mut drawn_offset = 0;
    let mut states: Vec<Tensor> = Vec::with_capacity(plans.len());
    for (p, &n) in plans.iter().zip(&lens) {
        match &p.init {
            ArInit::Warm(w) => states.push(w.clone()),
            ArInit::Drawn(_) => {
                let drawn = drawn.as_ref().expect("rows were drawn for this plan");
                states.push(drawn.narrow(0, drawn_offset, n)?);
                drawn_offset += n;
            }
        }
    }
    let injs: Vec<Tensor> = offsets
        .iter()
        .zip(&lens)
        .map(|(&o, &n)| injected.narrow(0, o, n))
        .collect::<candle_core::Result<_>>()?;

    // Core iterations: plan i takes part while it is still iterating.
    let mut steps_run = vec![0usize; plans.len()];
    let mut iterating: Vec<bool> = plans.iter().map(|p| p.num_steps > 0).collect();
    let max_steps = plans.iter().map(|p| p.num_steps).max().unwrap_or(0);
    for t in 0..max_steps {
        let members: Vec<usize> = (0..plans.len()).filter(|&i| iterating[i]).collect();
        if members.is_empty() {
            break;
        }
        let (s, next) = core_call(
            model,
            caches,
            &starts,
            &lens,
            &mut states,
            &injs,
            &members,
            t,
        )?;
        // Adaptive members need their exit value: one small host copy.
        let change = if members.iter().any(|&i| plans[i].exit_threshold.is_some()) {
            Some(relative_change(&next, &s)?.to_vec1::<f32>()?)
        } else {
            None
        };
        let mut row = 0;
        for &i in &members {
            let n = lens[i];
            steps_run[i] += 1;
            let exited = match (plans[i].exit_threshold, &change) {
                (Some(eps), Some(c)) => c[row..row + n].iter().sum::<f32>() / (n as f32) < eps,
                _ => false,
            };
            if steps_run[i] >= plans[i].num_steps || exited {
                iterating[i] = false;
            }
            row += n;
        }
    }

    // Coda over every row (its K/V is needed later), head on the last rows of whole plans.
    let final_state = cat_rows(&states)?;
    let hidden = {
        let mut seqs = seq_rows(caches, &starts, &lens);
        model.coda(&final_state, &mut seqs)?
    };
    let whole: Vec<usize> = (0..plans.len()).filter(|&i| plans[i].reads).collect();
    let mut next: Vec<Option<NextToken>> = vec![None; plans.len()];
    if !whole.is_empty() {
        let last_rows: Vec<u32> = whole
            .iter()
            .map(|&i| (offsets[i] + lens[i] - 1) as u32)
            .collect();
        let last = hidden.index_select(&Tensor::new(last_rows.as_slice(), &device)?, 0)?;
        let logits = model.lm_head(&last)?;
        let greedy = whole.iter().all(|&i| plans[i].greedy);
        for (&i, verdict) in whole.iter().zip(next_tokens(&logits, greedy)?) {
            next[i] = Some(verdict);
        }
    }
    plans
        .iter()
        .zip(states)
        .zip(next)
        .zip(steps_run)
        .enumerate()
        .map(|(i, (((p, s), next), steps))| {
            let n = p.ids.len();
            let scored = match &p.score {
                Some((targets, top)) => Some(score_hidden(
                    &hidden.narrow(0, offsets[i], n)?,
                    targets,
                    *top,
                    |rows| {
                        model
                            .lm_head(rows)
                            .map_err(|e| candle_core::Error::Msg(e.to_string()))
                    },
                )?),
                None => None,
            };
            Ok(ArOutput {
                scored,
                steps,
                last_state: if p.reads {
                    Some(s.narrow(0, n - 1, 1)?)
                } else {
                    None
                },
                next,
            })
        })
        .collect()
}

/// Plans and commits on fake outputs: what a program does with each kind of result, with no
/// model in the loop.
#[cfg(test)]
mod commit_tests {
    use anyhow::{bail, ensure, Result};
    use candle_core::{Device, Tensor};
    use wavefront_engine::{Event, FinishReason, Outbox};

    use super::{ArInit, ArOutput, ArProgram, NextToken};
    use crate::recurrent_depth::test_support::{ar_static, fixture_config, prompt};
    use crate::recurrent_depth::{HuginnPlanner, Program};
    use crate::request::{ArParams, GenerateSpec, SchemeParams};
    use crate::served::Planner;

    fn program(spec: GenerateSpec) -> Result<ArProgram> {
        let planner = HuginnPlanner::new(fixture_config()?, "f".into(), None);
        match planner.prepare(spec)?.program {
            Program::Ar(p) => Ok(p),
            Program::Diffusion(_) => bail!("not an AR request"),
        }
    }

    fn spec(len: usize, max_new: usize, scheme: SchemeParams) -> GenerateSpec {
        GenerateSpec::greedy(prompt(len, 0), max_new, 3, scheme)
    }

    fn out(steps: usize, next: Option<NextToken>) -> ArOutput {
        ArOutput {
            steps,
            next,
            last_state: None,
            scored: None,
        }
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

    fn finished(o: &Outbox) -> Option<(FinishReason, wavefront_engine::Stats)> {
        o.events().iter().find_map(|e| match e {
            Event::Finished { reason, stats } => Some((*reason, stats.clone())),
            _ => None,
        })
    }

    #[test]
    fn a_whole_plan_streams_its_token_and_a_stop_token_finishes() -> Result<()> {
        let dim = fixture_config()?.n_embd;
        let mut s = spec(5, 10, ar_static(4, "full"));
        s.stop_token_ids = vec![77];
        let mut p = program(s)?;
        let mut outbox = Outbox::default();
        let plan = p.plan(5, dim).map_err(anyhow::Error::msg)?;
        ensure!(plan.reads && plan.ids.len() == 5 && plan.start == 0 && plan.num_steps == 4);
        ensure!(matches!(&plan.init, ArInit::Drawn(v) if v.len() == 5 * dim));
        p.commit(&plan, out(4, Some(NextToken::Argmax(12))), &mut outbox)
            .map_err(anyhow::Error::msg)?;
        ensure!(tokens(&outbox) == [12] && p.pending == [12] && !outbox.is_done());
        let plan = p.plan(1, dim).map_err(anyhow::Error::msg)?;
        ensure!(plan.ids == [12]);
        p.commit(&plan, out(3, Some(NextToken::Argmax(77))), &mut outbox)
            .map_err(anyhow::Error::msg)?;
        let (reason, stats) = finished(&outbox).ok_or_else(|| anyhow::anyhow!("not finished"))?;
        ensure!(reason == FinishReason::StopToken && tokens(&outbox) == [12, 77]);
        ensure!(stats.forward_passes == 2 && stats.recurrence_steps == 7);
        ensure!(stats.series["steps_per_token"] == [4, 3]);
        Ok(())
    }

    #[test]
    fn the_checkpoints_eos_token_finishes_a_request_that_names_no_stop() -> Result<()> {
        let dim = fixture_config()?.n_embd;
        let mut cfg = fixture_config()?;
        cfg.eos_token_id = serde_json::from_str("[90, 91]")?;
        let planner = HuginnPlanner::new(cfg, "f".into(), None);
        let Program::Ar(mut p) = planner.prepare(spec(3, 10, ar_static(2, "full")))?.program else {
            bail!("not an AR request");
        };
        let mut outbox = Outbox::default();
        for t in [5, 91] {
            let n = p.pending.len();
            let plan = p.plan(n, dim).map_err(anyhow::Error::msg)?;
            p.commit(&plan, out(2, Some(NextToken::Argmax(t))), &mut outbox)
                .map_err(anyhow::Error::msg)?;
        }
        ensure!(matches!(
            finished(&outbox),
            Some((FinishReason::StopToken, _))
        ));
        ensure!(tokens(&outbox) == [5, 91]);
        Ok(())
    }

    #[test]
    fn max_new_tokens_finishes_with_length() -> Result<()> {
        let dim = fixture_config()?.n_embd;
        let mut p = program(spec(3, 2, ar_static(2, "full")))?;
        let mut outbox = Outbox::default();
        for t in [5, 6] {
            let n = p.pending.len();
            let plan = p.plan(n, dim).map_err(anyhow::Error::msg)?;
            p.commit(&plan, out(2, Some(NextToken::Argmax(t))), &mut outbox)
                .map_err(anyhow::Error::msg)?;
        }
        ensure!(matches!(finished(&outbox), Some((FinishReason::Length, _))));
        ensure!(tokens(&outbox) == [5, 6]);
        Ok(())
    }

    #[test]
    fn a_chunk_of_a_prefill_caches_and_chooses_no_token() -> Result<()> {
        let dim = fixture_config()?.n_embd;
        let mut p = program(spec(5, 4, ar_static(2, "full")))?;
        let mut outbox = Outbox::default();
        let plan = p.plan(2, dim).map_err(anyhow::Error::msg)?;
        ensure!(!plan.reads && plan.ids.len() == 2);
        p.commit(&plan, out(2, None), &mut outbox)
            .map_err(anyhow::Error::msg)?;
        ensure!(outbox.events().is_empty() && p.pending.len() == 3);
        // The rest of the prompt draws the next rows of the same source.
        let plan = p.plan(3, dim).map_err(anyhow::Error::msg)?;
        ensure!(plan.reads && plan.ids == prompt(5, 0)[2..]);
        // A whole plan must come back with the head's verdict.
        ensure!(p.commit(&plan, out(2, None), &mut outbox).is_err());
        Ok(())
    }

    #[test]
    fn a_sampled_request_draws_from_the_logits_row() -> Result<()> {
        let dim = fixture_config()?.n_embd;
        let mut s = spec(3, 4, ar_static(2, "full"));
        s.sampling.temperature = 0.5;
        let mut p = program(s)?;
        let plan = p.plan(3, dim).map_err(anyhow::Error::msg)?;
        ensure!(!plan.greedy);
        let mut row = vec![0f32; 512];
        row[301] = 60.0;
        let mut outbox = Outbox::default();
        p.commit(&plan, out(2, Some(NextToken::Logits(row))), &mut outbox)
            .map_err(anyhow::Error::msg)?;
        ensure!(tokens(&outbox) == [301]);
        Ok(())
    }

    #[test]
    fn continuous_compute_starts_the_next_position_from_the_last_state() -> Result<()> {
        let dim = fixture_config()?.n_embd;
        let cc = SchemeParams::Ar(ArParams {
            num_steps: Some(2),
            continuous_compute: true,
            ..ArParams::default()
        });
        let mut p = program(spec(3, 4, cc))?;
        let plan = p.plan(3, dim).map_err(anyhow::Error::msg)?;
        let last = Tensor::full(0.5f32, (1, dim), &Device::Cpu)?;
        let mut outbox = Outbox::default();
        let output = ArOutput {
            steps: 2,
            next: Some(NextToken::Argmax(9)),
            last_state: Some(last),
            scored: None,
        };
        p.commit(&plan, output, &mut outbox)
            .map_err(anyhow::Error::msg)?;
        let plan = p.plan(1, dim).map_err(anyhow::Error::msg)?;
        match &plan.init {
            ArInit::Warm(w) => ensure!(w.flatten_all()?.to_vec1::<f32>()? == vec![0.5; dim]),
            ArInit::Drawn(_) => bail!("a continuous-compute decode step drew a fresh state"),
        }
        Ok(())
    }
}
