//! Attention of packed query rows over keys read where they live, on the CPU.
//!
//! `out[h, r] = Σ_t softmax_t(scale · q[h, r] · k[g, t]) v[g, t]` over the keys `t` of row
//! `r`'s sequence that its [`Mask`] allows, `g` the key/value head of query head `h`
//! (grouped-query attention). Queries and outputs are head-major `[H, N, D]`, the layout of the
//! model crate's activations. A sequence's keys are a list of [`KvBlock`]s in key order, each a
//! run of keys inside some buffer (a cache, a page, a shared prefix, the call's own rows) with
//! its own head stride, so nothing is concatenated or gathered to attend.
//!
//! Work: one task per (sequence, key/value head, run of rows), spread over the pool. A task
//! streams its keys and values once for all the query heads of its group and all its rows:
//! scores for every query, a softmax per query (maximum, `exp`, sum, in float32, as the
//! reference implementations do it), then the weighted sum of the values. Runs of rows are as
//! long as keep every thread busy (at least 64 rows), so a sequence's keys are packed once for
//! as many rows as possible. Many queries go 32 at a time through the two products, over only
//! the leading keys the last of them can see (a causal prefill skips the keys after its rows;
//! a masked key would add an exact 0, so the bits are those of the whole product). In the bf16
//! compute mode the two products take bfloat16 operands and float32 sums, as bf16-dot weights
//! do.
//!
//! Reductions have one order on every instruction set (see [`super::simd`]), so results do not
//! depend on the machine's vector width or on the other sequences of the call.

use std::ops::Range;

use crate::attention::Mask;
use crate::{check, KernelError};

use super::aligned::Aligned;
use super::matmul::{
    bf16_panels, gemm_panels, pack_bf16_column_pairs, pack_column_pairs, pack_row_pairs, NR,
};
use super::simd::{self, Isa};
use super::SendPtr;

/// Keys or values as stored: float32, or bfloat16 (each value the upper half of a float32's
/// bits, the K/V cache's bf16 storage). Attention over bfloat16 keys and values has the bits of
/// attention over the float32 values they stand for.
#[derive(Debug, Clone, Copy)]
pub enum KvData<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl<'a> KvData<'a> {
    /// The values `r`.
    fn sub(self, r: Range<usize>) -> KvData<'a> {
        match self {
            KvData::F32(x) => KvData::F32(&x[r]),
            KvData::Bf16(x) => KvData::Bf16(&x[r]),
        }
    }

    /// Appends the values, as float32.
    fn extend_f32(&self, out: &mut Vec<f32>) {
        match self {
            Self::F32(x) => out.extend_from_slice(x),
            Self::Bf16(x) => out.extend(x.iter().map(|&b| simd::Elem::to_f32(b))),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Self::F32(x) => x.len(),
            Self::Bf16(x) => x.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn prefetch(&self, at: usize, n: usize) {
        match self {
            Self::F32(x) => simd::prefetch(&x[at..at + n]),
            Self::Bf16(x) => simd::prefetch(&x[at..at + n]),
        }
    }
}

impl<'a> From<&'a [f32]> for KvData<'a> {
    fn from(x: &'a [f32]) -> Self {
        Self::F32(x)
    }
}

impl<'a> From<&'a Vec<f32>> for KvData<'a> {
    fn from(x: &'a Vec<f32>) -> Self {
        Self::F32(x)
    }
}

/// A run of `len` consecutive keys: key `t` of head `g` starts at `k[g·head_stride + t·D]`
/// (values alike).
#[derive(Debug, Clone, Copy)]
pub struct KvBlock<'a> {
    pub k: KvData<'a>,
    pub v: KvData<'a>,
    pub len: usize,
    pub head_stride: usize,
}

/// One sequence of a call: its query rows, their buffer indices, its keys in order with their
/// buffer indices (`None`: key `t` is buffer index `t`) and its mask rule.
#[derive(Debug, Clone)]
pub struct SeqAttention<'a> {
    pub rows: Range<usize>,
    pub row_index: &'a [u32],
    pub blocks: Vec<KvBlock<'a>>,
    pub key_index: Option<&'a [u32]>,
    pub mask: Mask,
}

impl SeqAttention<'_> {
    fn keys(&self) -> usize {
        self.blocks.iter().map(|b| b.len).sum()
    }

    fn key_at(&self, t: usize) -> u32 {
        self.key_index.map_or(t as u32, |ix| ix[t])
    }
}

/// Shapes of a call.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Write the output row-major `[rows, H, D]` (what the output projection reads) instead of
    /// head-major `[H, rows, D]`.
    pub rows_out: bool,
    /// The bf16 compute mode: a sequence of two or more rows and at least [`GEMM_QUERIES`]
    /// queries per key/value head multiplies queries by keys and probabilities by values with
    /// both operands rounded to bfloat16 and float32 sums (the kernel of bf16-dot weights);
    /// the scale, masks and softmax stay float32. Fewer queries, or one row (decode), read the
    /// float32 keys as they are.
    pub bf16_products: bool,
}

/// Keys whose scores (and then weighted values) are computed for all of a group's few queries
/// while they are in L1, the next run prefetched (few queries: the keys stream by).
const KEYS_PER_RUN: usize = 16;
/// Query rows per task, at least (when the sequence has as many).
const ROWS_PER_TASK: usize = 64;
/// Queries whose scores are computed together, over the keys the last of them sees.
const QUERIES_PER_RUN: usize = 32;
/// Queries per kv head of a sequence (of two or more rows) from which scores and values go
/// through the product kernel.
const GEMM_QUERIES: usize = 4;

/// Attention of every sequence; `q` is `[H, rows, D]` with `rows` the call's rows, `out` the
/// same or `[rows, H, D]` ([`Heads::rows_out`]).
pub fn attention(
    heads: Heads,
    q: &[f32],
    rows: usize,
    seqs: &[SeqAttention],
    out: &mut [f32],
) -> Result<(), KernelError> {
    attention_with(Isa::get(), super::threads(), heads, q, rows, seqs, out)
}

/// [`attention`] into a new vector of `H · rows · D` outputs. When the sequences' rows cover
/// the call's rows once each (every model's call), the tasks write every output, so the vector
/// is not zeroed first (a canvas layer's output is a few hundred KiB, zeroed on the calling
/// thread while the pool waited); otherwise it is zeroed and the rows no sequence names stay 0.
pub fn attention_vec(
    heads: Heads,
    q: &[f32],
    rows: usize,
    seqs: &[SeqAttention],
) -> Result<Vec<f32>, KernelError> {
    let (isa, threads) = (Isa::get(), super::threads());
    if !covers_once(rows, seqs) {
        let mut out = vec![0f32; q.len()];
        attention_with(isa, threads, heads, q, rows, seqs, &mut out)?;
        return Ok(out);
    }
    let mut result = Ok(());
    // SAFETY: every row of the call is in one sequence, and the tasks write every head of each
    // row of their sequences; a refused call wrote nothing, and its values are set to 0.
    let out = unsafe {
        super::written(q.len(), |out| {
            result = attention_into(isa, threads, heads, q, rows, seqs, out);
            if result.is_err() {
                out.fill(std::mem::MaybeUninit::new(0.0));
            }
        })
    };
    result.map(|()| out)
}

/// Whether the sequences' rows are `0..rows`, each row in exactly one of them.
fn covers_once(rows: usize, seqs: &[SeqAttention]) -> bool {
    let mut ranges: Vec<&Range<usize>> = seqs.iter().map(|s| &s.rows).collect();
    ranges.sort_by_key(|r| r.start);
    let mut at = 0;
    for r in ranges {
        if r.start != at || r.end < r.start {
            return false;
        }
        at = r.end;
    }
    at == rows
}

/// [`attention`] on a given instruction set and thread count.
pub fn attention_with(
    isa: Isa,
    threads: usize,
    heads: Heads,
    q: &[f32],
    rows: usize,
    seqs: &[SeqAttention],
    out: &mut [f32],
) -> Result<(), KernelError> {
    // SAFETY: the tasks write only floats.
    let out = unsafe { super::as_uninit(out) };
    attention_into(isa, threads, heads, q, rows, seqs, out)
}

/// [`attention_with`] into values a call may find uninitialised: every head of the rows the
/// sequences name is written, nothing else; nothing is written when the call is refused.
fn attention_into(
    isa: Isa,
    threads: usize,
    heads: Heads,
    q: &[f32],
    rows: usize,
    seqs: &[SeqAttention],
    out: &mut [std::mem::MaybeUninit<f32>],
) -> Result<(), KernelError> {
    let Heads {
        n_heads: h,
        n_kv_heads: hkv,
        head_dim: d,
        ..
    } = heads;
    check(hkv > 0 && h.is_multiple_of(hkv), || {
        format!("{hkv} kv heads do not divide {h} heads")
    })?;
    check(q.len() == h * rows * d && out.len() == q.len(), || {
        format!(
            "q/out have {}/{} values, want {h}x{rows}x{d}",
            q.len(),
            out.len()
        )
    })?;
    for (i, s) in seqs.iter().enumerate() {
        check(
            s.rows.end <= rows && s.row_index.len() == s.rows.len(),
            || {
                format!(
                    "sequence {i}: rows {:?} of {rows}, {} indices",
                    s.rows,
                    s.row_index.len()
                )
            },
        )?;
        if let Some(ix) = s.key_index {
            check(ix.len() == s.keys(), || {
                format!(
                    "sequence {i}: {} key indices for {} keys",
                    ix.len(),
                    s.keys()
                )
            })?;
        }
        for b in &s.blocks {
            let need = if b.len == 0 {
                0
            } else {
                (hkv - 1) * b.head_stride + b.len * d
            };
            check(b.k.len() >= need && b.v.len() >= need, || {
                format!("sequence {i}: a key block needs {need} values")
            })?;
        }
    }
    let mut tasks = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        let per_task = rows_per_task(s.rows.len(), seqs.len() * hkv, threads);
        for g in 0..hkv {
            let mut r = s.rows.start;
            while r < s.rows.end {
                let end = (r + per_task).min(s.rows.end);
                tasks.push((si, g, r..end));
                r = end;
            }
        }
    }
    // Each sequence's mask, its keys' indices scanned once for all its tasks.
    let masks: Vec<Masks> = seqs.iter().map(Masks::new).collect();
    let op = SendPtr(out.as_mut_ptr().cast::<f32>());
    let run = |&(si, g, ref r): &(usize, usize, Range<usize>)| {
        // SAFETY: a task writes the rows `r` of its group's query heads only.
        unsafe { task(isa, heads, q, rows, &seqs[si], &masks[si], g, r.clone(), op) }
    };
    // Consecutive tasks in chunks, each task asking for its own first keys and values and
    // the next one's before it runs: a decode task's rows are a few KiB in pages nothing
    // touched since the layer's last step, so a chunk of them (one row of one request per kv
    // head) waits on memory once, not once per task. Decode (every sequence one row) takes
    // eight or more chunks per thread; tasks of many rows, whose sizes differ, are claimed one
    // by one.
    let work: usize = seqs.iter().map(|s| s.rows.len() * s.keys()).sum::<usize>() * h * d;
    let serial = threads <= 1 || tasks.len() == 1 || work < 1 << 15;
    let chunk = if serial {
        tasks.len().max(1)
    } else if seqs.iter().all(|s| s.rows.len() == 1) {
        (tasks.len() / (8 * threads)).max(1)
    } else {
        1
    };
    let ahead = |i: usize| {
        let (si, g, _) = tasks[i];
        first_run_ahead(&seqs[si], g, d);
    };
    let run_chunk = |c: usize| {
        let (first, end) = (c * chunk, ((c + 1) * chunk).min(tasks.len()));
        if first < end {
            ahead(first);
        }
        for (i, task) in tasks[first..end].iter().enumerate() {
            if first + i + 1 < end {
                ahead(first + i + 1);
            }
            run(task);
        }
    };
    let chunks = tasks.len().div_ceil(chunk);
    if serial {
        (0..chunks).for_each(run_chunk);
    } else {
        super::pool::pool().run(chunks, &run_chunk);
    }
    Ok(())
}

/// Asks for the first [`KEYS_PER_RUN`] keys and values of kv head `g` of `s`, when its tasks
/// stream them (one-row sequences; the product path packs them in one sweep instead): the
/// values' first run would otherwise wait until the whole score pass was done.
fn first_run_ahead(s: &SeqAttention, g: usize, d: usize) {
    if s.rows.len() >= 2 {
        return;
    }
    let mut left = KEYS_PER_RUN;
    for b in &s.blocks {
        let n = b.len.min(left);
        if n > 0 {
            let at = g * b.head_stride;
            b.k.prefetch(at, n * d);
            b.v.prefetch(at, n * d);
        }
        left -= n;
        if left == 0 {
            break;
        }
    }
}

/// Query rows per task of a sequence of `rows` rows, in a call of `groups`
/// (sequence, key/value head) pairs on `threads` threads: a task packs its group's keys and
/// values once for all its rows, so as many rows as keep four tasks per thread, at least
/// [`ROWS_PER_TASK`].
fn rows_per_task(rows: usize, groups: usize, threads: usize) -> usize {
    let mut per = ROWS_PER_TASK;
    while per < rows && groups * rows.div_ceil(2 * per) >= 4 * threads {
        per *= 2;
    }
    per
}

/// One (sequence, kv head, rows) task.
///
/// # Safety
/// `out` points to `[H, rows, D]` floats and no other task writes these rows of these heads.
#[allow(clippy::too_many_arguments)]
unsafe fn task(
    isa: Isa,
    heads: Heads,
    q: &[f32],
    rows: usize,
    s: &SeqAttention,
    masks: &Masks,
    g: usize,
    r: Range<usize>,
    out: SendPtr<f32>,
) {
    let (h, hkv, d) = (heads.n_heads, heads.n_kv_heads, heads.head_dim);
    let rep = h / hkv;
    let t_all = s.keys();
    // Queries of the task: (query head, row), and for each its visible key range or mask.
    let mut queries = Vec::with_capacity(rep * r.len());
    queries.extend((g * rep..(g + 1) * rep).flat_map(|hh| r.clone().map(move |row| (hh, row))));
    let nq = queries.len();
    // Key t of the group: its key and value rows, as stored.
    let key_rows = || {
        s.blocks.iter().flat_map(move |b| {
            (0..b.len).map(move |t| {
                let at = g * b.head_stride + t * d;
                (b.k.sub(at..at + d), b.v.sub(at..at + d))
            })
        })
    };
    // Many queries: scores and weighted values as two small products through the linear
    // kernel (keys and values packed once for all queries); few, or one row (decode: its keys
    // are used once, and packing them would read and write them again), dot products over
    // the keys as they stream by. Decided by the sequence's rows, not the task's, so a row's
    // result does not depend on how the call's rows were cut into tasks.
    let gemm = s.rows.len() >= 2 && s.rows.len() * rep >= GEMM_QUERIES;
    // Decode's small buffers are this thread's kept ones (a task per request and kv head
    // allocated and freed them a thousand times a step); the product path keeps those for its
    // packed keys and values.
    let mut acc = if gemm {
        Aligned::zeroed(nq * d)
    } else {
        spare::take::<f32>(nq * d)
    };
    if gemm {
        let qrows = |qs: &[(usize, usize)]| -> Vec<f32> {
            let mut a = Vec::with_capacity(qs.len() * d);
            for &(hh, row) in qs {
                a.extend_from_slice(&q[(hh * rows + row) * d..(hh * rows + row + 1) * d]);
            }
            a
        };
        let products = Products::pack(isa, heads.bf16_products, d, t_all, key_rows);
        // Runs of queries: each multiplies only the keys its last visible key needs (a causal
        // prefill skips the keys after its rows), the scores of a run `[queries][keys]`.
        // Aligned as the tiles store them (a tile row across two lines stores slower), and
        // reused from run to run.
        let mut scores = Aligned::<f32>::default();
        for (c, qs) in queries.chunks(QUERIES_PER_RUN).enumerate() {
            let keys = qs
                .iter()
                .map(|&(_, row)| masks.keys_needed(s.row_index[row - s.rows.start]))
                .max()
                .unwrap_or(0);
            if keys == 0 {
                continue;
            }
            scores.reset(qs.len() * keys);
            products.scores(isa, &qrows(qs), qs.len(), keys, &mut scores);
            let scale = pre_scale(heads.scale, &mut scores);
            for (sc, &(_, row)) in scores.chunks_mut(keys).zip(qs) {
                masks.apply(s.row_index[row - s.rows.start], sc);
                simd::softmax(isa, sc, scale);
            }
            let at = c * QUERIES_PER_RUN * d;
            products.weighted(
                isa,
                &scores,
                qs.len(),
                keys,
                &mut acc[at..at + qs.len() * d],
            );
        }
    } else {
        let stream = Stream {
            isa,
            scale: heads.scale,
            q,
            rows,
            s,
            masks,
            queries: &queries,
        };
        let all = |f: fn(&KvData) -> bool| s.blocks.iter().all(|b| f(&b.k) && f(&b.v));
        if all(|x| matches!(x, KvData::F32(_))) {
            stream.run::<f32>(&s.blocks, g, d, &mut acc);
        } else if all(|x| matches!(x, KvData::Bf16(_))) {
            stream.run::<u16>(&s.blocks, g, d, &mut acc);
        } else {
            // Keys stored both ways (a cache moved between precisions): float32 copies.
            let (mut kf, mut vf) = (Vec::with_capacity(t_all * d), Vec::with_capacity(t_all * d));
            for (k, v) in key_rows() {
                k.extend_f32(&mut kf);
                v.extend_f32(&mut vf);
            }
            let copy = [KvBlock {
                k: KvData::F32(&kf),
                v: KvData::F32(&vf),
                len: t_all,
                head_stride: 0,
            }];
            stream.run::<f32>(&copy, 0, d, &mut acc);
        }
    }
    for (qi, &(hh, row)) in queries.iter().enumerate() {
        let at = if heads.rows_out {
            (row * h + hh) * d
        } else {
            (hh * rows + row) * d
        };
        let dst = out.0.add(at);
        std::ptr::copy_nonoverlapping(acc[qi * d..].as_ptr(), dst, d);
    }
    if !gemm {
        spare::give(acc);
    }
}

/// The few queries of a task against keys and values that stream by (see [`task`]).
struct Stream<'q, 's, 'a> {
    isa: Isa,
    scale: f32,
    q: &'q [f32],
    rows: usize,
    s: &'s SeqAttention<'a>,
    masks: &'s Masks<'s, 'a>,
    queries: &'q [(usize, usize)],
}

/// A pass over one run of keys of [`Stream::run`]: its first key, its key and value rows, and
/// the next run's (to ask for as the first query goes).
type RunPass<'p, T> = dyn FnMut(usize, &[&[T]], &[&[T]], &[&[T]], &[&[T]]) + 'p;

/// The stored element of a sequence's blocks when they are all stored alike.
trait Stored: simd::Elem {
    fn of(x: KvData<'_>) -> &[Self];
}

impl Stored for f32 {
    fn of(x: KvData<'_>) -> &[f32] {
        match x {
            KvData::F32(x) => x,
            KvData::Bf16(_) => unreachable!("checked: every block is float32"),
        }
    }
}

impl Stored for u16 {
    fn of(x: KvData<'_>) -> &[u16] {
        match x {
            KvData::Bf16(x) => x,
            KvData::F32(_) => unreachable!("checked: every block is bfloat16"),
        }
    }
}

/// The key and value rows of kv head `g` in key order, walked block by block.
#[derive(Clone)]
struct KeyWalk<'s, 'a> {
    blocks: &'s [KvBlock<'a>],
    g: usize,
    d: usize,
    b: usize,
    t: usize,
}

impl<'a> KeyWalk<'_, 'a> {
    /// The next key's row and value row.
    fn next<T: Stored>(&mut self) -> (&'a [T], &'a [T]) {
        while self.t >= self.blocks[self.b].len {
            self.b += 1;
            self.t = 0;
        }
        let blk = &self.blocks[self.b];
        let at = self.g * blk.head_stride + self.t * self.d;
        self.t += 1;
        (
            &T::of(blk.k)[at..at + self.d],
            &T::of(blk.v)[at..at + self.d],
        )
    }

    /// The next `n` (at most [`KEYS_PER_RUN`]) keys' rows into `k` and `v`.
    fn fill<T: Stored>(
        &mut self,
        n: usize,
        k: &mut [&'a [T]; KEYS_PER_RUN],
        v: &mut [&'a [T]; KEYS_PER_RUN],
    ) {
        for j in 0..n {
            (k[j], v[j]) = self.next();
        }
    }
}

impl Stream<'_, '_, '_> {
    /// Every query's weighted values into `acc` `[queries][D]`, over kv head `g` of `blocks`
    /// (stored as `T`), key runs gathered on the stack as they are reached.
    fn run<T: Stored>(&self, blocks: &[KvBlock], g: usize, d: usize, acc: &mut [f32]) {
        let (isa, nq) = (self.isa, self.queries.len());
        let t_all: usize = blocks.iter().map(|b| b.len).sum();
        let walk = KeyWalk {
            blocks,
            g,
            d,
            b: 0,
            t: 0,
        };
        let empty: &[T] = &[];
        // Scores [nq][t_all]; masked keys get -inf. Keys, then values, go by in runs of
        // [`KEYS_PER_RUN`]: each run is used by every query while it is in L1, and the first
        // query's pass asks for the next run's rows as it goes.
        let mut scores = spare::take::<f32>(nq * t_all);
        let qv = |qi: usize| {
            let (hh, row) = self.queries[qi];
            &self.q[(hh * self.rows + row) * d..(hh * self.rows + row + 1) * d]
        };
        let runs = |pass: &mut RunPass<T>| {
            let mut w = walk.clone();
            let (mut k, mut v) = ([empty; KEYS_PER_RUN], [empty; KEYS_PER_RUN]);
            let (mut nk, mut nv) = ([empty; KEYS_PER_RUN], [empty; KEYS_PER_RUN]);
            let first = KEYS_PER_RUN.min(t_all);
            w.fill(first, &mut nk, &mut nv);
            for t in (0..t_all).step_by(KEYS_PER_RUN) {
                let n = KEYS_PER_RUN.min(t_all - t);
                std::mem::swap(&mut k, &mut nk);
                std::mem::swap(&mut v, &mut nv);
                let m = KEYS_PER_RUN.min(t_all - t - n);
                w.fill(m, &mut nk, &mut nv);
                pass(t, &k[..n], &v[..n], &nk[..m], &nv[..m]);
            }
        };
        runs(&mut |t, k, _, nk, _| {
            for qi in 0..nq {
                let at = qi * t_all + t;
                let ahead: &[&[T]] = if qi == 0 { nk } else { &[] };
                simd::dots(isa, qv(qi), k, &mut scores[at..at + k.len()], ahead);
            }
        });
        let scale = pre_scale(self.scale, &mut scores);
        // Softmax per query: scaled scores, max, exp, sum, then normalised probabilities.
        for (sc, &(_, row)) in scores.chunks_mut(t_all.max(1)).zip(self.queries) {
            self.masks
                .apply(self.s.row_index[row - self.s.rows.start], sc);
            simd::softmax(isa, sc, scale);
        }
        runs(&mut |t, _, v, _, nv| {
            for qi in 0..nq {
                let at = qi * t_all + t;
                let ahead: &[&[T]] = if qi == 0 { nv } else { &[] };
                simd::weighted_sum(
                    isa,
                    &scores[at..at + v.len()],
                    v,
                    &mut acc[qi * d..(qi + 1) * d],
                    ahead,
                );
            }
        });
        spare::give(scores);
    }
}

/// The scale the softmax applies: a positive one in its first pass, where a masked key's
/// `-inf` stays `-inf`; any other applied to the scores here, before the masks (then 1).
fn pre_scale(scale: f32, scores: &mut [f32]) -> f32 {
    if scale > 0.0 {
        scale
    } else {
        scores.iter_mut().for_each(|v| *v *= scale);
        1.0
    }
}

/// A sequence's mask over its `keys` keys, as a query's scores see it.
struct Masks<'s, 'a> {
    s: &'s SeqAttention<'a>,
    keys: usize,
    /// Keys at consecutive buffer indices from this one: a rule's visible run is a run of
    /// them (`None`: the keys' indices have gaps).
    base: Option<u32>,
}

impl<'s, 'a> Masks<'s, 'a> {
    fn new(s: &'s SeqAttention<'a>) -> Self {
        let base = match (s.mask, s.key_index) {
            // Every key is visible: no run to find.
            (Mask::Bidirectional, _) => None,
            (_, None) => Some(0),
            (_, Some(ix)) => ix
                .windows(2)
                .all(|w| w[0].checked_add(1) == Some(w[1]))
                .then(|| ix.first().copied().unwrap_or(0)),
        };
        Self {
            s,
            keys: s.keys(),
            base,
        }
    }

    /// The keys query `qix` sees as one run `(first, end)` of key positions, when its rule and
    /// the keys' indices make them one (`None` otherwise: ask the rule key by key).
    fn visible_run(&self, qix: u32) -> Option<(usize, usize)> {
        let (base, run) = (self.base?, self.s.mask.visible(qix)?);
        let at = |i: u32| (i.saturating_sub(base) as usize).min(self.keys);
        let (lo, hi) = (at(run.start), at(run.end));
        Some((lo, hi.max(lo)))
    }

    /// How many leading keys query `qix`'s scores need: past them every key is masked.
    fn keys_needed(&self, qix: u32) -> usize {
        self.visible_run(qix).map_or(self.keys, |(_, hi)| hi)
    }

    /// `-inf` on the scores `sc` (the first `sc.len()` keys) of query `qix` its rule masks.
    fn apply(&self, qix: u32, sc: &mut [f32]) {
        if self.s.mask == Mask::Bidirectional {
            return;
        }
        let n = sc.len();
        if let Some((lo, hi)) = self.visible_run(qix) {
            sc[..lo.min(n)].fill(f32::NEG_INFINITY);
            sc[hi.min(n)..].fill(f32::NEG_INFINITY);
            return;
        }
        for (t, v) in sc.iter_mut().enumerate() {
            if !self.s.mask.allows(qix, self.s.key_at(t)) {
                *v = f32::NEG_INFINITY;
            }
        }
    }
}

/// A task's keys and values packed for the two products of many queries: `[D][NR]` panels of
/// keys and `[T][NR]` panels of value dims in float32, or the same as bfloat16 pairs
/// (`[ceil(D / 2)][NR]`, `[ceil(T / 2)][NR]`) in the bf16 compute mode.
enum Products {
    F32 {
        d: usize,
        t: usize,
        k: Aligned<f32>,
        v: Aligned<f32>,
    },
    Bf16 {
        d: usize,
        t: usize,
        k: Aligned<u32>,
        v: Aligned<u32>,
    },
}

impl Products {
    fn pack<'a, I: Iterator<Item = (KvData<'a>, KvData<'a>)>>(
        isa: Isa,
        bf16: bool,
        d: usize,
        t: usize,
        rows: impl Fn() -> I,
    ) -> Self {
        // A row as float32: itself, or its bfloat16 values widened into `buf`.
        fn f32_row<'r>(x: &KvData<'r>, buf: &'r mut Vec<f32>) -> &'r [f32] {
            match *x {
                KvData::F32(x) => x,
                KvData::Bf16(_) => {
                    buf.clear();
                    x.extend_f32(buf);
                    buf
                }
            }
        }
        let (mut b0, mut b1) = (Vec::new(), Vec::new());
        if bf16 {
            // Kᵀ: panel p holds keys p·NR.. as `[ceil(D / 2)][NR]` pairs (a bfloat16 row's
            // consecutive values are its pairs already).
            let dp = d.div_ceil(2);
            let mut k = spare::take(t.div_ceil(NR) * dp * NR);
            for (i, (kt, _)) in rows().enumerate() {
                let panel = &mut k[(i / NR) * dp * NR..(i / NR + 1) * dp * NR];
                match kt {
                    KvData::F32(kt) => pack_row_pairs(isa, kt, panel, i % NR, NR),
                    KvData::Bf16(kt) => {
                        for (j, pair) in kt.chunks(2).enumerate() {
                            let hi = pair.get(1).map_or(0, |&h| u32::from(h));
                            panel[j * NR + i % NR] = u32::from(pair[0]) | hi << 16;
                        }
                    }
                }
            }
            // V: panel p holds dims p·NR.. as `[ceil(T / 2)][NR]`, pair j keys 2j and 2j + 1.
            let tp = t.div_ceil(2);
            let mut v = spare::take(d.div_ceil(NR) * tp * NR);
            let mut values = Vec::with_capacity(t);
            values.extend(rows().map(|(_, v)| v));
            for (j, pair) in values.chunks(2).enumerate() {
                // Both rows bfloat16 (or one, the last of an odd count): their values pair as
                // they are; otherwise float32 rows, rounded as they pack.
                let stored = match (pair[0], pair.get(1)) {
                    (KvData::Bf16(lo), None) => Some((lo, None)),
                    (KvData::Bf16(lo), Some(KvData::Bf16(hi))) => Some((lo, Some(*hi))),
                    _ => None,
                };
                let (lo, hi) = match stored {
                    Some(_) => (&[][..], None),
                    None => (
                        f32_row(&pair[0], &mut b0),
                        pair.get(1).map(|h| f32_row(h, &mut b1)),
                    ),
                };
                for p in 0..d.div_ceil(NR) {
                    let cols = p * NR..(p * NR + NR).min(d);
                    let at = p * tp * NR + j * NR;
                    let dst = &mut v[at..at + cols.len()];
                    match stored {
                        Some((l, h)) => pack_bf16_column_pairs(
                            isa,
                            &l[cols.clone()],
                            h.map(|h| &h[cols.clone()]),
                            dst,
                        ),
                        None => pack_column_pairs(
                            isa,
                            &lo[cols.clone()],
                            hi.map(|h| &h[cols.clone()]),
                            dst,
                        ),
                    }
                }
            }
            return Self::Bf16 { d, t, k, v };
        }
        let mut k = spare::take(t.div_ceil(NR) * d * NR);
        let mut v = spare::take(d.div_ceil(NR) * t * NR);
        for (i, (kt, vt)) in rows().enumerate() {
            let (kt, vt) = (f32_row(&kt, &mut b0), f32_row(&vt, &mut b1));
            let base = (i / NR) * d * NR + i % NR;
            for (dd, &x) in kt.iter().enumerate() {
                k[base + dd * NR] = x;
            }
            for (p, chunk) in vt.chunks(NR).enumerate() {
                let at = p * t * NR + i * NR;
                v[at..at + chunk.len()].copy_from_slice(chunk);
            }
        }
        Self::F32 { d, t, k, v }
    }

    /// `scores [m][keys]` of the query rows `a` `[m][D]` against the first `keys` keys.
    fn scores(&self, isa: Isa, a: &[f32], m: usize, keys: usize, scores: &mut [f32]) {
        match self {
            Self::F32 { d, k, .. } => gemm_panels(isa, a, m, *d, k, d * NR, keys, scores, keys),
            Self::Bf16 { d, k, .. } => {
                bf16_panels(isa, a, m, *d, k, d.div_ceil(2) * NR, keys, scores)
            }
        }
    }

    /// `out [m][D]` of the probabilities `p` `[m][keys]` times the first `keys` values.
    fn weighted(&self, isa: Isa, p: &[f32], m: usize, keys: usize, out: &mut [f32]) {
        match self {
            Self::F32 { d, t, v, .. } => gemm_panels(isa, p, m, keys, v, t * NR, *d, out, *d),
            Self::Bf16 { d, t, v, .. } => {
                bf16_panels(isa, p, m, keys, v, t.div_ceil(2) * NR, *d, out)
            }
        }
    }
}

impl Drop for Products {
    fn drop(&mut self) {
        match self {
            Self::F32 { k, v, .. } => {
                spare::give(std::mem::take(k));
                spare::give(std::mem::take(v));
            }
            Self::Bf16 { k, v, .. } => {
                spare::give(std::mem::take(k));
                spare::give(std::mem::take(v));
            }
        }
    }
}

/// Packing buffers kept per thread between calls: a long context's keys and values packed
/// into fresh buffers of several MiB cost a page fault per 4 KiB each call (the allocator
/// maps and unmaps them): a fifth of a 64-row chunk's attention over 4096 keys.
mod spare {
    use std::cell::RefCell;

    use crate::cpu::aligned::{Aligned, Plain};

    /// Bytes of one kept buffer, at most: a larger one goes back to the allocator.
    const MAX_BYTES: usize = 8 << 20;

    pub(super) trait Word: Plain {
        fn with<R>(f: impl FnOnce(&mut Vec<Aligned<Self>>) -> R) -> R;
    }

    thread_local! {
        static F32: RefCell<Vec<Aligned<f32>>> = const { RefCell::new(Vec::new()) };
        static U32: RefCell<Vec<Aligned<u32>>> = const { RefCell::new(Vec::new()) };
    }

    impl Word for f32 {
        fn with<R>(f: impl FnOnce(&mut Vec<Aligned<Self>>) -> R) -> R {
            F32.with_borrow_mut(f)
        }
    }

    impl Word for u32 {
        fn with<R>(f: impl FnOnce(&mut Vec<Aligned<Self>>) -> R) -> R {
            U32.with_borrow_mut(f)
        }
    }

    /// `len` zeros, in a kept buffer when this thread has one.
    pub(super) fn take<T: Word>(len: usize) -> Aligned<T> {
        let mut v = T::with(|spare| spare.pop()).unwrap_or_default();
        v.reset(len);
        v
    }

    /// Keeps `v` for this thread's next [`take`] (two at most, as a call packs two).
    pub(super) fn give<T: Word>(v: Aligned<T>) {
        if v.capacity_bytes() <= MAX_BYTES {
            T::with(|spare| {
                if spare.len() < 2 {
                    spare.push(v);
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::{ragged_attention, RaggedLayout, RaggedSeq};

    /// The call on every instruction set and thread count: each output within `tol` of `want`
    /// and, with `same_bits`, all with the same bits. Returns them for further checks.
    fn check_everywhere(
        heads: Heads,
        q: &[f32],
        rows: usize,
        seqs: &[SeqAttention],
        want: &[f32],
        tol: f32,
        same_bits: bool,
    ) -> Vec<(Isa, usize, Vec<f32>)> {
        let mut all: Vec<(Isa, usize, Vec<f32>)> = Vec::new();
        for isa in Isa::available() {
            for threads in [1, 2] {
                let mut out = vec![f32::NAN; q.len()];
                attention_with(isa, threads, heads, q, rows, seqs, &mut out).unwrap();
                let diff = max_diff(&out, want);
                assert!(diff < tol, "{isa:?} x{threads}: {diff} ({heads:?})");
                if let (true, Some((_, _, first))) = (same_bits, all.first()) {
                    assert_eq!(&out, first, "{isa:?} x{threads} ({heads:?})");
                }
                all.push((isa, threads, out));
            }
        }
        all
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(7);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// Two sequences over blocks cut from one key buffer each, against the ragged reference.
    #[test]
    fn blocks_read_in_place_match_the_ragged_reference() {
        let (h, hkv, d) = (4, 2, 20);
        let heads = Heads {
            n_heads: h,
            n_kv_heads: hkv,
            head_dim: d,
            scale: 0.3,
            rows_out: false,
            bf16_products: false,
        };
        // Sequence 0: 3 rows at buffer 5..8 over 8 causal keys (a cache of 5 + the rows);
        // sequence 1: 4 rows, WINO shadow mask over 6 keys.
        let (t0, t1) = (8, 6);
        let k0 = data(hkv * t0 * d, 1);
        let v0 = data(hkv * t0 * d, 2);
        let k1 = data(hkv * t1 * d, 3);
        let v1 = data(hkv * t1 * d, 4);
        let rows = 7;
        let q = data(h * rows * d, 5);
        let idx0 = [5u32, 6, 7];
        let idx1 = [0u32, 1, 4, 5];
        let shadow = Mask::ShadowBlock {
            main_len: 4,
            block_start: 2,
        };
        let split = |k: &'static [f32], v: &'static [f32], t: usize, at: usize| {
            vec![
                KvBlock {
                    k: k.into(),
                    v: v.into(),
                    len: at,
                    head_stride: t * d,
                },
                KvBlock {
                    k: (&k[at * d..]).into(),
                    v: (&v[at * d..]).into(),
                    len: t - at,
                    head_stride: t * d,
                },
            ]
        };
        let (k0, v0, k1, v1): (
            &'static [f32],
            &'static [f32],
            &'static [f32],
            &'static [f32],
        ) = (
            Box::leak(k0.into_boxed_slice()),
            Box::leak(v0.into_boxed_slice()),
            Box::leak(k1.into_boxed_slice()),
            Box::leak(v1.into_boxed_slice()),
        );
        let seqs = vec![
            SeqAttention {
                rows: 0..3,
                row_index: &idx0,
                blocks: split(k0, v0, t0, 5),
                key_index: None,
                mask: Mask::Causal,
            },
            SeqAttention {
                rows: 3..7,
                row_index: &idx1,
                blocks: split(k1, v1, t1, 2),
                key_index: None,
                mask: shadow,
            },
        ];
        // The reference wants every sequence's keys in one head-major buffer.
        let mut kk = Vec::new();
        let mut vv = Vec::new();
        for g in 0..hkv {
            kk.extend_from_slice(&k0[g * t0 * d..(g + 1) * t0 * d]);
            kk.extend_from_slice(&k1[g * t1 * d..(g + 1) * t1 * d]);
            vv.extend_from_slice(&v0[g * t0 * d..(g + 1) * t0 * d]);
            vv.extend_from_slice(&v1[g * t1 * d..(g + 1) * t1 * d]);
        }
        let layout = RaggedLayout {
            n_heads: h,
            n_kv_heads: hkv,
            head_dim: d,
            scale: 0.3,
            seqs: vec![
                RaggedSeq {
                    rows: 0..3,
                    keys: 0..8,
                    mask: Mask::Causal,
                },
                RaggedSeq {
                    rows: 3..7,
                    keys: 8..14,
                    mask: shadow,
                },
            ],
            row_index: [&idx0[..], &idx1[..]].concat(),
            key_index: (0..8).chain(0..6).collect(),
        };
        let want = ragged_attention(&layout, &q, &kk, &vv).unwrap();
        let all = check_everywhere(heads, &q, rows, &seqs, &want, 1e-5, true);
        // Into a new vector (not zeroed first where the sequences cover the rows): the same
        // bits; the rows no sequence names are 0; a refused call is refused.
        assert_eq!(attention_vec(heads, &q, rows, &seqs).unwrap(), all[0].2);
        let first_only = attention_vec(heads, &q, rows, &seqs[..1]).unwrap();
        for hh in 0..h {
            for r in 0..rows {
                let at = (hh * rows + r) * d..(hh * rows + r + 1) * d;
                if r < 3 {
                    assert_eq!(first_only[at.clone()], all[0].2[at]);
                } else {
                    assert!(first_only[at].iter().all(|&v| v == 0.0));
                }
            }
        }
        assert!(attention_vec(heads, &q[1..], rows, &seqs).is_err());
        for (isa, threads, out) in all {
            // Row-major output: the same values, transposed.
            let mut by_rows = vec![f32::NAN; q.len()];
            let rheads = Heads {
                rows_out: true,
                ..heads
            };
            attention_with(isa, threads, rheads, &q, rows, &seqs, &mut by_rows).unwrap();
            for hh in 0..h {
                for r in 0..rows {
                    assert_eq!(
                        by_rows[(r * h + hh) * d..(r * h + hh + 1) * d],
                        out[(hh * rows + r) * d..(hh * rows + r + 1) * d]
                    );
                }
            }
        }
    }

    /// One sequence of many rows under each mask rule, its keys at consecutive buffer indices
    /// (a visible run filled at once), at scattered ones (key by key), against the reference;
    /// in float32 the same bits on every instruction set and thread count, in bf16 products
    /// within bfloat16's rounding of the reference.
    #[test]
    fn mask_runs_and_bf16_products_match_the_ragged_reference() {
        let (h, hkv, d, t) = (4, 2, 40, 150);
        // One thread cuts the rows in runs of 128, two in runs of 64 (the same bits).
        let rows = 150;
        assert_eq!(
            (rows_per_task(rows, hkv, 1), rows_per_task(rows, hkv, 2)),
            (128, 64)
        );
        let k = data(hkv * t * d, 21);
        let v = data(hkv * t * d, 22);
        let q = data(h * rows * d, 23);
        // The rows are the keys' positions, from buffer index 5.
        let row_index: Vec<u32> = (t as u32 - rows as u32..t as u32).map(|r| r + 5).collect();
        let consecutive: Vec<u32> = (5..t as u32 + 5).collect();
        let mut scattered = consecutive.clone();
        scattered.swap(3, 90);
        let masks = [
            Mask::Causal,
            Mask::BlockCausal { block: 16 },
            Mask::SlidingCausal { window: 33 },
            Mask::Bidirectional,
        ];
        for mask in masks {
            for keys in [&consecutive, &scattered] {
                let seqs = vec![SeqAttention {
                    rows: 0..rows,
                    row_index: &row_index,
                    blocks: vec![KvBlock {
                        k: (&k).into(),
                        v: (&v).into(),
                        len: t,
                        head_stride: t * d,
                    }],
                    key_index: Some(keys),
                    mask,
                }];
                let layout = RaggedLayout {
                    n_heads: h,
                    n_kv_heads: hkv,
                    head_dim: d,
                    scale: 0.15,
                    seqs: vec![RaggedSeq {
                        rows: 0..rows as u32,
                        keys: 0..t as u32,
                        mask,
                    }],
                    row_index: row_index.clone(),
                    key_index: keys.clone(),
                };
                let want = ragged_attention(&layout, &q, &k, &v).unwrap();
                for bf16_products in [false, true] {
                    let heads = Heads {
                        n_heads: h,
                        n_kv_heads: hkv,
                        head_dim: d,
                        scale: 0.15,
                        rows_out: false,
                        bf16_products,
                    };
                    // bf16 products: within bfloat16's rounding, bits up to summation order.
                    let tol = if bf16_products { 2e-2 } else { 1e-5 };
                    check_everywhere(heads, &q, rows, &seqs, &want, tol, !bf16_products);
                }
            }
        }
    }

    /// One query row per head (decode): the dot-product path, against the reference.
    #[test]
    fn single_rows_match_the_ragged_reference() {
        // One decode row over keys in two blocks: plain heads with a head size off the vector
        // width, and grouped heads at the sizes whose weighted values stay in registers (a
        // one-row sequence streams its keys however many queries share a kv head).
        let t = 37;
        for (h, hkv, d) in [(3, 3, 24), (8, 2, 64), (4, 1, 128), (2, 2, 16)] {
            let k = data(hkv * t * d, 11);
            let v = data(hkv * t * d, 12);
            let q = data(h * d, 13);
            let seqs = vec![SeqAttention {
                rows: 0..1,
                row_index: &[36],
                blocks: vec![
                    KvBlock {
                        k: (&k).into(),
                        v: (&v).into(),
                        len: 30,
                        head_stride: t * d,
                    },
                    KvBlock {
                        k: (&k[30 * d..]).into(),
                        v: (&v[30 * d..]).into(),
                        len: 7,
                        head_stride: t * d,
                    },
                ],
                key_index: None,
                mask: Mask::Causal,
            }];
            let heads = Heads {
                n_heads: h,
                n_kv_heads: hkv,
                head_dim: d,
                scale: 0.2,
                rows_out: false,
                bf16_products: false,
            };
            let layout = RaggedLayout {
                n_heads: h,
                n_kv_heads: hkv,
                head_dim: d,
                scale: 0.2,
                seqs: vec![RaggedSeq {
                    rows: 0..1,
                    keys: 0..t as u32,
                    mask: Mask::Causal,
                }],
                row_index: vec![36],
                key_index: (0..t as u32).collect(),
            };
            let want = ragged_attention(&layout, &q, &k, &v).unwrap();
            check_everywhere(heads, &q, 1, &seqs, &want, 1e-5, true);
            // The bf16 mode reads a decode's float32 keys as they are: the same bits.
            let bf16 = Heads {
                bf16_products: true,
                ..heads
            };
            let all = check_everywhere(bf16, &q, 1, &seqs, &want, 1e-5, true);
            let mut out = vec![0f32; q.len()];
            attention_with(Isa::Portable, 1, heads, &q, 1, &seqs, &mut out).unwrap();
            assert_eq!(all[0].2, out, "h{h} kv{hkv} d{d}");
        }
    }

    #[test]
    fn a_row_that_sees_no_key_gets_zeros_and_bad_shapes_are_refused() {
        let heads = Heads {
            n_heads: 1,
            n_kv_heads: 1,
            head_dim: 2,
            scale: 1.0,
            rows_out: false,
            bf16_products: false,
        };
        let k = [1.0f32, 2.0];
        let seqs = vec![SeqAttention {
            rows: 0..1,
            row_index: &[0],
            blocks: vec![KvBlock {
                k: (&k[..]).into(),
                v: (&k[..]).into(),
                len: 1,
                head_stride: 2,
            }],
            key_index: Some(&[3]),
            mask: Mask::Causal,
        }];
        let mut out = [9f32; 2];
        attention(heads, &[1.0, 1.0], 1, &seqs, &mut out).unwrap();
        assert_eq!(out, [0.0, 0.0]);
        assert!(attention(heads, &[1.0], 1, &seqs, &mut out).is_err());
    }

    /// Keys and values stored as bfloat16 (the bf16 K/V cache) give the bits of the same call
    /// over float32 buffers holding their values, on every path: decode, few queries, the
    /// products in float32 and in bf16, and a sequence whose blocks are stored both ways.
    #[test]
    fn bf16_keys_and_values_have_the_bits_of_their_float32_values() {
        use super::super::matmul::{bf16_to_f32, f32_to_bf16};
        let (hkv, t) = (2, 45);
        for (h, d, rows) in [(8, 64, 1), (2, 24, 1), (2, 40, 1), (4, 40, 2), (4, 33, 40)] {
            let kb: Vec<u16> = data(hkv * t * d, 31).into_iter().map(f32_to_bf16).collect();
            let vb: Vec<u16> = data(hkv * t * d, 32).into_iter().map(f32_to_bf16).collect();
            let kf: Vec<f32> = kb.iter().map(|&x| bf16_to_f32(x)).collect();
            let vf: Vec<f32> = vb.iter().map(|&x| bf16_to_f32(x)).collect();
            let q = data(h * rows * d, 33);
            let row_index: Vec<u32> = (t - rows..t).map(|r| r as u32).collect();
            let at = 20;
            let seq = |blocks| SeqAttention {
                rows: 0..rows,
                row_index: &row_index,
                blocks,
                key_index: None,
                mask: Mask::Causal,
            };
            // Keys `from..from + len` of `k` and `v` as one block.
            fn block<'a>(
                kv: (KvData<'a>, KvData<'a>),
                from: usize,
                len: usize,
                d: usize,
                t: usize,
            ) -> KvBlock<'a> {
                KvBlock {
                    k: kv.0.sub(from * d..kv.0.len()),
                    v: kv.1.sub(from * d..kv.1.len()),
                    len,
                    head_stride: t * d,
                }
            }
            let block = |kv, from, len| block(kv, from, len, d, t);
            let (f, b) = (
                (KvData::F32(&kf), KvData::F32(&vf)),
                (KvData::Bf16(&kb), KvData::Bf16(&vb)),
            );
            let float = seq(vec![block(f, 0, at), block(f, at, t - at)]);
            let stored = seq(vec![block(b, 0, at), block(b, at, t - at)]);
            let mixed = seq(vec![block(b, 0, at), block(f, at, t - at)]);
            for bf16_products in [false, true] {
                let heads = Heads {
                    n_heads: h,
                    n_kv_heads: hkv,
                    head_dim: d,
                    scale: 0.2,
                    rows_out: false,
                    bf16_products,
                };
                for isa in Isa::available() {
                    for threads in [1, 2] {
                        let call = |s: &SeqAttention| {
                            let mut out = vec![f32::NAN; q.len()];
                            let seqs = [s.clone()];
                            attention_with(isa, threads, heads, &q, rows, &seqs, &mut out).unwrap();
                            out
                        };
                        let want = call(&float);
                        assert_eq!(call(&stored), want, "{isa:?} x{threads} h{h} d{d} r{rows}");
                        assert_eq!(call(&mixed), want, "{isa:?} x{threads} h{h} d{d} r{rows}");
                    }
                }
            }
        }
    }
}
