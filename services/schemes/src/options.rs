//! How a served model is loaded and sized ([`LoadOptions`]), and how requests of a paged family
//! take their pages ([`KvReserve`]).

use candle_core::{DType, Device};
use wavefront_engine::Prepared;
use wavefront_models::transformer::{AttentionKernel, CollectiveKind, WeightDtype};

use crate::error::SchemeError;
use crate::fingerprint::Fingerprint;

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
    /// What the K/V pages store in host memory ([`Self::kv_dtype`]).
    pub kv_cache_dtype: KvCacheDtype,
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
    /// Whether requests with the same prompt share its pages (on by default).
    pub prompt_sharing: bool,
    /// Finished requests kept for their prompt pages (the prefix cache; 0: none), while the
    /// pool does not need their slots.
    pub prefix_cache_entries: usize,
    /// How long a client may leave a request's events unread before the request is cancelled
    /// (until then it is paused, and the first preempted when the pool is short); `None`:
    /// forever.
    pub write_timeout: Option<std::time::Duration>,
    /// The checkpoint's fingerprint (set by [`load_model`]): requests move only between workers
    /// that serve the same one.
    pub fingerprint: Fingerprint,
}

/// What a model's K/V pages store (`--kv-cache-dtype`, vLLM's name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    /// The compute dtype's: bf16 in the CPU's bf16 compute mode (bf16-dot weights), float32
    /// otherwise on the CPU; the model's dtype on a GPU.
    #[default]
    Auto,
    /// Float32 (the exact default on the CPU).
    F32,
    /// bfloat16: half the bytes per cached position (twice the positions in a memory budget,
    /// half the bytes decode attention reads); keys and values rounded to nearest even when
    /// written, read exactly as float32.
    Bf16,
}

impl KvCacheDtype {
    /// From `auto`, `float32`/`f32` or `bf16`/`bfloat16`; the error names the flag and the
    /// values it takes.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "float32" | "f32" => Ok(Self::F32),
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            _ => Err(format!(
                "--kv-cache-dtype must be auto, float32 or bf16, got {s:?}"
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::F32 => "float32",
            Self::Bf16 => "bf16",
        }
    }
}

impl LoadOptions {
    /// The dtype K/V pages hold: on the CPU float32 or bf16 as [`KvCacheDtype`] says (auto:
    /// bf16 with bf16-dot weights, the bf16 compute mode); on a GPU the model's dtype.
    pub fn kv_dtype(&self) -> DType {
        if !self.device.is_cpu() {
            return self.dtype;
        }
        match self.kv_cache_dtype {
            KvCacheDtype::F32 => DType::F32,
            KvCacheDtype::Bf16 => DType::BF16,
            KvCacheDtype::Auto if self.weight_dtype == WeightDtype::Bf16Dot => DType::BF16,
            KvCacheDtype::Auto => self.dtype,
        }
    }

    /// The dtype a model's pool converts K/V rows to as it stores them: the CPU's
    /// [`Self::kv_dtype`]; `None` on a GPU (rows are stored as the model makes them).
    pub fn kv_store(&self) -> Option<DType> {
        self.device.is_cpu().then(|| self.kv_dtype())
    }

    /// Refuses a K/V dtype the device cannot take: on a GPU the cache holds the model's dtype.
    pub fn check_kv_cache_dtype(&self) -> Result<(), SchemeError> {
        let asked = match self.kv_cache_dtype {
            KvCacheDtype::Auto => return Ok(()),
            KvCacheDtype::F32 => DType::F32,
            KvCacheDtype::Bf16 => DType::BF16,
        };
        if !self.device.is_cpu() && asked != self.dtype {
            return Err(SchemeError::InvalidOption(format!(
                "--kv-cache-dtype {} on a GPU: its K/V cache holds the model's dtype ({:?}); \
                 leave --kv-cache-dtype auto or set --dtype",
                self.kv_cache_dtype.name(),
                self.dtype
            )));
        }
        Ok(())
    }
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
            kv_cache_dtype: KvCacheDtype::Auto,
            kv_reserve: KvReserve::OnDemand,
            kv_page_size: wavefront_models::transformer::PAGE_SIZE,
            max_batch_rows: None,
            prompt_sharing: true,
            prefix_cache_entries: wavefront_engine::scheduler::DEFAULT_PREFIX_CACHE_ENTRIES,
            write_timeout: Some(std::time::Duration::from_secs(30)),
            fingerprint: Fingerprint::default(),
        }
    }
}
