//! One sequence's keys and values per layer, for buffer indices `0..len`, in buffers with
//! room to grow: a call's new rows are written in place (no copy of what is cached), and
//! attention reads a view of the buffer.
//!
//! Buffers are `[n_kv_heads, capacity, head_dim]`, grown by doubling. A clone of a cache shares
//! its buffers and copies nothing; the first write to a shared buffer copies it first (copy on
//! write), so a clone never sees the other's later writes. Views handed out by
//! [`KvCache::layer_kv`] read the buffer as it is: they are for use before the next write.

use std::sync::Arc;

use candle_core::Tensor;

use crate::error::{ModelError, Result};

/// Rows of capacity a buffer starts with, at least.
const MIN_CAPACITY: usize = 16;

/// One layer's buffers.
#[derive(Debug, Clone)]
struct LayerKv {
    k: Tensor,
    v: Tensor,
    /// Valid rows (a layer runs ahead of `KvCache::len` during a forward).
    len: usize,
    /// Shared with every clone holding the same buffers: one owner may write in place.
    owner: Arc<()>,
}

impl LayerKv {
    fn capacity(&self) -> usize {
        self.k.dims()[1]
    }

    fn view(&self) -> Result<(Tensor, Tensor)> {
        Ok((
            self.k.narrow(1, 0, self.len)?,
            self.v.narrow(1, 0, self.len)?,
        ))
    }

    /// Makes the buffers this layer's own with room for `rows` rows, keeping the valid ones.
    fn reserve(&mut self, rows: usize) -> Result<()> {
        let shared = Arc::strong_count(&self.owner) > 1;
        if !shared && self.capacity() >= rows {
            return Ok(());
        }
        let cap = if self.capacity() >= rows {
            self.capacity()
        } else {
            rows.max(2 * self.capacity()).max(MIN_CAPACITY)
        };
        let (h, _, d) = self.k.dims3()?;
        let k = Tensor::zeros((h, cap, d), self.k.dtype(), self.k.device())?;
        let v = Tensor::zeros((h, cap, d), self.v.dtype(), self.v.device())?;
        if self.len > 0 {
            k.slice_set(&self.k.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
            v.slice_set(&self.v.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
        }
        self.k = k;
        self.v = v;
        self.owner = Arc::new(());
        Ok(())
    }

    /// Writes `k`/`v` `[H, n, D]` at rows `at..at + n`.
    fn write(&mut self, at: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let n = k.dim(1)?;
        self.reserve(at + n)?;
        self.k.slice_set(&k.contiguous()?, 1, at)?;
        self.v.slice_set(&v.contiguous()?, 1, at)?;
        Ok(())
    }
}

/// One sequence's per-layer keys and values `[n_kv_heads, len, head_dim]` (keys after RoPE)
/// for buffer indices `0..len`. Every layer holds the same `len` between calls.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<Option<LayerKv>>,
    len: usize,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Buffer indices held (0 before the first call that writes it).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps buffer indices `0..len` only (the buffers keep their room).
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len >= self.len {
            return Ok(());
        }
        for l in self.layers.iter_mut().flatten() {
            l.len = l.len.min(len);
        }
        self.len = len;
        Ok(())
    }

    /// Drops everything.
    pub fn clear(&mut self) {
        self.layers.clear();
        self.len = 0;
    }

    /// Bytes of the buffers this cache holds (room included).
    pub fn allocated_bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|l| 2 * l.k.elem_count() * l.k.dtype().size_in_bytes())
            .sum()
    }

    /// Stores the keys (after RoPE) and values `[n_kv_heads, len, head_dim]` of buffer indices
    /// `0..len` at `layer`, computed outside a [`super::Block`] call (ARMT's grouped diagonal
    /// step runs a segment's layers in different calls); the cache then holds `len` indices.
    pub(crate) fn store_layer(&mut self, layer: usize, k: Tensor, v: Tensor) -> Result<()> {
        let len = k.dim(1)?;
        self.set_layer(layer, k, v)?;
        self.len = len;
        Ok(())
    }

    /// Appends, after its own indices, buffer indices `start..start + len` of each of `parts` in
    /// order (e.g. the K/V of slots computed in other caches, stitched into this one). Keys keep
    /// the RoPE of the positions they were computed at.
    pub fn append(&mut self, parts: &[(&KvCache, usize, usize)]) -> Result<()> {
        let parts: Vec<_> = parts.iter().filter(|p| p.2 > 0).collect();
        let Some(first) = parts.first() else {
            return Ok(());
        };
        let n_layers = first.0.layers.len();
        for (c, start, len) in &parts {
            if start + len > c.len {
                return Err(ModelError::Cache(format!(
                    "cannot take indices {start}..{} of a cache holding {}",
                    start + len,
                    c.len
                )));
            }
            if c.layers.len() != n_layers {
                return Err(ModelError::Cache(
                    "caches with different layer counts cannot be stitched".into(),
                ));
            }
        }
        if self.len > 0 && self.layers.len() != n_layers {
            return Err(ModelError::Cache(
                "caches with different layer counts cannot be stitched".into(),
            ));
        }
        let total: usize = parts.iter().map(|p| p.2).sum();
        for l in 0..n_layers {
            let mut at = self.len;
            for (c, start, len) in &parts {
                let (k, v) = c.layer_kv(l)?;
                let (k, v) = (k.narrow(1, *start, *len)?, v.narrow(1, *start, *len)?);
                self.write_rows(l, at, &k, &v)?;
                at += len;
            }
        }
        self.len += total;
        for layer in self.layers.iter_mut().flatten() {
            layer.len = self.len;
        }
        Ok(())
    }

    /// Keys and values `[n_kv_heads, len, head_dim]` of layer `layer`: views of its buffers.
    pub fn layer_kv(&self, layer: usize) -> Result<(Tensor, Tensor)> {
        self.layer(layer)?.view()
    }

    fn layer(&self, layer: usize) -> Result<&LayerKv> {
        self.layers
            .get(layer)
            .and_then(Option::as_ref)
            .ok_or_else(|| ModelError::Cache(format!("layer {layer} holds no keys")))
    }

    /// Rows of `layer` valid now (the cache's length, or more once a forward wrote the layer).
    pub(crate) fn layer_len(&self, layer: usize) -> usize {
        self.layers
            .get(layer)
            .and_then(Option::as_ref)
            .map_or(0, |l| l.len)
    }

    /// Replaces `layer` with `k`/`v` (their rows are its valid rows).
    pub(crate) fn set_layer(&mut self, layer: usize, k: Tensor, v: Tensor) -> Result<()> {
        let len = k.dim(1)?;
        if self.layers.len() <= layer {
            self.layers.resize(layer + 1, None);
        }
        self.layers[layer] = Some(LayerKv {
            k: k.contiguous()?,
            v: v.contiguous()?,
            len,
            owner: Arc::new(()),
        });
        Ok(())
    }

    /// Writes `k`/`v` `[H, n, D]` at buffer indices `at..at + n` of `layer` (in place when
    /// the buffers are this cache's own and have room); the layer's valid rows extend to
    /// cover them.
    pub(crate) fn write_rows(
        &mut self,
        layer: usize,
        at: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let n = k.dim(1)?;
        match self.layers.get_mut(layer).and_then(Option::as_mut) {
            Some(l) => {
                if at > l.len {
                    return Err(ModelError::Cache(format!(
                        "rows written at {at} would leave a gap after the {} held",
                        l.len
                    )));
                }
                l.write(at, k, v)?;
                l.len = l.len.max(at + n);
                Ok(())
            }
            None if at == 0 => {
                let (h, _, d) = k.dims3()?;
                let cap = n.max(MIN_CAPACITY);
                let mut l = LayerKv {
                    k: Tensor::zeros((h, cap, d), k.dtype(), k.device())?,
                    v: Tensor::zeros((h, cap, d), v.dtype(), v.device())?,
                    len: 0,
                    owner: Arc::new(()),
                };
                l.write(0, k, v)?;
                l.len = n;
                if self.layers.len() <= layer {
                    self.layers.resize(layer + 1, None);
                }
                self.layers[layer] = Some(l);
                Ok(())
            }
            None => Err(ModelError::Cache(format!(
                "layer {layer} holds no keys to write rows at {at} after"
            ))),
        }
    }

    /// Makes `layer` hold exactly `len` rows: the rows a call just wrote end there, and rows
    /// left past it by an earlier, longer use are dropped. Fewer valid rows is an error.
    pub(crate) fn fit_layer(&mut self, layer: usize, len: usize) -> Result<()> {
        let held = self.layer_len(layer);
        if held < len {
            return Err(ModelError::Cache(format!(
                "layer {layer} holds {held} rows where the call needs {len}: an index is neither cached nor a row"
            )));
        }
        if let Some(l) = self.layers.get_mut(layer).and_then(Option::as_mut) {
            l.len = len;
        }
        Ok(())
    }

    /// Sets the length every layer holds after a forward wrote `len` indices.
    pub(crate) fn commit(&mut self, len: usize) {
        self.len = len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn rows(start: usize, n: usize) -> Result<Tensor> {
        Ok(
            Tensor::arange(start as f32, (start + n) as f32, &Device::Cpu)?
                .reshape((1, n, 1))?
                .broadcast_as((2, n, 3))?
                .contiguous()?,
        )
    }

    fn values(c: &KvCache) -> Result<Vec<f32>> {
        let (k, _) = c.layer_kv(0)?;
        Ok(k.get(1)?.narrow(1, 0, 1)?.flatten_all()?.to_vec1()?)
    }

    #[test]
    fn appends_grow_in_place_and_a_clone_keeps_its_own_rows() -> Result<()> {
        let mut c = KvCache::new();
        c.write_rows(0, 0, &rows(0, 3)?, &rows(0, 3)?)?;
        c.commit(3);
        let before = c.allocated_bytes();
        c.write_rows(0, 3, &rows(3, 2)?, &rows(3, 2)?)?;
        c.commit(5);
        // Room for 16 rows from the first write: no new buffer.
        assert_eq!(c.allocated_bytes(), before);
        assert_eq!(values(&c)?, [0.0, 1.0, 2.0, 3.0, 4.0]);
        let snapshot = c.clone();
        c.truncate(2)?;
        c.write_rows(0, 2, &rows(9, 2)?, &rows(9, 2)?)?;
        c.commit(4);
        assert_eq!(values(&c)?, [0.0, 1.0, 9.0, 10.0]);
        // Copy on write: the clone still reads what it held.
        assert_eq!(values(&snapshot)?, [0.0, 1.0, 2.0, 3.0, 4.0]);
        // Growth past the room doubles it and keeps the rows.
        c.write_rows(0, 4, &rows(4, 20)?, &rows(4, 20)?)?;
        c.commit(24);
        assert_eq!(values(&c)?.len(), 24);
        assert_eq!(values(&c)?[..4], [0.0, 1.0, 9.0, 10.0]);
        assert!(c.write_rows(0, 30, &rows(0, 1)?, &rows(0, 1)?).is_err());
        Ok(())
    }

    #[test]
    fn stitching_appends_other_caches_rows() -> Result<()> {
        let mut a = KvCache::new();
        a.write_rows(0, 0, &rows(0, 2)?, &rows(0, 2)?)?;
        a.commit(2);
        let mut b = KvCache::new();
        b.write_rows(0, 0, &rows(5, 3)?, &rows(5, 3)?)?;
        b.commit(3);
        a.append(&[(&b, 1, 2)])?;
        assert_eq!(a.len(), 4);
        assert_eq!(values(&a)?, [0.0, 1.0, 6.0, 7.0]);
        assert!(a.append(&[(&b, 2, 2)]).is_err());
        Ok(())
    }
}
