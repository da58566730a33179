//! ARMT, the associative recurrent memory transformer on a Llama backbone, with sequential and
//! diagonal-batched execution.
//!
//! Rodkin et al., 2024, "Associative Recurrent Memory Transformer" (upstream
//! RodkinIvan/associative-recurrent-memory-transformer, `modeling_amt/language_modeling.py`
//! with diagonal-batching's `group_amt.patch`), and Sivtsov et al., 2025, "Diagonal Batching
//! Unlocks Parallelism in Recurrent Memory Transformers for Long Contexts" (upstream
//! svtdanny/diagonal-batching, `FastGroupedArmtExecutor`).
//!
//! A long input is cut into segments of `segment_size` (S) tokens from the left; the last may
//! be shorter. Each segment runs through the unchanged Llama backbone as
//! `[embed(segment), P]`, where P (`memory_cell.memory` `[M, d]`) is the same learned matrix for
//! every segment, at positions `0..n` (RoPE restarts), with a plain causal mask; no key or value
//! crosses a segment boundary. What carries over is each layer's associative memory
//! ([`LayerMemory`]): before layer l every row reads it, after layer l the M memory rows write
//! it ([`memory`]). The logits of a segment are those of its real tokens.
//!
//! Two executions give the same numbers:
//! * **sequential** ([`Armt::forward_layers`]): a segment goes through all layers before the next
//!   starts; rows of many sequences pack into one call per layer of the shared
//!   [`crate::transformer::Block`] (also the generation path: a prompt segment whose keys go to a
//!   [`KvCache`], then one token at a time);
//! * **diagonal** ([`Armt::grouped_step`]): cell (segment s, layer l) runs at step `s + l`, all
//!   cells of a step in one grouped call over layer-stacked weights ([`grouped`]).
//!
//! Checkpoint: the state dict of upstream's `AssociativeRecurrentWrapper`. Per-layer tensors
//! live under `memory_cell.layers.{i}` (`safetensors.torch.save_model`) or
//! `memory_cell.model.model.layers.{i}` (accelerate's `save_model`): `W_mq`, `W_mk`, `W_mv`,
//! `W_mb` (with bias) and the backbone layer under `.layer.*`; then `memory_cell.memory`,
//! `memory_cell.model.model.{embed_tokens, norm}` and `memory_cell.model.lm_head`. Weights are
//! stacked per role at load ([`grouped`]); the per-layer blocks of the sequential path are views
//! of the stacks, so nothing is held twice.
//!
//! Tensor parallelism ([`Armt::load_parallel`]): the attention and MLP linears are split over
//! ranks as the shared block splits them (heads and MLP columns), stacked per rank, and both
//! executions sum the ranks' partials through the collective before each residual add; the
//! embeddings, norms, head and associative memories are whole.

pub mod config;
pub mod grouped;
pub mod memory;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

pub use self::config::{ArmtConfig, ArmtSettings, LlamaConfig};
pub use self::grouped::{CellInput, CellOutput, StepShape};
use self::grouped::{GroupedContext, Linears, Stacked};
use self::memory::{dpfp, read_term, updates, write_delta, WriteInputs};
pub use self::memory::{LayerMemory, MemoryPool, MemoryUpdate};
use crate::arena::{ArenaPool, Pooled};
use crate::error::{ModelError, Result};
use crate::transformer::{
    commit_buffers, get, AttentionKernel, Block, BlockConfig, BlockWeights, EmbedHead, KvCache,
    LinearStack, MaskRule, PackedLayout, RmsNorm, RopeTable, SelectAttention, SeqInput,
    StoreWeights, TensorParallel, WeightDtype,
};

/// One sequence's memories in a [`Armt::forward_layers`] call.
#[derive(Debug)]
pub struct SeqMemory<'a> {
    /// Its memory of every layer (read before each layer).
    pub layers: &'a mut [LayerMemory],
    /// A memory segment: its last `M` rows write every layer's memory.
    pub write: bool,
}

/// One sequence's memories in a [`Armt::forward_layers_deferred`] call, read only.
#[derive(Debug, Clone, Copy)]
pub struct MemoryView<'a> {
    /// Its memory of every layer (read before each layer).
    pub layers: &'a [LayerMemory],
    /// A memory segment: its last `M` rows write every layer's memory.
    pub write: bool,
}

/// What a whole-sequence forward produced.
#[derive(Debug, Clone)]
pub struct ForwardOutput {
    /// Logits of every input token `[T, V]` (float32).
    pub logits: Tensor,
    /// The memories after each segment (sequential), or after the last one (diagonal).
    pub memory: Vec<Vec<LayerMemory>>,
    /// Layer calls (sequential: segments × layers) or grouped steps (diagonal).
    pub steps: usize,
}

/// A loaded ARMT. A clone shares the weights and the slot pools of memories and streams.
#[derive(Clone)]
pub struct Armt {
    cfg: ArmtConfig,
    /// `embed_tokens` and `lm_head` (one weight when tied).
    io: EmbedHead,
    memory_tokens: Tensor,
    blocks: Vec<Block>,
    stacked: Stacked,
    norm: RmsNorm,
    rope: RopeTable,
    empty: LayerMemory,
    /// The slots requests' memories live in ([`Armt::new_memory`]).
    memories: MemoryPool,
    /// The slots diagonal execution's residual streams between two layers live in
    /// ([`Armt::pooled_stream`]): one cell's rows each.
    streams: ArenaPool,
    attention: AttentionKernel,
}

impl std::fmt::Debug for Armt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Armt").field("cfg", &self.cfg).finish()
    }
}

/// The sequential path (one segment through every layer) and generation attend with the chosen
/// kernel; a grouped diagonal step's cells all have a segment's rows, so they attend as one
/// batched product without raggedness (`grouped.rs`).
impl SelectAttention for Armt {
    fn select_attention(&mut self, kernel: AttentionKernel) -> Result<()> {
        self.attention = kernel;
        Ok(())
    }
}

impl StoreWeights for Armt {
    fn store_weights(&mut self, dtype: WeightDtype) -> Result<()> {
        for r in &mut self.stacked.ranks {
            r.store_as(dtype)?;
        }
        self.stacked.mq.store_as(dtype)?;
        self.stacked.mkvb.store_as(dtype)?;
        // The blocks share the stacks' layers: rebuilt so nothing keeps the old weights.
        let block_cfg = self.cfg.block_config();
        self.blocks = (0..self.cfg.n_layers())
            .map(|l| layer_block(&self.stacked, &block_cfg, l))
            .collect::<Result<Vec<_>>>()?;
        self.io.store_as(dtype)
    }
}

impl Armt {
    /// Loads the weights from a `VarBuilder` rooted at the checkpoint (names `memory_cell.*`),
    /// accepting either per-layer prefix. The `VarBuilder`'s dtype and device are the model's.
    pub fn load(vb: VarBuilder, cfg: ArmtConfig) -> Result<Self> {
        Self::load_parallel(vb, cfg, &TensorParallel::single())
    }

    /// Loads the model with every decoder layer split over `tp.world` ranks as the shared
    /// block splits (attention heads and MLP columns, partials summed before the residual
    /// adds), in both executions; embeddings, norms, the head and the associative memories
    /// stay whole.
    pub fn load_parallel(vb: VarBuilder, cfg: ArmtConfig, tp: &TensorParallel) -> Result<Self> {
        cfg.validate()?;
        let block_cfg = cfg.block_config();
        let ranges = block_cfg.shard_ranges(tp.world)?;
        let root = vb.pp("memory_cell");
        let layers_vb = if root.contains_tensor("layers.0.W_mq.weight") {
            root.pp("layers")
        } else if root.contains_tensor("model.model.layers.0.W_mq.weight") {
            root.pp("model").pp("model").pp("layers")
        } else if root.contains_tensor("model.base_model.model.model.norm.weight") {
            return Err(ModelError::Unsupported(
                "a PEFT (LoRA) ARMT checkpoint: merge the adapters first (merge_and_unload) and \
                 save the merged AssociativeRecurrentWrapper"
                    .into(),
            ));
        } else {
            return Err(ModelError::MissingTensor {
                name: "memory_cell.layers.0.W_mq.weight (or memory_cell.model.model.layers.0.W_mq.weight)"
                    .into(),
            });
        };
        let (d, v, inter) = (
            cfg.hidden_size(),
            cfg.vocab_size(),
            cfg.llama.intermediate_size,
        );
        let (h, hkv, hd) = (
            cfg.llama.num_attention_heads,
            cfg.kv_heads(),
            cfg.head_dim(),
        );
        let dm = cfg.d_mem();
        let n_layers = cfg.n_layers();

        let mut parts: HashMap<&str, Vec<Tensor>> = HashMap::new();
        for i in 0..n_layers {
            let lv = layers_vb.pp(i);
            let bv = lv.pp("layer");
            let mut push = |role: &'static str, t: Tensor| parts.entry(role).or_default().push(t);
            push("attn_norm", get(&bv.pp("input_layernorm"), &[d], "weight")?);
            push(
                "q",
                get(&bv.pp("self_attn.q_proj"), &[h * hd, d], "weight")?,
            );
            push(
                "k",
                get(&bv.pp("self_attn.k_proj"), &[hkv * hd, d], "weight")?,
            );
            push(
                "v",
                get(&bv.pp("self_attn.v_proj"), &[hkv * hd, d], "weight")?,
            );
            push(
                "o",
                get(&bv.pp("self_attn.o_proj"), &[d, h * hd], "weight")?,
            );
            push(
                "ff_norm",
                get(&bv.pp("post_attention_layernorm"), &[d], "weight")?,
            );
            push("gate", get(&bv.pp("mlp.gate_proj"), &[inter, d], "weight")?);
            push("up", get(&bv.pp("mlp.up_proj"), &[inter, d], "weight")?);
            push("down", get(&bv.pp("mlp.down_proj"), &[d, inter], "weight")?);
            push("mq", get(&lv.pp("W_mq"), &[dm, d], "weight")?);
            push(
                "mkvb",
                Tensor::cat(
                    &[
                        get(&lv.pp("W_mk"), &[dm, d], "weight")?,
                        get(&lv.pp("W_mv"), &[d, d], "weight")?,
                        get(&lv.pp("W_mb"), &[1, d], "weight")?,
                    ],
                    0,
                )?,
            );
            push("mb_bias", get(&lv.pp("W_mb"), &[1], "bias")?);
        }
        let mut stack = |role: &str| -> Result<Tensor> {
            let list = parts.remove(role).unwrap_or_default();
            Ok(Tensor::stack(&list, 0)?)
        };
        // Each rank's slice of the whole stacks (which are dropped here unless a rank's slice is
        // a view of them).
        let ranks = {
            let linears = Linears {
                q: stack("q")?,
                k: stack("k")?,
                v: stack("v")?,
                o: stack("o")?,
                gate: stack("gate")?,
                up: stack("up")?,
                down: stack("down")?,
            };
            ranges
                .iter()
                .enumerate()
                .map(|(rank, r)| {
                    let stack = linears.shard(r, hd)?;
                    match tp.comm.device(rank) {
                        Some(d) => stack.to_device(d),
                        None => Ok(stack),
                    }
                })
                .collect::<Result<Vec<_>>>()?
        };
        let stacked = Stacked {
            attn_norm: stack("attn_norm")?,
            ff_norm: stack("ff_norm")?,
            mq: LinearStack::new(stack("mq")?)?,
            mkvb: LinearStack::new(stack("mkvb")?)?,
            mb_bias: stack("mb_bias")?,
            ones: Tensor::ones(d, vb.dtype(), vb.device())?,
            ranks,
            comm: tp.comm.clone(),
        };
        let blocks = (0..n_layers)
            .map(|l| layer_block(&stacked, &block_cfg, l))
            .collect::<Result<Vec<_>>>()?;

        let model = root.pp("model");
        let embed_name = "model.embed_tokens";
        let head_name = "lm_head";
        let (embed, lm_head) = if cfg.llama.tie_word_embeddings {
            // save_model keeps one of the tied names.
            let t = if model.contains_tensor(&format!("{embed_name}.weight")) {
                get(&model.pp(embed_name), &[v, d], "weight")?
            } else {
                get(&model.pp(head_name), &[v, d], "weight")?
            };
            (t, None)
        } else {
            (
                get(&model.pp(embed_name), &[v, d], "weight")?,
                Some((get(&model.pp(head_name), &[v, d], "weight")?, None)),
            )
        };
        let io = EmbedHead::new(embed, lm_head)?;
        let memory_tokens = get(&root, &[cfg.num_mem_tokens(), d], "memory")?;
        let norm = RmsNorm::load(model.pp("model.norm"), d, cfg.llama.rms_norm_eps)?;
        let rope = cfg.rope_table(vb.device())?;
        let empty = LayerMemory::zeros(cfg.d_key(), d, vb.device())?;
        let memories = MemoryPool::new(cfg.n_layers(), cfg.d_key(), d, vb.device());
        let streams = ArenaPool::new(&[cfg.cell_rows(), d], io.dtype(), vb.device(), 8);
        Ok(Self {
            cfg,
            io,
            memory_tokens,
            blocks,
            stacked,
            norm,
            rope,
            empty,
            memories,
            streams,
            attention: AttentionKernel::default(),
        })
    }

    pub fn config(&self) -> &ArmtConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        self.io.device()
    }

    /// Compute dtype of the weights and hidden rows (memories are float32).
    pub fn dtype(&self) -> DType {
        self.io.dtype()
    }

    /// Fresh (never written) memories of every layer, in slots of the model's memory pool
    /// (they go back when the memories are dropped).
    pub fn new_memory(&self) -> Result<Vec<LayerMemory>> {
        (0..self.cfg.n_layers())
            .map(|l| self.memories.take(l))
            .collect()
    }

    /// `memory` (one per layer, e.g. in host memory after a preemption or a move) copied into
    /// slots of the model's memory pool.
    pub fn pooled_memory(&self, memory: &[LayerMemory]) -> Result<Vec<LayerMemory>> {
        memory
            .iter()
            .enumerate()
            .map(|(l, m)| self.memories.adopt(l, m))
            .collect()
    }

    /// Copies of another running request's `memory` (in this model's pool) in new slots.
    pub fn copied_memory(&self, memory: &[LayerMemory]) -> Result<Vec<LayerMemory>> {
        memory
            .iter()
            .enumerate()
            .map(|(l, m)| self.memories.copy(l, m))
            .collect()
    }

    /// The slots requests' memories live in.
    pub fn memory_pool(&self) -> &MemoryPool {
        &self.memories
    }

    /// A cell's residual stream `[rows, d]` (at most [`ArmtConfig::cell_rows`] rows) copied
    /// into a slot of the model's stream pool, where it waits for its next layer (diagonal
    /// execution); the slot goes back when the stream is dropped.
    pub fn pooled_stream(&self, hidden: &Tensor) -> Result<Pooled> {
        Pooled::new_in(&self.streams, hidden)
    }

    /// The slots diagonal residual streams live in.
    /// Bytes of the arenas the model's own pools (memories, residual streams) made so far.
    pub fn pool_bytes(&self) -> u64 {
        self.memories.allocated_bytes() + self.streams.allocated_bytes()
    }

    pub fn stream_pool(&self) -> &ArenaPool {
        &self.streams
    }

    /// Token embeddings `[n, d]`.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let v = self.cfg.vocab_size();
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= v) {
            return Err(ModelError::Shape(format!(
                "token id {bad} outside the vocabulary of {v}"
            )));
        }
        self.io.embed(ids)
    }

    /// A segment's backbone input: its embeddings, followed by the memory tokens P when
    /// `memory_tokens` (a memory segment) or alone (a generation prompt).
    pub fn segment_input(&self, ids: &[u32], memory_tokens: bool) -> Result<Tensor> {
        let e = self.embed(ids)?;
        if memory_tokens {
            Ok(Tensor::cat(&[&e, &self.memory_tokens], 0)?)
        } else {
            Ok(e)
        }
    }

    /// The RoPE table (`max_position_embeddings` positions).
    pub fn rope(&self) -> &RopeTable {
        &self.rope
    }

    /// Packed rows `x` `[N, d]` of many sequences through every layer (the sequential path and
    /// generation): before layer l each sequence's rows read its layer-l memory, the shared
    /// block runs, and each writing sequence's last `M` rows write its layer-l memory. Buffer
    /// sequences' caches hold this call's keys afterwards. Returns the last layer's output
    /// (before the final norm).
    pub fn forward_layers(
        &self,
        x: &Tensor,
        seqs: &mut [SeqInput],
        mems: &mut [SeqMemory],
    ) -> Result<Tensor> {
        let views: Vec<MemoryView> = mems
            .iter()
            .map(|m| MemoryView {
                layers: &*m.layers,
                write: m.write,
            })
            .collect();
        let (out, writes) = self.forward_layers_deferred(x, seqs, &views)?;
        for (m, w) in mems.iter_mut().zip(writes) {
            for (l, u) in w.into_iter().enumerate() {
                if let Some(u) = u {
                    m.layers[l].apply(u)?;
                }
            }
        }
        Ok(out)
    }

    /// [`Armt::forward_layers`] with the memories only read: each writing sequence's writes
    /// come back, one per layer, to be applied (with [`LayerMemory::apply`]) afterwards. A
    /// layer's write changes only that layer's memory, which no later layer of the pass reads,
    /// so applying them after the pass gives the same memories.
    #[allow(clippy::type_complexity)]
    pub fn forward_layers_deferred(
        &self,
        x: &Tensor,
        seqs: &mut [SeqInput],
        mems: &[MemoryView],
    ) -> Result<(Tensor, Vec<Vec<Option<MemoryUpdate>>>)> {
        if seqs.len() != mems.len() {
            return Err(ModelError::Shape(format!(
                "{} sequences but {} memories",
                seqs.len(),
                mems.len()
            )));
        }
        let layout = PackedLayout::new(&self.rope, x.dim(0)?, seqs, self.attention)?;
        let rows: Vec<usize> = seqs.iter().map(SeqInput::rows).collect();
        let offsets: Vec<usize> = rows
            .iter()
            .scan(0, |acc, &n| {
                let o = *acc;
                *acc += n;
                Some(o)
            })
            .collect();
        let m = self.cfg.num_mem_tokens();
        for (&n, mem) in rows.iter().zip(mems.iter()) {
            if mem.write && n < m {
                return Err(ModelError::Shape(format!(
                    "a writing sequence has {n} rows, fewer than the {m} memory tokens"
                )));
            }
        }
        let mut writes: Vec<Vec<Option<MemoryUpdate>>> = mems
            .iter()
            .map(|_| (0..self.blocks.len()).map(|_| None).collect())
            .collect();
        let mut x = x.clone();
        for (l, block) in self.blocks.iter().enumerate() {
            x = self.read_rows(&x, l, &rows, mems)?;
            x = block.forward(&x, &layout, seqs)?;
            for (i, u) in self.write_rows(&x, l, &rows, &offsets, mems)? {
                writes[i][l] = Some(u);
            }
        }
        commit_buffers(seqs);
        Ok((x, writes))
    }

    /// `x + read` of layer `l` for every sequence whose layer-l memory was written.
    fn read_rows(
        &self,
        x: &Tensor,
        l: usize,
        rows: &[usize],
        mems: &[MemoryView],
    ) -> Result<Tensor> {
        if !mems.iter().any(|m| m.layers[l].is_written()) {
            return Ok(x.clone());
        }
        let mq = self.stacked.mq.layer(l)?;
        let bf16 = mq.bf16_products();
        let q = dpfp(&mq.forward(x)?.to_dtype(DType::F32)?, self.cfg.nu)?;
        let mut pieces = Vec::with_capacity(rows.len());
        let mut offset = 0;
        for (&n, mem) in rows.iter().zip(mems) {
            let lm = &mem.layers[l];
            if lm.is_written() {
                let t = read_term(
                    &q.narrow(0, offset, n)?.unsqueeze(0)?,
                    &lm.a().unsqueeze(0)?,
                    &lm.z().unsqueeze(0)?,
                    self.cfg.mem_eps,
                    bf16,
                )?;
                pieces.push(t.squeeze(0)?);
            } else {
                pieces.push(Tensor::zeros(
                    (n, self.cfg.hidden_size()),
                    DType::F32,
                    self.device(),
                )?);
            }
            offset += n;
        }
        let assoc = Tensor::cat(&pieces, 0)?.to_dtype(x.dtype())?;
        crate::transformer::cpu::add(x, &assoc)
    }

    /// The read term alone, `phi(q) A / (phi(q) · z + eps)` of rows `hidden` `[n, d]` against
    /// `memory` at `layer` (float32; zero for a memory never written). For checks: the forward
    /// paths add it to the residual stream themselves.
    pub fn read(&self, layer: usize, hidden: &Tensor, memory: &LayerMemory) -> Result<Tensor> {
        let (n, d) = hidden.dims2()?;
        if !memory.is_written() {
            return Ok(Tensor::zeros((n, d), DType::F32, self.device())?);
        }
        let mq = self.stacked.mq.layer(layer)?;
        let q = mq.forward(hidden)?.to_dtype(DType::F32)?;
        let t = read_term(
            &dpfp(&q, self.cfg.nu)?.unsqueeze(0)?,
            &memory.a().unsqueeze(0)?,
            &memory.z().unsqueeze(0)?,
            self.cfg.mem_eps,
            mq.bf16_products(),
        )?;
        Ok(t.squeeze(0)?)
    }

    /// The writes of layer `l` from each writing sequence's last `M` rows, in one batch: the
    /// update of each writer (by sequence index), not applied.
    fn write_rows(
        &self,
        x: &Tensor,
        l: usize,
        rows: &[usize],
        offsets: &[usize],
        mems: &[MemoryView],
    ) -> Result<Vec<(usize, MemoryUpdate)>> {
        let writers: Vec<usize> = (0..mems.len()).filter(|&i| mems[i].write).collect();
        if writers.is_empty() {
            return Ok(Vec::new());
        }
        let (m, d, dm) = (
            self.cfg.num_mem_tokens(),
            self.cfg.hidden_size(),
            self.cfg.d_mem(),
        );
        let o = writers
            .iter()
            .map(|&i| x.narrow(0, offsets[i] + rows[i] - m, m))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let c = writers.len();
        let proj = self
            .stacked
            .mkvb
            .layer(l)?
            .forward(&Tensor::cat(&o, 0)?)?
            .to_dtype(DType::F32)?
            .reshape((c, m, dm + d + 1))?;
        let bias = self.stacked.mb_bias.get(l)?.to_dtype(DType::F32)?;
        let beta_logit = proj.narrow(2, dm + d, 1)?.broadcast_add(&bias)?;
        let k = dpfp(&proj.narrow(2, 0, dm)?, self.cfg.nu)?;
        let v = proj.narrow(2, dm, d)?;
        let a = Tensor::stack(
            &writers
                .iter()
                .map(|&i| mems[i].layers[l].a())
                .collect::<Vec<_>>(),
            0,
        )?;
        let z = Tensor::stack(
            &writers
                .iter()
                .map(|&i| mems[i].layers[l].z())
                .collect::<Vec<_>>(),
            0,
        )?;
        let first: Vec<f32> = writers
            .iter()
            .map(|&i| {
                if mems[i].layers[l].is_written() {
                    0.0
                } else {
                    1.0
                }
            })
            .collect();
        let first = Tensor::from_vec(first, c, self.device())?;
        let (da, dz) = write_delta(&WriteInputs {
            k: &k,
            v: &v,
            beta_logit: &beta_logit,
            a: &a,
            z: &z,
            first: &first,
            correction: self.cfg.armt.correction,
            eps: self.cfg.mem_eps,
            bf16: self.stacked.mkvb.bf16_products(),
        })?;
        Ok(writers.into_iter().zip(updates(&da, &dz)?).collect())
    }

    /// Runs every cell as one grouped decoder-layer call (diagonal batching, see [`grouped`]).
    /// Reads use the memories as given; the writes come back in the outputs, to be applied
    /// (with [`LayerMemory::apply`]) once the step is done.
    pub fn grouped_step(&self, cells: &[CellInput]) -> Result<(Vec<CellOutput>, StepShape)> {
        GroupedContext {
            cfg: &self.cfg,
            stacked: &self.stacked,
            rope: &self.rope,
            device: self.device(),
            dtype: self.dtype(),
            empty: &self.empty,
        }
        .step(cells)
    }

    /// Tensor-parallel ranks the decoder layers are split over.
    pub fn world(&self) -> usize {
        self.stacked.ranks.len()
    }

    /// Stores keys and values a grouped step kept (a prompt segment's, `keep_kv`: one pair per
    /// rank) as buffer indices `0..n` of `cache` at `layer`, in the slots where generation's
    /// [`Armt::forward_layers`] calls read them (the shared block's `layer · world + rank`).
    pub fn store_kv(
        &self,
        cache: &mut KvCache,
        layer: usize,
        kv: Vec<(Tensor, Tensor)>,
    ) -> Result<()> {
        let world = self.world();
        if kv.len() != world {
            return Err(ModelError::Shape(format!(
                "keys and values of {} ranks for a model split over {world}",
                kv.len()
            )));
        }
        for (rank, (k, v)) in kv.into_iter().enumerate() {
            cache.store_layer(layer * world + rank, k, v)?;
        }
        Ok(())
    }

    /// Logits `[n, V]` (float32) of last-layer rows: the final RMSNorm and `lm_head`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let h = self.norm.forward(hidden)?;
        self.io.logits(&h)
    }

    /// The reference forward of upstream's `AssociativeRecurrentWrapper.forward`: every segment
    /// (the partial last one too) with its memory tokens, reads and writes, one after another
    /// through [`Armt::forward_layers`]. Holds all logits: for tests and checks, not serving.
    pub fn forward_sequential(&self, ids: &[u32]) -> Result<ForwardOutput> {
        let mut memory = self.new_memory()?;
        let mut logits = Vec::new();
        let mut snapshots = Vec::new();
        for seg in ids.chunks(self.cfg.segment_size()) {
            let x = self.segment_input(seg, true)?;
            let n = x.dim(0)?;
            let mut seqs = [SeqInput::dense(n).with_mask(MaskRule::Causal)];
            let mut mems = [SeqMemory {
                layers: &mut memory,
                write: true,
            }];
            let out = self.forward_layers(&x, &mut seqs, &mut mems)?;
            logits.push(self.logits(&out.narrow(0, 0, seg.len())?)?);
            // Copies: the memories' pool slots keep changing.
            snapshots.push(
                memory
                    .iter()
                    .map(|m| m.to_device(self.device()))
                    .collect::<Result<Vec<_>>>()?,
            );
        }
        Ok(ForwardOutput {
            logits: Tensor::cat(&logits, 0)?,
            memory: snapshots,
            steps: ids.len().div_ceil(self.cfg.segment_size()) * self.cfg.n_layers(),
        })
    }

    /// The same forward with diagonal batching: step i runs every cell (s, l) with
    /// `s + l = i` in one [`Armt::grouped_step`], `segments + layers - 1` steps in all. The
    /// partial last segment is a cell like the others (padded). For tests and checks.
    pub fn forward_diagonal(&self, ids: &[u32]) -> Result<ForwardOutput> {
        let segs: Vec<&[u32]> = ids.chunks(self.cfg.segment_size()).collect();
        let (n_segs, n_layers) = (segs.len(), self.cfg.n_layers());
        let mut memory = self.new_memory()?;
        let mut inflight: Vec<Option<Tensor>> = vec![None; n_segs];
        let mut logits: Vec<Option<Tensor>> = vec![None; n_segs];
        let steps = n_segs + n_layers - 1;
        for i in 0..steps {
            let first = i.saturating_sub(n_layers - 1);
            let last = i.min(n_segs - 1);
            let placed: Vec<(usize, usize)> = (first..=last).map(|s| (s, i - s)).collect();
            let outputs = {
                let mut cells = Vec::with_capacity(placed.len());
                for &(s, l) in &placed {
                    let hidden = match inflight[s].take() {
                        Some(h) => h,
                        None => self.segment_input(segs[s], true)?,
                    };
                    cells.push(CellInput {
                        layer: l,
                        hidden,
                        memory: &memory[l],
                        write: true,
                        keep_kv: false,
                    });
                }
                self.grouped_step(&cells)?.0
            };
            for (&(s, l), out) in placed.iter().zip(outputs) {
                if let Some(u) = out.update {
                    memory[l].apply(u)?;
                }
                if l + 1 == n_layers {
                    logits[s] = Some(self.logits(&out.hidden.narrow(0, 0, segs[s].len())?)?);
                } else {
                    inflight[s] = Some(out.hidden);
                }
            }
        }
        let logits = logits
            .into_iter()
            .map(|t| t.ok_or_else(|| ModelError::Shape("a segment never reached the top".into())))
            .collect::<Result<Vec<_>>>()?;
        Ok(ForwardOutput {
            logits: Tensor::cat(&logits, 0)?,
            memory: vec![memory],
            steps,
        })
    }
}

/// Layer `l`'s shared block, split as the stacks are, its weights views into them.
fn layer_block(s: &Stacked, cfg: &BlockConfig, l: usize) -> Result<Block> {
    let weights = BlockWeights {
        attn_norm: RmsNorm::new(s.attn_norm.get(l)?, cfg.norm_eps),
        ff_norm: RmsNorm::new(s.ff_norm.get(l)?, cfg.norm_eps),
        qk_norm: None,
        o_bias: None,
        down_bias: None,
        shards: s
            .ranks
            .iter()
            .map(|r| r.layer(l))
            .collect::<Result<Vec<_>>>()?,
        moe: None,
    };
    Block::from_weights(weights, cfg, l, s.comm.clone())
}
