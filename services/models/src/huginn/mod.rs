//! Huginn-0125 ("raven"), a recurrent-depth language model, with a packed multi-sequence API.
//!
//! Geiping et al., 2025, "Scaling up Test-Time Compute with Latent Reasoning: A Recurrent Depth
//! Approach" (arXiv:2502.05171); checkpoint `tomg-group-umd/huginn-0125`, reference code
//! `seal-rg/recurrent-pretraining` (`raven_modeling_minimal.py`, whose parameter names are the
//! checkpoint's tensor names and are mirrored by the `VarBuilder` paths below).
//!
//! The model: embeddings scaled by `sqrt(n_embd)`; a prelude of P sandwich blocks maps them to
//! `e'`; a latent state `s` starts from a (truncated-normal or zero) draw and is iterated
//! `s <- core(adapter([s, e']))` any number of times (the same `e'` injected every step); the
//! output is `ln_f -> coda -> ln_f -> lm_head` (tied to `wte`). The number of recurrences is a
//! test-time choice, which is what the decoding programs in `wavefront-schemes` exploit.
//!
//! Packed API: every entry point takes rows of many sequences concatenated along dim 0
//! (`[N_total, E]`) plus one [`SeqRows`] per sequence, in row order, naming that sequence's KV
//! cache, first absolute position, row count and recurrence index. Projections, norms and MLPs
//! run once over all rows; attention runs per sequence against its own [`HuginnCache`]. Results
//! for a sequence do not depend on which other sequences share the call.

mod block;
mod cache;
mod config;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;

use self::block::{get, linear, Linear, RmsNorm, RowLayout, SandwichBlock};
pub use self::cache::SeqRows;
pub use self::cache::{CacheLayer, CacheStrategy, HuginnCache};
pub use self::config::{HuginnConfig, InitValues};
use crate::error::{ModelError, Result};
use crate::transformer::RopeTable;
use crate::transformer::{
    AttentionKernel, EmbedHead, SelectAttention, StoreWeights, TensorParallel, WeightDtype,
};

/// A loaded Huginn model.
#[derive(Debug, Clone)]
pub struct Huginn {
    cfg: HuginnConfig,
    /// `transformer.wte` and `lm_head` (tied unless the config says otherwise).
    io: EmbedHead,
    prelude: Vec<SandwichBlock>,
    adapter: Linear,
    core_block: Vec<SandwichBlock>,
    coda: Vec<SandwichBlock>,
    ln_f: RmsNorm,
    rope: RopeTable,
}

/// Huginn's sandwich blocks attend through their own per-row-group path (`block.rs`): its
/// rows' keys live in the recurrent-depth cache layers, not in the shared transformer's buffers.
impl SelectAttention for Huginn {
    fn select_attention(&mut self, kernel: AttentionKernel) -> Result<()> {
        match kernel {
            AttentionKernel::Sdpa => Ok(()),
            AttentionKernel::Ragged => Err(ModelError::Unsupported(
                "huginn (recurrent depth) attends with sdpa only; --attention ragged serves the \
                 llada, armt and refusion families"
                    .into(),
            )),
        }
    }
}

impl StoreWeights for Huginn {
    fn store_weights(&mut self, dtype: WeightDtype) -> Result<()> {
        for b in self
            .prelude
            .iter_mut()
            .chain(&mut self.core_block)
            .chain(&mut self.coda)
        {
            b.store_weights(dtype)?;
        }
        self.adapter.store_as(dtype)?;
        self.io.store_as(dtype)
    }
}

impl Huginn {
    /// Loads the weights from a `VarBuilder` rooted at the checkpoint (names `transformer.*`).
    /// The `VarBuilder`'s dtype and device are the model's.
    pub fn load(vb: VarBuilder, cfg: HuginnConfig) -> Result<Self> {
        Self::load_parallel(vb, cfg, &TensorParallel::single())
    }

    /// Loads the model with every sandwich block split over `tp.world` tensor-parallel ranks
    /// (attention heads and MLP columns; embeddings, adapter, norms and head replicated).
    pub fn load_parallel(vb: VarBuilder, cfg: HuginnConfig, tp: &TensorParallel) -> Result<Self> {
        cfg.validate()?;
        let (e, v) = (cfg.n_embd, cfg.padded_vocab());
        let t = vb.pp("transformer");
        let wte = get(&t.pp("wte"), &[v, e], "weight")?;
        let lm_head = if cfg.tie_embeddings {
            None
        } else {
            Some((get(&vb.pp("lm_head"), &[v, e], "weight")?, None))
        };
        let io = EmbedHead::new(wte, lm_head)?;
        let blocks = |name: &str, n: usize| -> Result<Vec<SandwichBlock>> {
            (0..n)
                .map(|i| SandwichBlock::load(t.pp(name).pp(i), &cfg, tp))
                .collect()
        };
        let prelude = blocks("prelude", cfg.n_layers_in_prelude)?;
        let core_block = blocks("core_block", cfg.n_layers_in_recurrent_block)?;
        let coda = blocks("coda", cfg.n_layers_in_coda)?;
        let adapter = linear(&t.pp("adapter"), 2 * e, e, cfg.bias)?;
        let ln_f = RmsNorm::load(t.pp("ln_f"), e, cfg.norm_eps)?;
        let rope = RopeTable::new(cfg.head_dim(), cfg.rope_base, cfg.block_size, vb.device())?;
        Ok(Self {
            cfg,
            io,
            prelude,
            adapter,
            core_block,
            coda,
            ln_f,
            rope,
        })
    }

    /// The model's config.
    pub fn config(&self) -> &HuginnConfig {
        &self.cfg
    }

    /// Device of the weights.
    pub fn device(&self) -> &Device {
        self.io.device()
    }

    /// Compute dtype of the weights (and of states, embeddings and caches).
    pub fn dtype(&self) -> DType {
        self.io.dtype()
    }

    /// Token embeddings `[N, E]`, scaled by the embedding scale (`sqrt(n_embd)`).
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let vocab = self.cfg.padded_vocab();
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(ModelError::Shape(format!(
                "token id {bad} outside the vocabulary of {vocab}"
            )));
        }
        Ok(self.io.embed(ids)?.affine(self.cfg.embed_scale(), 0.0)?)
    }

    /// Prelude over packed embeddings: returns `e'` `[N, E]` and writes the prelude KV layers.
    /// Writing prelude layer 0 appends: each sequence's `start` must equal its cache length.
    pub fn prelude(&self, emb: &Tensor, seqs: &mut [SeqRows]) -> Result<Tensor> {
        let layout = RowLayout::new(&self.rope, emb.dim(0)?, seqs)?;
        let mut x = emb.clone();
        for (i, block) in self.prelude.iter().enumerate() {
            x = block.forward(&x, &layout, seqs, &|_| CacheLayer::Prelude(i))?;
        }
        Ok(x)
    }

    /// One recurrence: `core_blocks(adapter([state, injected]))` `[N, E]`. Sequence `i` writes
    /// core layer j's KV in layer `Core { recurrence: seqs[i].recurrence, layer: j }` (upstream
    /// step index `2 + 4·recurrence + j`, remapped by the cache strategy).
    pub fn core_step(
        &self,
        state: &Tensor,
        injected: &Tensor,
        seqs: &mut [SeqRows],
    ) -> Result<Tensor> {
        let layout = RowLayout::new(&self.rope, state.dim(0)?, seqs)?;
        let c = self.core_block.len();
        for seq in seqs.iter_mut() {
            seq.cache.bind_core_layers(c)?;
        }
        let mut x = self.adapter.forward(&Tensor::cat(
            &[state, &injected.to_dtype(state.dtype())?],
            D::Minus1,
        )?)?;
        for (j, block) in self.core_block.iter().enumerate() {
            x = block.forward(&x, &layout, seqs, &|s| CacheLayer::Core {
                recurrence: s.recurrence,
                layer: j,
            })?;
        }
        Ok(x)
    }

    /// `ln_f(state)`: the "latent" output of a forward pass.
    pub fn latent(&self, state: &Tensor) -> Result<Tensor> {
        self.ln_f.forward(state)
    }

    /// `ln_f -> coda -> ln_f` on raw states: the hidden rows fed to the head `[N, E]`; writes the
    /// coda KV layers.
    pub fn coda(&self, state: &Tensor, seqs: &mut [SeqRows]) -> Result<Tensor> {
        let layout = RowLayout::new(&self.rope, state.dim(0)?, seqs)?;
        let mut x = self.ln_f.forward(state)?;
        for (i, block) in self.coda.iter().enumerate() {
            x = block.forward(&x, &layout, seqs, &|_| CacheLayer::Coda(i))?;
        }
        self.ln_f.forward(&x)
    }

    /// Logits `[N, V]` (float32) of hidden rows from [`Huginn::coda`]. Select rows first to
    /// avoid computing logits nobody reads.
    pub fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        self.io.logits(hidden)
    }

    /// `ln_f -> coda -> ln_f -> lm_head` on raw states: logits `[N, V]` (float32); writes the
    /// coda KV layers.
    pub fn predict_from_latents(&self, state: &Tensor, seqs: &mut [SeqRows]) -> Result<Tensor> {
        self.lm_head(&self.coda(state, seqs)?)
    }
}

/// Per-row relative change `||new - old|| / ||new||` `[N]` (float32), the latent-difference
/// exit criterion of adaptive compute and the diffusion sampler's freeze test.
pub fn relative_change(new: &Tensor, old: &Tensor) -> Result<Tensor> {
    let new = new.to_dtype(DType::F32)?;
    let old = old.to_dtype(DType::F32)?;
    let diff = (&new - &old)?.sqr()?.sum(D::Minus1)?.sqrt()?;
    let norm = new.sqr()?.sum(D::Minus1)?.sqrt()?;
    Ok((diff / norm)?)
}
