//! # Recurrent depth (Huginn-0125)
//!
//! Geiping et al. 2025, "Scaling up Test-Time Compute with Latent Reasoning:
//! A Recurrent Depth Approach": a prelude, a core block iterated `r` times
//! with the prelude output injected at every step, and a coda. Decoding
//! schemes served here:
//! - `ar` static: a fixed number of recurrence steps per token ([`ar`]);
//! - `ar` adaptive exit: iterate until the latent stops moving ([`ar`]);
//! - `diffusion-forcing`: a wavefront of positions iterated together, frozen
//!   as their latents converge ([`diffusion`]; Geiping et al. 2025, "Efficient
//!   Parallel Samplers for Recurrent-Depth Models and Their Connection to
//!   Diffusion Language Models").
//!
//! Both schemes take upstream's `continuous_compute`: a new position starts
//! from the latent state of the position before it instead of a fresh random
//! draw (see each module for the exact state copied).
//!
//! The planner validates a request and builds its program on the caller's
//! thread; the family packs every active program's rows into one prelude,
//! one core call per recurrence and one coda call per tick.
//!
//! ## Slots
//!
//! The slot unit is a page: `--kv-page-size` ([`PAGE_SIZE`] by default) rows of
//! `2 · n_embd` values of the
//! model dtype; the pool holds `memory_budget_bytes / (16 · 2 · n_embd · dtype
//! size)` of them. A page holds either
//! - the keys and values of 16 consecutive positions in one cache slot (a
//!   prelude or coda layer, or a core layer at one recurrence), or
//! - 16 rows of a diffusion-forcing request's wavefront: each position's
//!   latent state in the key half (also the state the freeze test compares the
//!   next step's with) and, with momentum, the step's mixed embeddings in the
//!   value half ([`HuginnCache::write_latents`]).
//!
//! The K/V pages are the family's page pool ([`HuginnFamily`]): slot ids are
//! page ids, and a request's [`HuginnCache`] takes a page when a position in
//! it is first written to a cache slot. Cache slots are the prelude and coda
//! layers plus the core layers its `cache_lookup_strategy` keeps (every
//! recurrence for `full` and `latest-m4`, `N` for `compress-sN`). Before each
//! tick a request is granted the pages its next positions can reach
//! ([`Program::pages_needed`]: a page for every cache slot whose page of a new
//! position it does not hold yet), so an adaptive exit that stops early leaves
//! the deeper slots' pages untaken; admission takes the first step's pages
//! (the prompt's), not the worst case. The worst case (prompt +
//! `max_new_tokens` positions, plus `max_wavefront` for diffusion forcing, in
//! every cache slot) bounds what a request may ever hold: one larger than the
//! pool is refused at once.
//!
//! A diffusion-forcing request also holds latent pages for its wavefront's states:
//! `ceil(rows × occupancy_multiplier / 16)` for the rows the wave has after the
//! next step (one after the prefill, then the wave plus its headway), at most
//! `ceil(max_wavefront × occupancy_multiplier / 16)`
//! ([`LoadOptions::occupancy_multiplier`]; values below 1.0 count as 1.0). Pages
//! are taken as the wave grows and given back as its positions freeze and it
//! shrinks. The states live in those pages, not in request tensors: each step reads
//! them (a copy into the packed rows) and writes the next wave back into the same
//! pages, so preemption, resumption and export move them with the K/V pages.
//! `ar` latent states live only within one tick.
//!
//! When the pool is short the engine preempts the newest request: its pages
//! are copied to host memory with its latent states and given back, and it
//! resumes, in whatever pages are free then, ahead of new arrivals, producing
//! exactly the tokens it would have.

pub mod ar;
pub mod diffusion;
pub mod draws;
#[cfg(test)]
mod golden_tests;
mod packed;
#[cfg(test)]
mod scheme_tests;
#[cfg(test)]
mod serving_tests;
#[cfg(test)]
pub(crate) mod test_support;

use std::sync::Arc;

use candle_core::{DType, Device};
use wavefront_engine::{
    Active, Demand, Family, FamilyError, FinishReason, Group, Moved, Phase, Planned, Prepared,
    RequestError, SlotId, Stats,
};
use wavefront_models::transformer::{KvPool, PAGE_SIZE};
use wavefront_models::{
    CacheStrategy, Huginn, HuginnCache, HuginnConfig, ModelFiles, TextTokenizer,
};

use crate::paging;
use crate::registry::FamilyKind;
use crate::request::{ArParams, Execution, GenerateSpec, SchemeParams};
use crate::sampling::TokenSampler;
use crate::served::{
    checked_family, checkpoint_loader, optional_tokenizer, start_served, KvReserve, LoadOptions,
    ModelInfo, Planner, ServedModel,
};
use crate::SchemeError;
use ar::ArProgram;
use draws::DrawSource;

/// This family's name.
pub(crate) const FAMILY: &str = FamilyKind::RecurrentDepth.name();

/// Upper bound on recurrence steps per token a request may ask for.
pub const MAX_NUM_STEPS: usize = 1024;

/// A recurrent-depth request's program.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub enum Program {
    Ar(ArProgram),
    Diffusion(diffusion::DiffusionProgram),
}

/// Validates requests against a Huginn config and builds programs.
pub struct HuginnPlanner {
    cfg: HuginnConfig,
    info: ModelInfo,
    end_text_id: Option<u32>,
    occupancy_multiplier: f32,
    reserve: KvReserve,
    /// Positions a page holds.
    pub(crate) page: usize,
}

impl HuginnPlanner {
    pub fn new(cfg: HuginnConfig, name: String, tokenizer: Option<&TextTokenizer>) -> Self {
        let info = ModelInfo {
            name,
            family: FAMILY,
            schemes: vec!["ar", "diffusion-forcing"],
            vocab_size: cfg.vocab_size,
            max_context: cfg.block_size,
        };
        let end_text_id = tokenizer.and_then(|t| t.token_to_id("<|end_text|>"));
        Self {
            cfg,
            info,
            end_text_id,
            occupancy_multiplier: 1.0,
            reserve: KvReserve::OnDemand,
            page: PAGE_SIZE,
        }
    }

    /// Latent slots reserved per wavefront position a diffusion-forcing request may hold
    /// (see the module doc); must be finite and positive.
    pub fn with_occupancy_multiplier(mut self, multiplier: f32) -> Self {
        self.occupancy_multiplier = multiplier;
        self
    }

    /// Latent slots a diffusion-forcing request with this wavefront cap reserves: at least one
    /// per position, since the states are stored in them.
    pub fn latent_slots(&self, max_wavefront: usize) -> usize {
        (max_wavefront as f64 * f64::from(self.occupancy_multiplier).max(1.0)).ceil() as usize
    }

    /// Takes each request's worst case at admission instead of pages on demand.
    pub fn with_reserve(mut self, reserve: KvReserve) -> Self {
        self.reserve = reserve;
        self
    }

    /// A request's stop tokens and the checkpoint's `eos_token_id`s.
    fn stop_ids(&self, mut stop: Vec<u32>) -> Vec<u32> {
        stop.extend(self.cfg.eos_token_ids());
        stop
    }

    /// Positions a page holds (default [`PAGE_SIZE`]).
    pub fn with_page_size(mut self, page: usize) -> Self {
        self.page = page.max(1);
        self
    }

    /// An empty cache with this planner's pages (moved into the family's pool at its first
    /// tick).
    pub(crate) fn cache(&self, strategy: CacheStrategy) -> HuginnCache {
        HuginnCache::with_page_size(strategy, self.page)
    }

    /// K/V pages `positions` positions take in every cache slot of `strategy` with `steps`
    /// recurrences.
    fn kv_pages(&self, positions: usize, strategy: CacheStrategy, steps: usize) -> usize {
        positions.div_ceil(self.page) * cache_slots(&self.cfg, strategy, steps).total()
    }

    /// The request running `program`, `max_slots` pages at most: its first step's pages at
    /// admission, or its worst case.
    fn prepared(
        &self,
        program: Program,
        max_slots: usize,
        prompt_tokens: usize,
    ) -> Prepared<Program> {
        let first = program.pages_needed(&self.cfg);
        self.reserve
            .prepared(program, first, max_slots, prompt_tokens)
    }

    fn prepare_ar(
        &self,
        spec: GenerateSpec,
        a: &ArParams,
    ) -> Result<Prepared<Program>, RequestError> {
        let bad = |m: String| Err(RequestError::InvalidArgument(m));
        if a.execution != Execution::Auto {
            return bad(format!(
                "ar.execution `{}` applies to recurrent-memory (ARMT) models; leave it empty or \
                 `auto` for recurrent-depth models",
                a.execution.as_str()
            ));
        }
        let num_steps = a.num_steps.unwrap_or(self.cfg.mean_recurrence);
        if num_steps == 0 || num_steps > MAX_NUM_STEPS {
            return bad(format!(
                "ar.num_steps must be in 1..={MAX_NUM_STEPS}, got {num_steps}"
            ));
        }
        let strategy_name = a.cache_lookup_strategy.as_deref().unwrap_or("full");
        let strategy: CacheStrategy = strategy_name
            .parse()
            .map_err(|e| RequestError::InvalidArgument(format!("ar.cache_lookup_strategy: {e}")))?;
        let init_scale = a.init_scale.unwrap_or(1.0);
        if !init_scale.is_finite() || !(0.0..=100.0).contains(&init_scale) {
            return bad(format!(
                "ar.init_scale must be in [0, 100], got {init_scale}"
            ));
        }
        if let Some(eps) = a.exit_threshold {
            if !eps.is_finite() || eps <= 0.0 || eps > 1.0 {
                return bad(format!("ar.exit_threshold must be in (0, 1], got {eps}"));
            }
        }
        let positions = spec.prompt_ids.len() + spec.max_new_tokens;
        let draws = match (&spec.replay_draws, init_scale) {
            (_, 0.0) => DrawSource::Zeros,
            (Some(r), _) => {
                // Row p of an AR replay is position p's initial state; with continuous
                // compute only the prompt's positions are drawn.
                let needed = if a.continuous_compute {
                    spec.prompt_ids.len()
                } else {
                    positions - 1
                };
                if r.rows() < needed {
                    return bad(format!(
                        "replayed draws hold {} rows; this request needs {needed}",
                        r.rows()
                    ));
                }
                DrawSource::replay(r.clone())
            }
            (None, s) => DrawSource::seeded(
                spec.sampling.seed,
                self.cfg.init_std(f64::from(s)),
                self.cfg.embed_scale(),
            ),
        };
        let max_slots = self.kv_pages(positions, strategy, num_steps);
        let prompt_tokens = spec.prompt_ids.len();
        let program = ArProgram {
            cache: self.cache(strategy),
            pending: spec.prompt_ids,
            num_steps,
            exit_threshold: a.exit_threshold,
            continuous_compute: a.continuous_compute,
            warm_state: None,
            draws,
            sampler: TokenSampler::new(spec.sampling),
            max_new_tokens: spec.max_new_tokens,
            stop_token_ids: self.stop_ids(spec.stop_token_ids),
            generated: 0,
            stats: Stats::default(),
        };
        Ok(self.prepared(Program::Ar(program), max_slots, prompt_tokens))
    }
}

/// Cache slots (K/V stores) of one position: prelude, core and coda layers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CacheSlots {
    prelude: usize,
    core: usize,
    coda: usize,
}

impl CacheSlots {
    fn total(self) -> usize {
        self.prelude + self.core + self.coda
    }
}

/// The cache slots one position occupies under `strategy` with `steps` recurrences: every
/// prelude and coda layer, and the core layers at every recurrence (`full`, `latest-m4`) or
/// shared across recurrences (`compress-sN`: N).
pub(crate) fn cache_slots(cfg: &HuginnConfig, strategy: CacheStrategy, steps: usize) -> CacheSlots {
    let core = cfg.n_layers_in_recurrent_block * steps;
    CacheSlots {
        prelude: cfg.n_layers_in_prelude,
        core: match strategy {
            CacheStrategy::Compress { stride, .. } => core.min(stride),
            _ => core,
        },
        coda: cfg.n_layers_in_coda,
    }
}

impl Program {
    /// The cache that holds the request's K/V between ticks (in the family's page pool).
    pub(crate) fn state_cache(&mut self) -> &mut HuginnCache {
        match self {
            Program::Ar(p) => &mut p.cache,
            Program::Diffusion(p) => &mut p.cache,
        }
    }

    /// Slots (pages) the request holds after its next tick at most: its cache's pages plus a
    /// page for every cache slot the next positions reach in a page not held yet, and (diffusion
    /// forcing) the wavefront's latent pages.
    pub fn pages_needed(&self, cfg: &HuginnConfig) -> usize {
        let (cache, steps, rows, latent) = match self {
            Program::Ar(p) => (&p.cache, p.num_steps, p.pending.len(), 0),
            Program::Diffusion(p) => (
                &p.cache,
                p.settings.num_steps,
                p.next_rows(),
                p.latent_pages_needed(),
            ),
        };
        let s = cache_slots(cfg, cache.strategy(), steps);
        let start = cache.len();
        cache.pages_after(start..start + rows, s.prelude, s.core, s.coda) + latent
    }
}

impl Planner for HuginnPlanner {
    type Program = Program;

    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn prepare(&self, spec: GenerateSpec) -> Result<Prepared<Program>, RequestError> {
        spec.validate_common(self.cfg.vocab_size, self.cfg.block_size)?;
        match spec.scheme.clone() {
            SchemeParams::Ar(a) => self.prepare_ar(spec, &a),
            SchemeParams::DiffusionForcing(d) => self.prepare_diffusion(spec, &d),
            #[allow(unreachable_patterns)]
            other => Err(RequestError::InvalidArgument(format!(
                "scheme `{}` is not available for recurrent-depth models; use `ar` or `diffusion-forcing`",
                other.name()
            ))),
        }
    }

    /// Huginn's recipe: encode with the template `<|begin_text|> $A
    /// <|end_text|>` and drop the trailing `<|end_text|>`.
    fn encode_prompt(
        &self,
        tokenizer: &TextTokenizer,
        text: &str,
    ) -> Result<Vec<u32>, SchemeError> {
        let mut ids = tokenizer.encode(text, true)?;
        if self.end_text_id.is_some() && ids.last().copied() == self.end_text_id {
            ids.pop();
        }
        Ok(ids)
    }
}

/// A recurrent-depth step as plain data: one token (or a chunk of a prefill) of `ar`, or the
/// prefill or one outer step of diffusion forcing.
#[derive(Debug)]
pub enum HuginnPlan {
    Ar(ar::ArPlan),
    Diffusion(diffusion::DfPlan),
}

/// What the packed forwards produced for one [`HuginnPlan`].
#[derive(Debug)]
pub enum HuginnOutput {
    Ar(ar::ArOutput),
    Diffusion(diffusion::DfOutput),
}

/// The family: owns the model and the page pool of its requests' caches on the engine thread.
/// Slot ids granted by the engine are page ids of the pool (K/V pages, and a diffusion-forcing
/// request's latent pages, which hold its wavefront's states). Each scheme's steps run in a
/// forward group of their own: one prelude, one core call per recurrence and one coda call
/// over every request of the scheme.
pub struct HuginnFamily {
    model: Huginn,
    pool: KvPool,
    /// Tests: the scheme group whose next forward fails.
    #[cfg(test)]
    pub(crate) fail_next: Option<&'static str>,
}

impl HuginnFamily {
    pub fn new(model: Huginn) -> Self {
        Self {
            model,
            pool: KvPool::shared(PAGE_SIZE),
            #[cfg(test)]
            fail_next: None,
        }
    }

    /// Pages of `page` positions (the planner's page size).
    pub fn with_page_size(mut self, page: usize) -> Self {
        self.pool = KvPool::shared(page.max(1));
        self
    }

    pub fn model(&self) -> &Huginn {
        &self.model
    }

    /// Hands the slots granted to `a` since the last look to its cache (moved into the pool on
    /// first sight: programs are built outside the engine thread).
    fn bind(&self, a: &mut Active<Program>) {
        let new = a.take_new_slots();
        paging::bind(a.program.state_cache(), &self.pool, new);
    }

    /// Moves a preempted request's latent states to host memory, or back to the model's device.
    fn move_latents(&self, a: &mut Active<Program>, device: &Device) -> Result<(), FamilyError> {
        let moved = match &mut a.program {
            Program::Ar(p) => p
                .warm_state
                .as_mut()
                .map(|w| w.to_device(device).map(|t| *w = t))
                .transpose()
                .map(|_| ()),
            // Diffusion forcing's states are in its cache's pages: they move with them.
            Program::Diffusion(_) => Ok(()),
        };
        let phase = if device.is_cpu() {
            Phase::Preempt
        } else {
            Phase::Resume
        };
        moved.map_err(|e| FamilyError::program(FAMILY, phase, e))
    }

    /// A fault injected by a test into `group`'s next forward.
    fn injected(&mut self, group: &'static str) -> Result<(), SchemeError> {
        #[cfg(test)]
        if self.fail_next == Some(group) {
            self.fail_next = None;
            return Err(SchemeError::Unsupported(format!(
                "injected failure of the {group} forward"
            )));
        }
        let _ = group;
        Ok(())
    }
}

impl Family for HuginnFamily {
    type Program = Program;
    type Plan = HuginnPlan;
    type Output = HuginnOutput;

    /// A static `ar` prefill may run in chunks (an adaptive exit averages the latent change over
    /// the positions of the call, so its prefill runs whole); every other step runs whole.
    fn demand(&self, a: &Active<Program>) -> Demand {
        match &a.program {
            Program::Ar(p) if ar::chunkable(p) => Demand::Prefill(p.pending.len()),
            Program::Ar(p) => Demand::Whole(p.pending.len()),
            Program::Diffusion(p) => Demand::Whole(p.next_rows()),
        }
    }

    fn plan(
        &mut self,
        a: &mut Active<Program>,
        rows: usize,
    ) -> Result<Option<HuginnPlan>, FamilyError> {
        self.bind(a);
        let cfg = self.model.config();
        let planned = match &mut a.program {
            Program::Ar(p) => p.plan(rows, cfg.n_embd).map(HuginnPlan::Ar),
            Program::Diffusion(p) => {
                // A request whose next wavefront would leave the RoPE table stops here.
                if p.leaves_context(cfg.block_size) {
                    p.finish(&mut a.outbox, FinishReason::ContextLimit);
                    return Ok(None);
                }
                p.plan(cfg.n_embd, cfg.n_heads).map(HuginnPlan::Diffusion)
            }
        };
        planned
            .map(Some)
            .map_err(|e| FamilyError::program(FAMILY, Phase::Plan, e))
    }

    /// Two forward groups: every `ar` step, and every diffusion-forcing step. A failure of one
    /// group's forwards fails its requests only.
    fn run(&mut self, work: &mut [Planned<'_, Program, HuginnPlan>]) -> Vec<Group<HuginnOutput>> {
        let (mut ar_members, mut ar_plans, mut ar_caches) = (Vec::new(), Vec::new(), Vec::new());
        let (mut df_members, mut df_plans, mut df_caches) = (Vec::new(), Vec::new(), Vec::new());
        let mut mismatched = Vec::new();
        for (i, w) in work.iter_mut().enumerate() {
            let Planned { program, plan } = w;
            match (plan, &mut **program) {
                (HuginnPlan::Ar(plan), Program::Ar(p)) => {
                    ar_members.push(i);
                    ar_plans.push(&*plan);
                    ar_caches.push(&mut p.cache);
                }
                (HuginnPlan::Diffusion(plan), Program::Diffusion(p)) => {
                    df_members.push(i);
                    df_plans.push(&*plan);
                    df_caches.push(&mut p.cache);
                }
                _ => mismatched.push(i),
            }
        }
        let mut groups = Vec::with_capacity(3);
        if !ar_members.is_empty() {
            let outputs = self
                .injected("ar")
                .and_then(|()| ar::run(&self.model, &ar_plans, &mut ar_caches))
                .map(|o| o.into_iter().map(HuginnOutput::Ar).collect())
                .map_err(FamilyError::forward);
            groups.push(Group {
                members: ar_members,
                outputs,
            });
        }
        if !df_members.is_empty() {
            let outputs = self
                .injected("diffusion-forcing")
                .and_then(|()| diffusion::run(&self.model, &df_plans, &mut df_caches))
                .map(|o| o.into_iter().map(HuginnOutput::Diffusion).collect())
                .map_err(FamilyError::forward);
            groups.push(Group {
                members: df_members,
                outputs,
            });
        }
        if !mismatched.is_empty() {
            groups.push(Group {
                members: mismatched,
                outputs: Err(FamilyError::program(
                    FAMILY,
                    Phase::Plan,
                    SchemeError::inconsistent("a plan of another scheme than its program"),
                )),
            });
        }
        groups
    }

    fn commit(
        &mut self,
        a: &mut Active<Program>,
        plan: HuginnPlan,
        output: HuginnOutput,
    ) -> Result<(), FamilyError> {
        let done = match (&mut a.program, plan, output) {
            (Program::Ar(p), HuginnPlan::Ar(plan), HuginnOutput::Ar(out)) => {
                p.commit(&plan, out, &mut a.outbox)
            }
            (Program::Diffusion(p), HuginnPlan::Diffusion(plan), HuginnOutput::Diffusion(out)) => {
                p.commit(&plan, out, &mut a.outbox)
            }
            _ => Err(SchemeError::inconsistent(
                "an output of another scheme than its program",
            )),
        };
        done.map_err(|e| FamilyError::commit(FAMILY, e))
    }

    fn export(&mut self, a: &mut Active<Program>) -> Result<Vec<u8>, FamilyError> {
        crate::migrate::export(&a.program, FAMILY)
    }

    fn slots_needed(&self, a: &Active<Program>) -> usize {
        a.program
            .pages_needed(self.model.config())
            .max(a.slots.len())
    }

    fn reclaim(&mut self, a: &mut Active<Program>) -> Vec<SlotId> {
        let need = a.keeps(a.program.pages_needed(self.model.config()));
        let held = a.slots.len();
        paging::reclaim(a.program.state_cache(), held, need)
    }

    fn preempt(&mut self, a: &mut Active<Program>) -> Result<Moved, FamilyError> {
        // A request preempted before its first tick moves its (empty) cache into the pool.
        self.bind(a);
        let moved = paging::swap_out(a.program.state_cache(), FAMILY)?;
        self.move_latents(a, &Device::Cpu)?;
        Ok(moved)
    }

    fn resume(&mut self, a: &mut Active<Program>) -> Result<Moved, FamilyError> {
        self.bind(a);
        let moved = paging::swap_in(a.program.state_cache(), FAMILY)?;
        let device = self.model.device().clone();
        self.move_latents(a, &device)?;
        Ok(moved)
    }

    fn stop(&mut self, a: &mut Active<Program>) {
        match &mut a.program {
            Program::Ar(p) => {
                let stats = std::mem::take(&mut p.stats);
                a.outbox.finish(FinishReason::StopString, stats);
            }
            Program::Diffusion(p) => p.finish(&mut a.outbox, FinishReason::StopString),
        }
    }
}

/// Loads a Huginn checkpoint and starts its engine.
pub fn serve(files: ModelFiles, opts: LoadOptions) -> Result<Arc<dyn ServedModel>, SchemeError> {
    let cfg = HuginnConfig::from_json(files.config_json())?;
    let tokenizer = optional_tokenizer(&files);
    let load = checkpoint_loader(files, cfg.clone(), &opts, Huginn::load_parallel);
    serve_model(cfg, tokenizer, opts, load)
}

/// Starts the engine for the model `load` builds on the engine thread (from a checkpoint, or
/// synthetic weights for benchmarks); `cfg` must be the model's config.
pub fn serve_model<L>(
    cfg: HuginnConfig,
    tokenizer: Option<TextTokenizer>,
    opts: LoadOptions,
    load: L,
) -> Result<Arc<dyn ServedModel>, SchemeError>
where
    L: FnOnce(&Device, DType) -> Result<Huginn, SchemeError> + Send + 'static,
{
    let make = checked_family(cfg.clone(), &opts, load, Huginn::config, HuginnFamily::new);
    let page = opts.kv_page_size;
    let make = move |device: &Device, dtype| make(device, dtype).map(|f| f.with_page_size(page));
    serve_family(cfg, tokenizer, opts, make)
}

/// Sizes the slot pool from the memory budget and starts the engine with the family `make`
/// builds on the engine thread.
pub(crate) fn serve_family<F, M>(
    cfg: HuginnConfig,
    tokenizer: Option<TextTokenizer>,
    opts: LoadOptions,
    make: M,
) -> Result<Arc<dyn ServedModel>, SchemeError>
where
    F: Family<Program = Program>,
    M: FnOnce(&Device, DType) -> Result<F, SchemeError> + Send + 'static,
{
    let m = opts.occupancy_multiplier;
    if !m.is_finite() || m <= 0.0 {
        return Err(SchemeError::InvalidOption(format!(
            "occupancy multiplier must be a positive number, got {m}"
        )));
    }
    let planner = Arc::new(
        HuginnPlanner::new(cfg.clone(), opts.name.clone(), tokenizer.as_ref())
            .with_occupancy_multiplier(m)
            .with_reserve(opts.kv_reserve)
            .with_page_size(opts.kv_page_size),
    );
    let bytes_per_slot = opts.kv_page_size * 2 * cfg.n_embd * opts.dtype.size_in_bytes();
    // 1% of the pool kept free at admission for running requests to grow into.
    start_served(planner, tokenizer, &opts, bytes_per_slot, 10, make)
}
