//! A loaded model behind its engine: the one seam the services use.
//!
//! [`load_model`] reads a model directory (or the embedded default model),
//! picks the family from its config, starts the engine thread (the weights
//! load on that thread, with a ready handshake) and returns a
//! [`ServedModel`]: validate-and-submit a [`GenerateSpec`], read the load.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use candle_core::{DType, Device};
use wavefront_engine::{
    Carried, Cause, Engine, EngineConfig, EngineError, EngineHandle, EngineLoad, EventSink,
    ExportReply, Family, Prepared, RequestError, RequestId, Submission,
};
use wavefront_models::candle_nn::VarBuilder;
use wavefront_models::transformer::{
    AttentionKernel, CollectiveKind, SelectAttention, StoreWeights, TensorParallel, WeightDtype,
};
use wavefront_models::{ChatMessage, ModelError, ModelFamily, ModelFiles, TextTokenizer};

use crate::request::GenerateSpec;
use crate::SchemeError;

/// What clients may know about a served model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    pub name: String,
    /// "recurrent_depth", "recurrent_memory", "masked_diffusion", "slot_diffusion".
    pub family: &'static str,
    pub schemes: Vec<&'static str>,
    pub vocab_size: usize,
    /// Longest prompt + max_new_tokens accepted.
    pub max_context: usize,
}

/// Validates requests for one model and builds their programs; runs on the
/// caller's thread so bad input is answered before anything is queued.
pub trait Planner: Send + Sync + 'static {
    /// A request's program; its serde form is its state when it moves between workers
    /// ([`crate::migrate`]).
    type Program: Send + serde::de::DeserializeOwned + 'static;
    fn info(&self) -> &ModelInfo;
    fn prepare(&self, spec: GenerateSpec) -> Result<Prepared<Self::Program>, RequestError>;
    /// Turns prompt text into ids the way the model's reference code does.
    fn encode_prompt(
        &self,
        tokenizer: &TextTokenizer,
        text: &str,
    ) -> Result<Vec<u32>, SchemeError> {
        Ok(tokenizer.encode(text, true)?)
    }
}

/// A model being served, independent of its family.
pub trait ServedModel: Send + Sync {
    fn info(&self) -> &ModelInfo;
    fn tokenizer(&self) -> Option<&TextTokenizer>;
    /// Prompt text to ids (the family's convention for special tokens).
    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, SchemeError>;
    /// A conversation to ids through the model's chat template.
    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, SchemeError> {
        Ok(self
            .tokenizer()
            .ok_or_else(no_tokenizer)?
            .encode_chat(messages)?)
    }
    /// The fewest tokens a text prompt of `text_bytes` bytes can become, known without
    /// tokenizing it (0 without a tokenizer).
    fn min_prompt_tokens(&self, text_bytes: usize) -> usize {
        self.tokenizer().map_or(0, |t| t.min_tokens(text_bytes))
    }
    /// Ids to text, special tokens kept (empty without a tokenizer).
    fn decode(&self, ids: &[u32]) -> String;
    /// Validates and queues a request; events arrive through `sink`.
    fn submit(
        &self,
        spec: GenerateSpec,
        sink: Box<dyn EventSink>,
        deadline: Option<Instant>,
        span: tracing::Span,
    ) -> Result<RequestId, EngineError>;
    fn load(&self) -> EngineLoad;
    /// Whether the admission queue has a place now (`Err(QueueFull)` if not): checked before a
    /// request is converted, so shedding a flood costs no tokenizing.
    fn check_room(&self) -> Result<(), EngineError> {
        Ok(())
    }
    /// Fails everything in flight and stops the engine thread.
    fn shutdown(&self);

    /// What a request's state must match to move here from another worker, or to leave for one:
    /// the checkpoint's fingerprint and the settings that shape the state and its numerics
    /// (dtype, weight storage, attention path, tensor parallelism, page size, device kind).
    /// Waits for the fingerprint on first use (it reads every weight byte once).
    fn migration_key(&self) -> Result<String, SchemeError> {
        Err(SchemeError::Unsupported(
            "this model cannot move requests between workers".into(),
        ))
    }

    /// Stops running request `id` at its next step boundary and exports its state
    /// (`EngineHandle::export`); blocks while the engine's command channel is full.
    fn export(&self, _id: RequestId, reply: ExportReply) {
        reply(Err(EngineError::CannotMove(
            "this model cannot move requests between workers".into(),
        )));
    }

    /// Settles the move of exported request `id` (`EngineHandle::finish_export`).
    fn finish_export(
        &self,
        _id: RequestId,
        _moved: bool,
        reply: Box<dyn FnOnce(Result<(), EngineError>) + Send>,
    ) {
        reply(Err(EngineError::CannotMove(
            "this model cannot move requests between workers".into(),
        )));
    }

    /// Queues a request exported by another worker (`state`, what [`ServedModel::export`]
    /// produced there; `carried`, what that engine counted) to resume here; events arrive
    /// through `sink` as for [`ServedModel::submit`].
    fn import(
        &self,
        _state: &[u8],
        _carried: Carried,
        _sink: Box<dyn EventSink>,
        _deadline: Option<Instant>,
        _span: tracing::Span,
    ) -> Result<RequestId, EngineError> {
        Err(EngineError::CannotMove(
            "this model cannot move requests between workers".into(),
        ))
    }
}

/// A checkpoint's fingerprint ([`ModelFiles::fingerprint`]), computed once on a thread of its
/// own from load on (it reads every weight byte) and waited for by the first move that needs
/// it. A model without files (a benchmark's synthetic weights) has none and moves nothing.
#[derive(Clone, Default)]
pub struct Fingerprint(Option<Arc<FingerprintJob>>);

struct FingerprintJob {
    value: OnceLock<Result<String, Cause>>,
    job: Mutex<Option<std::thread::JoinHandle<Result<String, ModelError>>>>,
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.as_ref().and_then(|j| j.value.get()) {
            Some(Ok(v)) => write!(f, "Fingerprint({v})"),
            Some(Err(e)) => write!(f, "Fingerprint(failed: {e})"),
            None if self.0.is_some() => f.write_str("Fingerprint(computing)"),
            None => f.write_str("Fingerprint(none)"),
        }
    }
}

impl Fingerprint {
    /// Starts computing the fingerprint of `files`.
    pub fn of(files: &ModelFiles) -> Self {
        let files = files.clone();
        let job = std::thread::Builder::new()
            .name("wavefront-fingerprint".into())
            .spawn(move || files.fingerprint());
        let (value, job) = match job {
            Ok(h) => (OnceLock::new(), Some(h)),
            Err(e) => (OnceLock::from(Err(Cause::new(e))), None),
        };
        Self(Some(Arc::new(FingerprintJob {
            value,
            job: Mutex::new(job),
        })))
    }

    /// A fingerprint the caller vouches for: weights with no files behind them (a benchmark's
    /// synthetic weights, made from a seed) named by what makes them.
    pub fn given(value: impl Into<String>) -> Self {
        Self(Some(Arc::new(FingerprintJob {
            value: OnceLock::from(Ok(value.into())),
            job: Mutex::new(None),
        })))
    }

    /// The fingerprint, waiting for it if it is still being computed.
    pub fn get(&self) -> Result<String, SchemeError> {
        let job = self.0.as_ref().ok_or(SchemeError::NoFingerprint)?;
        job.value
            .get_or_init(|| {
                let handle = job
                    .job
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take();
                match handle.map(|h| h.join()) {
                    Some(Ok(r)) => r.map_err(Cause::new),
                    _ => Err(Cause::new(SchemeError::FingerprintThread)),
                }
            })
            .clone()
            .map_err(SchemeError::Fingerprint)
    }
}

/// Refuses, before tokenizing, a text of `bytes` bytes that must become more tokens than a
/// context of `max_context` holds.
fn too_long(tok: &TextTokenizer, bytes: usize, max_context: usize) -> Result<(), SchemeError> {
    let at_least = tok.min_tokens(bytes);
    if at_least > max_context {
        return Err(SchemeError::Prompt(format!(
            "the prompt's {bytes} bytes make at least {at_least} tokens, more than the \
             {max_context} this model accepts (prompt plus max_new_tokens); shorten it"
        )));
    }
    Ok(())
}

fn no_tokenizer() -> SchemeError {
    SchemeError::Prompt("this model has no tokenizer; send token ids".into())
}

/// The generic [`ServedModel`]: a planner plus the engine running its family.
pub struct Served<P: Planner> {
    planner: Arc<P>,
    handle: EngineHandle<P::Program>,
    tokenizer: Option<TextTokenizer>,
    /// Where imported state goes back to when it resumes.
    device: Device,
    fingerprint: Fingerprint,
    /// The settings part of [`ServedModel::migration_key`].
    settings: String,
}

impl<P: Planner> Served<P> {
    pub fn new(
        planner: Arc<P>,
        handle: EngineHandle<P::Program>,
        tokenizer: Option<TextTokenizer>,
    ) -> Self {
        Self {
            planner,
            handle,
            tokenizer,
            device: Device::Cpu,
            fingerprint: Fingerprint::default(),
            settings: String::new(),
        }
    }

    /// Lets requests move to and from other workers serving the same checkpoint
    /// (`fingerprint`) with the same `opts`.
    fn movable(mut self, fingerprint: Fingerprint, opts: &LoadOptions) -> Self {
        self.device = opts.device.clone();
        self.fingerprint = fingerprint;
        self.settings = format!(
            "dtype={:?};weights={:?};attention={:?};tensor_parallel={};kv_page_size={};device={}",
            opts.dtype,
            opts.weight_dtype,
            opts.attention,
            opts.tensor_parallel,
            opts.kv_page_size,
            if opts.device.is_cpu() { "cpu" } else { "gpu" },
        );
        self
    }
}

impl<P: Planner> ServedModel for Served<P> {
    fn info(&self) -> &ModelInfo {
        self.planner.info()
    }

    fn tokenizer(&self) -> Option<&TextTokenizer> {
        self.tokenizer.as_ref()
    }

    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, SchemeError> {
        let tok = self.tokenizer.as_ref().ok_or_else(no_tokenizer)?;
        too_long(tok, text.len(), self.info().max_context)?;
        self.planner.encode_prompt(tok, text)
    }

    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, SchemeError> {
        let tok = self.tokenizer.as_ref().ok_or_else(no_tokenizer)?;
        let bytes = messages.iter().map(|m| m.content.len()).sum();
        too_long(tok, bytes, self.info().max_context)?;
        Ok(tok.encode_chat(messages)?)
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer
            .as_ref()
            .and_then(|t| t.decode(ids, false).ok())
            .unwrap_or_default()
    }

    fn submit(
        &self,
        spec: GenerateSpec,
        sink: Box<dyn EventSink>,
        deadline: Option<Instant>,
        span: tracing::Span,
    ) -> Result<RequestId, EngineError> {
        let prepared = self.planner.prepare(spec)?;
        self.handle.submit(Submission {
            prepared,
            sink,
            deadline,
            span,
        })
    }

    fn load(&self) -> EngineLoad {
        self.handle.load()
    }

    fn check_room(&self) -> Result<(), EngineError> {
        self.handle.check_room()
    }

    fn shutdown(&self) {
        self.handle.shutdown();
    }

    fn migration_key(&self) -> Result<String, SchemeError> {
        Ok(format!("{};{}", self.fingerprint.get()?, self.settings))
    }

    fn export(&self, id: RequestId, reply: ExportReply) {
        self.handle.export(id, reply);
    }

    fn finish_export(
        &self,
        id: RequestId,
        moved: bool,
        reply: Box<dyn FnOnce(Result<(), EngineError>) + Send>,
    ) {
        self.handle.finish_export(id, moved, reply);
    }

    fn import(
        &self,
        state: &[u8],
        carried: Carried,
        sink: Box<dyn EventSink>,
        deadline: Option<Instant>,
        span: tracing::Span,
    ) -> Result<RequestId, EngineError> {
        let program: P::Program = crate::migrate::decode(state, &self.device)
            .map_err(|e| EngineError::Invalid(RequestError::InvalidArgument(e.to_string())))?;
        self.handle.submit(Submission {
            prepared: Prepared::imported(program, carried),
            sink,
            deadline,
            span,
        })
    }
}

/// How to load and size a served model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Served name; default: the directory's name (or "default" when embedded).
    pub name: String,
    pub device: Device,
    pub dtype: DType,
    /// Device memory given to the slot pool (K/V and latent states).
    pub memory_budget_bytes: u64,
    pub queue_capacity: usize,
    /// Requests ticked together at most.
    pub max_active: usize,
    /// Diffusion-forcing: slots reserved per request are its maximum
    /// wavefront times this multiplier.
    pub occupancy_multiplier: f32,
    /// Recurrent memory (ARMT): the longest prompt + `max_new_tokens` accepted; `None`:
    /// [`crate::recurrent_memory::DEFAULT_MAX_CONTEXT_TOKENS`]. Other families take their limit
    /// from their config and ignore this.
    pub max_context_tokens: Option<usize>,
    /// Tensor-parallel ranks each block is split over (heads and MLP columns); 1 disables the
    /// split.
    pub tensor_parallel: usize,
    /// What joins the ranks: in-process on the model's device, or NCCL over one GPU per rank.
    pub collective: CollectiveKind,
    /// How packed calls attend (per-sequence candle ops, or one ragged operation); a family
    /// that cannot honour it refuses to load.
    pub attention: AttentionKernel,
    /// How CPU float32 weights are stored (bf16: half the bytes, float32 arithmetic).
    pub weight_dtype: WeightDtype,
    /// How requests of a paged family take their K/V pages.
    pub kv_reserve: KvReserve,
    /// Positions a K/V page holds (per layer): smaller pages waste less of a request's last
    /// page, larger ones are read in longer runs (see docs/benchmarks.md).
    pub kv_page_size: usize,
    /// Rows one tick computes at most: autoregressive prefills (Huginn static `ar`, ReFusion
    /// `ar`) run in chunks of what the rest of the tick leaves, so a long prompt does not stall
    /// the decoding of the others. Work that runs whole (decoding steps, canvases, segments,
    /// wavefronts, plan-and-infill calls) counts against it. `None`: no cap.
    pub max_batch_rows: Option<usize>,
    /// The checkpoint's fingerprint (set by [`load_model`]): requests move only between workers
    /// that serve the same one.
    pub fingerprint: Fingerprint,
}

/// How a request of a family with paged K/V takes its pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvReserve {
    /// Its first step's pages at admission, more as it grows, preempted when the pool is short.
    #[default]
    OnDemand,
    /// Its worst case (prompt and every token it may generate) at admission: no growth and no
    /// preemption, fewer requests at once (the comparison point of the benchmarks).
    WorstCase,
}

impl KvReserve {
    /// The request running `program`, whose first step takes `first` slots and whose life
    /// takes `max_slots` at most: admitted with the first, or with the worst case.
    pub(crate) fn prepared<P>(
        self,
        program: P,
        first: usize,
        max_slots: usize,
        prompt_tokens: usize,
    ) -> Prepared<P> {
        let (slots, floor) = match self {
            KvReserve::OnDemand => (first.min(max_slots), 0),
            // Held to the end: the pages it does not use yet are not given back after a tick.
            KvReserve::WorstCase => (max_slots, max_slots),
        };
        Prepared {
            program,
            slots,
            max_slots,
            floor,
            prompt_tokens,
            carried: None,
        }
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            name: "default".into(),
            device: Device::Cpu,
            dtype: DType::F32,
            memory_budget_bytes: 256 << 20,
            queue_capacity: 64,
            max_active: 32,
            occupancy_multiplier: 1.0,
            max_context_tokens: None,
            tensor_parallel: 1,
            collective: CollectiveKind::Auto,
            attention: AttentionKernel::Sdpa,
            weight_dtype: WeightDtype::F32,
            kv_reserve: KvReserve::OnDemand,
            kv_page_size: wavefront_models::transformer::PAGE_SIZE,
            max_batch_rows: None,
            fingerprint: Fingerprint::default(),
        }
    }
}

/// Loads `files` with the family its config names and starts its engine.
pub fn load_model(
    files: ModelFiles,
    mut opts: LoadOptions,
) -> Result<Arc<dyn ServedModel>, SchemeError> {
    let family = files.family()?;
    opts.fingerprint = Fingerprint::of(&files);
    if family != ModelFamily::RecurrentMemory {
        if let Some(n) = opts.max_context_tokens {
            tracing::warn!(
                max_context_tokens = n,
                ?family,
                "the context-length option applies to recurrent-memory models only; ignored"
            );
        }
    }
    match family {
        ModelFamily::RecurrentDepth => crate::recurrent_depth::serve(files, opts),
        ModelFamily::MaskedDiffusion => crate::masked_diffusion::serve(files, opts),
        ModelFamily::RecurrentMemory => crate::recurrent_memory::serve(files, opts),
        ModelFamily::SlotDiffusion => crate::slot_diffusion::serve(files, opts),
        other => Err(SchemeError::Unsupported(format!(
            "model family {other:?} is not served yet"
        ))),
    }
}

/// The tokenizer of `files`; without a usable one only token-id prompts work.
pub(crate) fn optional_tokenizer(files: &ModelFiles) -> Option<TextTokenizer> {
    match files.tokenizer() {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!(error = %e, "no usable tokenizer: only token-id prompts will work");
            None
        }
    }
}

/// Sizes the slot pool from the memory budget (`bytes_per_slot` each) and
/// starts the engine of `planner`'s model; the family is built by `make` on
/// the engine thread. Admission keeps `watermark_permille` thousandths of the
/// pool free for running requests to grow into (0 for families that reserve
/// a request's slots at admission).
pub(crate) fn start_served<P, F, M>(
    planner: Arc<P>,
    tokenizer: Option<TextTokenizer>,
    opts: &LoadOptions,
    bytes_per_slot: usize,
    watermark_permille: usize,
    make: M,
) -> Result<Arc<dyn ServedModel>, SchemeError>
where
    P: Planner,
    F: Family<Program = P::Program>,
    M: FnOnce(&Device, DType) -> Result<F, SchemeError> + Send + 'static,
{
    let total_slots = usize::try_from(opts.memory_budget_bytes / bytes_per_slot as u64)
        .unwrap_or(usize::MAX)
        .min(u32::MAX as usize);
    if total_slots == 0 {
        return Err(SchemeError::InvalidOption(format!(
            "memory budget of {} bytes holds no slot ({bytes_per_slot} bytes each)",
            opts.memory_budget_bytes
        )));
    }
    let engine_cfg = EngineConfig {
        total_slots,
        queue_capacity: opts.queue_capacity,
        max_active: opts.max_active,
        watermark_slots: total_slots * watermark_permille / 1000,
        max_batch_rows: opts.max_batch_rows,
    };
    let (device, dtype) = (opts.device.clone(), opts.dtype);
    tracing::info!(
        model = %opts.name,
        family = planner.info().family,
        total_slots,
        bytes_per_slot,
        ?dtype,
        "starting engine"
    );
    let handle = Engine::start_labeled(&opts.name, engine_cfg, move || make(&device, dtype))?;
    Ok(Arc::new(
        Served::new(planner, handle, tokenizer).movable(opts.fingerprint.clone(), opts),
    ))
}

/// The engine-thread loader of a checkpoint: builds the model of config `cfg` from the weights
/// of `files` (in the engine's device and dtype) with `load_parallel`, split over
/// `opts.tensor_parallel` ranks joined by `opts.collective` (made on the engine thread, which
/// drives every rank).
pub(crate) fn checkpoint_loader<C, M>(
    files: ModelFiles,
    cfg: C,
    opts: &LoadOptions,
    load_parallel: fn(VarBuilder<'static>, C, &TensorParallel) -> Result<M, ModelError>,
) -> impl FnOnce(&Device, DType) -> Result<M, SchemeError> + Send + 'static
where
    C: Send + 'static,
    M: 'static,
{
    let (world, kind) = (opts.tensor_parallel, opts.collective);
    move |device, dtype| {
        let tp = TensorParallel::for_device(kind, world, device)?;
        let vb = files.var_builder(dtype, device)?;
        Ok(load_parallel(vb, cfg, &tp)?)
    }
}

/// The engine-thread constructor of a family wrapping one model: runs `load` (a checkpoint, or
/// a bench's synthetic weights), refuses a model whose config (`config_of`) is not `cfg`, the
/// config requests are planned with, sets its attention path to `opts.attention` (a model that
/// cannot take it refuses to start) and its CPU weights' storage to `opts.weight_dtype`, and
/// wraps the model with `wrap`. Hand the result to
/// [`start_served`].
pub(crate) fn checked_family<C, M, F, L>(
    cfg: C,
    opts: &LoadOptions,
    load: L,
    config_of: fn(&M) -> &C,
    wrap: fn(M) -> F,
) -> impl FnOnce(&Device, DType) -> Result<F, SchemeError> + Send + 'static
where
    C: PartialEq + Send + 'static,
    M: SelectAttention + StoreWeights + 'static,
    F: 'static,
    L: FnOnce(&Device, DType) -> Result<M, SchemeError> + Send + 'static,
{
    let (attention, weight_dtype) = (opts.attention, opts.weight_dtype);
    move |device, dtype| {
        let mut model = load(device, dtype)?;
        if config_of(&model) != &cfg {
            return Err(SchemeError::InvalidOption(
                "the loaded model's config differs from the one requests are planned with".into(),
            ));
        }
        model.select_attention(attention)?;
        model.store_weights(weight_dtype)?;
        Ok(wrap(model))
    }
}
