//! Model definitions on candle for the wavefront serving system.
//!
//! Each model family lives in its own module mirroring the upstream checkpoint's tensor names
//! (loaded through `VarBuilder::pp`), with its config deserialized from `config.json` and its
//! per-sequence state (KV caches) passed explicitly. Models expose *packed* entry points: rows of
//! many requests are concatenated so one call serves a whole engine step.
//!
//! * [`files`]: Hugging Face model directories (single or sharded safetensors, tokenizer) and
//!   embedded checkpoints; family detection.
//! * [`tokenizer`]: tokenizer wrapper and streaming detokenizer.
//! * [`huginn`]: Huginn-0125 recurrent-depth model (Geiping et al., 2025) and its KV cache.
//! * [`transformer`]: a pre-norm Llama-style block over packed rows with per-sequence keys and
//!   mask rules, shared by the Llama-like families.
//! * [`llada`]: LLaDA masked-diffusion model (Nie et al., 2025).
//! * [`llada2`]: LLaDA2.0, a mixture-of-experts masked-diffusion model decoded block by block.
//! * [`dream`]: Dream masked-diffusion model, Qwen2 run bidirectionally (Ye et al., 2025).
//! * [`armt`]: ARMT, associative recurrent memory on a Llama backbone (Rodkin et al., 2024),
//!   with sequential and diagonal-batched execution (Sivtsov et al., 2025).
//! * [`qwen3`]: Qwen3 with explicit position ids, the backbone of ReFusion (Li et al., 2025).
//! * [`diffusion_gemma`]: DiffusionGemma, a Gemma 4 mixture-of-experts transformer run as a
//!   causal encoder and a bidirectional denoiser of uniform-noise canvases.

pub mod arena;
pub mod armt;
pub mod chat;
mod config;
pub mod device;
pub mod diffusion_gemma;
pub mod dream;
pub mod error;
pub mod files;
pub mod gguf;
mod gpu_memory;
pub mod huginn;
pub mod llada;
pub mod llada2;
pub mod qwen3;
pub mod state;
pub mod tokenizer;
pub mod transformer;

pub use armt::{Armt, ArmtConfig};
pub use chat::{ChatMessage, ChatTemplate};
pub use diffusion_gemma::{DiffusionGemma, DiffusionGemmaConfig};
pub use dream::{Dream, DreamConfig};
pub use error::ModelError;
pub use files::{detect_architecture, detect_family, Architecture, ModelFamily, ModelFiles};
pub use huginn::{
    relative_change, CacheLayer, CacheStrategy, Huginn, HuginnCache, HuginnConfig, SeqRows,
};
pub use llada::{Llada, LladaConfig};
pub use llada2::{Llada2, Llada2Config};
pub use qwen3::{Qwen3, Qwen3Config};
pub use tokenizer::{IncrementalDecoder, TextTokenizer};

/// The CPU kernels' thread pool: [`init_cpu_threads`] sizes it once at start-up (`--threads`),
/// [`cpu_threads`] says its size; [`cpu_isa`] names the vector instructions they use.
pub use wavefront_kernels::cpu::{
    bf16_unit as cpu_bf16_unit, init_threads as init_cpu_threads, int8_unit as cpu_int8_unit,
    isa as cpu_isa, peaks as cpu_peaks, threads as cpu_threads,
};

/// Sets glibc's allocator up for inference (call once at start-up, before threads allocate):
/// buffers up to 1 GiB come from the heap and are reused instead of being mapped and unmapped
/// at every step, and freed memory is not handed back on every `free`. A packed step's
/// activations are tens to hundreds of MB; mapped afresh each time, every page of them faults
/// and is zeroed by the kernel (ARMT's packed diagonal steps spent 6 to 12 s of 70 in the
/// kernel that way). Servers still return freed heap every few seconds (`malloc_trim`), so
/// resident memory follows what they hold. Elsewhere than glibc, nothing.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets glibc's allocator parameters; it takes the allocator's lock and
    // touches no allocated memory.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 256 << 20);
    }
}

/// Re-exported so downstream crates name the same candle types.
pub use candle_core;
pub use candle_nn;
