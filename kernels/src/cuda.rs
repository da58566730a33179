//! Launchers of the CUDA kernels (PTX built by `build.rs`), with the layouts of the CPU
//! references in [`crate::attention`], [`crate::grouped`], [`crate::pages`] and
//! [`crate::softmax_stats`].
//! Element types: `f32` and `bf16` (float32 accumulation in both).

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DeviceRepr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use half::bf16;

use crate::attention::RaggedLayout;
use crate::grouped::{self, Group};
use crate::pages::ScatterDims;
use crate::softmax_stats::RowStats;
use crate::{check, KernelError};

const ATTENTION: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
const GROUPED: &str = include_str!(concat!(env!("OUT_DIR"), "/grouped.ptx"));
const SOFTMAX_STATS: &str = include_str!(concat!(env!("OUT_DIR"), "/softmax_stats.ptx"));

/// Largest head_dim of the split-key attention kernel (16 values per thread, 32 threads a key).
pub const MAX_HEAD_DIM: usize = 512;
/// Largest head_dim of the one-warp baseline kernel (8 values per lane).
pub const MAX_HEAD_DIM_WARP: usize = 256;
/// Threads of a split-key attention block (`SPLIT_THREADS` in `cuda/attention.cu`).
const SPLIT_THREADS: usize = 128;
/// Fewest keys a split of the split-key kernel takes (below that the partials' merge costs
/// more than the parallelism gives).
const MIN_SPLIT_KEYS: usize = 64;
const TILE: u32 = 16;

/// Sizes of one ragged attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RaggedDims {
    pub rows: usize,
    pub keys: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// The most keys any one sequence of the call has ([`RaggedLayout::max_seq_keys`]): how
    /// the split-key kernel sizes its splits. A larger value (up to `keys`) is correct too,
    /// only launches blocks that find no keys.
    pub max_seq_keys: usize,
}

impl RaggedDims {
    pub fn of(layout: &RaggedLayout) -> Self {
        Self {
            rows: layout.rows(),
            keys: layout.keys(),
            n_heads: layout.n_heads,
            n_kv_heads: layout.n_kv_heads,
            head_dim: layout.head_dim,
            scale: layout.scale,
            max_seq_keys: layout.max_seq_keys(),
        }
    }
}

/// Which CUDA kernel computes ragged attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RaggedKernel {
    /// Split-key (flash-decoding): blocks of 128 threads over ranges of a row's keys, several
    /// keys in flight per thread, partials merged by a second launch when a row has several
    /// splits; a block computes up to 8 query heads of one kv group, so a key is read once
    /// for all of them. What [`Kernels::ragged_attention_paged`] runs.
    #[default]
    SplitKey,
    /// [`RaggedKernel::SplitKey`] with one query head per block (each head of a kv group
    /// reads its keys again): kept to measure what the grouping gives.
    SplitKeyPerHead,
    /// One warp per (row, head) walking its keys one by one (head_dim <= 256): the kernel
    /// before the split-key one, kept as the baseline `bench-ragged` measures against.
    Warp,
}

/// How the split-key kernel divides a call: `splits` ranges of `chunk` keys per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitPlan {
    pub splits: usize,
    pub chunk: usize,
}

impl SplitPlan {
    /// The plan of [`RaggedKernel::SplitKey`] for `dims` on `sms` multiprocessors.
    pub fn new(dims: &RaggedDims, sms: usize) -> Self {
        let group = dims.n_heads / dims.n_kv_heads.max(1);
        let (_, _, hg) = split_shape(dims.head_dim, group);
        Self::with_heads_per_block(dims, sms, hg)
    }

    /// Enough blocks for `sms` multiprocessors (eight blocks each, several waves with the
    /// partial waves of ragged rows), never a split of fewer than [`MIN_SPLIT_KEYS`] keys:
    /// one split (no merge launch) when the rows and head blocks alone fill the device.
    fn with_heads_per_block(dims: &RaggedDims, sms: usize, hg: usize) -> Self {
        let keys = dims.max_seq_keys.max(1);
        let pairs = (dims.rows * dims.n_heads / hg.max(1)).max(1);
        let want = (8 * sms.max(1)).div_ceil(pairs);
        let splits = want.min(keys.div_ceil(MIN_SPLIT_KEYS)).clamp(1, 65_535);
        // Whole steps of the kernel's loop: two keys per group of threads, 4 to 16 groups a
        // block, so a multiple of 32 keys suits every instantiation.
        let chunk = keys.div_ceil(splits).next_multiple_of(32);
        Self {
            splits: keys.div_ceil(chunk),
            chunk,
        }
    }
}

/// The split-key kernel's instantiations (`INSTANTIATE_SPLITS` in `cuda/attention.cu`):
/// (threads per key, dims per thread, query heads per block). Their products of the first two
/// (the dims a key's threads cover) and the third are what [`split_shape`] chooses by.
const SPLIT_SHAPES: [(usize, usize, usize); 19] = [
    (8, 1, 1),
    (8, 2, 1),
    (8, 4, 1),
    (8, 8, 1),
    (8, 16, 1),
    (16, 16, 1),
    (32, 16, 1),
    (8, 4, 2),
    (8, 8, 2),
    (16, 8, 2),
    (32, 8, 2),
    (32, 16, 2),
    (8, 4, 4),
    (8, 8, 4),
    (16, 8, 4),
    (32, 8, 4),
    (8, 4, 8),
    (16, 4, 8),
    (32, 4, 8),
];

/// The instantiation for a head dimension and a kv group of `group` query heads: the most
/// heads per block that divide the group (so a block never spans two kv heads), then the
/// fewest dims per key that cover `head_dim`.
fn split_shape(head_dim: usize, group: usize) -> (usize, usize, usize) {
    [8, 4, 2, 1]
        .into_iter()
        .filter(|hg| group.is_multiple_of(*hg))
        .find_map(|hg| {
            SPLIT_SHAPES
                .iter()
                .filter(|&&(t, d, h)| h == hg && t * d >= head_dim)
                .min_by_key(|&&(t, d, _)| t * d)
                .copied()
        })
        .unwrap_or((32, 16, 1))
}

/// The instantiation with one query head per block.
fn split_shape_per_head(head_dim: usize) -> (usize, usize, usize) {
    split_shape(head_dim, 1)
}

/// A [`RaggedLayout`]'s tables on the device: [`RaggedLayout::seq_table`],
/// [`RaggedLayout::row_seq`], `row_index` and `key_index`.
pub struct RaggedTables<'a> {
    pub seq_table: &'a CudaSlice<u32>,
    pub row_seq: &'a CudaSlice<u32>,
    pub row_index: &'a CudaSlice<u32>,
    pub key_index: &'a CudaSlice<u32>,
}

/// A run of a call's keys on the device: `keys` consecutive keys of every kv head, head `g`'s
/// key `i` at element `g · head_stride + i · head_dim` of `k` (and of `v`). A slice of a K/V
/// page arena `[Hkv, arena_rows, D]` from its first key on is a run with head stride
/// `arena_rows · D`; a contiguous `[Hkv, keys, D]` buffer is one with `keys · D`.
pub struct KvRun<'a, T> {
    pub k: CudaView<'a, T>,
    pub v: CudaView<'a, T>,
    pub keys: usize,
    pub head_stride: usize,
}

impl<T> KvRun<'_, T> {
    /// Whether the run's keys of `n_kv_heads` heads of `head_dim` lie inside its views.
    fn fits(&self, n_kv_heads: usize, head_dim: usize) -> bool {
        if self.keys == 0 {
            return true;
        }
        let need = (n_kv_heads - 1) * self.head_stride + self.keys * head_dim;
        self.head_stride >= self.keys * head_dim && self.k.len() >= need && self.v.len() >= need
    }
}

/// A [`RaggedLayout`]'s tables uploaded to the device (owned); [`LayoutTables::tables`] lends
/// them to the launchers.
pub struct LayoutTables {
    seq_table: CudaSlice<u32>,
    row_seq: CudaSlice<u32>,
    row_index: CudaSlice<u32>,
    key_index: CudaSlice<u32>,
}

impl LayoutTables {
    /// Validates `layout` and uploads its tables on `stream`.
    pub fn upload(stream: &Arc<CudaStream>, layout: &RaggedLayout) -> Result<Self, KernelError> {
        layout.validate()?;
        Ok(Self {
            seq_table: stream.clone_htod(&layout.seq_table())?,
            row_seq: stream.clone_htod(&layout.row_seq())?,
            row_index: stream.clone_htod(&layout.row_index)?,
            key_index: stream.clone_htod(&layout.key_index)?,
        })
    }

    pub fn tables(&self) -> RaggedTables<'_> {
        RaggedTables {
            seq_table: &self.seq_table,
            row_seq: &self.row_seq,
            row_index: &self.row_index,
            key_index: &self.key_index,
        }
    }
}

/// A call's runs of keys as the attention kernels read them, on the device
/// ([`Kernels::upload_runs`]); it borrows the runs, so their buffers outlive it.
pub struct RunTable<'a, T> {
    table: CudaSlice<u64>,
    n_runs: u32,
    keys: usize,
    _runs: PhantomData<&'a [KvRun<'a, T>]>,
}

/// An element type the kernels are instantiated for.
pub trait Elem: DeviceRepr + Copy {
    const SUFFIX: &'static str;
}
impl Elem for f32 {
    const SUFFIX: &'static str = "f32";
}
impl Elem for bf16 {
    const SUFFIX: &'static str = "bf16";
}

/// The loaded kernels of one device, launched on one stream.
pub struct Kernels {
    stream: Arc<CudaStream>,
    modules: [Arc<CudaModule>; 3],
    /// The device's multiprocessors (how the split-key kernel sizes its grid).
    sms: usize,
}

impl Kernels {
    /// The kernels of `ctx`'s device, launched on its default stream.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, KernelError> {
        Self::on_stream(ctx.default_stream())
    }

    /// The kernels of `stream`'s device, launched on `stream` (e.g. candle's stream of a
    /// device, so launches are ordered with candle's own work without synchronising).
    pub fn on_stream(stream: Arc<CudaStream>) -> Result<Self, KernelError> {
        let ctx = stream.context().clone();
        let load = |src: &str| ctx.load_module(Ptx::from_src(src));
        let sms = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?;
        Ok(Self {
            modules: [load(ATTENTION)?, load(GROUPED)?, load(SOFTMAX_STATS)?],
            stream,
            sms: sms.max(1) as usize,
        })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's multiprocessor count.
    pub fn multiprocessors(&self) -> usize {
        self.sms
    }

    fn function(&self, module: usize, name: &str) -> Result<CudaFunction, KernelError> {
        Ok(self.modules[module].load_function(name)?)
    }

    /// Ragged attention: `q` `[H, rows, D]`, `k`/`v` `[Hkv, keys, D]` → `out` `[H, rows, D]`.
    /// Uploads the layout's tables, then [`Kernels::ragged_attention_with`].
    pub fn ragged_attention<T: Elem>(
        &self,
        layout: &RaggedLayout,
        q: &CudaSlice<T>,
        k: &CudaSlice<T>,
        v: &CudaSlice<T>,
        out: &mut CudaSlice<T>,
    ) -> Result<(), KernelError> {
        let tables = LayoutTables::upload(&self.stream, layout)?;
        let (q, k, v) = (q.as_view(), k.as_view(), v.as_view());
        self.ragged_attention_with(&RaggedDims::of(layout), &tables.tables(), &q, &k, &v, out)
    }

    /// Ragged attention over tables already on the device (uploaded once per packed call and
    /// shared by every layer), with the keys in one contiguous buffer: `k`/`v`
    /// `[Hkv, keys, D]`. The tables must come from a [`RaggedLayout`] that passed
    /// [`RaggedLayout::validate`] with `dims`' row and key counts: the kernel trusts the
    /// per-sequence ranges they hold.
    pub fn ragged_attention_with<T: Elem>(
        &self,
        dims: &RaggedDims,
        tables: &RaggedTables<'_>,
        q: &CudaView<'_, T>,
        k: &CudaView<'_, T>,
        v: &CudaView<'_, T>,
        out: &mut CudaSlice<T>,
    ) -> Result<(), KernelError> {
        let run = KvRun {
            k: k.slice(..),
            v: v.slice(..),
            keys: dims.keys,
            head_stride: dims.keys * dims.head_dim,
        };
        self.ragged_attention_paged(dims, tables, q, &[run], out)
    }

    /// Ragged attention reading the keys where they are: the call's key axis is `runs` in
    /// order (pages of a K/V pool's arenas, the call's own rows, a shared prefix's pages), so
    /// no sequence's cache is gathered or copied. Only the runs' table (four `u64` per run) is
    /// uploaded; the other tables are as for [`Kernels::ragged_attention_with`]. Runs the
    /// split-key kernel ([`RaggedKernel::SplitKey`]).
    pub fn ragged_attention_paged<T: Elem>(
        &self,
        dims: &RaggedDims,
        tables: &RaggedTables<'_>,
        q: &CudaView<'_, T>,
        runs: &[KvRun<'_, T>],
        out: &mut CudaSlice<T>,
    ) -> Result<(), KernelError> {
        self.ragged_attention_kernel(RaggedKernel::SplitKey, dims, tables, q, runs, out)
    }

    /// [`Kernels::ragged_attention_paged`] through the chosen kernel: uploads the runs'
    /// table, then [`Kernels::ragged_attention_runs`].
    pub fn ragged_attention_kernel<T: Elem>(
        &self,
        kernel: RaggedKernel,
        dims: &RaggedDims,
        tables: &RaggedTables<'_>,
        q: &CudaView<'_, T>,
        runs: &[KvRun<'_, T>],
        out: &mut CudaSlice<T>,
    ) -> Result<(), KernelError> {
        let table = self.upload_runs(dims, runs)?;
        self.ragged_attention_runs(kernel, dims, tables, q, &table, out)
    }

    /// The runs' table of a call on the device (four `u64` per run and a last entry holding
    /// the key count), after checking that every run lies inside its views and that they add
    /// up to the call's keys. The table borrows the runs, so their buffers outlive it.
    pub fn upload_runs<'a, T: Elem>(
        &self,
        dims: &RaggedDims,
        runs: &'a [KvRun<'a, T>],
    ) -> Result<RunTable<'a, T>, KernelError> {
        let (hkv, d) = (dims.n_kv_heads, dims.head_dim);
        let mut keys = 0;
        for (i, r) in runs.iter().enumerate() {
            check(r.fits(hkv, d), || {
                format!(
                    "run {i}: {} keys of {hkv} heads at head stride {} do not fit its {}/{} values",
                    r.keys,
                    r.head_stride,
                    r.k.len(),
                    r.v.len()
                )
            })?;
            keys += r.keys;
        }
        check(keys == dims.keys, || {
            format!("the runs hold {keys} keys, the call has {}", dims.keys)
        })?;
        let s = &self.stream;
        // Pointers stay valid while the table borrows `runs`; the guards order any write to
        // their buffers before the upload (a no-op on one stream).
        let mut guards = Vec::with_capacity(2 * runs.len());
        let mut table = Vec::with_capacity(4 * runs.len() + 8);
        let mut first = 0u64;
        for r in runs {
            let (kp, kg) = r.k.device_ptr(s);
            let (vp, vg) = r.v.device_ptr(s);
            guards.push(kg);
            guards.push(vg);
            table.extend([kp, vp, r.head_stride as u64, first]);
            first += r.keys as u64;
        }
        if runs.is_empty() {
            // An empty run, so the kernel's run search always has one to start from.
            table.extend([0, 0, 0, 0]);
        }
        table.extend([0, 0, 0, first]);
        let n_runs = (table.len() / 4 - 1) as u32;
        let table = s.clone_htod(&table)?;
        drop(guards);
        Ok(RunTable {
            table,
            n_runs,
            keys,
            _runs: PhantomData,
        })
    }

    /// Ragged attention over a run table already on the device (see
    /// [`Kernels::upload_runs`]), through the chosen kernel.
    pub fn ragged_attention_runs<T: Elem>(
        &self,
        kernel: RaggedKernel,
        dims: &RaggedDims,
        tables: &RaggedTables<'_>,
        q: &CudaView<'_, T>,
        runs: &RunTable<'_, T>,
        out: &mut CudaSlice<T>,
    ) -> Result<(), KernelError> {
        let (h, hkv, d) = (dims.n_heads, dims.n_kv_heads, dims.head_dim);
        check(hkv > 0 && h.is_multiple_of(hkv), || {
            format!("{hkv} kv heads do not divide {h} heads")
        })?;
        let max_d = match kernel {
            RaggedKernel::SplitKey | RaggedKernel::SplitKeyPerHead => MAX_HEAD_DIM,
            RaggedKernel::Warp => MAX_HEAD_DIM_WARP,
        };
        check(d <= max_d, || format!("head_dim {d} > {max_d}"))?;
        check(dims.max_seq_keys <= dims.keys || dims.keys == 0, || {
            format!(
                "a sequence of {} keys in a call of {}",
                dims.max_seq_keys, dims.keys
            )
        })?;
        check(q.len() == dims.rows * h * d && out.len() == q.len(), || {
            "q/out shape".into()
        })?;
        check(
            tables.row_seq.len() == dims.rows
                && tables.row_index.len() == dims.rows
                && tables.key_index.len() == dims.keys
                && tables.seq_table.len().is_multiple_of(7),
            || "tables do not match the row and key counts".into(),
        )?;
        check(runs.keys == dims.keys, || {
            format!(
                "the runs hold {} keys, the call has {}",
                runs.keys, dims.keys
            )
        })?;
        if dims.rows == 0 {
            return Ok(());
        }
        let s = &self.stream;
        let (table, n_runs) = (&runs.table, runs.n_runs);
        let (h32, hkv32, d32, rows32) = (h as u32, hkv as u32, d as u32, dims.rows as u32);
        if kernel == RaggedKernel::Warp {
            let f = self.function(0, &format!("ragged_attention_{}", T::SUFFIX))?;
            let cfg = LaunchConfig {
                grid_dim: (rows32, h32, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = s.launch_builder(&f);
            b.arg(q).arg(out).arg(table).arg(&n_runs);
            b.arg(tables.seq_table)
                .arg(tables.row_seq)
                .arg(tables.row_index)
                .arg(tables.key_index);
            b.arg(&rows32)
                .arg(&h32)
                .arg(&hkv32)
                .arg(&d32)
                .arg(&dims.scale);
            // SAFETY: argument types and order match the kernel's signature; q/out lengths and
            // every run's extent were checked above and by `upload_runs`, the runs add up to
            // the tables' key count, and the tables' ranges were checked when their layout was
            // validated.
            unsafe { b.launch(cfg) }?;
            return Ok(());
        }
        let (tpk, dpt, hg) = match kernel {
            RaggedKernel::SplitKeyPerHead => split_shape_per_head(d),
            _ => split_shape(d, h / hkv),
        };
        let plan = SplitPlan::with_heads_per_block(dims, self.sms, hg);
        let f = self.function(0, &format!("ragged_split_{}_{tpk}_{dpt}_{hg}", T::SUFFIX))?;
        // Partials only when a row has several splits; one split writes `out` itself.
        let part_len = if plan.splits > 1 {
            dims.rows * h * plan.splits * (d + 2)
        } else {
            1
        };
        // SAFETY: every block writes its partial (head_dim values, its max and its sum, `-inf`
        // and 0 for a split with no keys) before the merge launch reads it.
        let mut part = unsafe { s.alloc::<f32>(part_len) }?;
        let chunk32 = plan.chunk as u32;
        let cfg = LaunchConfig {
            grid_dim: (rows32, plan.splits as u32, (h / hg) as u32),
            block_dim: (SPLIT_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        {
            let mut b = s.launch_builder(&f);
            b.arg(q)
                .arg(&mut *out)
                .arg(&mut part)
                .arg(table)
                .arg(&n_runs);
            b.arg(tables.seq_table)
                .arg(tables.row_seq)
                .arg(tables.row_index)
                .arg(tables.key_index);
            b.arg(&rows32)
                .arg(&h32)
                .arg(&hkv32)
                .arg(&d32)
                .arg(&dims.scale)
                .arg(&chunk32);
            // SAFETY: as for the warp kernel; `part` holds rows · heads · splits partials of
            // head_dim + 2 floats when there are several splits, and is not touched otherwise.
            unsafe { b.launch(cfg) }?;
        }
        if plan.splits > 1 {
            let f = self.function(0, &format!("ragged_combine_{}", T::SUFFIX))?;
            let splits32 = plan.splits as u32;
            let cfg = LaunchConfig {
                grid_dim: (rows32, h32, 1),
                block_dim: (d.next_multiple_of(32).min(256) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = s.launch_builder(&f);
            b.arg(&part)
                .arg(out)
                .arg(&rows32)
                .arg(&h32)
                .arg(&d32)
                .arg(&splits32);
            // SAFETY: `part` was written in full by the launch before it on this stream; `out`
            // holds rows · heads · head_dim elements (checked above).
            unsafe { b.launch(cfg) }?;
        }
        Ok(())
    }

    /// Grouped matmul: `x` `[rows, k]`, `w` `[layers, n, k]` → `y` `[rows, n]`.
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_matmul<T: Elem>(
        &self,
        groups: &[Group],
        x: &CudaSlice<T>,
        w: &CudaSlice<T>,
        y: &mut CudaSlice<T>,
        layers: usize,
        k: usize,
        n: usize,
    ) -> Result<(), KernelError> {
        let rows = groups.last().map_or(0, |g| g.rows.end as usize);
        grouped::validate(groups, rows, layers, k, n, x.len(), w.len())?;
        check(y.len() == rows * n, || "y shape".into())?;
        let tiles: Vec<u32> = grouped::row_tiles(groups, TILE).concat();
        if tiles.is_empty() {
            return Ok(());
        }
        let s = &self.stream;
        let weights: Vec<u32> = groups.iter().map(|g| g.weight).collect();
        let tiles_d = s.clone_htod(&tiles)?;
        let weights_d = s.clone_htod(&weights)?;
        let f = self.function(1, &format!("grouped_matmul_{}", T::SUFFIX))?;
        let (k32, n32) = (k as u32, n as u32);
        let cfg = LaunchConfig {
            grid_dim: (n32.div_ceil(TILE), (tiles.len() / 3) as u32, 1),
            block_dim: (TILE, TILE, 1),
            shared_mem_bytes: 0,
        };
        let mut b = s.launch_builder(&f);
        b.arg(x)
            .arg(w)
            .arg(y)
            .arg(&tiles_d)
            .arg(&weights_d)
            .arg(&k32)
            .arg(&n32);
        // SAFETY: as above; tiles never leave their group's rows and weights index the stack.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Per-row softmax statistics of `logits` `[rows, vocab]`; `prev` (log-probabilities of the
    /// same shape) adds the KL divergence, `log_probs_out` receives the rows' log-probabilities.
    /// Only `4 · rows` floats come back to the host.
    pub fn softmax_stats<T: Elem>(
        &self,
        logits: &CudaSlice<T>,
        vocab: usize,
        prev: Option<&CudaSlice<f32>>,
        log_probs_out: Option<&mut CudaSlice<f32>>,
    ) -> Result<Vec<RowStats>, KernelError> {
        check(vocab > 0 && logits.len().is_multiple_of(vocab), || {
            "logits are not whole rows".into()
        })?;
        let rows = logits.len() / vocab;
        check(prev.is_none_or(|p| p.len() == logits.len()), || {
            "prev shape".into()
        })?;
        check(
            log_probs_out
                .as_ref()
                .is_none_or(|p| p.len() == logits.len()),
            || "log_probs_out shape".into(),
        )?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let s = &self.stream;
        let mut stats = s.alloc_zeros::<f32>(4 * rows)?;
        let f = self.function(2, &format!("softmax_stats_{}", T::SUFFIX))?;
        let null = 0u64;
        let vocab32 = vocab as u32;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = s.launch_builder(&f);
        b.arg(logits);
        match prev {
            Some(p) => b.arg(p),
            None => b.arg(&null),
        };
        match log_probs_out {
            Some(o) => b.arg(o),
            None => b.arg(&null),
        };
        b.arg(&mut stats).arg(&vocab32);
        // SAFETY: as above; a null pointer is how the kernel is told an optional buffer is absent.
        unsafe { b.launch(cfg) }?;
        let host = s.clone_dtoh(&stats)?;
        Ok(host
            .chunks_exact(4)
            .map(|c| RowStats {
                lse: c[0],
                top_prob: c[1],
                top_id: c[2].to_bits(),
                kl: c[3],
            })
            .collect())
    }

    /// [`crate::pages::scatter_rows`] on the device: row `r` of `src` into row `slots[r]` of
    /// `dst`, every head, in one launch (the slots uploaded with it); rows whose slot is
    /// [`crate::pages::SKIP_ROW`] are left out.
    pub fn scatter_rows<T: Elem>(
        &self,
        dst: &mut CudaViewMut<'_, T>,
        src: &CudaView<'_, T>,
        dims: &ScatterDims,
        slots: &[u32],
    ) -> Result<(), KernelError> {
        dims.check(dst.len(), src.len(), slots)?;
        let total = dims.heads * dims.n * dims.head_dim;
        if total == 0 {
            return Ok(());
        }
        let s = &self.stream;
        let slots = s.clone_htod(slots)?;
        let f = self.function(0, &format!("scatter_rows_{}", T::SUFFIX))?;
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(256).min(16 * self.sms).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (heads, n, head_dim) = (dims.heads as u32, dims.n as u32, dims.head_dim as u32);
        let (dst_hs, src_hs, src_rs) = (
            (dims.dst_rows * dims.head_dim) as u64,
            dims.src_head_stride as u64,
            dims.src_row_stride as u64,
        );
        let mut b = s.launch_builder(&f);
        b.arg(dst)
            .arg(src)
            .arg(&slots)
            .arg(&heads)
            .arg(&n)
            .arg(&head_dim)
            .arg(&dst_hs)
            .arg(&src_hs)
            .arg(&src_rs);
        // SAFETY: `dims.check` bounds both buffers' extents and the slots' range, and makes
        // the slots distinct: the kernel reads `src` and writes only the rows the slots name.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}
