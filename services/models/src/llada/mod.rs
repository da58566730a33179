//! LLaDA, a masked-diffusion language model, with a packed multi-sequence API.
//!
//! Nie et al., 2025, "Large Language Diffusion Models" (arXiv:2502.09992); checkpoint
//! `GSAI-ML/LLaDA-8B-Instruct`, reference code its remote `modeling_llada.py` (`LLaDAModel`,
//! `LLaDALlamaBlock`), whose parameter names are the checkpoint's tensor names
//! (`model.transformer.{wte, blocks.N.*, ln_f, ff_out}`) and are mirrored by the `VarBuilder`
//! paths here.
//!
//! The network is a Llama-like stack without a causal mask: `x = wte[ids]` (no scaling), then per
//! block `x += attn_out(attn(rope(q), rope(k), v))` over RMS-normed rows with **bidirectional**
//! attention, `x += ff_out(silu(ff_proj(h)) · up_proj(h))`, and finally
//! `logits = ff_out(ln_f(x))`. The mask token is an ordinary embedding row; the decoding
//! programs in `wavefront-schemes` decide what to unmask.
//!
//! Packed API ([`crate::transformer`]): rows of many sequences concatenated along dim 0, one
//! [`SeqInput`] per sequence naming each row's buffer index and position id, its mask rule
//! (bidirectional for plain LLaDA, the shadow-block rule for WINO) and whether its keys come
//! from a [`crate::transformer::KvCache`] (SureLock's locked positions). Select the rows that need
//! logits before [`Llada::logits`]: the head is as wide as the vocabulary.

mod config;

use candle_core::Tensor;
use candle_nn::VarBuilder;

pub use self::config::LladaConfig;
use crate::error::Result;
use crate::transformer::{
    get, Block, BlockNames, EmbedHead, RmsNorm, RopeTable, SeqInput, Stack, TensorParallel,
};

/// A loaded LLaDA model.
#[derive(Debug, Clone)]
pub struct Llada {
    cfg: LladaConfig,
    /// `wte`, the blocks, `ln_f` and the head (`ff_out`, or `wte` under weight tying).
    stack: Stack,
}

crate::stack_model!(Llada, LladaConfig);

impl Llada {
    /// Loads the weights from a `VarBuilder` rooted at the checkpoint (names `model.transformer.*`).
    /// The `VarBuilder`'s dtype and device are the model's.
    pub fn load(vb: VarBuilder, cfg: LladaConfig) -> Result<Self> {
        Self::load_parallel(vb, cfg, &TensorParallel::single())
    }

    /// Loads the model with every block split over `tp.world` tensor-parallel ranks (heads and
    /// MLP columns; embeddings, norms and the head replicated).
    pub fn load_parallel(vb: VarBuilder, cfg: LladaConfig, tp: &TensorParallel) -> Result<Self> {
        cfg.validate()?;
        let t = vb.pp("model").pp("transformer");
        let (e, v) = (cfg.d_model, cfg.embedding_rows());
        let wte = get(&t.pp("wte"), &[v, e], "weight")?;
        let block_cfg = cfg.block_config();
        let blocks = (0..cfg.n_layers)
            .map(|i| {
                Block::load_parallel(t.pp("blocks").pp(i), &block_cfg, &BlockNames::LLADA, i, tp)
            })
            .collect::<Result<Vec<_>>>()?;
        let ln_f = RmsNorm::load(t.pp("ln_f"), e, cfg.rms_norm_eps)?;
        let head = if cfg.weight_tying {
            None
        } else {
            let bias = if cfg.include_bias {
                Some(get(&t.pp("ff_out"), &[v], "bias")?)
            } else {
                None
            };
            Some((get(&t.pp("ff_out"), &[v, e], "weight")?, bias))
        };
        let rope = RopeTable::new(
            cfg.head_dim(),
            cfg.rope_theta,
            cfg.max_sequence_length,
            vb.device(),
        )?;
        let stack = Stack::new(EmbedHead::new(wte, head)?, blocks, ln_f, rope);
        Ok(Self { cfg, stack })
    }

    /// Upstream's `output_hidden_states`: the embeddings, the input of every block after the
    /// first, and `ln_f` of the last block's output (`n_layers + 1` tensors `[N, E]`).
    pub fn forward_hidden_states(&self, ids: &[u32], seqs: &mut [SeqInput]) -> Result<Vec<Tensor>> {
        self.stack.hidden_states(ids, seqs, |_, _| Ok(()))
    }

    /// Logits `[N, V]` (float32) of hidden rows from [`Llada::forward`].
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let logits = self.stack.logits(hidden)?;
        if self.cfg.scale_logits {
            return Ok((logits * (1.0 / (self.cfg.d_model as f64).sqrt()))?);
        }
        Ok(logits)
    }
}
