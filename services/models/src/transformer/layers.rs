//! Building blocks of the shared transformer: checked tensor loading, RMSNorm, the gated SiLU MLP
//! and a rotary-embedding table in the GPT-NeoX "half" layout (Su et al., 2021, RoFormer).

use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;

use super::linear::{at_least_f32, Linear};

use crate::error::{ModelError, Result};

/// Loads a tensor, reporting a missing one by its full checkpoint name, and one whose shape is
/// not the config's with both shapes. The tensor is read at the size the checkpoint stores
/// (checked against the file's length when it was opened), never at the config's size.
pub fn get(vb: &VarBuilder, shape: &[usize], name: &str) -> Result<Tensor> {
    let full = || {
        let prefix = vb.prefix();
        if prefix.is_empty() {
            name.to_owned()
        } else {
            format!("{prefix}.{name}")
        }
    };
    if !vb.contains_tensor(name) {
        return Err(ModelError::MissingTensor { name: full() });
    }
    vb.get(shape, name).map_err(|e| match unexpected_shape(&e) {
        Some(got) => ModelError::Shape(format!(
            "checkpoint tensor `{}` is {got:?} in the safetensors weights but config.json \
             implies {shape:?}: the weights and config.json disagree (use the config.json the \
             weights were exported with)",
            full()
        )),
        None => ModelError::Candle(e.context(format!("checkpoint tensor `{}`", full()))),
    })
}

/// The shape the checkpoint has, when `e` is candle's shape-mismatch error.
fn unexpected_shape(e: &candle_core::Error) -> Option<Vec<usize>> {
    match e {
        candle_core::Error::UnexpectedShape { got, .. } => Some(got.dims().to_vec()),
        candle_core::Error::WithBacktrace { inner, .. } => unexpected_shape(inner),
        _ => None,
    }
}

/// `nn.Linear` with weight `[out, in]` and an optional bias `[out]`.
pub fn linear(vb: &VarBuilder, in_dim: usize, out_dim: usize, bias: bool) -> Result<Linear> {
    let w = get(vb, &[out_dim, in_dim], "weight")?;
    let b = if bias {
        Some(get(vb, &[out_dim], "bias")?)
    } else {
        None
    };
    Linear::new(w, b)
}

/// RMSNorm over the last dim: `weight · cast(x · rsqrt(mean(x²) + eps))`, the statistic in float32
/// and the weight applied after casting back (the LLaDA / Llama / Qwen3 reference order).
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// Loads `weight` `[dim]` under `vb`.
    pub fn load(vb: VarBuilder, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: get(&vb, &[dim], "weight")?,
            eps,
        })
    }

    /// A norm with the given `weight` `[dim]` (e.g. a view of a layer-stacked tensor).
    pub(crate) fn new(weight: Tensor, eps: f64) -> Self {
        Self { weight, eps }
    }

    /// The weight `[dim]`.
    pub(crate) fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The epsilon added to the mean square.
    pub(crate) fn eps(&self) -> f64 {
        self.eps
    }

    /// The norm with its weight on `device` (itself when it is there).
    pub(crate) fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(Self::new(self.weight.to_device(device)?, self.eps))
    }

    /// The residual add `x + a` and the norm of the sum: `(sum, normed)`. Float32 on the CPU in
    /// one pass threaded over rows (the bits of the add and then [`Self::forward`]), the add
    /// then [`Self::forward`] otherwise.
    pub fn add_forward(&self, x: &Tensor, a: &Tensor) -> Result<(Tensor, Tensor)> {
        let fused = super::cpu::on_cpu_f32(x)
            && super::cpu::on_cpu_f32(a)
            && super::cpu::on_cpu_f32(&self.weight)
            && x.dims() == a.dims()
            && x.rank() > 0
            && x.dim(x.rank() - 1)? == self.weight.elem_count();
        if fused {
            return super::cpu::add_rms_norm(x, a, &self.weight, self.eps as f32);
        }
        let sum = super::cpu::add(x, a)?;
        let normed = self.forward(&sum)?;
        Ok((sum, normed))
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if super::cpu::on_cpu_f32(x) && super::cpu::on_cpu_f32(&self.weight) {
            return super::cpu::rms_norm(x, &self.weight, self.eps as f32);
        }
        let x = x.contiguous()?;
        if x.dtype() == DType::F32 {
            // Same arithmetic in one fused kernel.
            return Ok(candle_nn::ops::rms_norm(&x, &self.weight, self.eps as f32)?);
        }
        let dtype = x.dtype();
        let xf = x.to_dtype(at_least_f32(dtype))?;
        let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = xf.broadcast_mul(&(ms + self.eps)?.sqrt()?.recip()?)?;
        Ok(normed.to_dtype(dtype)?.broadcast_mul(&self.weight)?)
    }
}

/// Gated SiLU MLP: `down(silu(gate(x)) * up(x))`, with gate and up fused into one product
/// (`[gate | up]`, `2 · hidden` outputs).
#[derive(Debug, Clone)]
pub(crate) struct GatedMlp {
    pub(crate) gate_up: Linear,
    pub(crate) down: Linear,
    pub(crate) hidden: usize,
}

/// `l` with its weight and bias on `device` (no copy of what is already there).
pub(crate) fn linear_to_device(l: &Linear, device: &Device) -> Result<Linear> {
    l.to_device(device)
}

impl GatedMlp {
    /// The MLP of `gate` and `up` (weights `[hidden, in]`, optional biases) and `down`.
    pub(crate) fn new(
        gate: (Tensor, Option<Tensor>),
        up: (Tensor, Option<Tensor>),
        down: Linear,
    ) -> Result<Self> {
        let hidden = gate.0.dim(0)?;
        let w = Tensor::cat(&[&gate.0, &up.0], 0)?;
        let b = match (gate.1, up.1) {
            (Some(g), Some(u)) => Some(Tensor::cat(&[&g, &u], 0)?),
            _ => None,
        };
        Ok(Self {
            gate_up: Linear::new(w, b)?,
            down,
            hidden,
        })
    }

    /// The MLP of a fused `[gate | up]` product (`hidden` columns each) and `down`.
    pub(crate) fn fused(gate_up: Linear, down: Linear, hidden: usize) -> Self {
        Self {
            gate_up,
            down,
            hidden,
        }
    }

    /// Stores the CPU weights as `dtype` ([`crate::transformer::StoreWeights`]).
    pub(crate) fn store_weights(&mut self, dtype: super::linear::WeightDtype) -> Result<()> {
        self.gate_up.store_as(dtype)?;
        self.down.store_as(dtype)
    }

    /// The MLP with its weights on `device`.
    pub(crate) fn to_device(&self, device: &Device) -> Result<Self> {
        Ok(Self {
            gate_up: linear_to_device(&self.gate_up, device)?,
            down: linear_to_device(&self.down, device)?,
            hidden: self.hidden,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        gated_mlp(&self.gate_up, &self.down, self.hidden, x)
    }
}

/// `down(silu(g) * u)` with `[g | u] = gate_up(x)` (`hidden` columns each), for `x`
/// `[rows, in]`: every gated MLP (the shared block's, Huginn's, each layer of ARMT's grouped
/// step). With packed CPU weights the rows run in chunks ([`in_row_chunks`]).
pub(crate) fn gated_mlp(
    gate_up: &Linear,
    down: &Linear,
    hidden: usize,
    x: &Tensor,
) -> Result<Tensor> {
    let run = |x: &Tensor| -> Result<Tensor> {
        let gu = gate_up.forward(x)?;
        down.forward(&super::cpu::silu_mul(&gu, hidden)?)
    };
    if gate_up.is_packed() && down.is_packed() {
        in_row_chunks(x, run)
    } else {
        run(x)
    }
}

/// Rows an MLP runs at a time with packed CPU weights ([`in_row_chunks`]).
pub(crate) const MLP_CHUNK_ROWS: usize = 512;

/// `f` over the rows of `x` `[rows, in]` (float32 on the CPU) in equal chunks of at most
/// [`MLP_CHUNK_ROWS`] rows, concatenated. For an MLP, whose `[rows, 2·I]` intermediate is
/// several times its input: a chunk's intermediate stays in cache between the products
/// instead of streaming through memory, which a packed call of many requests (thousands of
/// rows) otherwise does for every row. `f` must treat rows independently; with packed
/// weights every output row is computed the same way whatever rows share its product, so the
/// result is the same bit for bit.
pub(crate) fn in_row_chunks(x: &Tensor, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let rows = x.dim(0)?;
    if x.rank() != 2 || !super::cpu::on_cpu_f32(x) || rows <= MLP_CHUNK_ROWS {
        return f(x);
    }
    let chunk = rows.div_ceil(rows.div_ceil(MLP_CHUNK_ROWS));
    let parts = (0..rows)
        .step_by(chunk)
        .map(|start| f(&x.narrow(0, start, chunk.min(rows - start))?))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

/// `cos` and `sin` of `pos · inv_freq[i]` for every position below `max_positions`, float32,
/// `[max_positions, head_dim / 2]`; rows are picked per packed row by its position id.
#[derive(Debug, Clone)]
pub struct RopeTable {
    cos: Tensor,
    sin: Tensor,
    head_dim: usize,
    max_positions: usize,
}

impl RopeTable {
    /// The standard table: `inv_freq[i] = 1 / theta^(2i / head_dim)`, all in float32 as the
    /// reference implementations compute it.
    pub fn new(head_dim: usize, theta: f64, max_positions: usize, device: &Device) -> Result<Self> {
        if !head_dim.is_multiple_of(2) {
            return Err(ModelError::Config {
                key: "head_dim".into(),
                reason: format!("rotary embeddings need an even head dim, got {head_dim}"),
            });
        }
        let theta = theta as f32;
        let inv_freq: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        Self::from_inv_freq(&inv_freq, max_positions, device)
    }

    /// A table from explicit inverse frequencies (for scaled-RoPE variants).
    /// A table of more than 2^30 entries is refused before anything is allocated.
    pub fn from_inv_freq(inv_freq: &[f32], max_positions: usize, device: &Device) -> Result<Self> {
        let half = inv_freq.len();
        let entries = rope_entries(max_positions, half)?;
        let mut cos = Vec::with_capacity(entries);
        let mut sin = Vec::with_capacity(entries);
        for p in 0..max_positions {
            for &f in inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Ok(Self {
            cos: Tensor::from_vec(cos, (max_positions, half), device)?,
            sin: Tensor::from_vec(sin, (max_positions, half), device)?,
            head_dim: 2 * half,
            max_positions,
        })
    }

    /// Positions the table covers.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// Device of the table.
    pub fn device(&self) -> &Device {
        self.cos.device()
    }

    /// Head width the table rotates.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// `(cos, sin)` rows `[positions.len(), head_dim / 2]` of the given position ids.
    pub(crate) fn rows(&self, positions: &[u32]) -> Result<(Tensor, Tensor)> {
        if let Some(&p) = positions
            .iter()
            .find(|&&p| p as usize >= self.max_positions)
        {
            return Err(ModelError::Shape(format!(
                "position id {p} beyond the RoPE table ({} positions)",
                self.max_positions
            )));
        }
        let idx = Tensor::new(positions, self.cos.device())?;
        Ok((
            self.cos.index_select(&idx, 0)?,
            self.sin.index_select(&idx, 0)?,
        ))
    }
}

/// The entries of a RoPE table of `positions` rows of `half` frequencies, refused (naming the
/// config bound) above `config::MAX_ROPE_ENTRIES`.
pub(crate) fn rope_entries(positions: usize, half: usize) -> Result<usize> {
    let max = crate::config::MAX_ROPE_ENTRIES;
    positions
        .checked_mul(half)
        .filter(|&n| n <= max)
        .ok_or_else(|| ModelError::Config {
            key: "max_position_embeddings".into(),
            reason: format!(
                "a RoPE table of {positions} positions by {half} frequencies exceeds {max} \
                 entries; lower the context length in config.json"
            ),
        })
}

/// Half-layout RoPE on `[H, N, D]` with per-row `cos`/`sin` `[N, D/2]`, computed in float32.
pub(crate) fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x
        .to_dtype(at_least_f32(dtype))?
        .contiguous()?
        .unsqueeze(0)?;
    let (cos, sin) = (&cos.to_dtype(x.dtype())?, &sin.to_dtype(x.dtype())?);
    let y = candle_nn::rotary_emb::rope(&x, cos, sin)?.squeeze(0)?;
    Ok(y.to_dtype(dtype)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A packed CPU MLP over more rows than a chunk gives, bit for bit, what the whole product
    /// gives: chunks of rows change nothing but where the intermediate lives.
    #[test]
    fn an_mlp_in_row_chunks_matches_the_whole_product_bit_for_bit() -> Result<()> {
        let cpu = Device::Cpu;
        let (d, hidden) = (64, 96);
        let w = |rows: usize, cols: usize| -> Result<Tensor> {
            Ok((Tensor::randn(0f32, 1.0, (rows, cols), &cpu)? / (cols as f64).sqrt())?)
        };
        let mlp = GatedMlp::new(
            (w(hidden, d)?, None),
            (w(hidden, d)?, None),
            Linear::new(w(d, hidden)?, None)?,
        )?;
        assert!(mlp.gate_up.is_packed() && mlp.down.is_packed());
        for rows in [
            7,
            MLP_CHUNK_ROWS,
            MLP_CHUNK_ROWS + 1,
            3 * MLP_CHUNK_ROWS + 17,
        ] {
            let x = Tensor::randn(0f32, 1.0, (rows, d), &cpu)?;
            let whole = mlp.down.forward(&super::super::cpu::silu_mul(
                &mlp.gate_up.forward(&x)?,
                hidden,
            )?)?;
            let chunked = mlp.forward(&x)?;
            let (a, b): (Vec<f32>, Vec<f32>) = (
                whole.flatten_all()?.to_vec1()?,
                chunked.flatten_all()?.to_vec1()?,
            );
            assert_eq!(a.len(), rows * d);
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{rows} rows differ"
            );
        }
        Ok(())
    }
}
