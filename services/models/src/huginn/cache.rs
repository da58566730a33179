//! KV cache of a recurrent-depth model, with upstream's cache lookup strategies.
//!
//! A recurrent-depth transformer (Geiping et al., 2025, "Scaling up Test-Time Compute with
//! Latent Reasoning: A Recurrent Depth Approach") runs its core block many times per token, so a
//! token has one key/value entry per *cache slot*: prelude layer i -> slot `Prelude(i)`, core
//! layer j at recurrence r -> slot `Core(C·r + j)` (upstream step index `P + C·r + j`), coda
//! layer i -> slot `Coda(i)`. Entries are keyed by absolute position; the sequence length
//! advances when the first prelude slot is written (as upstream's `HuginnDynamicCache`).
//!
//! Lookup strategies (upstream `cache_lookup_strategy` strings, [`CacheStrategy`]):
//! * `full` - every core slot separate. Positions missing from a slot are skipped (upstream
//!   behaviour).
//! * `compress-sN` - core slot `f` is stored at `f mod N` ("KV-cache sharing" for N = C: each
//!   core layer keeps the last recurrence computed for every position).
//! * `latest-m4` (and the `latest-m4-` prefix) - a position lacking the requested core slot
//!   contributes its entry of the same core layer at the deepest earlier recurrence it computed
//!   (the largest stored slot `f' <= f` with `f' = f mod C`), which is what adaptive per-token
//!   exits need. Upstream hardcodes C = 4 and the first core slot 2 here; the flat core index
//!   used in this module makes both follow the model's config (identical for the real model).
//!
//! Storage: one contiguous `[H, capacity, D]` key and value buffer per slot, grown by doubling,
//! written in place, plus a host-side bitmap of the positions present. Attention over a fully
//! populated slot reads one narrow view (no copy); holes are resolved by concatenating runs of
//! positions from their source slots. The cache never reads device memory back to the host.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};

/// How core-block cache slots are stored and looked up (upstream `cache_lookup_strategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CacheStrategy {
    /// `full`: one slot per core layer and recurrence.
    #[default]
    Full,
    /// `latest-m4`: like `full`, but missing entries fall back to the deepest computed recurrence.
    LatestM4,
    /// `compress-sN` / `latest-m4-compress-sN`: core slots shared modulo `stride`, with the
    /// latest-m4 fallback when `latest` is set.
    Compress { stride: usize, latest: bool },
}

impl CacheStrategy {
    /// Whether missing core entries fall back to earlier recurrences.
    pub fn falls_back(self) -> bool {
        matches!(self, Self::LatestM4 | Self::Compress { latest: true, .. })
    }

    /// Storage index of flat core slot `flat` (= C·recurrence + layer).
    pub fn core_index(self, flat: usize) -> usize {
        match self {
            Self::Full | Self::LatestM4 => flat,
            Self::Compress { stride, .. } => flat % stride,
        }
    }
}

impl FromStr for CacheStrategy {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        let err = || ModelError::CacheStrategy(s.to_owned());
        let (latest, rest) = match s.strip_prefix("latest-m4") {
            Some("") => return Ok(Self::LatestM4),
            Some(rest) => (true, rest.strip_prefix('-').ok_or_else(err)?),
            None => (false, s),
        };
        if rest == "full" && !latest {
            return Ok(Self::Full);
        }
        let stride: usize = rest
            .strip_prefix("compress-s")
            .and_then(|n| n.parse().ok())
            .ok_or_else(err)?;
        if stride == 0 {
            return Err(err());
        }
        Ok(Self::Compress { stride, latest })
    }
}

impl fmt::Display for CacheStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Full => f.write_str("full"),
            Self::LatestM4 => f.write_str("latest-m4"),
            Self::Compress {
                stride,
                latest: true,
            } => write!(f, "latest-m4-compress-s{stride}"),
            Self::Compress {
                stride,
                latest: false,
            } => write!(f, "compress-s{stride}"),
        }
    }
}

/// The cache slot a layer invocation reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheSlot {
    /// Prelude layer `i`.
    Prelude(usize),
    /// Core layer `layer` at 0-based `recurrence`.
    Core { recurrence: usize, layer: usize },
    /// Coda layer `i`.
    Coda(usize),
}

/// A resolved storage slot (after the strategy's remapping).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoreKey {
    Prelude(usize),
    Core(usize),
    Coda(usize),
}

/// Keys and values of one slot: `[H, capacity, D]` buffers and the positions written.
struct KvStore {
    k: Tensor,
    v: Tensor,
    present: Vec<bool>,
}

impl KvStore {
    fn capacity(&self) -> usize {
        self.k.dims()[1]
    }

    fn has(&self, pos: usize) -> bool {
        self.present.get(pos).copied().unwrap_or(false)
    }

    fn covers(&self, upto: usize) -> bool {
        self.present.len() >= upto && self.present[..upto].iter().all(|&p| p)
    }

    fn bytes(&self) -> usize {
        2 * self.k.elem_count() * self.k.dtype().size_in_bytes()
    }
}

/// Per-sequence KV cache of a Huginn model.
pub struct HuginnCache {
    strategy: CacheStrategy,
    len: usize,
    min_capacity: usize,
    core_layers: Option<usize>,
    prelude: Vec<Option<KvStore>>,
    core: Vec<Option<KvStore>>,
    coda: Vec<Option<KvStore>>,
}

impl fmt::Debug for HuginnCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HuginnCache")
            .field("strategy", &self.strategy)
            .field("len", &self.len)
            .field(
                "core_slots",
                &self.core.iter().filter(|s| s.is_some()).count(),
            )
            .field("bytes", &self.allocated_bytes())
            .finish()
    }
}

/// Initial capacity granularity of a slot buffer (positions).
const CAPACITY_QUANTUM: usize = 16;

impl HuginnCache {
    /// An empty cache.
    pub fn new(strategy: CacheStrategy) -> Self {
        Self::with_capacity(strategy, 0)
    }

    /// An empty cache whose slot buffers start with room for `positions` entries.
    pub fn with_capacity(strategy: CacheStrategy, positions: usize) -> Self {
        Self {
            strategy,
            len: 0,
            min_capacity: positions,
            core_layers: None,
            prelude: Vec::new(),
            core: Vec::new(),
            coda: Vec::new(),
        }
    }

    /// The lookup strategy.
    pub fn strategy(&self) -> CacheStrategy {
        self.strategy
    }

    /// Sequence length: positions `0..len()` have been through the first prelude layer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drops every slot's entries at positions `>= len` (upstream `clear_last_k_entries`).
    /// Buffers keep their capacity.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        for store in self.stores_mut() {
            store.present.truncate(len);
        }
    }

    /// Drops every entry and frees the buffers.
    pub fn clear(&mut self) {
        self.len = 0;
        self.prelude.clear();
        self.core.clear();
        self.coda.clear();
    }

    /// Device bytes held by key and value buffers.
    pub fn allocated_bytes(&self) -> usize {
        self.stores().map(KvStore::bytes).sum()
    }

    /// Whether position `pos` has an entry in `slot` (after remapping, without fallback).
    pub fn has_entry(&self, slot: CacheSlot, pos: usize) -> bool {
        match self.resolve(slot) {
            Ok(key) => self.store(key).is_some_and(|s| s.has(pos)),
            Err(_) => false,
        }
    }

    fn stores(&self) -> impl Iterator<Item = &KvStore> {
        self.prelude
            .iter()
            .chain(&self.core)
            .chain(&self.coda)
            .flatten()
    }

    fn stores_mut(&mut self) -> impl Iterator<Item = &mut KvStore> {
        self.prelude
            .iter_mut()
            .chain(&mut self.core)
            .chain(&mut self.coda)
            .flatten()
    }

    /// Records the model's core depth C (needed to map core slots); fails on a mismatch.
    pub(crate) fn bind_core_layers(&mut self, core_layers: usize) -> Result<()> {
        match self.core_layers {
            None => {
                self.core_layers = Some(core_layers);
                Ok(())
            }
            Some(c) if c == core_layers => Ok(()),
            Some(c) => Err(ModelError::Cache(format!(
                "cache was used with {c} core layers, model has {core_layers}"
            ))),
        }
    }

    fn core_layers(&self) -> Result<usize> {
        self.core_layers.ok_or_else(|| {
            ModelError::Cache("core slot used before the model bound its core depth".into())
        })
    }

    fn resolve(&self, slot: CacheSlot) -> Result<StoreKey> {
        Ok(match slot {
            CacheSlot::Prelude(i) => StoreKey::Prelude(i),
            CacheSlot::Coda(i) => StoreKey::Coda(i),
            CacheSlot::Core { recurrence, layer } => {
                let c = self.core_layers()?;
                StoreKey::Core(self.strategy.core_index(c * recurrence + layer))
            }
        })
    }

    fn store(&self, key: StoreKey) -> Option<&KvStore> {
        let (list, i) = match key {
            StoreKey::Prelude(i) => (&self.prelude, i),
            StoreKey::Core(i) => (&self.core, i),
            StoreKey::Coda(i) => (&self.coda, i),
        };
        list.get(i).and_then(Option::as_ref)
    }

    fn store_slot_mut(&mut self, key: StoreKey) -> &mut Option<KvStore> {
        let (list, i) = match key {
            StoreKey::Prelude(i) => (&mut self.prelude, i),
            StoreKey::Core(i) => (&mut self.core, i),
            StoreKey::Coda(i) => (&mut self.coda, i),
        };
        if list.len() <= i {
            list.resize_with(i + 1, || None);
        }
        &mut list[i]
    }

    /// Writes keys and values `[H, n, D]` (contiguous) of positions `start..start+n` into
    /// `slot`, overwriting entries already there. Writing `Prelude(0)` appends: `start` must be
    /// the current length, which then becomes `start + n`; other slots may only hold positions
    /// below the length.
    pub(crate) fn write(
        &mut self,
        slot: CacheSlot,
        start: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let (h, n, d) = k.dims3()?;
        if v.dims() != k.dims() {
            return Err(ModelError::Shape(format!(
                "cache keys {:?} and values {:?} differ",
                k.dims(),
                v.dims()
            )));
        }
        if slot == CacheSlot::Prelude(0) {
            if start != self.len {
                return Err(ModelError::Cache(format!(
                    "rows start at position {start} but the cache holds {} positions",
                    self.len
                )));
            }
            self.len = start + n;
        } else if start + n > self.len {
            return Err(ModelError::Cache(format!(
                "{slot:?}: positions {start}..{} beyond the cached length {}",
                start + n,
                self.len
            )));
        }
        let key = self.resolve(slot)?;
        let min_capacity = self.min_capacity;
        let entry = self.store_slot_mut(key);
        let needed = start + n;
        match entry {
            Some(store) if store.capacity() >= needed => {}
            _ => {
                let old_cap = entry.as_ref().map_or(0, KvStore::capacity);
                let cap = grown_capacity(old_cap, needed, min_capacity);
                let fresh_k = Tensor::zeros((h, cap, d), k.dtype(), k.device())?;
                let fresh_v = Tensor::zeros((h, cap, d), v.dtype(), v.device())?;
                let present = match entry.take() {
                    Some(old) => {
                        fresh_k.slice_set(&old.k, 1, 0)?;
                        fresh_v.slice_set(&old.v, 1, 0)?;
                        old.present
                    }
                    None => Vec::new(),
                };
                *entry = Some(KvStore {
                    k: fresh_k,
                    v: fresh_v,
                    present,
                });
            }
        }
        let store = entry.as_mut().expect("slot store was just ensured");
        check_layout(&store.k, k)?;
        store.k.slice_set(k, 1, start)?;
        store.v.slice_set(v, 1, start)?;
        if store.present.len() < needed {
            store.present.resize(needed, false);
        }
        store.present[start..needed].fill(true);
        Ok(())
    }

    /// Keys and values `[H, T, D]` that queries ending at position `upto - 1` attend to in
    /// `slot`: positions `0..upto` (T = `upto`), resolved with the lookup strategy. Under `full`,
    /// positions missing from the slot are skipped, so T may be smaller than `upto`.
    pub(crate) fn read(&self, slot: CacheSlot, upto: usize) -> Result<(Tensor, Tensor)> {
        let mut runs = self.read_runs(slot, upto)?;
        if runs.len() == 1 {
            return Ok(runs.pop().expect("one run"));
        }
        let (ks, vs): (Vec<Tensor>, Vec<Tensor>) = runs.into_iter().unzip();
        Ok((Tensor::cat(&ks, 1)?, Tensor::cat(&vs, 1)?))
    }

    /// [`HuginnCache::read`] without concatenating: the keys and values as runs of consecutive
    /// positions `[H, n_i, D]`, views into the slots' buffers (nothing is copied), in key order.
    pub(crate) fn read_runs(&self, slot: CacheSlot, upto: usize) -> Result<Vec<(Tensor, Tensor)>> {
        let key = self.resolve(slot)?;
        let store = self
            .store(key)
            .ok_or_else(|| ModelError::Cache(format!("{slot:?} was never written")))?;
        if store.covers(upto) {
            return Ok(vec![(
                store.k.narrow(1, 0, upto)?,
                store.v.narrow(1, 0, upto)?,
            )]);
        }
        // Holes: build runs of consecutive positions read from the same store.
        let fallback = match key {
            StoreKey::Core(f) if self.strategy.falls_back() => Some((f, self.core_layers()?)),
            _ => None,
        };
        let mut runs: Vec<(StoreKey, usize, usize)> = Vec::new();
        for pos in 0..upto {
            let source = if store.has(pos) {
                Some(key)
            } else if let Some((f, c)) = fallback {
                (0..=f / c)
                    .map(|back| StoreKey::Core(f - back * c))
                    .find(|&k| self.store(k).is_some_and(|s| s.has(pos)))
            } else {
                None
            };
            let Some(source) = source else {
                if self.strategy == CacheStrategy::Full && matches!(key, StoreKey::Core(_)) {
                    continue; // upstream `full` silently skips missing positions
                }
                return Err(ModelError::Cache(format!(
                    "{slot:?} has no entry for position {pos} under strategy `{}`",
                    self.strategy
                )));
            };
            match runs.last_mut() {
                Some((k, s, n)) if *k == source && *s + *n == pos => *n += 1,
                _ => runs.push((source, pos, 1)),
            }
        }
        if runs.is_empty() {
            return Err(ModelError::Cache(format!(
                "{slot:?} has no entries below {upto}"
            )));
        }
        runs.into_iter()
            .map(|(source, start, n)| {
                let s = self.store(source).expect("run sources exist");
                Ok((s.k.narrow(1, start, n)?, s.v.narrow(1, start, n)?))
            })
            .collect()
    }

    /// Device and dtype of the cached tensors, if any slot was written.
    pub fn device_dtype(&self) -> Option<(Device, DType)> {
        self.stores()
            .next()
            .map(|s| (s.k.device().clone(), s.k.dtype()))
    }
}

fn grown_capacity(old: usize, needed: usize, min_capacity: usize) -> usize {
    let cap = needed.max(old * 2).max(min_capacity);
    cap.div_ceil(CAPACITY_QUANTUM) * CAPACITY_QUANTUM
}

fn check_layout(buffer: &Tensor, block: &Tensor) -> Result<()> {
    let (bh, _, bd) = buffer.dims3()?;
    let (h, _, d) = block.dims3()?;
    if (bh, bd) != (h, d) || buffer.dtype() != block.dtype() {
        return Err(ModelError::Shape(format!(
            "cache block {:?} {:?} does not fit buffer {:?} {:?}",
            block.dims(),
            block.dtype(),
            buffer.dims(),
            buffer.dtype()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_upstream_strategy_strings() {
        for (s, want) in [
            ("full", CacheStrategy::Full),
            ("latest-m4", CacheStrategy::LatestM4),
            (
                "compress-s4",
                CacheStrategy::Compress {
                    stride: 4,
                    latest: false,
                },
            ),
            (
                "latest-m4-compress-s4",
                CacheStrategy::Compress {
                    stride: 4,
                    latest: true,
                },
            ),
            (
                "latest-m4-compress-s16",
                CacheStrategy::Compress {
                    stride: 16,
                    latest: true,
                },
            ),
        ] {
            let got: CacheStrategy = s.parse().unwrap();
            assert_eq!(got, want);
            assert_eq!(got.to_string(), s);
        }
        for bad in [
            "",
            "latest",
            "latest-m4-full",
            "compress-s0",
            "compress-r4",
            "latest-m4compress-s4",
        ] {
            assert!(bad.parse::<CacheStrategy>().is_err(), "{bad}");
        }
    }

    fn block(h: usize, n: usize, d: usize, value: f32) -> Tensor {
        Tensor::full(value, (h, n, d), &Device::Cpu).unwrap()
    }

    fn positions_of(t: &Tensor) -> Vec<f32> {
        // Each test entry holds a constant; read it back per position (head 0, dim 0).
        t.narrow(0, 0, 1)
            .unwrap()
            .narrow(2, 0, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    #[test]
    fn appends_grow_and_truncate() {
        let mut cache = HuginnCache::new(CacheStrategy::Full);
        for pos in 0..40 {
            let b = block(2, 1, 4, pos as f32);
            cache.write(CacheSlot::Prelude(0), pos, &b, &b).unwrap();
        }
        assert_eq!(cache.len(), 40);
        let (k, _) = cache.read(CacheSlot::Prelude(0), 40).unwrap();
        assert_eq!(
            positions_of(&k),
            (0..40).map(|p| p as f32).collect::<Vec<_>>()
        );
        cache.truncate(10);
        assert_eq!(cache.len(), 10);
        let b = block(2, 1, 4, 0.0);
        assert!(cache.write(CacheSlot::Prelude(0), 11, &b, &b).is_err());
        cache.write(CacheSlot::Prelude(0), 10, &b, &b).unwrap();
        assert_eq!(cache.len(), 11);
        assert!(cache.write(CacheSlot::Prelude(1), 11, &b, &b).is_err());
    }

    #[test]
    fn compress_shares_slots_and_latest_falls_back() {
        let mut cache = HuginnCache::new("latest-m4".parse().unwrap());
        cache.bind_core_layers(4).unwrap();
        let b = |v: f32| block(1, 1, 2, v);
        // position 0 runs 3 recurrences, position 1 runs 1.
        cache
            .write(CacheSlot::Prelude(0), 0, &b(0.0), &b(0.0))
            .unwrap();
        for r in 0..3 {
            let slot = CacheSlot::Core {
                recurrence: r,
                layer: 1,
            };
            cache.write(slot, 0, &b(10.0 + r as f32), &b(0.0)).unwrap();
        }
        cache
            .write(CacheSlot::Prelude(0), 1, &b(0.0), &b(0.0))
            .unwrap();
        cache
            .write(
                CacheSlot::Core {
                    recurrence: 0,
                    layer: 1,
                },
                1,
                &b(20.0),
                &b(0.0),
            )
            .unwrap();
        cache
            .write(CacheSlot::Prelude(0), 2, &b(0.0), &b(0.0))
            .unwrap();
        for r in 0..4 {
            let slot = CacheSlot::Core {
                recurrence: r,
                layer: 1,
            };
            cache.write(slot, 2, &b(30.0 + r as f32), &b(0.0)).unwrap();
            let (k, _) = cache.read(slot, 3).unwrap();
            let r0 = (r as f32).min(2.0);
            assert_eq!(positions_of(&k), vec![10.0 + r0, 20.0, 30.0 + r as f32]);
        }

        let mut shared = HuginnCache::new("latest-m4-compress-s4".parse().unwrap());
        shared.bind_core_layers(4).unwrap();
        shared
            .write(CacheSlot::Prelude(0), 0, &b(0.0), &b(0.0))
            .unwrap();
        for r in 0..3 {
            let slot = CacheSlot::Core {
                recurrence: r,
                layer: 2,
            };
            shared.write(slot, 0, &b(r as f32), &b(0.0)).unwrap();
        }
        let (k, _) = shared
            .read(
                CacheSlot::Core {
                    recurrence: 0,
                    layer: 2,
                },
                1,
            )
            .unwrap();
        assert_eq!(positions_of(&k), vec![2.0]);
    }

    #[test]
    fn full_skips_missing_positions() {
        let mut cache = HuginnCache::new(CacheStrategy::Full);
        cache.bind_core_layers(4).unwrap();
        let b = |v: f32| block(1, 1, 2, v);
        let slot = CacheSlot::Core {
            recurrence: 1,
            layer: 0,
        };
        cache
            .write(CacheSlot::Prelude(0), 0, &b(0.0), &b(0.0))
            .unwrap();
        cache
            .write(CacheSlot::Prelude(0), 1, &b(0.0), &b(0.0))
            .unwrap();
        cache.write(slot, 1, &b(5.0), &b(0.0)).unwrap();
        let (k, _) = cache.read(slot, 2).unwrap();
        assert_eq!(positions_of(&k), vec![5.0]);
    }
}
