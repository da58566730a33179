//! KV cache of a recurrent-depth model, with upstream's cache lookup strategies.
//!
//! A recurrent-depth transformer (Geiping et al., 2025, "Scaling up Test-Time Compute with
//! Latent Reasoning: A Recurrent Depth Approach") runs its core block many times per token, so a
//! token has one key/value entry per *cache layer*: prelude layer i -> layer `Prelude(i)`, core
//! layer j at recurrence r -> layer `Core(C·r + j)` (upstream step index `P + C·r + j`), coda
//! layer i -> layer `Coda(i)`. Entries are keyed by absolute position; the sequence length
//! advances when the first prelude layer is written (as upstream's `HuginnDynamicCache`).
//!
//! Lookup strategies (upstream `cache_lookup_strategy` strings, [`CacheStrategy`]):
//! * `full` - every core layer separate. Positions missing from a layer are skipped (upstream
//!   behaviour).
//! * `compress-sN` - core layer `f` is stored at `f mod N` ("KV-cache sharing" for N = C: each
//!   core layer keeps the last recurrence computed for every position).
//! * `latest-m4` (and the `latest-m4-` prefix) - a position lacking the requested core layer
//!   contributes its entry of the same core layer at the deepest earlier recurrence it computed
//!   (the largest stored layer `f' <= f` with `f' = f mod C`), which is what adaptive per-token
//!   exits need. Upstream hardcodes C = 4 and the first core layer 2 here; the flat core index
//!   used in this module makes both follow the model's config (identical for the real model).
//!
//! Storage: per layer, a page table over positions (pages of [`PAGE_SIZE`] positions from a
//! [`KvPool`]: the model's shared pool when the engine grants the pages, else a private one)
//! and a host-side bitmap of the positions present. A page is taken when a position in it is
//! first written, so a layer that only some positions reach (a deep recurrence under adaptive
//! exits) holds only the pages of those positions. Attention reads runs of positions in place,
//! one per page (holes resolved per position from their source layers); nothing is
//! concatenated as the sequence grows, and the cache never reads device memory back to the
//! host.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Tensor};

use crate::error::{ModelError, Result};
use crate::transformer::kv_cache::{HostPage, PageSupply};
use crate::transformer::{KvPool, PagedCache, PAGE_SIZE};

/// How core-block cache layers are stored and looked up (upstream `cache_lookup_strategy`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
pub enum CacheStrategy {
    /// `full`: one layer per core layer and recurrence.
    #[default]
    Full,
    /// `latest-m4`: like `full`, but missing entries fall back to the deepest computed recurrence.
    LatestM4,
    /// `compress-sN` / `latest-m4-compress-sN`: core layers shared modulo `stride`, with the
    /// latest-m4 fallback when `latest` is set.
    Compress { stride: usize, latest: bool },
}

impl CacheStrategy {
    /// Whether missing core entries fall back to earlier recurrences.
    pub fn falls_back(self) -> bool {
        matches!(self, Self::LatestM4 | Self::Compress { latest: true, .. })
    }

    /// Storage index of flat core layer `flat` (= C·recurrence + layer).
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

/// The cache layer a layer invocation reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheLayer {
    /// Prelude layer `i`.
    Prelude(usize),
    /// Core layer `layer` at 0-based `recurrence`.
    Core { recurrence: usize, layer: usize },
    /// Coda layer `i`.
    Coda(usize),
}

/// A resolved store (after the strategy's remapping).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
enum StoreKey {
    Prelude(usize),
    Core(usize),
    Coda(usize),
    /// Diffusion forcing's wavefront ([`HuginnCache::write_latents`]).
    Latent,
}

/// Keys and values of one layer: a page table over positions (a page holds
/// [`KvPool::page_size`] consecutive positions; pages no position of which was written are
/// absent) and the positions written.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct KvStore {
    pages: Vec<Option<u32>>,
    present: Vec<bool>,
}

impl KvStore {
    fn has(&self, pos: usize) -> bool {
        self.present.get(pos).copied().unwrap_or(false)
    }

    fn covers(&self, upto: usize) -> bool {
        self.present.len() >= upto && self.present[..upto].iter().all(|&p| p)
    }

    fn pages_used(&self) -> usize {
        self.pages.iter().flatten().count()
    }

    /// Page `pi` of the table, taken from `supply` if absent (`used`: the pages the cache
    /// holds outside this table, for the message when the grant is spent).
    fn page(&mut self, pi: usize, supply: &mut PageSupply, used: usize) -> Result<u32> {
        if self.pages.len() <= pi {
            self.pages.resize(pi + 1, None);
        }
        if let Some(id) = self.pages[pi] {
            return Ok(id);
        }
        let id = supply.take(used + self.pages_used())?;
        self.pages[pi] = Some(id);
        Ok(id)
    }
}

/// A store key with its pages copied to host memory (a swapped-out cache).
type SwappedStore = (StoreKey, Vec<Option<HostPage>>);

/// Per-sequence KV cache of a Huginn model.
pub struct HuginnCache {
    strategy: CacheStrategy,
    len: usize,
    core_layers: Option<usize>,
    prelude: Vec<Option<KvStore>>,
    core: Vec<Option<KvStore>>,
    coda: Vec<Option<KvStore>>,
    /// Latent rows in pages: row `i` of the wavefront's states in the key half, of its mixed
    /// embeddings in the value half (a page's "positions" are rows here, not sequence
    /// positions; truncation leaves them alone).
    latent: Option<KvStore>,
    supply: PageSupply,
    swapped: Option<Vec<SwappedStore>>,
    /// Leading pages of every position store that another cache reads too
    /// ([`Self::share_prefix`]): never written again, never given back as spare pages.
    frozen: usize,
}

impl fmt::Debug for HuginnCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HuginnCache")
            .field("strategy", &self.strategy)
            .field("len", &self.len)
            .field(
                "core_stores",
                &self.core.iter().filter(|s| s.is_some()).count(),
            )
            .field("pages", &self.pages_used())
            .finish()
    }
}

impl HuginnCache {
    /// An empty cache over a private pool of pages.
    pub fn new(strategy: CacheStrategy) -> Self {
        Self::in_pool(strategy, KvPool::private(PAGE_SIZE))
    }

    /// An empty cache over a private pool of pages of `page_size` positions (one page as long
    /// as the sequence is one contiguous buffer per layer, as before paging: benchmarks compare
    /// the two).
    pub fn with_page_size(strategy: CacheStrategy, page_size: usize) -> Self {
        Self::in_pool(strategy, KvPool::private(page_size))
    }

    /// An empty cache over `pool`; over a shared pool it takes only pages it was granted.
    pub fn in_pool(strategy: CacheStrategy, pool: KvPool) -> Self {
        Self {
            strategy,
            len: 0,
            core_layers: None,
            prelude: Vec::new(),
            core: Vec::new(),
            coda: Vec::new(),
            latent: None,
            supply: PageSupply::new(pool),
            swapped: None,
            frozen: 0,
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

    /// The pool the cache's pages come from.
    pub fn pool(&self) -> &KvPool {
        self.supply.pool()
    }

    /// Positions a page holds.
    pub fn page_size(&self) -> usize {
        self.supply.page_size()
    }

    /// Gives this cache pages (the engine's slot ids) to take as it grows.
    pub fn grant(&mut self, pages: impl IntoIterator<Item = u32>) {
        self.supply.grant(pages);
    }

    /// Pages in the page tables (K/V and latent rows).
    pub fn pages_used(&self) -> usize {
        self.stores().map(KvStore::pages_used).sum::<usize>() + self.latent_pages_in_use()
    }

    fn latent_pages_in_use(&self) -> usize {
        self.latent.as_ref().map_or(0, KvStore::pages_used)
    }

    /// Pages holding latent rows, in the pool or (swapped out) in host memory.
    pub fn latent_pages(&self) -> usize {
        let swapped = self.swapped.as_ref().map_or(0, |stores| {
            stores
                .iter()
                .filter(|(k, _)| *k == StoreKey::Latent)
                .map(|(_, p)| p.iter().flatten().count())
                .sum()
        });
        self.latent_pages_in_use() + swapped
    }

    /// Pages held: in the tables, and granted but not used yet.
    pub fn pages_held(&self) -> usize {
        self.pages_used() + self.supply.spare()
    }

    /// Pages the cache holds once positions `rows` are written to `core_stores` core layers as
    /// well as every prelude and coda layer (`prelude` and `coda` layers), at most: the pages it
    /// holds, plus a page for every layer whose page of a new position is not there yet (or was
    /// swapped out).
    pub fn pages_after(
        &self,
        rows: std::ops::Range<usize>,
        prelude: usize,
        core_stores: usize,
        coda: usize,
    ) -> usize {
        let p = self.page_size();
        let new_pages = || (rows.start / p)..rows.end.div_ceil(p);
        // Whether layer `key` holds page `i`: in the pool, or (swapped out) in host memory.
        let holds = |key: StoreKey, i: usize| match &self.swapped {
            Some(stores) => stores
                .iter()
                .find(|(k, _)| *k == key)
                .is_some_and(|(_, pages)| matches!(pages.get(i), Some(Some(_)))),
            None => self
                .store(key)
                .is_some_and(|s| s.pages.get(i).copied().flatten().is_some()),
        };
        let lists = [
            (
                self.prelude.len(),
                prelude,
                StoreKey::Prelude as fn(usize) -> StoreKey,
            ),
            (self.core.len(), core_stores, StoreKey::Core),
            (self.coda.len(), coda, StoreKey::Coda),
        ];
        // K/V pages only: latent rows are counted by whoever writes them.
        let mut total = self.pages_used() + self.swapped_pages() - self.latent_pages();
        for (len, n, key) in lists {
            for i in 0..n.max(len) {
                total += new_pages().filter(|&pg| !holds(key(i), pg)).count();
            }
        }
        total
    }

    /// Drops every layer's entries at positions `>= len` (upstream `clear_last_k_entries`);
    /// pages wholly past them go back to the cache's spare ones.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        let keep = len.div_ceil(self.page_size());
        // Shared pages leave the tables only: their holders give them back to the engine.
        let own_from = keep.max(self.frozen);
        let mut freed = Vec::new();
        for store in self.stores_mut() {
            store.present.truncate(len);
            if store.pages.len() > keep {
                let dropped = store.pages.split_off(keep);
                freed.extend(dropped.into_iter().skip(own_from - keep).flatten());
            }
        }
        self.supply.give(freed);
    }

    /// Makes this empty cache read the first `pages` pages of every position store of `donor`
    /// (same pool; each store holding those pages whole, every position present): positions
    /// `0..pages · page_size` without computing them. Neither cache writes those pages again or
    /// hands them out as spare pages. Returns the page ids now read by both.
    pub fn share_prefix(&mut self, donor: &mut HuginnCache, pages: usize) -> Result<Vec<u32>> {
        let rows = pages * self.page_size();
        let same_pool = self.pool().same_as(donor.pool());
        if !same_pool || !self.pool().is_shared() || self.strategy != donor.strategy {
            return Err(ModelError::Cache(
                "prompt pages are shared only within a model's pool, under one lookup strategy"
                    .into(),
            ));
        }
        if self.len > 0 || self.pages_used() > 0 || self.swapped.is_some() {
            return Err(ModelError::Cache(
                "only an empty cache takes another's prompt pages".into(),
            ));
        }
        if donor.swapped.is_some() || donor.len < rows {
            return Err(ModelError::Cache(format!(
                "the cache holds {} positions, not the {rows} to share",
                donor.len
            )));
        }
        let mut ids = Vec::new();
        let mut stores = Vec::new();
        for (list, make) in [
            (&donor.prelude, StoreKey::Prelude as fn(usize) -> StoreKey),
            (&donor.core, StoreKey::Core),
            (&donor.coda, StoreKey::Coda),
        ] {
            for (i, store) in list.iter().enumerate() {
                let Some(store) = store else { continue };
                let whole = store.pages.len() >= pages
                    && store.pages[..pages].iter().all(Option::is_some)
                    && store.covers(rows);
                if !whole {
                    return Err(ModelError::Cache(format!(
                        "{:?} does not hold the {rows} positions to share",
                        make(i)
                    )));
                }
                ids.extend(store.pages[..pages].iter().flatten());
                stores.push((
                    make(i),
                    KvStore {
                        pages: store.pages[..pages].to_vec(),
                        present: vec![true; rows],
                    },
                ));
            }
        }
        for (key, store) in stores {
            *self.store_mut(key) = Some(store);
        }
        self.core_layers = donor.core_layers;
        self.len = rows;
        self.frozen = pages;
        donor.frozen = donor.frozen.max(pages);
        Ok(ids)
    }

    /// Drops every entry (the pages stay this cache's to reuse).
    pub fn clear(&mut self) {
        self.truncate(0);
        self.frozen = 0;
        self.prelude.clear();
        self.core.clear();
        self.coda.clear();
        if let Some(l) = self.latent.take() {
            self.supply.give(l.pages.into_iter().flatten());
        }
    }

    /// Bytes of the pages the cache's tables hold.
    pub fn allocated_bytes(&self) -> usize {
        self.pages_used() * self.supply.page_bytes()
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

    /// Records the model's core depth C (needed to map core layers); fails on a mismatch.
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
            ModelError::Cache("core layer used before the model bound its core depth".into())
        })
    }

    fn resolve(&self, layer: CacheLayer) -> Result<StoreKey> {
        Ok(match layer {
            CacheLayer::Prelude(i) => StoreKey::Prelude(i),
            CacheLayer::Coda(i) => StoreKey::Coda(i),
            CacheLayer::Core { recurrence, layer } => {
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
            StoreKey::Latent => return self.latent.as_ref(),
        };
        list.get(i).and_then(Option::as_ref)
    }

    fn store_mut(&mut self, key: StoreKey) -> &mut Option<KvStore> {
        let (list, i) = match key {
            StoreKey::Prelude(i) => (&mut self.prelude, i),
            StoreKey::Core(i) => (&mut self.core, i),
            StoreKey::Coda(i) => (&mut self.coda, i),
            StoreKey::Latent => return &mut self.latent,
        };
        if list.len() <= i {
            list.resize_with(i + 1, || None);
        }
        &mut list[i]
    }

    /// Writes keys and values `[H, n, D]` (contiguous) of positions `start..start+n` into
    /// `layer`, overwriting entries already there. Writing `Prelude(0)` appends: `start` must be
    /// the current length, which then becomes `start + n`; other layers may only hold positions
    /// below the length.
    pub(crate) fn write(
        &mut self,
        layer: CacheLayer,
        start: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<()> {
        let (_, n, _) = k.dims3()?;
        if v.dims() != k.dims() {
            return Err(ModelError::Shape(format!(
                "cache keys {:?} and values {:?} differ",
                k.dims(),
                v.dims()
            )));
        }
        if self.swapped.is_some() {
            return Err(ModelError::Cache("the cache is swapped out".into()));
        }
        let new_len = if layer == CacheLayer::Prelude(0) {
            if start != self.len {
                return Err(ModelError::Cache(format!(
                    "rows start at position {start} but the cache holds {} positions",
                    self.len
                )));
            }
            start + n
        } else if start + n > self.len {
            return Err(ModelError::Cache(format!(
                "{layer:?}: positions {start}..{} beyond the cached length {}",
                start + n,
                self.len
            )));
        } else {
            self.len
        };
        let key = self.resolve(layer)?;
        let p = self.page_size();
        // The pages held, for the message when the grant runs out: counted (over every layer)
        // only when the spare pages might not cover the pages this write can take.
        let used = if self.supply.spare() <= n.div_ceil(p) {
            self.pages_used()
        } else {
            0
        };
        if start < self.frozen * p {
            return Err(ModelError::Cache(format!(
                "{layer:?}: positions from {start} would overwrite the {} shared prompt positions",
                self.frozen * p
            )));
        }
        let mut store = self.store_mut(key).take().unwrap_or_default();
        let mut done = 0;
        let written = (|| {
            while done < n {
                let pos = start + done;
                let (pi, off) = (pos / p, pos % p);
                let take = (p - off).min(n - done);
                let id = store.page(pi, &mut self.supply, used)?;
                let (ks, vs) = (k.narrow(1, done, take)?, v.narrow(1, done, take)?);
                self.supply.write(id, off, &ks, &vs)?;
                done += take;
            }
            Ok::<(), ModelError>(())
        })();
        let needed = start + done;
        if store.present.len() < needed {
            store.present.resize(needed, false);
        }
        store.present[start..needed].fill(true);
        *self.store_mut(key) = Some(store);
        written?;
        self.len = new_len;
        Ok(())
    }

    /// Page rows one latent row takes: 2 where the pool stores K/V rows as bf16 in host
    /// memory (a float32 row's bits, whole, in two bf16 rows), else 1.
    pub fn latent_rows(&self) -> usize {
        Self::latent_rows_storing(self.supply.pool().kv_dtype())
    }

    /// [`Self::latent_rows`] of a cache whose pool stores K/V rows as `kv_dtype`
    /// (`KvPool::kv_dtype`): what a planner reserves per latent state.
    pub fn latent_rows_storing(kv_dtype: Option<DType>) -> usize {
        if kv_dtype == Some(DType::BF16) {
            2
        } else {
            1
        }
    }

    /// Stores diffusion forcing's wavefront in the cache's pages: `states` `[n, n_embd]` as
    /// rows `0..n` of the key half, `embeds` `[m, n_embd]` (momentum) as rows `0..m` of the
    /// value half (each split into `heads` heads, as K/V rows are), replacing what was there.
    /// Pages come from the granted ones; pages past `max(n, m)` rows go back to the spare ones.
    pub fn write_latents(
        &mut self,
        states: &Tensor,
        embeds: Option<&Tensor>,
        heads: usize,
    ) -> Result<()> {
        if self.swapped.is_some() {
            return Err(ModelError::Cache("the cache is swapped out".into()));
        }
        let (n, dim) = states.dims2()?;
        let m = embeds.map(|e| e.dim(0)).transpose()?.unwrap_or(0);
        let rows = n.max(m);
        if heads == 0 || !dim.is_multiple_of(heads) {
            return Err(ModelError::Shape(format!(
                "latent rows of width {dim} do not split into {heads} heads"
            )));
        }
        // `[rows, dim]` (zero rows after `len`) as `[heads, rows, dim / heads]`.
        let split = |t: Option<&Tensor>, len: usize| -> Result<Tensor> {
            let t = match t {
                Some(t) if len == rows => t.clone(),
                Some(t) => {
                    let pad = Tensor::zeros((rows - len, dim), t.dtype(), t.device())?;
                    Tensor::cat(&[t, &pad], 0)?
                }
                None => Tensor::zeros((rows, dim), states.dtype(), states.device())?,
            };
            Ok(t.reshape((rows, heads, dim / heads))?
                .transpose(0, 1)?
                .contiguous()?)
        };
        let (k, v) = (split(Some(states), n)?, split(embeds, m)?);
        // In a pool that stores bf16, each float32 row goes whole into two rows of the page.
        let (k, v, rows) = if self.latent_rows() == 2 {
            (float_bits_as_bf16(&k)?, float_bits_as_bf16(&v)?, 2 * rows)
        } else {
            (k, v, rows)
        };
        let p = self.page_size();
        let used = self.pages_used();
        let mut store = self.latent.take().unwrap_or_default();
        let keep = rows.div_ceil(p);
        if store.pages.len() > keep {
            self.supply
                .give(store.pages.split_off(keep).into_iter().flatten());
        }
        let mut done = 0;
        let written = (|| {
            while done < rows {
                let (pi, take) = (done / p, p.min(rows - done));
                let id = store.page(pi, &mut self.supply, used)?;
                self.supply
                    .write(id, 0, &k.narrow(1, done, take)?, &v.narrow(1, done, take)?)?;
                done += take;
            }
            Ok::<(), ModelError>(())
        })();
        store.present = vec![true; done];
        self.latent = Some(store);
        written
    }

    /// The wavefront's states (rows `0..n`) and momentum embeddings (rows `0..m`, `None` when
    /// `m` is 0) as [`Self::write_latents`] stored them, `[rows, n_embd]` copies.
    pub fn read_latents(&self, n: usize, m: usize) -> Result<(Tensor, Option<Tensor>)> {
        let f = self.latent_rows();
        let store = self
            .latent
            .as_ref()
            .filter(|s| s.present.len() >= f * n.max(m))
            .ok_or_else(|| {
                ModelError::Cache(format!("the cache holds no {} latent rows", n.max(m)))
            })?;
        let p = self.page_size();
        let rows = f * n.max(m);
        let pieces: Vec<(u32, usize, usize)> = (0..rows.div_ceil(p))
            .map(|pi| {
                let id = store.pages[pi].expect("written rows have pages");
                (id, 0, p.min(rows - pi * p))
            })
            .collect();
        let (k, v) = crate::transformer::merge_runs(&self.supply.views(&pieces)?)?;
        let (k, v) = if f == 2 {
            (bf16_bits_as_float(&k)?, bf16_bits_as_float(&v)?)
        } else {
            (k, v)
        };
        let join = |t: Tensor, len: usize| -> Result<Tensor> {
            let (h, _, d) = t.dims3()?;
            Ok(t.narrow(1, 0, len)?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((len, h * d))?)
        };
        let states = join(k, n)?;
        let embeds = (m > 0).then(|| join(v, m)).transpose()?;
        Ok((states, embeds))
    }

    /// Keys and values `[H, T, D]` that queries ending at position `upto - 1` attend to in
    /// `layer`: positions `0..upto` (T = `upto`), resolved with the lookup strategy. Under `full`,
    /// positions missing from the layer are skipped, so T may be smaller than `upto`.
    pub(crate) fn read(&self, layer: CacheLayer, upto: usize) -> Result<(Tensor, Tensor)> {
        crate::transformer::merge_runs(&self.read_runs(layer, upto)?)
    }

    /// [`HuginnCache::read`] without concatenating: the keys and values as runs of consecutive
    /// positions `[H, n_i, D]` (one per page, or per run of pages with consecutive ids), views
    /// into the pool (nothing is copied), in key order.
    pub(crate) fn read_runs(
        &self,
        layer: CacheLayer,
        upto: usize,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let key = self.resolve(layer)?;
        let store = self
            .store(key)
            .ok_or_else(|| ModelError::Cache(format!("{layer:?} was never written")))?;
        let runs: Vec<(StoreKey, usize, usize)> = if store.covers(upto) {
            vec![(key, 0, upto)]
        } else {
            self.hole_runs(layer, key, store, upto)?
        };
        let p = self.page_size();
        let mut pieces = Vec::with_capacity(runs.len() + upto / p);
        for (source, start, n) in runs {
            let s = self.store(source).expect("run sources exist");
            let mut pos = start;
            while pos < start + n {
                let (pi, off) = (pos / p, pos % p);
                let take = (p - off).min(start + n - pos);
                let id = s.pages.get(pi).copied().flatten().ok_or_else(|| {
                    ModelError::Cache(format!("{layer:?}: no page holds position {pos}"))
                })?;
                pieces.push((id, off, take));
                pos += take;
            }
        }
        self.supply.views(&pieces)
    }

    /// Runs `(source store, start, n)` of consecutive positions below `upto` read from the same
    /// store, for a store with holes.
    fn hole_runs(
        &self,
        layer: CacheLayer,
        key: StoreKey,
        store: &KvStore,
        upto: usize,
    ) -> Result<Vec<(StoreKey, usize, usize)>> {
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
                    "{layer:?} has no entry for position {pos} under strategy `{}`",
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
                "{layer:?} has no entries below {upto}"
            )));
        }
        Ok(runs)
    }

    /// Whether the cache's pages are in host memory ([`Self::swap_out`]).
    pub fn is_swapped(&self) -> bool {
        self.swapped.is_some()
    }

    /// Pages [`Self::swap_in`] needs granted first.
    pub fn swapped_pages(&self) -> usize {
        self.swapped.as_ref().map_or(0, |s| {
            s.iter().map(|(_, p)| p.iter().flatten().count()).sum()
        })
    }

    /// Moves every page to host memory and gives up every page id (tables and spare ones: the
    /// caller hands them back to the engine). Returns the bytes moved.
    pub fn swap_out(&mut self) -> Result<usize> {
        if self.swapped.is_some() {
            return Err(ModelError::Cache("the cache is already swapped out".into()));
        }
        let keys: Vec<StoreKey> = [
            (&self.prelude, StoreKey::Prelude as fn(usize) -> StoreKey),
            (&self.core, StoreKey::Core),
            (&self.coda, StoreKey::Coda),
        ]
        .into_iter()
        .flat_map(|(list, make)| {
            list.iter()
                .enumerate()
                .filter(|(_, s)| s.is_some())
                .map(move |(i, _)| make(i))
        })
        .chain(self.latent.is_some().then_some(StoreKey::Latent))
        .collect();
        let mut out = Vec::with_capacity(keys.len());
        let mut bytes = 0;
        for key in keys {
            let pages =
                std::mem::take(&mut self.store_mut(key).as_mut().expect("listed above").pages);
            let host = pages
                .iter()
                .map(|id| id.map(|id| self.supply.copy_out(id)).transpose())
                .collect::<Result<Vec<_>>>()?;
            bytes += host.iter().flatten().map(HostPage::bytes).sum::<usize>();
            out.push((key, host));
        }
        self.supply.drop_spare();
        self.swapped = Some(out);
        // The pages come back as this cache's own.
        self.frozen = 0;
        Ok(bytes)
    }

    /// Moves the pages back from host memory into granted pages (any ids). Returns the bytes
    /// moved.
    pub fn swap_in(&mut self) -> Result<usize> {
        let (need, have) = (self.swapped_pages(), self.supply.spare());
        if need > have {
            return Err(ModelError::Cache(format!(
                "swapping in needs {need} pages; {have} were granted"
            )));
        }
        let Some(stores) = self.swapped.take() else {
            return Ok(0);
        };
        let mut bytes = 0;
        for (key, host) in stores {
            let mut pages = Vec::with_capacity(host.len());
            for h in &host {
                pages.push(match h {
                    Some(h) => {
                        bytes += h.bytes();
                        Some(self.supply.copy_in(h, 0)?)
                    }
                    None => None,
                });
            }
            if let Some(store) = self.store_mut(key).as_mut() {
                store.pages = pages;
            }
        }
        Ok(bytes)
    }
}

impl PagedCache for HuginnCache {
    fn pool(&self) -> &KvPool {
        HuginnCache::pool(self)
    }
    fn is_empty(&self) -> bool {
        HuginnCache::is_empty(self)
    }
    fn is_swapped(&self) -> bool {
        HuginnCache::is_swapped(self)
    }
    fn grant_pages(&mut self, pages: Vec<u32>) {
        self.grant(pages);
    }
    fn swap_out(&mut self) -> Result<usize> {
        HuginnCache::swap_out(self)
    }
    fn swap_in(&mut self) -> Result<usize> {
        HuginnCache::swap_in(self)
    }
    fn release_spare(&mut self, n: usize) -> Vec<u32> {
        self.supply.release_spare(n)
    }
    fn empty_in(&self, pool: KvPool) -> Self {
        HuginnCache::in_pool(self.strategy, pool)
    }
    fn adopt(&mut self, pool: KvPool) {
        self.supply = PageSupply::new(pool);
    }
}

/// A swapped-out [`HuginnCache`] as plain values (a request's cache while it moves).
#[derive(serde::Serialize, serde::Deserialize)]
struct SwappedHuginn {
    strategy: CacheStrategy,
    page_size: usize,
    len: usize,
    core_layers: Option<usize>,
    prelude: Vec<Option<KvStore>>,
    core: Vec<Option<KvStore>>,
    coda: Vec<Option<KvStore>>,
    latent: Option<KvStore>,
    swapped: Vec<SwappedStore>,
}

/// Only a swapped-out cache has a serde form (see [`KvCache`]'s).
impl serde::Serialize for HuginnCache {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::Error;
        let Some(swapped) = &self.swapped else {
            return Err(S::Error::custom(
                "a Huginn cache is exported only from host memory (preempt it first)",
            ));
        };
        SwappedHuginn {
            strategy: self.strategy,
            page_size: self.supply.page_size(),
            len: self.len,
            core_layers: self.core_layers,
            prelude: self.prelude.clone(),
            core: self.core.clone(),
            coda: self.coda.clone(),
            latent: self.latent.clone(),
            swapped: swapped.clone(),
        }
        .serialize(s)
    }
}

impl<'de> serde::Deserialize<'de> for HuginnCache {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error;
        let w = SwappedHuginn::deserialize(d)?;
        if w.page_size == 0 {
            return Err(D::Error::custom("a Huginn cache with pages of no position"));
        }
        let mut c = HuginnCache::in_pool(w.strategy, KvPool::private(w.page_size));
        c.len = w.len;
        c.core_layers = w.core_layers;
        c.prelude = w.prelude;
        c.core = w.core;
        c.coda = w.coda;
        c.latent = w.latent;
        for (key, _) in &w.swapped {
            if c.store_mut(*key).is_none() {
                return Err(D::Error::custom(
                    "a Huginn cache's pages name a layer it lacks",
                ));
            }
        }
        c.swapped = Some(w.swapped);
        Ok(c)
    }
}

/// The rows one sequence contributes to a packed call.
#[derive(Debug)]
pub struct SeqRows<'a> {
    /// This sequence's KV cache.
    pub cache: &'a mut HuginnCache,
    /// Absolute position of this sequence's first row.
    pub start: usize,
    /// Number of rows of this sequence in the packed tensor (contiguous, in slice order).
    pub len: usize,
    /// 0-based recurrence index, used by [`Huginn::core_step`] for the cache layer.
    pub recurrence: usize,
}

impl<'a> SeqRows<'a> {
    /// Rows `start..start + len` of `cache`, recurrence 0.
    pub fn new(cache: &'a mut HuginnCache, start: usize, len: usize) -> Self {
        Self {
            cache,
            start,
            len,
            recurrence: 0,
        }
    }

    /// The same rows at recurrence `recurrence`.
    pub fn at_recurrence(mut self, recurrence: usize) -> Self {
        self.recurrence = recurrence;
        self
    }
}

/// `[H, n, D]` float32 (host memory) as `[H, 2n, D]` bf16 holding its bits: value `j` of a row
/// is values `2j` (low half) and `2j + 1` of the pair of rows (little-endian).
fn float_bits_as_bf16(t: &Tensor) -> Result<Tensor> {
    let (h, n, d) = t.dims3()?;
    let x: Vec<f32> = t.flatten_all()?.to_vec1()?;
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    Ok(Tensor::from_raw_buffer(
        &bytes,
        DType::BF16,
        &[h, 2 * n, d],
        &candle_core::Device::Cpu,
    )?)
}

/// The inverse of [`float_bits_as_bf16`].
fn bf16_bits_as_float(t: &Tensor) -> Result<Tensor> {
    let (h, n2, d) = t.dims3()?;
    let x: Vec<half::bf16> = t.flatten_all()?.to_vec1()?;
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
    Ok(Tensor::from_raw_buffer(
        &bytes,
        DType::F32,
        &[h, n2 / 2, d],
        &candle_core::Device::Cpu,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

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
            cache.write(CacheLayer::Prelude(0), pos, &b, &b).unwrap();
        }
        assert_eq!(cache.len(), 40);
        let (k, _) = cache.read(CacheLayer::Prelude(0), 40).unwrap();
        assert_eq!(
            positions_of(&k),
            (0..40).map(|p| p as f32).collect::<Vec<_>>()
        );
        cache.truncate(10);
        assert_eq!(cache.len(), 10);
        let b = block(2, 1, 4, 0.0);
        assert!(cache.write(CacheLayer::Prelude(0), 11, &b, &b).is_err());
        cache.write(CacheLayer::Prelude(0), 10, &b, &b).unwrap();
        assert_eq!(cache.len(), 11);
        assert!(cache.write(CacheLayer::Prelude(1), 11, &b, &b).is_err());
    }

    #[test]
    fn compress_shares_slots_and_latest_falls_back() {
        let mut cache = HuginnCache::new("latest-m4".parse().unwrap());
        cache.bind_core_layers(4).unwrap();
        let b = |v: f32| block(1, 1, 2, v);
        // position 0 runs 3 recurrences, position 1 runs 1.
        cache
            .write(CacheLayer::Prelude(0), 0, &b(0.0), &b(0.0))
            .unwrap();
        for r in 0..3 {
            let layer = CacheLayer::Core {
                recurrence: r,
                layer: 1,
            };
            cache.write(layer, 0, &b(10.0 + r as f32), &b(0.0)).unwrap();
        }
        cache
            .write(CacheLayer::Prelude(0), 1, &b(0.0), &b(0.0))
            .unwrap();
        cache
            .write(
                CacheLayer::Core {
                    recurrence: 0,
                    layer: 1,
                },
                1,
                &b(20.0),
                &b(0.0),
            )
            .unwrap();
        cache
            .write(CacheLayer::Prelude(0), 2, &b(0.0), &b(0.0))
            .unwrap();
        for r in 0..4 {
            let layer = CacheLayer::Core {
                recurrence: r,
                layer: 1,
            };
            cache.write(layer, 2, &b(30.0 + r as f32), &b(0.0)).unwrap();
            let (k, _) = cache.read(layer, 3).unwrap();
            let r0 = (r as f32).min(2.0);
            assert_eq!(positions_of(&k), vec![10.0 + r0, 20.0, 30.0 + r as f32]);
        }

        let mut shared = HuginnCache::new("latest-m4-compress-s4".parse().unwrap());
        shared.bind_core_layers(4).unwrap();
        shared
            .write(CacheLayer::Prelude(0), 0, &b(0.0), &b(0.0))
            .unwrap();
        for r in 0..3 {
            let layer = CacheLayer::Core {
                recurrence: r,
                layer: 2,
            };
            shared.write(layer, 0, &b(r as f32), &b(0.0)).unwrap();
        }
        let (k, _) = shared
            .read(
                CacheLayer::Core {
                    recurrence: 0,
                    layer: 2,
                },
                1,
            )
            .unwrap();
        assert_eq!(positions_of(&k), vec![2.0]);
    }

    #[test]
    fn a_swapped_cache_needs_the_pages_it_needed_before_and_comes_back_bit_exact() {
        let pool = KvPool::shared(4);
        let mut cache = HuginnCache::in_pool("latest-m4-compress-s4".parse().unwrap(), pool);
        cache.bind_core_layers(4).unwrap();
        cache.grant((0..20).rev());
        for pos in 0..6 {
            let b = block(1, 1, 2, pos as f32);
            cache.write(CacheLayer::Prelude(0), pos, &b, &b).unwrap();
            let core = CacheLayer::Core {
                recurrence: 0,
                layer: 1,
            };
            cache.write(core, pos, &b, &b).unwrap();
        }
        assert_eq!(cache.pages_used(), 4);
        let need = cache.pages_after(6..8, 2, 4, 2);
        // Held: 4; the new rows' page 1 is missing from 6 layers (2 prelude, 3 core, 2 coda less
        // the two that have it).
        assert_eq!(need, 4 + 6);
        cache.swap_out().unwrap();
        assert_eq!(cache.pages_held(), 0);
        assert_eq!(cache.pages_after(6..8, 2, 4, 2), need);
        cache.grant([7, 3, 11, 9]);
        cache.swap_in().unwrap();
        let (k, _) = cache.read(CacheLayer::Prelude(0), 6).unwrap();
        assert_eq!(
            positions_of(&k),
            (0..6).map(|p| p as f32).collect::<Vec<_>>()
        );
    }

    /// Diffusion forcing's wavefront lives in the cache's pages: rows written are read back bit
    /// for bit (states and momentum embeddings of different lengths, across page boundaries),
    /// a smaller wave gives its pages back, the latent pages are not K/V pages to
    /// `pages_after`, and they move with the cache to host memory, through serde and back.
    #[test]
    fn latent_rows_live_in_pages_shrink_and_move_with_the_cache() {
        let pool = KvPool::shared(4);
        let mut cache = HuginnCache::in_pool("latest-m4-compress-s4".parse().unwrap(), pool);
        cache.bind_core_layers(4).unwrap();
        cache.grant((0..12).rev());
        let b = block(2, 3, 3, 1.0);
        cache.write(CacheLayer::Prelude(0), 0, &b, &b).unwrap();
        let kv_need = cache.pages_after(3..5, 2, 4, 2);
        let rows = |n: usize, base: f32| {
            let v: Vec<f32> = (0..n * 6).map(|i| base + i as f32).collect();
            Tensor::from_vec(v, (n, 6), &Device::Cpu).unwrap()
        };
        let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        // 9 states and 6 embeddings: 3 pages of 4 rows.
        let (z, e) = (rows(9, 0.0), rows(6, 1000.0));
        cache.write_latents(&z, Some(&e), 2).unwrap();
        assert_eq!(cache.latent_pages(), 3);
        assert_eq!(cache.pages_used(), 1 + 3);
        assert_eq!(
            cache.pages_after(3..5, 2, 4, 2),
            kv_need,
            "latent pages are not K/V"
        );
        let (rz, re) = cache.read_latents(9, 6).unwrap();
        assert_eq!(values(&rz), values(&z));
        assert_eq!(values(&re.unwrap()), values(&e));
        // The wave shrinks to 3 states and no embeddings: one page, two back to the spare ones.
        let spare = cache.pages_held() - cache.pages_used();
        let z = rows(3, 50.0);
        cache.write_latents(&z, None, 2).unwrap();
        assert_eq!(cache.latent_pages(), 1);
        assert_eq!(cache.pages_held() - cache.pages_used(), spare + 2);
        let (rz, re) = cache.read_latents(3, 0).unwrap();
        assert_eq!(values(&rz), values(&z));
        assert!(re.is_none());
        assert!(
            cache.read_latents(4, 0).is_err(),
            "only 3 rows were written"
        );
        // To host memory and back (and through serde, as an export does).
        cache.swap_out().unwrap();
        assert_eq!(cache.latent_pages(), 1);
        let bytes = postcard::to_allocvec(&cache).unwrap();
        let mut moved: HuginnCache = postcard::from_bytes(&bytes).unwrap();
        for c in [&mut cache, &mut moved] {
            let pool = KvPool::shared(4);
            c.adopt(pool);
            c.grant([5, 2]);
            c.swap_in().unwrap();
            let (rz, _) = c.read_latents(3, 0).unwrap();
            assert_eq!(values(&rz), values(&z));
        }
        assert!(
            cache.write_latents(&rows(2, 0.0), None, 4).is_err(),
            "6 is not 4 heads"
        );
    }

    /// A pool that stores bf16: K/V rows are rounded as they are written (half the bytes),
    /// latent states keep their float32 bits (each in two rows of a page), through host memory
    /// and back; host pages of float32 are refused with the flag to set.
    #[test]
    fn a_bf16_pool_rounds_kv_rows_and_keeps_latent_bits() {
        let pool = KvPool::shared_storing(4, Some(DType::BF16));
        let mut cache = HuginnCache::in_pool(CacheStrategy::Full, pool.clone());
        cache.bind_core_layers(4).unwrap();
        cache.grant((0..12).rev());
        assert_eq!(cache.latent_rows(), 2);
        // Values off the bf16 grid: 1 + 2^-10 rounds to 1.
        let kv = Tensor::from_vec(
            vec![1.0f32 + 1.0 / 1024.0; 2 * 3 * 3],
            (2, 3, 3),
            &Device::Cpu,
        )
        .unwrap();
        cache.write(CacheLayer::Prelude(0), 0, &kv, &kv).unwrap();
        let (k, _) = cache.read(CacheLayer::Prelude(0), 3).unwrap();
        assert_eq!(k.dtype(), DType::BF16);
        let k: Vec<f32> = k
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(k.iter().all(|&x| x == 1.0), "{k:?}");
        assert_eq!(pool.allocated_bytes(), 2 * 2 * (256 * 4) * 3 * 2);
        // 5 states of width 6 in 2 heads: 10 rows, 3 pages of 4.
        let z: Vec<f32> = (0..30).map(|i| 0.1 + i as f32 / 7.0).collect();
        let z = Tensor::from_vec(z, (5, 6), &Device::Cpu).unwrap();
        cache
            .write_latents(&z, Some(&z.affine(-1.0, 0.0).unwrap()), 2)
            .unwrap();
        assert_eq!(cache.latent_pages(), 3);
        let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (rz, re) = cache.read_latents(5, 5).unwrap();
        assert_eq!(values(&rz), values(&z));
        assert_eq!(values(&re.unwrap()), values(&z.affine(-1.0, 0.0).unwrap()));
        cache.swap_out().unwrap();
        cache.grant((0..12).rev());
        cache.swap_in().unwrap();
        let (rz, _) = cache.read_latents(5, 0).unwrap();
        assert_eq!(values(&rz), values(&z));
        // A float32 cache's pages do not go into this pool.
        let mut float = HuginnCache::in_pool(CacheStrategy::Full, KvPool::shared(4));
        float.bind_core_layers(4).unwrap();
        float.grant((0..4).rev());
        float.write(CacheLayer::Prelude(0), 0, &kv, &kv).unwrap();
        float.swap_out().unwrap();
        float.adopt(KvPool::shared_storing(4, Some(DType::BF16)));
        float.grant((0..4).rev());
        let err = float.swap_in().unwrap_err().to_string();
        assert!(err.contains("--kv-cache-dtype"), "{err}");
    }

    #[test]
    fn full_skips_missing_positions() {
        let mut cache = HuginnCache::new(CacheStrategy::Full);
        cache.bind_core_layers(4).unwrap();
        let b = |v: f32| block(1, 1, 2, v);
        let layer = CacheLayer::Core {
            recurrence: 1,
            layer: 0,
        };
        cache
            .write(CacheLayer::Prelude(0), 0, &b(0.0), &b(0.0))
            .unwrap();
        cache
            .write(CacheLayer::Prelude(0), 1, &b(0.0), &b(0.0))
            .unwrap();
        cache.write(layer, 1, &b(5.0), &b(0.0)).unwrap();
        let (k, _) = cache.read(layer, 2).unwrap();
        assert_eq!(positions_of(&k), vec![5.0]);
    }
}
