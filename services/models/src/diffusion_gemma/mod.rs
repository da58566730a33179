//! DiffusionGemma (`google/diffusiongemma-26B-A4B-it`, model type `diffusion_gemma`): a Gemma 4
//! mixture-of-experts transformer run in two modes with the same weights, over packed rows.
//!
//! - **Encoder** (causal): the prompt, then each finished canvas, at their positions; its keys
//!   and values are what the request's cache holds. Input `E[ids] · sqrt(H)`.
//! - **Denoiser** (bidirectional): a canvas of `canvas_length` tokens read against the cache
//!   (never written: the canvas rows' K/V are overwritten by the next call), input
//!   `rms(E[ids] · sqrt(H) + SC)` where `SC` is the self-conditioning MLP of the previous step's
//!   expected embedding (`softmax(logits / T) · E · sqrt(H)`, [`DiffusionGemma::soft_embedding`]).
//!
//! A layer (`layer_types[l]` sliding or full attention):
//! ```text
//! x += post_attention_layernorm(attn(input_layernorm(x)))
//! dense = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(x)))
//! moe   = post_feedforward_layernorm_2(Σ_k w_k · expert_k(pre_feedforward_layernorm_2(x)))
//! x = (x + post_feedforward_layernorm(dense + moe)) · layer_scalar[mode]
//! ```
//! with gelu-tanh gated MLPs, RMSNorms that multiply by their plain weight, attention of scale 1
//! with q/k RMSNorm per head, values RMS-normalised without a weight and, in full layers, taken
//! from the key projection (before its norm and RoPE). The router reads the un-normalised
//! residual: `softmax((rms(x) · scale · H^-½) · projᵀ)`, its top k renormalised and multiplied
//! by `per_expert_scale`. Logits are `c · tanh(E · norm(x) / c)` (tied head, soft cap `c`).
//!
//! Sliding layers: the encoder sees `sliding_window` keys up to itself; the denoiser sees the
//! last `sliding_window - 1` cached keys and the whole canvas ([`MaskRule::RecentCache`]), as
//! upstream's sliding cache keeps them. Full layers see everything cached. Both kinds have their
//! own head width, key/value heads and RoPE table (full layers: `proportional`, the first
//! quarter of the frequencies rotated).
//!
//! The mixture of experts runs grouped per expert: the router runs once over every row of the
//! call, and each expert one product over all rows routed to it. With several ranks
//! ([`TensorParallel`]) each rank owns a contiguous range of experts and the collective sums the
//! ranks' partial outputs; everything else is replicated (expert parallelism).

mod config;

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;

pub use self::config::{DiffusionGemmaConfig, LayerType};
use crate::error::{ModelError, Result};
use crate::transformer::moe::{expert_range, Routed};
use crate::transformer::parallel::{on_rank, reduce, Collective};
use crate::transformer::{
    apply_rope, attend_packed, get, AttentionKernel, EmbedHead, Keys, KvCache, Linear, MaskRule,
    PackedLayout, RmsNorm, RopeTable, SeqInput, TensorParallel,
};

/// Which mode a sequence of a packed call runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Causal, writes its rows' K/V to the cache.
    Encode,
    /// Bidirectional over the cache and itself.
    Denoise,
}

/// One sequence of a packed call: rows `start..start + ids.len()` of its buffer (buffer index =
/// position), over its cache, which must hold exactly `start` indices of encoded rows
/// (a denoised canvas's rows past them are dropped first).
#[derive(Debug)]
pub struct DgSeq<'a> {
    pub ids: Vec<u32>,
    pub start: usize,
    pub mode: Mode,
    /// The denoiser's self-conditioning input `[rows, H]`
    /// ([`DiffusionGemma::soft_embedding`]); `None` at a canvas's first step (and always for
    /// the encoder).
    pub soft: Option<Tensor>,
    pub cache: &'a mut KvCache,
}

impl<'a> DgSeq<'a> {
    /// An encoder pass of `ids` at buffer indices `start ..`.
    pub fn encode(ids: Vec<u32>, start: usize, cache: &'a mut KvCache) -> Self {
        Self {
            ids,
            start,
            mode: Mode::Encode,
            soft: None,
            cache,
        }
    }

    /// A denoising step of the canvas `ids` over the `start` cached rows, with its
    /// self-conditioning input.
    pub fn denoise(
        ids: Vec<u32>,
        start: usize,
        soft: Option<Tensor>,
        cache: &'a mut KvCache,
    ) -> Self {
        Self {
            ids,
            start,
            mode: Mode::Denoise,
            soft,
            cache,
        }
    }
}

/// A gated MLP `down(gelu_tanh(gate(x)) · up(x))`, gate and up fused.
#[derive(Debug, Clone)]
struct GeluMlp {
    gate_up: Linear,
    down: Linear,
    hidden: usize,
}

impl GeluMlp {
    fn new(gate: Tensor, up: Tensor, down: Tensor) -> Result<Self> {
        let hidden = gate.dim(0)?;
        Ok(Self {
            gate_up: Linear::new(Tensor::cat(&[&gate, &up], 0)?, None)?,
            down: Linear::new(down, None)?,
            hidden,
        })
    }

    fn load(vb: &VarBuilder, e: usize, width: usize) -> Result<Self> {
        Self::new(
            get(&vb.pp("gate_proj"), &[width, e], "weight")?,
            get(&vb.pp("up_proj"), &[width, e], "weight")?,
            get(&vb.pp("down_proj"), &[e, width], "weight")?,
        )
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gu = self.gate_up.forward(x)?;
        self.down
            .forward(&crate::transformer::cpu::gelu_tanh_mul(&gu, self.hidden)?)
    }

    fn store_as(&mut self, dtype: crate::transformer::WeightDtype) -> Result<()> {
        self.gate_up.store_as(dtype)?;
        self.down.store_as(dtype)
    }
}

/// What a layer's router chose for every row of a call (tests compare it with upstream's).
#[derive(Debug, Clone, PartialEq)]
pub struct GemmaRouting {
    /// Router probabilities `[rows, experts]`.
    pub probs: Vec<Vec<f32>>,
    /// Chosen experts per row, best first.
    pub experts: Vec<Vec<usize>>,
    /// Their weights (renormalised, times `per_expert_scale`).
    pub weights: Vec<Vec<f32>>,
}

/// One rank's experts.
#[derive(Debug, Clone)]
struct ExpertShard {
    experts: Range<usize>,
    mlps: Vec<GeluMlp>,
}

/// The mixture of experts of one layer.
#[derive(Debug, Clone)]
struct GemmaMoe {
    /// `[experts, H]`, float32.
    proj: Tensor,
    /// `router.scale · H^-½` `[H]`, float32.
    scale: Tensor,
    per_expert_scale: Vec<f32>,
    top_k: usize,
    eps: f64,
    shards: Vec<ExpertShard>,
    comm: Arc<dyn Collective>,
}

impl GemmaMoe {
    fn load(vb: &VarBuilder, cfg: &DiffusionGemmaConfig, tp: &TensorParallel) -> Result<Self> {
        let (e, n, w) = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size);
        let r = vb.pp("router");
        let proj = get(&r.pp("proj"), &[n, e], "weight")?.to_dtype(DType::F32)?;
        let scale = get(&r, &[e], "scale")?.to_dtype(DType::F32)?;
        let per_expert_scale: Vec<f32> = get(&r, &[n], "per_expert_scale")?
            .to_dtype(DType::F32)?
            .to_vec1()?;
        let x = vb.pp("experts");
        let gate_up = get(&x, &[n, 2 * w, e], "gate_up_proj")?;
        let down = get(&x, &[n, e, w], "down_proj")?;
        let shards = (0..tp.world)
            .map(|rank| {
                let experts = expert_range(n, tp.world, rank);
                let mlps = experts
                    .clone()
                    .map(|i| {
                        let gu = gate_up.get(i)?;
                        let comm_dev = tp.comm.device(rank);
                        let mlp = GeluMlp::new(
                            gu.narrow(0, 0, w)?.contiguous()?,
                            gu.narrow(0, w, w)?.contiguous()?,
                            down.get(i)?.contiguous()?,
                        )?;
                        match comm_dev {
                            None => Ok(mlp),
                            Some(d) => Ok(GeluMlp {
                                gate_up: mlp.gate_up.to_device(d)?,
                                down: mlp.down.to_device(d)?,
                                hidden: mlp.hidden,
                            }),
                        }
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(ExpertShard { experts, mlps })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            proj,
            scale,
            per_expert_scale,
            top_k: cfg.top_k_experts,
            eps: cfg.rms_norm_eps,
            shards,
            comm: tp.comm.clone(),
        })
    }

    /// The router over the residual rows `x` `[N, H]`.
    fn route(&self, x: &Tensor) -> Result<GemmaRouting> {
        let n_experts = self.per_expert_scale.len();
        let xf = x.to_dtype(DType::F32)?;
        let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = xf.broadcast_mul(&(ms + self.eps)?.sqrt()?.recip()?)?;
        let z = normed
            .broadcast_mul(&self.scale.to_device(x.device())?)?
            .affine((self.scale.dim(0)? as f64).powf(-0.5), 0.0)?;
        let logits = z.matmul(&self.proj.to_device(x.device())?.t()?)?;
        let probs: Vec<Vec<f32>> = candle_nn::ops::softmax_last_dim(&logits)?.to_vec2()?;
        let mut experts = Vec::with_capacity(probs.len());
        let mut weights = Vec::with_capacity(probs.len());
        for p in &probs {
            let mut order: Vec<usize> = (0..n_experts).collect();
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            order.truncate(self.top_k);
            let sum: f32 = order.iter().map(|&i| p[i]).sum();
            weights.push(
                order
                    .iter()
                    .map(|&i| p[i] / sum * self.per_expert_scale[i])
                    .collect(),
            );
            experts.push(order);
        }
        Ok(GemmaRouting {
            probs,
            experts,
            weights,
        })
    }

    /// `Σ_k w_k · expert_k(h)` with the routing of `routing`, each expert one product over its
    /// rows of the whole call.
    fn forward(&self, h: &Tensor, routing: &GemmaRouting) -> Result<Tensor> {
        let routed = Routed::new(
            self.per_expert_scale.len(),
            &routing.experts,
            &routing.weights,
        );
        let comm = self.comm.as_ref();
        let partials = self
            .shards
            .iter()
            .enumerate()
            .map(|(rank, s)| {
                let x = on_rank(comm, rank, h)?;
                routed.add(
                    x.zeros_like()?,
                    &x,
                    s.experts.start,
                    &s.mlps,
                    GeluMlp::forward,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        reduce(comm, partials)
    }
}

/// One layer's weights.
#[derive(Debug, Clone)]
struct Layer {
    ty: LayerType,
    heads: (usize, usize, usize),
    input_ln: RmsNorm,
    post_attn_ln: RmsNorm,
    pre_ff_ln: RmsNorm,
    post_ff_ln: RmsNorm,
    post_ff_ln1: RmsNorm,
    pre_ff_ln2: RmsNorm,
    post_ff_ln2: RmsNorm,
    /// q, k (and v on sliding layers) fused on the output axis.
    qkv: Linear,
    o: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    /// The weightless norm of the values.
    v_norm: RmsNorm,
    mlp: GeluMlp,
    moe: GemmaMoe,
    /// `layer_scalar` of the encoder and of the denoiser.
    scalar: [f32; 2],
}

/// A loaded DiffusionGemma text model.
#[derive(Debug, Clone)]
pub struct DiffusionGemma {
    cfg: DiffusionGemmaConfig,
    io: EmbedHead,
    /// The embedding table as the self-conditioning's expected embedding reads it.
    soft_table: SoftTable,
    layers: Vec<Layer>,
    norm: RmsNorm,
    sc_pre_norm: RmsNorm,
    sc_mlp: GeluMlp,
    /// The denoiser's input norm (no weight).
    input_norm: RmsNorm,
    sliding_rope: RopeTable,
    full_rope: RopeTable,
    attention: AttentionKernel,
}

/// The embedding table `[V, H]` for products `[rows, V] · [V, H]`: on the CPU in float32
/// packed once at load for the kernels (the head keeps its own packed copy; no dense copy is
/// kept), elsewhere the tensor itself.
#[derive(Debug, Clone)]
enum SoftTable {
    Packed(Arc<wavefront_kernels::cpu::matmul::PackedWeight>),
    Dense(Tensor),
}

/// `softmax(pl) · table` with the CPU kernels: the rows' softmax, then one product with the
/// packed table over every row.
fn soft_embedding_cpu(
    pl: &Tensor,
    table: &wavefront_kernels::cpu::matmul::PackedWeight,
) -> Result<Tensor> {
    use wavefront_kernels::cpu::{elementwise, matmul};
    let (rows, v) = pl.dims2()?;
    let mut p = pl.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    for row in p.chunks_mut(v) {
        elementwise::softmax(row);
    }
    let h = table.out_features();
    let mut out = vec![0f32; rows * h];
    matmul::linear(&p, rows, table, None, &mut out)?;
    Ok(Tensor::from_vec(out, (rows, h), &Device::Cpu)?)
}

/// A weightless RMSNorm over `dim`.
fn plain_norm(dim: usize, eps: f64, dtype: DType, device: &Device) -> Result<RmsNorm> {
    Ok(RmsNorm::new(Tensor::ones(dim, dtype, device)?, eps))
}

fn scalar(vb: &VarBuilder) -> Result<f32> {
    let t = get(vb, &[1], "layer_scalar")?;
    Ok(t.to_dtype(DType::F32)?.to_vec1::<f32>()?[0])
}

impl DiffusionGemma {
    pub fn load(vb: VarBuilder, cfg: DiffusionGemmaConfig) -> Result<Self> {
        Self::load_parallel(vb, cfg, &TensorParallel::single())
    }

    /// Loads the text model, its experts split over `tp.world` expert-parallel ranks.
    pub fn load_parallel(
        vb: VarBuilder,
        cfg: DiffusionGemmaConfig,
        tp: &TensorParallel,
    ) -> Result<Self> {
        cfg.validate()?;
        let m = vb.pp("model");
        let dec = m.pp("decoder");
        let enc = m.pp("encoder").pp("language_model");
        let (e, v, eps) = (cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps);
        let (device, dtype) = (vb.device().clone(), vb.dtype());
        let table = get(&dec.pp("embed_tokens"), &[v, e], "weight")?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers());
        for l in 0..cfg.num_hidden_layers() {
            let lv = dec.pp("layers").pp(l);
            let ty = cfg.layer_types[l];
            let (h, hkv, d) = cfg.heads(l);
            let a = lv.pp("self_attn");
            let q = get(&a.pp("q_proj"), &[h * d, e], "weight")?;
            let k = get(&a.pp("k_proj"), &[hkv * d, e], "weight")?;
            let qkv = match ty {
                LayerType::SlidingAttention => {
                    let v = get(&a.pp("v_proj"), &[hkv * d, e], "weight")?;
                    Tensor::cat(&[&q, &k, &v], 0)?
                }
                LayerType::FullAttention => Tensor::cat(&[&q, &k], 0)?,
            };
            let norm = |name: &str| RmsNorm::load(lv.pp(name), e, eps);
            layers.push(Layer {
                ty,
                heads: (h, hkv, d),
                input_ln: norm("input_layernorm")?,
                post_attn_ln: norm("post_attention_layernorm")?,
                pre_ff_ln: norm("pre_feedforward_layernorm")?,
                post_ff_ln: norm("post_feedforward_layernorm")?,
                post_ff_ln1: norm("post_feedforward_layernorm_1")?,
                pre_ff_ln2: norm("pre_feedforward_layernorm_2")?,
                post_ff_ln2: norm("post_feedforward_layernorm_2")?,
                qkv: Linear::new(qkv, None)?,
                o: Linear::new(get(&a.pp("o_proj"), &[e, h * d], "weight")?, None)?,
                q_norm: RmsNorm::load(a.pp("q_norm"), d, eps)?,
                k_norm: RmsNorm::load(a.pp("k_norm"), d, eps)?,
                v_norm: plain_norm(d, eps, dtype, &device)?,
                mlp: GeluMlp::load(&lv.pp("mlp"), e, cfg.intermediate_size)?,
                moe: GemmaMoe::load(&lv, &cfg, tp)?,
                scalar: [scalar(&enc.pp("layers").pp(l))?, scalar(&lv)?],
            });
        }
        let sc = dec.pp("self_conditioning");
        let rope =
            |ty| RopeTable::from_inv_freq(&cfg.inv_freq(ty), cfg.max_position_embeddings, &device);
        Ok(Self {
            io: EmbedHead::new(table.clone(), None)?,
            soft_table: if crate::transformer::cpu::on_cpu_f32(&table) {
                let t = table.flatten_all()?.to_vec1::<f32>()?;
                SoftTable::Packed(Arc::new(
                    wavefront_kernels::cpu::matmul::PackedWeight::pack_kn(&t, v, e)?,
                ))
            } else {
                SoftTable::Dense(table)
            },
            layers,
            norm: RmsNorm::load(dec.pp("norm"), e, eps)?,
            sc_pre_norm: RmsNorm::load(sc.pp("pre_norm"), e, eps)?,
            sc_mlp: GeluMlp::load(&sc, e, cfg.intermediate_size)?,
            input_norm: plain_norm(e, eps, dtype, &device)?,
            sliding_rope: rope(LayerType::SlidingAttention)?,
            full_rope: rope(LayerType::FullAttention)?,
            attention: AttentionKernel::default(),
            cfg,
        })
    }

    pub fn config(&self) -> &DiffusionGemmaConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        self.io.device()
    }

    pub fn dtype(&self) -> DType {
        self.io.dtype()
    }

    /// `E[ids] · sqrt(H)`, the scale cast to the weights' dtype first, as upstream does.
    fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let scale = Tensor::new(&[(self.cfg.hidden_size as f32).sqrt()], self.device())?
            .to_dtype(self.dtype())?;
        Ok(self.io.embed(ids)?.broadcast_mul(&scale)?)
    }

    /// The self-conditioning input of a canvas from its previous step's tempered logits `pl`
    /// `[L, V]`: `softmax(pl) · E · sqrt(H)` `[L, H]` (in the model's dtype).
    pub fn soft_embedding(&self, pl: &Tensor) -> Result<Tensor> {
        let scale = (self.cfg.hidden_size as f64).sqrt();
        let soft = match &self.soft_table {
            SoftTable::Packed(packed) => soft_embedding_cpu(pl, packed)?,
            SoftTable::Dense(table) => {
                let p = candle_nn::ops::softmax_last_dim(&pl.to_dtype(DType::F32)?)?;
                p.to_dtype(self.dtype())?.matmul(table)?
            }
        };
        Ok(soft.affine(scale, 0.0)?)
    }

    /// The input rows of one sequence.
    fn input(&self, s: &DgSeq) -> Result<Tensor> {
        let x = self.embed(&s.ids)?;
        match s.mode {
            Mode::Encode => Ok(x),
            Mode::Denoise => {
                let x = match &s.soft {
                    Some(soft) => {
                        let sc = self.sc_mlp.forward(&self.sc_pre_norm.forward(soft)?)?;
                        (x + sc)?
                    }
                    None => x,
                };
                self.input_norm.forward(&x)
            }
        }
    }

    /// Every layer and the final norm over the packed rows of `seqs`: the hidden rows `[N, H]`
    /// fed to the head. Encoder sequences' caches hold their rows afterwards.
    pub fn forward(&self, seqs: &mut [DgSeq]) -> Result<Tensor> {
        Ok(self
            .run(seqs, false)?
            .0
            .pop()
            .expect("the final norm's rows"))
    }

    /// Upstream's `output_hidden_states` (the first layer's input, the outputs of the layers
    /// but the last, the final norm's output) and every layer's routing.
    pub fn forward_traced(&self, seqs: &mut [DgSeq]) -> Result<(Vec<Tensor>, Vec<GemmaRouting>)> {
        self.run(seqs, true)
    }

    fn run(&self, seqs: &mut [DgSeq], trace: bool) -> Result<(Vec<Tensor>, Vec<GemmaRouting>)> {
        if seqs.is_empty() {
            return Err(ModelError::Shape("a call of no sequences".into()));
        }
        let mut xs = Vec::with_capacity(seqs.len());
        let mut modes = Vec::new();
        for s in seqs.iter_mut() {
            if s.ids.is_empty() {
                return Err(ModelError::Shape("a sequence contributes no rows".into()));
            }
            if s.cache.len() < s.start {
                return Err(ModelError::Cache(format!(
                    "rows from index {} over a cache holding {}",
                    s.start,
                    s.cache.len()
                )));
            }
            s.cache.truncate(s.start)?;
            if s.mode == Mode::Encode && s.soft.is_some() {
                return Err(ModelError::Shape(
                    "the encoder takes no self-conditioning".into(),
                ));
            }
            xs.push(self.input(s)?);
            modes.extend(std::iter::repeat_n(s.mode, s.ids.len()));
        }
        let mut x = if xs.len() == 1 {
            xs.pop().expect("one sequence")
        } else {
            Tensor::cat(&xs, 0)?
        };
        let rows = x.dim(0)?;
        let window = self.cfg.sliding_window;
        let rules = |s: &DgSeq, ty: LayerType| match (s.mode, ty) {
            (Mode::Encode, LayerType::SlidingAttention) => MaskRule::SlidingCausal { window },
            (Mode::Encode, LayerType::FullAttention) => MaskRule::Causal,
            (Mode::Denoise, LayerType::SlidingAttention) => MaskRule::RecentCache {
                cached: s.start,
                window,
            },
            (Mode::Denoise, LayerType::FullAttention) => MaskRule::Bidirectional,
        };
        let masks: Vec<[MaskRule; 2]> = seqs
            .iter()
            .map(|s| {
                [
                    rules(s, LayerType::SlidingAttention),
                    rules(s, LayerType::FullAttention),
                ]
            })
            .collect();
        let mut inputs: Vec<SeqInput> = seqs
            .iter_mut()
            .map(|s| {
                let n = s.ids.len();
                let index: Vec<u32> = (s.start as u32..(s.start + n) as u32).collect();
                SeqInput {
                    positions: index.clone(),
                    index,
                    mask: MaskRule::Bidirectional,
                    keys: Keys::Buffer {
                        cache: &mut *s.cache,
                        len: s.start + n,
                    },
                }
            })
            .collect();
        let set_masks = |inputs: &mut [SeqInput], k: usize| {
            for (i, m) in inputs.iter_mut().zip(&masks) {
                i.mask = m[k];
            }
        };
        set_masks(&mut inputs, 0);
        let sliding =
            PackedLayout::new(&self.sliding_rope, rows, &inputs, self.attention)?.with_scale(1.0);
        set_masks(&mut inputs, 1);
        let full =
            PackedLayout::new(&self.full_rope, rows, &inputs, self.attention)?.with_scale(1.0);
        // Per-row layer scalars, unless every row runs in one mode.
        let uniform = modes.iter().all(|&m| m == modes[0]);
        let mut states = Vec::new();
        let mut routes = Vec::new();
        for (l, layer) in self.layers.iter().enumerate() {
            if trace {
                states.push(x.clone());
            }
            let (layout, k) = match layer.ty {
                LayerType::SlidingAttention => (&sliding, 0),
                LayerType::FullAttention => (&full, 1),
            };
            set_masks(&mut inputs, k);
            let a = self.attention(layer, &layer.input_ln.forward(&x)?, layout, &mut inputs, l)?;
            x = (x + layer.post_attn_ln.forward(&a)?)?;
            let dense = layer
                .post_ff_ln1
                .forward(&layer.mlp.forward(&layer.pre_ff_ln.forward(&x)?)?)?;
            let routing = layer.moe.route(&x)?;
            let moe = layer
                .moe
                .forward(&layer.pre_ff_ln2.forward(&x)?, &routing)?;
            let moe = layer.post_ff_ln2.forward(&moe)?;
            x = (x + layer.post_ff_ln.forward(&(dense + moe)?)?)?;
            x = if uniform {
                let s = layer.scalar[usize::from(modes[0] == Mode::Denoise)];
                x.affine(f64::from(s), 0.0)?
            } else {
                let s: Vec<f32> = modes
                    .iter()
                    .map(|&m| layer.scalar[usize::from(m == Mode::Denoise)])
                    .collect();
                let s = Tensor::from_vec(s, (rows, 1), x.device())?.to_dtype(x.dtype())?;
                x.broadcast_mul(&s)?
            };
            if trace {
                routes.push(routing);
            }
        }
        crate::transformer::commit_buffers(&mut inputs);
        states.push(self.norm.forward(&x)?);
        Ok((states, routes))
    }

    /// One layer's attention over the normed rows `h`.
    fn attention(
        &self,
        layer: &Layer,
        h: &Tensor,
        layout: &PackedLayout,
        seqs: &mut [SeqInput],
        l: usize,
    ) -> Result<Tensor> {
        let n = h.dim(0)?;
        let (nh, nkv, d) = layer.heads;
        let qkv = layer.qkv.forward(h)?;
        let q = qkv.narrow(1, 0, nh * d)?.reshape((n, nh, d))?;
        let k_raw = qkv.narrow(1, nh * d, nkv * d)?.reshape((n, nkv, d))?;
        let v_raw = match layer.ty {
            LayerType::SlidingAttention => qkv
                .narrow(1, (nh + nkv) * d, nkv * d)?
                .reshape((n, nkv, d))?,
            LayerType::FullAttention => k_raw.clone(),
        };
        let q = layer.q_norm.forward(&q.contiguous()?)?;
        let k = layer.k_norm.forward(&k_raw.contiguous()?)?;
        let v = layer.v_norm.forward(&v_raw.contiguous()?)?;
        let rope = |t: &Tensor| -> Result<Tensor> {
            apply_rope(&t.transpose(0, 1)?.contiguous()?, &layout.cos, &layout.sin)
        };
        let (q, k) = (rope(&q)?, rope(&k)?);
        let v = v.transpose(0, 1)?.contiguous()?;
        let y = attend_packed(&q, &k, &v, layout, seqs, l, layer.qkv.bf16_products())?;
        layer.o.forward(&y)
    }

    /// Soft-capped float32 logits `[N, V]` of hidden rows.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let y = self.io.logits(hidden)?;
        Ok(match self.cfg.final_logit_softcapping {
            Some(c) => crate::transformer::cpu::soft_cap(&y, c)?,
            None => y,
        })
    }
}

impl crate::transformer::SelectAttention for DiffusionGemma {
    fn select_attention(&mut self, kernel: AttentionKernel) -> Result<()> {
        self.attention = kernel;
        Ok(())
    }
}

impl crate::transformer::StoreWeights for DiffusionGemma {
    fn store_weights(&mut self, dtype: crate::transformer::WeightDtype) -> Result<()> {
        for l in &mut self.layers {
            l.qkv.store_as(dtype)?;
            l.o.store_as(dtype)?;
            l.mlp.store_as(dtype)?;
            for s in &mut l.moe.shards {
                for m in &mut s.mlps {
                    m.store_as(dtype)?;
                }
            }
        }
        self.sc_mlp.store_as(dtype)
    }
}
