//! Validation of recurrent-depth requests and their programs: a request's parameters are checked
//! on the caller's thread, and its program ([`Program`]: `ar` or diffusion forcing) is built with
//! the pages its first step takes (see the module doc of [`crate::recurrent_depth`]).

use wavefront_engine::{Prepared, RequestError, Stats};
use wavefront_models::transformer::PAGE_SIZE;
use wavefront_models::{CacheStrategy, HuginnCache, HuginnConfig, ModelFamily, TextTokenizer};

use super::ar::ArProgram;
use super::diffusion::{self, DiffusionProgram, DiffusionSettings};
use super::draws::DrawSource;
use crate::options::KvReserve;
use crate::request::{ArParams, DiffusionForcingParams, Execution, GenerateSpec, SchemeParams};
use crate::sampling::TokenSampler;
use crate::served::{ModelInfo, Planner};
use crate::SchemeError;

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
    /// Page rows one latent state takes: 2 where the pool stores bf16 K/V (a float32 state's
    /// bits in two rows: `HuginnCache::latent_rows`).
    latent_rows: usize,
}

impl HuginnPlanner {
    pub fn new(cfg: HuginnConfig, name: String, tokenizer: Option<&TextTokenizer>) -> Self {
        let info = ModelInfo {
            name,
            family: ModelFamily::RecurrentDepth.name(),
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
            latent_rows: 1,
        }
    }

    /// Page rows per latent state (1, or 2 where the K/V pages store bf16).
    pub fn with_latent_rows(mut self, rows: usize) -> Self {
        self.latent_rows = rows.max(1);
        self
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
        (max_wavefront as f64 * self.latent_multiplier()).ceil() as usize
    }

    /// Page rows reserved per wavefront position: the occupancy multiplier (at least 1) times
    /// the rows a state takes.
    fn latent_multiplier(&self) -> f64 {
        f64::from(self.occupancy_multiplier).max(1.0) * self.latent_rows as f64
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

    /// K/V pages `positions` positions take in every cache layer of `strategy` with `steps`
    /// recurrences.
    fn kv_pages(&self, positions: usize, strategy: CacheStrategy, steps: usize) -> usize {
        positions.div_ceil(self.page) * cache_layers(&self.cfg, strategy, steps).total()
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
        // Prompt sharing: a static prefill's rows depend on the ids, the recurrences, the cache
        // layout and the initial states (zeros, or the seed's draws). An adaptive exit averages
        // over the positions of a call, and replayed or scored prompts are the request's own.
        // A cache that shares core slots across recurrences (`compress-sN`) keeps a position's
        // last recurrence only, where the positions after it would read each recurrence's.
        let init = match &draws {
            DrawSource::Zeros => Some((0u8, 0, 0)),
            DrawSource::Seeded { .. } => Some((1, spec.sampling.seed, init_scale.to_bits())),
            DrawSource::Replay { .. } => None,
        };
        let per_recurrence = !matches!(strategy, CacheStrategy::Compress { .. });
        // What the rows depend on besides the ids: prompts that only begin alike share their
        // common prefix's pages when it is the same.
        let settings = init
            .filter(|_| a.exit_threshold.is_none() && spec.sampling.prompt_logprobs.is_none())
            .filter(|_| per_recurrence)
            .map(|init| {
                crate::packing::key_of(&("huginn-ar-rows", num_steps, strategy.to_string(), init))
            });
        let key = settings
            .map(|settings| crate::packing::key_of(&("huginn-ar", &spec.prompt_ids, settings)));
        let program = ArProgram {
            key,
            settings,
            prompt: spec.prompt_ids.clone(),
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
            prompt_scores: spec.sampling.prompt_logprobs.map(|_| Vec::new()),
            constrained: spec.guide.is_some(),
            guide: spec.guide,
        };
        Ok(self.prepared(Program::Ar(program), max_slots, prompt_tokens))
    }
}

/// Cache layers (K/V stores) of one position: prelude, core and coda layers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CacheLayers {
    prelude: usize,
    core: usize,
    coda: usize,
}

impl CacheLayers {
    fn total(self) -> usize {
        self.prelude + self.core + self.coda
    }
}

/// The cache layers one position occupies under `strategy` with `steps` recurrences: every
/// prelude and coda layer, and the core layers at every recurrence (`full`, `latest-m4`) or
/// shared across recurrences (`compress-sN`: N).
pub(crate) fn cache_layers(
    cfg: &HuginnConfig,
    strategy: CacheStrategy,
    steps: usize,
) -> CacheLayers {
    let core = cfg.n_layers_in_recurrent_block * steps;
    CacheLayers {
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
    /// page for every cache layer the next positions reach in a page not held yet, and (diffusion
    /// forcing) the wavefront's latent pages.
    pub fn pages_needed(&self, cfg: &HuginnConfig) -> usize {
        let (cache, steps, rows, latent) = match self {
            Program::Ar(p) => (&p.cache, p.num_steps, p.pending.len(), 0),
            // The wave's latent rows are rewritten at the commit, after the forward: until then
            // it holds the pages it has, so a wave that shrinks still needs them this tick.
            Program::Diffusion(p) => (
                &p.cache,
                p.settings.num_steps,
                p.next_rows(),
                p.latent_pages_needed().max(p.cache.latent_pages()),
            ),
        };
        let s = cache_layers(cfg, cache.strategy(), steps);
        let start = cache.len();
        cache.pages_after(start..start + rows, s.prelude, s.core, s.coda) + latent
    }
}

impl Planner for HuginnPlanner {
    type Program = Program;

    fn eos_token_ids(&self) -> Vec<u32> {
        self.cfg.eos_token_ids()
    }

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

impl HuginnPlanner {
    /// Validates diffusion-forcing parameters and builds the program.
    fn prepare_diffusion(
        &self,
        spec: GenerateSpec,
        d: &DiffusionForcingParams,
    ) -> Result<Prepared<Program>, RequestError> {
        let bad = |m: String| Err(RequestError::InvalidArgument(m));
        let max_steps = MAX_NUM_STEPS;
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
        let core = self.cfg.n_layers_in_recurrent_block;
        let shared = format!("latest-m4-compress-s{core}");
        let name = match d.cache_lookup_strategy.as_str() {
            "" => shared.as_str(),
            name => name,
        };
        let strategy: CacheStrategy = name.parse().map_err(|e| {
            RequestError::InvalidArgument(format!("diffusion_forcing.cache_lookup_strategy: {e}"))
        })?;
        if !matches!(strategy, CacheStrategy::Compress { stride, .. } if stride == core) {
            return bad(format!(
                "diffusion_forcing.cache_lookup_strategy must share core KV slots across recurrences \
                 (`{shared}`, the default), got `{name}`"
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
            self.stop_ids(spec.stop_token_ids),
        );
        program.latent_pages = latent_pages;
        program.latent_page = (self.page, self.latent_multiplier());
        program.constrained = spec.guide.is_some();
        program.guide = spec.guide;
        Ok(self.prepared(Program::Diffusion(program), max_slots, prompt_tokens))
    }
}
