//! The body every Llama-like family wraps: token embeddings, a stack of shared [`Block`]s, the
//! final norm and the output head, with the RoPE table and the attention path the blocks use.
//! LLaDA, Dream, LLaDA2.0 and Qwen3 (ReFusion) are each a config plus a [`Stack`];
//! [`stack_model!`](crate::stack_model) gives them the same accessors and forwards.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use super::attention::{commit_buffers, PackedLayout, SeqInput};
use super::block::{forward_stack, Block, BlockConfig, BlockNames};
use super::layers::{get, RmsNorm, RopeTable};
use super::linear::{EmbedHead, StoreWeights, WeightDtype};
use super::parallel::TensorParallel;
use super::ragged::AttentionKernel;
use crate::error::Result;

#[derive(Debug, Clone)]
pub(crate) struct Stack {
    io: EmbedHead,
    pub(crate) blocks: Vec<Block>,
    norm: RmsNorm,
    rope: RopeTable,
    pub(crate) attention: AttentionKernel,
}

/// The Hugging Face Llama layout of a checkpoint: `model.embed_tokens`, `model.layers.N.*`
/// ([`BlockNames::LLAMA`]), `model.norm`, and `lm_head` unless the embeddings are tied.
pub(crate) struct HfLayout {
    pub vocab_size: usize,
    pub layers: usize,
    pub block: BlockConfig,
    pub tie_word_embeddings: bool,
    /// RoPE: dims rotated, theta, positions.
    pub rope: (usize, f64, usize),
}

impl Stack {
    /// Loads a checkpoint in the Hugging Face Llama layout (Qwen3, Dream), every block split
    /// over `tp.world` ranks.
    pub(crate) fn load_hf(vb: VarBuilder, l: &HfLayout, tp: &TensorParallel) -> Result<Self> {
        let m = vb.pp("model");
        let (e, v) = (l.block.hidden_size, l.vocab_size);
        let embed = get(&m.pp("embed_tokens"), &[v, e], "weight")?;
        let blocks = (0..l.layers)
            .map(|i| {
                Block::load_parallel(m.pp("layers").pp(i), &l.block, &BlockNames::LLAMA, i, tp)
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(m.pp("norm"), e, l.block.norm_eps)?;
        let head = if l.tie_word_embeddings {
            None
        } else {
            Some((get(&vb.pp("lm_head"), &[v, e], "weight")?, None))
        };
        let (dims, theta, positions) = l.rope;
        let rope = RopeTable::new(dims, theta, positions, vb.device())?;
        Ok(Self::new(EmbedHead::new(embed, head)?, blocks, norm, rope))
    }

    pub(crate) fn new(io: EmbedHead, blocks: Vec<Block>, norm: RmsNorm, rope: RopeTable) -> Self {
        Self {
            io,
            blocks,
            norm,
            rope,
            attention: AttentionKernel::default(),
        }
    }

    pub(crate) fn device(&self) -> &Device {
        self.io.device()
    }

    pub(crate) fn dtype(&self) -> DType {
        self.io.dtype()
    }

    pub(crate) fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        self.io.embed(ids)
    }

    /// Every block and the final norm over packed rows: the hidden rows `[N, E]` fed to the
    /// head. Buffer sequences' caches hold this call's keys afterwards.
    pub(crate) fn forward(&self, ids: &[u32], seqs: &mut [SeqInput]) -> Result<Tensor> {
        forward_stack(
            &self.blocks,
            &self.rope,
            &self.norm,
            self.embed(ids)?,
            seqs,
            self.attention,
        )
    }

    /// Upstream's `output_hidden_states`: the embeddings, the input of every block after the
    /// first, and the final norm of the last block's output. `visit` sees each block with its
    /// feed-forward's input (LLaDA2.0 reads its routers there).
    pub(crate) fn hidden_states(
        &self,
        ids: &[u32],
        seqs: &mut [SeqInput],
        mut visit: impl FnMut(&Block, &Tensor) -> Result<()>,
    ) -> Result<Vec<Tensor>> {
        let mut x = self.embed(ids)?;
        let layout = PackedLayout::new(&self.rope, ids.len(), seqs, self.attention)?;
        let mut states = Vec::with_capacity(self.blocks.len() + 1);
        for block in &self.blocks {
            states.push(x.clone());
            let (out, ffn_input) = block.forward_traced(&x, &layout, seqs)?;
            visit(block, &ffn_input)?;
            x = out;
        }
        commit_buffers(seqs);
        states.push(self.norm.forward(&x)?);
        Ok(states)
    }

    /// Float32 logits `[N, V]` of hidden rows.
    pub(crate) fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.io.logits(hidden)
    }

    pub(crate) fn store_weights(&mut self, dtype: WeightDtype) -> Result<()> {
        for b in &mut self.blocks {
            b.store_weights(dtype)?;
        }
        self.io.store_as(dtype)
    }
}

/// For a model struct with fields `cfg: $cfg` and `stack: Stack`: `SelectAttention`,
/// `StoreWeights`, and the accessors and forwards every Llama-like family offers (`config`,
/// `device`, `dtype`, `embed`, `forward`).
#[macro_export]
#[doc(hidden)]
macro_rules! stack_model {
    ($model:ty, $cfg:ty) => {
        impl $crate::transformer::SelectAttention for $model {
            fn select_attention(
                &mut self,
                kernel: $crate::transformer::AttentionKernel,
            ) -> $crate::error::Result<()> {
                self.stack.attention = kernel;
                Ok(())
            }
        }

        impl $crate::transformer::StoreWeights for $model {
            fn store_weights(
                &mut self,
                dtype: $crate::transformer::WeightDtype,
            ) -> $crate::error::Result<()> {
                self.stack.store_weights(dtype)
            }
        }

        impl $model {
            pub fn config(&self) -> &$cfg {
                &self.cfg
            }

            pub fn device(&self) -> &candle_core::Device {
                self.stack.device()
            }

            /// Compute dtype of the weights (and of hidden rows and caches).
            pub fn dtype(&self) -> candle_core::DType {
                self.stack.dtype()
            }

            /// Token embeddings `[N, E]`.
            pub fn embed(&self, ids: &[u32]) -> $crate::error::Result<candle_core::Tensor> {
                self.stack.embed(ids)
            }

            /// Every layer and the final norm over packed token rows: the hidden rows `[N, E]`
            /// fed to the head. Buffer sequences' caches hold this call's keys afterwards.
            pub fn forward(
                &self,
                ids: &[u32],
                seqs: &mut [$crate::transformer::SeqInput],
            ) -> $crate::error::Result<candle_core::Tensor> {
                self.stack.forward(ids, seqs)
            }
        }
    };
}
