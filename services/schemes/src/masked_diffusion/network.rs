//! The networks the masked-diffusion family serves, as its tick and planner see them: LLaDA
//! (Nie et al., 2025) and Dream (Ye et al., 2025). Both are bidirectional transformers on the
//! shared block; they differ in where a position's prediction is read (Dream's head is shifted
//! by one, [`Shape::shifted`]) and in their configs.

use candle_core::{Device, Tensor};
use wavefront_models::transformer::{BlockConfig, SeqInput};
use wavefront_models::{Dream, DreamConfig, Llada, LladaConfig, ModelError};

/// What the planner needs of a network's config.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    /// `"llada"` or `"dream"`, for messages.
    pub kind: &'static str,
    pub vocab_size: usize,
    /// Rows of the output head (at least the vocabulary).
    pub head_rows: usize,
    /// The longest canvas (prompt + generation) accepted.
    pub max_context: usize,
    pub mask_token_id: u32,
    /// End-of-sequence ids the responses stop at.
    pub eos_token_ids: Vec<u32>,
    pub n_layers: usize,
    pub block: BlockConfig,
    /// Position `j`'s prediction is read from the output row of `j - 1` (Dream), not `j`.
    pub shifted: bool,
}

impl Shape {
    pub fn llada(cfg: &LladaConfig) -> Self {
        Self {
            kind: "llada",
            vocab_size: cfg.vocab_size,
            head_rows: cfg.embedding_rows(),
            max_context: cfg.max_sequence_length,
            mask_token_id: cfg.mask_token_id,
            eos_token_ids: cfg.eos_token_id.into_iter().collect(),
            n_layers: cfg.n_layers,
            block: cfg.block_config(),
            shifted: false,
        }
    }

    pub fn dream(cfg: &DreamConfig) -> Self {
        Self {
            kind: "dream",
            vocab_size: cfg.vocab_size,
            head_rows: cfg.vocab_size,
            max_context: cfg.max_position_embeddings,
            mask_token_id: cfg.mask_token_id,
            eos_token_ids: cfg.eos_token_ids(),
            n_layers: cfg.num_hidden_layers,
            block: cfg.block_config(),
            shifted: true,
        }
    }
}

/// A network the family's tick runs.
pub trait MdNetwork: Send + 'static {
    /// Hidden rows `[N, E]` of packed sequences (caches of buffer sequences hold their keys).
    fn forward(&self, ids: &[u32], seqs: &mut [SeqInput]) -> Result<Tensor, ModelError>;
    /// Float32 logits `[N, V]` of hidden rows.
    fn logits(&self, hidden: &Tensor) -> Result<Tensor, ModelError>;
    fn device(&self) -> &Device;
    /// Rows of the output head.
    fn head_rows(&self) -> usize;
    /// GEMM FLOPs of `queries` rows attending over `keys` keys.
    fn algorithmic_flops(&self, queries: u64, keys: u64) -> u64;
}

impl MdNetwork for Llada {
    fn forward(&self, ids: &[u32], seqs: &mut [SeqInput]) -> Result<Tensor, ModelError> {
        Llada::forward(self, ids, seqs)
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor, ModelError> {
        Llada::logits(self, hidden)
    }

    fn device(&self) -> &Device {
        Llada::device(self)
    }

    fn head_rows(&self) -> usize {
        self.config().embedding_rows()
    }

    fn algorithmic_flops(&self, queries: u64, keys: u64) -> u64 {
        self.config().algorithmic_flops(queries, keys)
    }
}

impl MdNetwork for Dream {
    fn forward(&self, ids: &[u32], seqs: &mut [SeqInput]) -> Result<Tensor, ModelError> {
        Dream::forward(self, ids, seqs)
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor, ModelError> {
        Dream::logits(self, hidden)
    }

    fn device(&self) -> &Device {
        Dream::device(self)
    }

    fn head_rows(&self) -> usize {
        self.config().vocab_size
    }

    fn algorithmic_flops(&self, queries: u64, keys: u64) -> u64 {
        self.config().algorithmic_flops(queries, keys)
    }
}
