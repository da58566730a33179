//! Attention of the shared transformer over packed rows: per-sequence keys (the call's rows, or
//! a whole buffer assembled from a [`KvCache`] and the call's rows), a [`MaskRule`] decided on
//! buffer indices (the rules are in `mask.rs`), grouped-query heads, softmax in float32.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};

use super::cpu;
pub use super::kv_cache::KvCache;
use super::layers::RopeTable;
use super::mask::build_mask;
pub use super::mask::MaskRule;
use super::ragged::{AttentionKernel, RaggedPlan};
use crate::error::{ModelError, Result};

/// The keys of one sequence in a packed call.
#[derive(Debug)]
pub enum Keys<'a> {
    /// The call's own rows.
    Rows,
    /// Buffer indices `0..len`: a row of the call supplies its fresh K/V, every other index reads
    /// `cache` (which must hold it). The assembled K/V replace the cache's, layer by layer, and
    /// the cache then holds `len` indices.
    Buffer { cache: &'a mut KvCache, len: usize },
    /// A buffer whose first `prefix.len()` indices live in a cache shared with other sequences
    /// (read, never written), followed by `suffix`'s indices and then the call's rows, which
    /// must be the next indices in order (`prefix.len() + suffix.len() ..`). Only `suffix`
    /// grows: afterwards it holds its old indices plus the rows. Several sequences of one call
    /// may share a prefix (ReFusion's parallel slots each extend their own copy of a request's
    /// committed cache without copying it).
    Shared {
        prefix: &'a KvCache,
        suffix: &'a mut KvCache,
    },
}

/// The rows one sequence contributes to a packed call, contiguous in row order.
#[derive(Debug)]
pub struct SeqInput<'a> {
    /// Buffer index of each row (distinct).
    pub index: Vec<u32>,
    /// RoPE position id of each row.
    pub positions: Vec<u32>,
    pub mask: MaskRule,
    pub keys: Keys<'a>,
}

impl<'a> SeqInput<'a> {
    /// Rows `0..n` of a buffer at positions `0..n`, bidirectional, attending to each other.
    pub fn dense(n: usize) -> Self {
        let index: Vec<u32> = (0..n as u32).collect();
        Self {
            positions: index.clone(),
            index,
            mask: MaskRule::Bidirectional,
            keys: Keys::Rows,
        }
    }

    pub fn with_mask(mut self, mask: MaskRule) -> Self {
        self.mask = mask;
        self
    }

    pub fn with_keys(mut self, keys: Keys<'a>) -> Self {
        self.keys = keys;
        self
    }

    /// Rows this sequence puts in the call.
    pub fn rows(&self) -> usize {
        self.index.len()
    }
}

/// How one sequence's keys are assembled.
#[derive(Debug)]
enum KeySource {
    Rows,
    /// `index` picks each buffer key from `cache ++ rows` (`None`: the rows are exactly the
    /// buffer, in order, and nothing is read from the cache).
    Buffer {
        index: Option<Tensor>,
        cached: usize,
    },
    /// `prefix ++ suffix ++ rows`, in order.
    Shared {
        prefix: usize,
        suffix: usize,
    },
}

#[derive(Debug)]
struct SeqLayout {
    offset: usize,
    len: usize,
    keys: KeySource,
    /// Additive mask `[rows, keys]` (float32), `None` when every key is visible.
    mask: Option<Tensor>,
}

/// Per-call bookkeeping computed once and shared by every layer: row ranges, RoPE rows, key
/// assembly and masks of each sequence.
#[derive(Debug)]
pub struct PackedLayout {
    rows: usize,
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
    seqs: Vec<SeqLayout>,
    /// With [`AttentionKernel::Ragged`]: every sequence's attention as one operation.
    ragged: Option<Arc<RaggedPlan>>,
    /// Copies on other devices (tensor-parallel ranks on their own GPUs), made once per call.
    replicas: Mutex<Vec<Arc<PackedLayout>>>,
    /// The scores' scale; `None`: `1 / sqrt(head_dim)`.
    scale: Option<f64>,
}

impl PackedLayout {
    /// The layout of a call whose packed rows `0..rows` are `seqs`' rows in order, attending
    /// with `kernel`.
    pub fn new(
        rope: &RopeTable,
        rows: usize,
        seqs: &[SeqInput],
        kernel: AttentionKernel,
    ) -> Result<Self> {
        let total: usize = seqs.iter().map(SeqInput::rows).sum();
        if total != rows {
            return Err(ModelError::Shape(format!(
                "sequences cover {total} rows but the packed input has {rows}"
            )));
        }
        let device = rope.device().clone();
        let mut positions = Vec::with_capacity(rows);
        let mut layouts = Vec::with_capacity(seqs.len());
        let mut ragged = Vec::new();
        let mut offset = 0;
        for s in seqs {
            let n = s.rows();
            if n == 0 {
                return Err(ModelError::Shape("a sequence contributes no rows".into()));
            }
            if s.positions.len() != n {
                return Err(ModelError::Shape(format!(
                    "a sequence has {n} rows but {} position ids",
                    s.positions.len()
                )));
            }
            positions.extend_from_slice(&s.positions);
            let (keys, key_index) = match &s.keys {
                Keys::Rows => (KeySource::Rows, s.index.clone()),
                Keys::Buffer { cache, len } => {
                    let (src, keys) = buffer_keys(&s.index, cache.len(), *len, &device)?;
                    (src, keys)
                }
                Keys::Shared { prefix, suffix } => {
                    let (p, c) = (prefix.len(), suffix.len());
                    if !s
                        .index
                        .iter()
                        .copied()
                        .eq((p + c) as u32..(p + c + n) as u32)
                    {
                        return Err(ModelError::Shape(format!(
                            "rows of a shared-prefix sequence must be buffer indices {}..{} in order",
                            p + c,
                            p + c + n
                        )));
                    }
                    (
                        KeySource::Shared {
                            prefix: p,
                            suffix: c,
                        },
                        (0..(p + c + n) as u32).collect(),
                    )
                }
            };
            let mask = match kernel {
                AttentionKernel::Sdpa => build_mask(s.mask, &s.index, &key_index, &device)?,
                AttentionKernel::Ragged => {
                    ragged.push((s.index.clone(), key_index, s.mask));
                    None
                }
            };
            layouts.push(SeqLayout {
                offset,
                len: n,
                keys,
                mask,
            });
            offset += n;
        }
        let (cos, sin) = rope.rows(&positions)?;
        let ragged = match kernel {
            AttentionKernel::Sdpa => None,
            AttentionKernel::Ragged => Some(Arc::new(RaggedPlan::new(ragged, &device)?)),
        };
        Ok(Self {
            rows,
            cos,
            sin,
            seqs: layouts,
            ragged,
            replicas: Mutex::default(),
            scale: None,
        })
    }

    /// Scores scaled by `scale` instead of `1 / sqrt(head_dim)` (DiffusionGemma: 1, its q/k
    /// norms set the scale).
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }

    /// This layout on `device`: `None` when it is already there (or no device is asked for),
    /// else a copy of its RoPE rows, masks and key gathers, made on the first request for that
    /// device and shared by every layer after.
    pub(crate) fn replica(&self, device: Option<&Device>) -> Result<Option<Arc<PackedLayout>>> {
        let Some(device) = device else {
            return Ok(None);
        };
        if self.cos.device().same_device(device) {
            return Ok(None);
        }
        let mut replicas = self
            .replicas
            .lock()
            .map_err(|_| ModelError::Shape("a layout's replicas are poisoned".into()))?;
        if let Some(r) = replicas.iter().find(|r| r.cos.device().same_device(device)) {
            return Ok(Some(r.clone()));
        }
        let move_opt = |t: &Option<Tensor>| t.as_ref().map(|t| t.to_device(device)).transpose();
        let seqs = self
            .seqs
            .iter()
            .map(|s| {
                let keys = match &s.keys {
                    KeySource::Rows => KeySource::Rows,
                    KeySource::Buffer { index, cached } => KeySource::Buffer {
                        index: move_opt(index)?,
                        cached: *cached,
                    },
                    KeySource::Shared { prefix, suffix } => KeySource::Shared {
                        prefix: *prefix,
                        suffix: *suffix,
                    },
                };
                Ok(SeqLayout {
                    offset: s.offset,
                    len: s.len,
                    keys,
                    mask: move_opt(&s.mask)?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let r = Arc::new(Self {
            rows: self.rows,
            cos: self.cos.to_device(device)?,
            sin: self.sin.to_device(device)?,
            seqs,
            ragged: self
                .ragged
                .as_ref()
                .map(|p| p.to_device(device).map(Arc::new))
                .transpose()?,
            replicas: Mutex::default(),
            scale: self.scale,
        });
        replicas.push(r.clone());
        Ok(Some(r))
    }

    /// Rows of the call.
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// Key assembly for a buffer of `len` indices with `cached` of them in the cache: for each key,
/// its index in `cache ++ rows`. Returns the source and the keys' buffer indices (`0..len`).
fn buffer_keys(
    index: &[u32],
    cached: usize,
    len: usize,
    device: &candle_core::Device,
) -> Result<(KeySource, Vec<u32>)> {
    let mut row_of: HashMap<u32, usize> = HashMap::with_capacity(index.len());
    for (r, &b) in index.iter().enumerate() {
        if b as usize >= len {
            return Err(ModelError::Shape(format!(
                "row at buffer index {b} outside the buffer of {len}"
            )));
        }
        if row_of.insert(b, r).is_some() {
            return Err(ModelError::Shape(format!(
                "buffer index {b} appears twice in one call"
            )));
        }
    }
    let keys: Vec<u32> = (0..len as u32).collect();
    // The rows are exactly the indices after the cached ones: `cache ++ rows` is the buffer.
    let in_order = cached <= len && index.iter().copied().eq(cached as u32..len as u32);
    if in_order {
        return Ok((
            KeySource::Buffer {
                index: None,
                cached,
            },
            keys,
        ));
    }
    let mut gather = Vec::with_capacity(len);
    for j in 0..len as u32 {
        match row_of.get(&j) {
            Some(&r) => gather.push((cached + r) as u32),
            None if (j as usize) < cached => gather.push(j),
            None => {
                return Err(ModelError::Cache(format!(
                    "buffer index {j} is neither cached ({cached} held) nor a row of the call"
                )))
            }
        }
    }
    let index = Tensor::from_vec(gather, len, device)?;
    Ok((
        KeySource::Buffer {
            index: Some(index),
            cached,
        },
        keys,
    ))
}

/// Attention of every sequence over its own keys. `q` `[H, N, D]`, `k`/`v` `[H_kv, N, D]` (keys
/// after RoPE); returns `[N, H · D]`, the rows the output projection reads. Writes the assembled keys of buffer sequences to their
/// caches at `layer`. With a ragged plan all sequences attend in one operation, else one
/// [`sdpa`] per sequence. `bf16`: the CPU kernel multiplies in bfloat16 (the bf16 compute
/// mode of the layer's weights).
pub(crate) fn attend_packed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    layout: &PackedLayout,
    seqs: &mut [SeqInput],
    layer: usize,
    bf16: bool,
) -> Result<Tensor> {
    let scale = layout
        .scale
        .unwrap_or_else(|| 1.0 / (q.dim(2).unwrap_or(1) as f64).sqrt());
    let single = seqs.len() == 1;
    let rows = |t: &Tensor, s: &SeqLayout| -> Result<Tensor> {
        Ok(if single {
            t.clone()
        } else {
            t.narrow(1, s.offset, s.len)?.contiguous()?
        })
    };
    let mut outs = Vec::with_capacity(seqs.len());
    let mut all_keys = Vec::with_capacity(seqs.len());
    // Float32 on the CPU: every sequence in one call of the CPU kernel, keys read in place.
    let on_cpu = layout.ragged.is_none() && cpu::on_cpu_f32(q);
    let mut cpu_seqs = Vec::with_capacity(if on_cpu { seqs.len() } else { 0 });
    for (s, seq) in layout.seqs.iter().zip(seqs.iter_mut()) {
        let parts = assemble_keys(s, seq, rows(k, s)?, rows(v, s)?, layer)?;
        if on_cpu {
            cpu_seqs.push(cpu::CpuSeq {
                rows: s.offset..s.offset + s.len,
                row_index: seq.index.clone(),
                runs: parts,
                key_index: matches!(s.keys, KeySource::Rows).then(|| seq.index.clone()),
                mask: seq.mask.into(),
            });
        } else if layout.ragged.is_some() {
            // Concatenated once, with every other sequence's, by the ragged operation.
            all_keys.extend(as_dtype(parts, q.dtype())?);
        } else {
            let parts = as_dtype(parts, q.dtype())?;
            // One product over the sequence's keys (its pages merged), as before paging.
            let (k, v) = super::kv_cache::merge_runs(&parts)?;
            outs.push(sdpa(&rows(q, s)?, &[(&k, &v)], s.mask.as_ref(), scale)?);
        }
    }
    if on_cpu {
        return cpu::attend(q, k.dim(0)?, scale as f32, &cpu_seqs, true, bf16);
    }
    let y = if let Some(plan) = &layout.ragged {
        plan.attend(q, &all_keys, scale)?
    } else if single {
        outs.pop().expect("one sequence")
    } else {
        Tensor::cat(&outs, 1)?
    };
    let (h, n, d) = y.dims3()?;
    Ok(y.transpose(0, 1)?.contiguous()?.reshape((n, h * d))?)
}

/// Runs of keys and values in `dtype` (pages that store bf16 K/V, read by a float32 path other
/// than the CPU kernel).
pub(crate) fn as_dtype(runs: Vec<(Tensor, Tensor)>, dtype: DType) -> Result<Vec<(Tensor, Tensor)>> {
    runs.into_iter()
        .map(|(k, v)| {
            Ok(if k.dtype() == dtype && v.dtype() == dtype {
                (k, v)
            } else {
                (k.to_dtype(dtype)?, v.to_dtype(dtype)?)
            })
        })
        .collect()
}

/// One sequence's keys and values `[H_kv, T, D]` at `layer` from its rows' fresh `ks`/`vs`,
/// in runs that concatenate along the key axis (a cache's pages, a shared prefix's pages, read
/// in place); a buffer sequence's cache (or a shared sequence's suffix) is updated.
fn assemble_keys(
    s: &SeqLayout,
    seq: &mut SeqInput,
    ks: Tensor,
    vs: Tensor,
    layer: usize,
) -> Result<Vec<(Tensor, Tensor)>> {
    match (&s.keys, &mut seq.keys) {
        (KeySource::Rows, _) => Ok(vec![(ks, vs)]),
        (KeySource::Buffer { index, cached }, Keys::Buffer { cache, len }) => {
            match index {
                // The rows are the indices after the cached ones: one write.
                None => cache.write_rows(layer, *cached, &ks, &vs)?,
                // Rows at scattered indices: runs of consecutive indices in host memory, one
                // launch per page arena on a device.
                Some(_) => cache.write_indices(layer, &seq.index, &ks, &vs)?,
            }
            cache.fit_layer(layer, *len)?;
            cache.layer_runs(layer)
        }
        (
            KeySource::Shared {
                prefix: p,
                suffix: c,
            },
            Keys::Shared { prefix, suffix },
        ) => {
            suffix.write_rows(layer, *c, &ks, &vs)?;
            suffix.fit_layer(layer, c + ks.dim(1)?)?;
            let own = suffix.layer_runs(layer)?;
            if *p == 0 {
                return Ok(own);
            }
            let mut runs = prefix.layer_runs(layer)?;
            runs.extend(own);
            Ok(runs)
        }
        _ => Err(ModelError::Shape(
            "the sequences changed between layout and call".into(),
        )),
    }
}

/// Records the new buffer length of every buffer sequence after all layers ran.
pub(crate) fn commit_buffers(seqs: &mut [SeqInput]) {
    for s in seqs {
        let rows = s.index.len();
        match &mut s.keys {
            Keys::Buffer { cache, len } => cache.commit(*len),
            Keys::Shared { suffix, .. } => {
                let n = suffix.len() + rows;
                suffix.commit(n);
            }
            Keys::Rows => {}
        }
    }
}

/// `softmax(q kᵀ · scale + mask) v` with `q` `[H, L, D]` and the keys and values `[H_kv, T_i, D]`
/// given in parts that concatenate along the key axis (`T = Σ T_i`, e.g. a shared prefix cache
/// and a sequence's own keys, read where they are); scores and softmax in float32. Key/value
/// head `j` serves query heads `j · H / H_kv ..`: the queries of a group are stacked so each
/// part is multiplied once per key/value head, without repeating keys or values.
fn sdpa(
    q: &Tensor,
    parts: &[(&Tensor, &Tensor)],
    mask: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    let dtype = q.dtype();
    let (h, l, d) = q.dims3()?;
    let hkv = parts.first().map_or(h, |(k, _)| k.dim(0).unwrap_or(h));
    let rep = h / hkv;
    let qg = q.contiguous()?.reshape((hkv, rep * l, d))?;
    let contiguous = |x: &Tensor| -> Result<Tensor> { Ok(x.contiguous()?) };
    let mut scores = Vec::with_capacity(parts.len());
    let mut lens = Vec::with_capacity(parts.len());
    for (k, _) in parts {
        let k = contiguous(k)?;
        lens.push(k.dim(1)?);
        scores.push(qg.matmul(&k.t()?)?);
    }
    let scores = if scores.len() == 1 {
        scores.pop().expect("one part")
    } else {
        Tensor::cat(&scores, 2)?
    };
    let t: usize = lens.iter().sum();
    let scores = (scores.to_dtype(super::linear::at_least_f32(dtype))? * scale)?;
    let scores = match mask {
        Some(m) => scores
            .reshape((hkv, rep, l, t))?
            .broadcast_add(m)?
            .reshape((hkv, rep * l, t))?,
        None => scores,
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(dtype)?;
    let mut out: Option<Tensor> = None;
    let mut offset = 0;
    for ((_, v), &n) in parts.iter().zip(&lens) {
        let p = if parts.len() == 1 {
            probs.clone()
        } else {
            probs.narrow(2, offset, n)?.contiguous()?
        };
        offset += n;
        let y = p.matmul(&contiguous(v)?)?;
        out = Some(match out {
            None => y,
            Some(acc) => (acc + y)?,
        });
    }
    let out = out.ok_or_else(|| ModelError::Shape("attention over no keys".into()))?;
    Ok(out.reshape((h, l, d))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_keys_read_the_cache_where_no_row_is_given() -> Result<()> {
        let (src, keys) = buffer_keys(&[4, 1], 4, 5, &candle_core::Device::Cpu)?;
        assert_eq!(keys, vec![0, 1, 2, 3, 4]);
        let KeySource::Buffer {
            index: Some(idx),
            cached,
        } = src
        else {
            panic!("expected a gather");
        };
        assert_eq!(cached, 4);
        // Keys 0, 2, 3 from the cache; 1 and 4 from rows 1 and 0 (after the 4 cached).
        assert_eq!(idx.to_vec1::<u32>()?, vec![0, 5, 2, 3, 4]);
        Ok(())
    }

    #[test]
    fn a_buffer_index_without_cache_or_row_is_an_error() {
        let err = buffer_keys(&[0, 1], 1, 3, &candle_core::Device::Cpu);
        assert!(matches!(err, Err(ModelError::Cache(_))));
    }
}
