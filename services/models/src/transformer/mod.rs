//! A pre-norm Llama-style transformer block run over packed rows of many sequences, shared by
//! the Llama-like families: LLaDA (Nie et al., 2025, "Large Language Diffusion Models":
//! bidirectional attention), ARMT's Llama backbone (causal) and ReFusion's Qwen3 layout (q/k
//! RMSNorm, grouped-query attention, `head_dim` independent of the width, explicit position ids,
//! causal in buffer order).
//!
//! One block is `x + attn(norm(x))` followed by `x + mlp(norm(x))` with RMSNorm, separate q/k/v/o
//! projections (optional biases), optional per-head q/k RMSNorm (Qwen3), rotary embeddings in the
//! GPT-NeoX "half" layout (Su et al., 2021, RoFormer) at explicit position ids, and a gated SiLU
//! MLP `down(silu(gate(x)) * up(x))` (Shazeer, 2020, SwiGLU). [`BlockNames`] maps the roles to
//! each checkpoint's tensor names so the `VarBuilder` paths mirror the checkpoint.
//!
//! Packed API: every call takes the rows of many sequences concatenated along dim 0 (`[N, E]`)
//! plus one [`SeqInput`] per sequence, in row order. A sequence lives in a *buffer* (its canvas,
//! cache or segment); each of its rows names its buffer index and its RoPE position id, which
//! need not agree (WINO's shadow block copies positions, ReFusion's slots are non-contiguous).
//! Projections, norms and the MLP run once over all rows; attention runs per sequence over that
//! sequence's keys only, with a [`MaskRule`] evaluated on buffer indices (one candle
//! attention per sequence, or all sequences in one ragged operation: [`AttentionKernel`]). Keys are either the
//! call's own rows ([`Keys::Rows`]) or the whole buffer `0..len`, where buffer indices that are
//! not rows of the call read their K/V from the sequence's [`KvCache`] ([`Keys::Buffer`]; the
//! assembled K/V replace the cache). The latter serves SureLock (locked positions keep their
//! K/V), autoregressive caches (rows appended after the cached prefix) and slot infill. Results
//! for a sequence never depend on which other sequences share the call.

mod attention;
mod block;
mod collective;
pub mod cpu;
pub(crate) mod kv_cache;
mod layers;
mod linear;
mod mask;
pub mod moe;
#[cfg(feature = "cuda")]
mod nccl;
pub mod parallel;
mod ragged;
mod stack;

pub(crate) use attention::{attend_packed, commit_buffers};
pub use attention::{Keys, KvCache, MaskRule, PackedLayout, SeqInput};
pub use block::{Block, BlockConfig, BlockNames};
pub(crate) use block::{BlockWeights, ShardRange, ShardWeights};
pub(crate) use kv_cache::merge_runs;
pub use kv_cache::{KvPool, PagedCache, PAGE_SIZE};
pub(crate) use layers::{apply_rope, gated_mlp, GatedMlp};
pub use layers::{get, linear, RmsNorm, RopeTable};
pub(crate) use linear::{EmbedHead, LinearStack};
pub use linear::{Linear, StoreWeights, WeightDtype};
pub use parallel::{cached_kv_heads, Collective, CollectiveKind, LocalCollective, TensorParallel};
pub use ragged::{AttentionKernel, SelectAttention};
pub(crate) use stack::{HfLayout, Stack};
