//! Starting a family's engine: the generic [`ServedModel`] over a planner and an engine handle
//! ([`Served`]), the slot pool sized from the memory budget ([`start_served`]), and the
//! engine-thread constructors of a checkpoint's model and its family.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device};
use wavefront_engine::{
    Carried, Engine, EngineConfig, EngineError, EngineHandle, EngineLoad, EventSink, ExportReply,
    Family, Prepared, RequestError, RequestId, Submission,
};
use wavefront_models::candle_nn::VarBuilder;
use wavefront_models::transformer::{SelectAttention, StoreWeights, TensorParallel, WeightDtype};
use wavefront_models::{ChatMessage, ModelError, ModelFiles, TextTokenizer};

use crate::fingerprint::Fingerprint;
use crate::options::LoadOptions;
use crate::request::GenerateSpec;
use crate::served::{no_tokenizer, ModelInfo, Planner, ServedModel};
use crate::SchemeError;

/// Bytes of prompt text a worker takes per token of the model's context, at most: far more than
/// any tokenizer's text per token (about 4 bytes for English), and the cap that holds where a
/// tokenizer may drop text and its token count has no lower bound from the text's length.
pub const PROMPT_BYTES_PER_CONTEXT_TOKEN: usize = 64;

/// Refuses `bytes` of text (`what`: whose) over [`PROMPT_BYTES_PER_CONTEXT_TOKEN`] per token of
/// a context of `max_context`, saying how to fix it.
fn over_byte_cap(
    what: &str,
    bytes: usize,
    max_context: usize,
    fix: &str,
) -> Result<(), SchemeError> {
    let cap = max_context.saturating_mul(PROMPT_BYTES_PER_CONTEXT_TOKEN);
    if bytes > cap {
        return Err(SchemeError::Prompt(format!(
            "{what} {bytes} bytes are more than {cap}, {PROMPT_BYTES_PER_CONTEXT_TOKEN} per \
             token of the {max_context} this model accepts (prompt plus max_new_tokens); {fix}"
        )));
    }
    Ok(())
}

/// Refuses, before tokenizing, a text that must become more tokens than a context of
/// `max_context` holds, or that is more than [`PROMPT_BYTES_PER_CONTEXT_TOKEN`] bytes per
/// token of it.
fn too_long(tok: &TextTokenizer, text: &str, max_context: usize) -> Result<(), SchemeError> {
    let bytes = text.len();
    over_byte_cap("the prompt's", bytes, max_context, "shorten it")?;
    let at_least = tok.min_tokens(text);
    if at_least > max_context {
        return Err(SchemeError::Prompt(format!(
            "the prompt's {bytes} bytes make at least {at_least} tokens, more than the \
             {max_context} this model accepts (prompt plus max_new_tokens); shorten it"
        )));
    }
    Ok(())
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
    /// The grammar engine over the model's vocabulary, built at the first constrained request.
    grammar: std::sync::OnceLock<Result<Arc<crate::constraint::GrammarEngine>, String>>,
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
            grammar: std::sync::OnceLock::new(),
        }
    }

    /// Lets requests move to and from other workers serving the same checkpoint
    /// (`fingerprint`) with the same `opts`.
    fn movable(mut self, fingerprint: Fingerprint, opts: &LoadOptions) -> Self {
        self.device = opts.device.clone();
        self.fingerprint = fingerprint;
        self.settings = settings_key(opts);
        self
    }
}

/// The settings part of a migration key: what shapes a request's state and its numerics. On
/// the CPU, bf16-dot products also name what multiplies the pairs (AMX tiles, AVX512-BF16 or
/// float32 FMAs sum in different orders, so a request moved between them would not continue
/// with the bits it had); every other CPU path has the same bits on every instruction set.
fn settings_key(opts: &LoadOptions) -> String {
    let products = if opts.device.is_cpu() && opts.weight_dtype == WeightDtype::Bf16Dot {
        format!(";bf16_products={}", wavefront_models::cpu_bf16_unit())
    } else {
        String::new()
    };
    format!(
        "dtype={:?};weights={:?};kv={:?};attention={:?};tensor_parallel={};kv_page_size={};\
         device={}{products}",
        opts.dtype,
        opts.weight_dtype,
        opts.kv_dtype(),
        opts.attention,
        opts.tensor_parallel,
        opts.kv_page_size,
        if opts.device.is_cpu() { "cpu" } else { "gpu" },
    )
}

impl<P: Planner> ServedModel for Served<P> {
    fn info(&self) -> &ModelInfo {
        self.planner.info()
    }

    fn tokenizer(&self) -> Option<&TextTokenizer> {
        self.tokenizer.as_ref()
    }

    fn eos_token_ids(&self) -> Vec<u32> {
        self.planner.eos_token_ids()
    }

    fn guide(&self, c: &crate::constraint::Constraint) -> Result<crate::constraint::Guide, String> {
        let engine = self.grammar.get_or_init(|| {
            let tok = self.tokenizer.as_ref().ok_or_else(|| {
                "the model was loaded without a tokenizer: structured outputs need one".to_owned()
            })?;
            let eos = self
                .planner
                .eos_token_ids()
                .first()
                .copied()
                .ok_or_else(|| {
                    "the checkpoint names no end-of-sequence token to end a structured output"
                        .to_owned()
                })?;
            crate::constraint::GrammarEngine::new(tok, self.info().vocab_size, eos).map(Arc::new)
        });
        engine.as_ref().map_err(Clone::clone)?.compile(c)
    }

    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, SchemeError> {
        let tok = self.tokenizer.as_ref().ok_or_else(no_tokenizer)?;
        too_long(tok, text, self.info().max_context)?;
        self.planner.encode_prompt(tok, text)
    }

    fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, SchemeError> {
        let tok = self.tokenizer.as_ref().ok_or_else(no_tokenizer)?;
        let at_least = tok.min_chat_tokens(messages.iter().map(|m| m.content.as_str()));
        let max_context = self.info().max_context;
        let bytes = messages.iter().map(|m| m.content.len()).sum();
        over_byte_cap(
            "the conversation's messages'",
            bytes,
            max_context,
            "send fewer or shorter messages",
        )?;
        if at_least > max_context {
            return Err(SchemeError::Prompt(crate::chat_too_long(
                messages.len(),
                at_least,
                max_context,
            )));
        }
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
        prompt_sharing: opts.prompt_sharing,
        prefix_cache_entries: opts.prefix_cache_entries,
        write_timeout: opts.write_timeout,
    };
    opts.check_kv_cache_dtype()?;
    let (device, dtype) = (opts.device.clone(), opts.dtype);
    tracing::info!(
        model = %opts.name,
        family = planner.info().family,
        total_slots,
        bytes_per_slot,
        ?dtype,
        kv_dtype = ?opts.kv_dtype(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16-dot products name their unit in the key (AMX, AVX512-BF16 and FMA sums differ in
    /// order); the paths whose bits are the same on every CPU do not, so a mixed fleet still
    /// moves them.
    #[test]
    fn the_key_names_the_bf16_unit_only_where_it_changes_the_bits() {
        let key = |weight_dtype| {
            settings_key(&LoadOptions {
                weight_dtype,
                ..LoadOptions::default()
            })
        };
        let unit = wavefront_models::cpu_bf16_unit();
        assert!(
            key(WeightDtype::Bf16Dot).ends_with(&format!(";bf16_products={unit}")),
            "{}",
            key(WeightDtype::Bf16Dot)
        );
        for other in [WeightDtype::F32, WeightDtype::Bf16, WeightDtype::Int8Dot] {
            assert!(!key(other).contains("bf16_products"), "{}", key(other));
        }
        assert_ne!(key(WeightDtype::Bf16Dot), key(WeightDtype::F32));
    }
}
