//! Qwen3, the backbone of ReFusion, with a packed multi-sequence API and explicit position ids.
//!
//! Li et al., 2025, "ReFusion: A Diffusion Large Language Model with Parallel Autoregressive
//! Decoding" (arXiv:2512.13586); checkpoint `GSAI-ML/ReFusion`, reference code
//! `qwen3/modeling_qwen3_refusion.py` of ML-GSAI/ReFusion, which is Hugging Face's generated
//! Qwen3 file with a training loss: for inference ReFusion *is* Qwen3 (Qwen3-8B's shapes), fed
//! explicit, non-contiguous `position_ids`. Tensor names are `Qwen3ForCausalLM`'s
//! (`model.embed_tokens`, `model.layers.N.*`, `model.norm`, `lm_head`) and are mirrored by the
//! `VarBuilder` paths here.
//!
//! The network: `x = embed_tokens[ids]`, then per layer
//! `x += o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))` over `input_layernorm(x)` and
//! `x += down(silu(gate(h)) · up(h))` over `post_attention_layernorm(x)`, then `norm` and
//! `lm_head`. q/k RMSNorm is per head over `head_dim`; RoPE is the "half" layout at each row's
//! **position id**; attention is grouped-query and **causal in buffer order** (the order rows
//! were appended to the sequence's cache), never in position order: ReFusion moves decoded slots
//! in front of still-masked ones, so a key's buffer index and its position id disagree.
//!
//! The block is the shared one ([`crate::transformer`], [`BlockNames::LLAMA`] with q/k norm).
//! Each sequence of a packed call reads its earlier keys from a
//! [`crate::transformer::KvCache`]: [`crate::transformer::Keys::Buffer`] for one cache that
//! grows, [`crate::transformer::Keys::Shared`] for a row that extends a cache shared with other
//! rows without copying it (ReFusion's parallel slots). Select the rows that need logits before
//! [`Qwen3::logits`]: the head is as wide as the vocabulary.

mod config;

use candle_core::Tensor;
use candle_nn::VarBuilder;

pub use self::config::Qwen3Config;
pub use crate::config::TokenIds;
use crate::error::Result;
use crate::transformer::{HfLayout, Stack, TensorParallel};

/// A loaded Qwen3 / ReFusion model.
#[derive(Debug, Clone)]
pub struct Qwen3 {
    cfg: Qwen3Config,
    stack: Stack,
}

crate::stack_model!(Qwen3, Qwen3Config);

impl Qwen3 {
    /// Loads the weights from a `VarBuilder` rooted at the checkpoint (names `model.*`,
    /// `lm_head.*`). The `VarBuilder`'s dtype and device are the model's.
    pub fn load(vb: VarBuilder, cfg: Qwen3Config) -> Result<Self> {
        Self::load_parallel(vb, cfg, &TensorParallel::single())
    }

    /// Loads the model with every block split over `tp.world` tensor-parallel ranks (heads and
    /// MLP columns; embeddings, norms and the head replicated). Caches then hold one slot per
    /// layer and rank; stitching and sharing them ([`crate::transformer::KvCache::append`],
    /// `Keys::Shared`) works slot by slot as with one rank.
    pub fn load_parallel(vb: VarBuilder, cfg: Qwen3Config, tp: &TensorParallel) -> Result<Self> {
        cfg.validate()?;
        let layout = HfLayout {
            vocab_size: cfg.vocab_size,
            layers: cfg.num_hidden_layers,
            block: cfg.block_config(),
            tie_word_embeddings: cfg.tie_word_embeddings,
            rope: (cfg.head_dim(), cfg.rope_theta, cfg.max_position_embeddings),
        };
        let stack = Stack::load_hf(vb, &layout, tp)?;
        Ok(Self { cfg, stack })
    }

    /// Logits `[N, V]` (float32) of hidden rows from [`Qwen3::forward`].
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.stack.logits(hidden)
    }
}
