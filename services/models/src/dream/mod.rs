//! Dream, a masked-diffusion language model initialised from Qwen2.5, with a packed
//! multi-sequence API.
//!
//! Ye et al., 2025, "Dream 7B: Diffusion Large Language Models" (arXiv:2508.15487); checkpoint
//! `Dream-org/Dream-v0-Instruct-7B`, reference code its remote `modeling_dream.py`
//! (`DreamModel`, `DreamBaseModel`), whose parameter names (`model.embed_tokens`,
//! `model.layers.N.*`, `model.norm`, `lm_head`) are mirrored by the `VarBuilder` paths here.
//!
//! The network is Qwen2 run **bidirectionally**: `x = embed_tokens[ids]` (no scaling), then per
//! layer `x += o_proj(attn(rope(q), rope(k), v))` over `input_layernorm(x)`, with biases on the
//! q, k and v projections, grouped-query attention, RoPE in the "half" layout and no causal
//! mask; `x += down(silu(gate(h)) · up(h))` over `post_attention_layernorm(x)`; then `norm` and
//! `lm_head` over every position. The block is the shared one ([`crate::transformer`],
//! [`BlockNames::LLAMA`] with q/k/v biases).
//!
//! The logits of position `j` predict the token at `j + 1` (Dream keeps Qwen2.5's
//! autoregressive head): a sampler reads position `j`'s prediction from the output row of
//! `j - 1`, and position 0's from its own row (upstream `diffusion_generate`'s
//! `cat([logits[:, :1], logits[:, :-1]])`). The network itself knows nothing of that shift;
//! [`Dream::prediction_row`] states it for the samplers in `wavefront-schemes`.

mod config;

use candle_core::Tensor;
use candle_nn::VarBuilder;

pub use self::config::DreamConfig;
use crate::error::Result;
use crate::transformer::{HfLayout, SeqInput, Stack, TensorParallel};

/// A loaded Dream model.
#[derive(Debug, Clone)]
pub struct Dream {
    cfg: DreamConfig,
    stack: Stack,
}

crate::stack_model!(Dream, DreamConfig);

impl Dream {
    /// Loads the weights from a `VarBuilder` rooted at the checkpoint (names `model.*`,
    /// `lm_head.*`). The `VarBuilder`'s dtype and device are the model's.
    pub fn load(vb: VarBuilder, cfg: DreamConfig) -> Result<Self> {
        Self::load_parallel(vb, cfg, &TensorParallel::single())
    }

    /// Loads the model with every block split over `tp.world` tensor-parallel ranks (heads and
    /// MLP columns; embeddings, norms and the head replicated).
    pub fn load_parallel(vb: VarBuilder, cfg: DreamConfig, tp: &TensorParallel) -> Result<Self> {
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

    /// The output row whose logits predict position `position` of a sequence: the row before
    /// it, and position 0's own row.
    pub fn prediction_row(position: usize) -> usize {
        position.saturating_sub(1)
    }

    /// Upstream's `output_hidden_states`: the embeddings, the output of every layer but the
    /// last, and `norm` of the last layer's output (`num_hidden_layers + 1` tensors `[N, E]`).
    pub fn forward_hidden_states(&self, ids: &[u32], seqs: &mut [SeqInput]) -> Result<Vec<Tensor>> {
        self.stack.hidden_states(ids, seqs, |_, _| Ok(()))
    }

    /// Logits `[N, V]` (float32) of hidden rows from [`Dream::forward`].
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.stack.logits(hidden)
    }
}
