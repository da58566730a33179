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

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

pub use self::config::LladaConfig;
use crate::error::Result;
use crate::transformer::{
    forward_stack, get, AttentionKernel, Block, BlockNames, EmbedHead, PackedLayout, RmsNorm,
    RopeTable, SelectAttention, SeqInput, StoreWeights, TensorParallel, WeightDtype,
};

/// A loaded LLaDA model.
#[derive(Debug, Clone)]
pub struct Llada {
    cfg: LladaConfig,
    /// `wte` and the head (`ff_out`, or `wte` under weight tying).
    io: EmbedHead,
    blocks: Vec<Block>,
    ln_f: RmsNorm,
    rope: RopeTable,
    attention: AttentionKernel,
}

impl SelectAttention for Llada {
    fn select_attention(&mut self, kernel: AttentionKernel) -> Result<()> {
        self.attention = kernel;
        Ok(())
    }
}

impl StoreWeights for Llada {
    fn store_weights(&mut self, dtype: WeightDtype) -> Result<()> {
        for b in &mut self.blocks {
            b.store_weights(dtype)?;
        }
        self.io.store_as(dtype)
    }
}

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
        let io = EmbedHead::new(wte, head)?;
        let rope = RopeTable::new(
            cfg.head_dim(),
            cfg.rope_theta,
            cfg.max_sequence_length,
            vb.device(),
        )?;
        Ok(Self {
            cfg,
            io,
            blocks,
            ln_f,
            rope,
            attention: AttentionKernel::default(),
        })
    }

    pub fn config(&self) -> &LladaConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        self.io.device()
    }

    /// Compute dtype of the weights (and of hidden rows and caches).
    pub fn dtype(&self) -> DType {
        self.io.dtype()
    }

    /// Token embeddings `[N, E]`.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        self.io.embed(ids)
    }

    /// All blocks and `ln_f` over packed token rows: the hidden rows `[N, E]` fed to the head.
    /// Buffer sequences' caches hold this call's keys afterwards.
    pub fn forward(&self, ids: &[u32], seqs: &mut [SeqInput]) -> Result<Tensor> {
        forward_stack(
            &self.blocks,
            &self.rope,
            &self.ln_f,
            self.embed(ids)?,
            seqs,
            self.attention,
        )
    }

    /// Upstream's `output_hidden_states`: the embeddings, the input of every block after the
    /// first, and `ln_f` of the last block's output (`n_layers + 1` tensors `[N, E]`).
    pub fn forward_hidden_states(&self, ids: &[u32], seqs: &mut [SeqInput]) -> Result<Vec<Tensor>> {
        let mut x = self.embed(ids)?;
        let layout = PackedLayout::new(&self.rope, ids.len(), seqs, self.attention)?;
        let mut states = Vec::with_capacity(self.blocks.len() + 1);
        for block in &self.blocks {
            states.push(x.clone());
            x = block.forward(&x, &layout, seqs)?;
        }
        crate::transformer::commit_buffers(seqs);
        states.push(self.ln_f.forward(&x)?);
        Ok(states)
    }

    /// Logits `[N, V]` (float32) of hidden rows from [`Llada::forward`].
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let logits = self.io.logits(hidden)?;
        if self.cfg.scale_logits {
            return Ok((logits * (1.0 / (self.cfg.d_model as f64).sqrt()))?);
        }
        Ok(logits)
    }
}
