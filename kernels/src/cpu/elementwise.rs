//! Row-wise operations between the products of a block, threaded over rows: the gated SiLU of
//! an MLP and RMSNorm.

use super::simd::{self, Isa};
use super::{split, threads, SendPtr};
use crate::{check, KernelError};

/// Elements below which one thread does the whole call.
const PARALLEL_FROM: usize = 1 << 15;

/// Runs `f(rows)` over contiguous runs of `0..n_rows` on the pool (inline when small).
fn over_rows(n_rows: usize, elems: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    let t = threads();
    if t <= 1 || elems < PARALLEL_FROM || n_rows < 2 {
        f(0..n_rows);
        return;
    }
    let parts: Vec<_> = split(n_rows, t).collect();
    super::pool::pool().run(parts.len(), &|i| f(parts[i].clone()));
}

/// `out[r][j] = silu(gu[r][j]) · gu[r][hidden + j]` for rows `gu` `[rows, 2·hidden]` (the gate
/// and up projections side by side): `silu(g) = g / (exp(-g) + 1)`.
pub fn silu_mul(gu: &[f32], hidden: usize, out: &mut [f32]) -> Result<(), KernelError> {
    gated_into(gu, hidden, out, simd::silu_mul)
}

/// [`silu_mul`] into a new vector (not zeroed first: every value is written).
pub fn silu_mul_vec(gu: &[f32], hidden: usize) -> Result<Vec<f32>, KernelError> {
    gated_vec(gu, hidden, simd::silu_mul)
}

/// One row's `act(g) · u` into `out`, every value written.
type GatedRow = fn(Isa, &[f32], &[f32], &mut [std::mem::MaybeUninit<f32>]);

/// The rows of `gu` `[rows, 2·hidden]`, or why it is not such rows.
fn gated_rows_of(gu: &[f32], hidden: usize) -> Result<usize, KernelError> {
    check(hidden > 0 && gu.len().is_multiple_of(2 * hidden), || {
        format!("{} values are not rows of 2 x {hidden}", gu.len())
    })?;
    Ok(gu.len() / (2 * hidden))
}

/// `out[r][j] = act(gu[r][j]) · gu[r][hidden + j]`, with `f` computing one row's `act(g) · u`.
fn gated_into(gu: &[f32], hidden: usize, out: &mut [f32], f: GatedRow) -> Result<(), KernelError> {
    let rows = gated_rows_of(gu, hidden)?;
    check(out.len() == rows * hidden, || {
        format!("out has {} values, want {rows}x{hidden}", out.len())
    })?;
    // SAFETY: the row kernels write floats only.
    gated_rows(gu, hidden, unsafe { super::as_uninit(out) }, f);
    Ok(())
}

/// [`gated_into`] into a new vector.
fn gated_vec(gu: &[f32], hidden: usize, f: GatedRow) -> Result<Vec<f32>, KernelError> {
    let rows = gated_rows_of(gu, hidden)?;
    // SAFETY: `gated_rows` writes every row's `hidden` values.
    Ok(unsafe { super::written(rows * hidden, |out| gated_rows(gu, hidden, out, f)) })
}

/// The rows of a gated activation (shapes checked by the callers) into `out`, every value
/// written.
fn gated_rows(gu: &[f32], hidden: usize, out: &mut [std::mem::MaybeUninit<f32>], f: GatedRow) {
    let rows = gu.len() / (2 * hidden);
    debug_assert_eq!(out.len(), rows * hidden);
    let isa = Isa::get();
    let op = SendPtr(out.as_mut_ptr());
    over_rows(rows, out.len(), |r| {
        for row in r {
            let g = &gu[row * 2 * hidden..row * 2 * hidden + hidden];
            let u = &gu[row * 2 * hidden + hidden..(row + 1) * 2 * hidden];
            // SAFETY: each task writes its own rows.
            let o = unsafe { std::slice::from_raw_parts_mut(op.ptr().add(row * hidden), hidden) };
            f(isa, g, u, o);
        }
    });
}

/// `out[r] = w · x[r] / sqrt(mean(x[r]²) + eps)` for rows `x` `[rows, dim]`, the statistic
/// accumulated in the canonical lane order.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<(), KernelError> {
    rms_rows_of(x, w)?;
    check(out.len() == x.len(), || {
        format!("out has {} values, want {}", out.len(), x.len())
    })?;
    // SAFETY: the rows are written with floats only.
    rms_rows(x, w, eps, unsafe { super::as_uninit(out) });
    Ok(())
}

/// [`rms_norm`] into a new vector (not zeroed first: every value is written).
pub fn rms_norm_vec(x: &[f32], w: &[f32], eps: f32) -> Result<Vec<f32>, KernelError> {
    rms_rows_of(x, w)?;
    // SAFETY: `rms_rows` writes each of the values.
    Ok(unsafe { super::written(x.len(), |out| rms_rows(x, w, eps, out)) })
}

/// The residual add and the next norm in one pass, threaded over rows: `sum = x + a` and
/// `normed = rms_norm(sum)`, as the two calls would give them (the same add, then
/// [`rms_norm`]'s arithmetic on the sum), into new vectors (not zeroed first).
pub fn add_rms_norm_vecs(
    x: &[f32],
    a: &[f32],
    w: &[f32],
    eps: f32,
) -> Result<[Vec<f32>; 2], KernelError> {
    rms_rows_of(x, w)?;
    check(a.len() == x.len(), || {
        format!("{} values added to {}", a.len(), x.len())
    })?;
    let dim = w.len();
    let (rows, isa) = (x.len() / dim, Isa::get());
    // SAFETY: each row's sum and normed values are written by the part that holds the row.
    Ok(unsafe {
        super::written_each([x.len(); 2], |[sum, normed]| {
            let (sp, np) = (SendPtr(sum.as_mut_ptr()), SendPtr(normed.as_mut_ptr()));
            over_rows(rows, x.len(), |r| {
                for row in r {
                    let at = row * dim;
                    {
                        let s = std::slice::from_raw_parts_mut(sp.ptr().add(at), dim);
                        let xa = x[at..at + dim].iter().zip(&a[at..at + dim]);
                        for (s, (&x, &a)) in s.iter_mut().zip(xa) {
                            s.write(x + a);
                        }
                    }
                    // The row's sums, every one just written.
                    let sr = std::slice::from_raw_parts(sp.ptr().add(at).cast::<f32>(), dim);
                    let o = std::slice::from_raw_parts_mut(np.ptr().add(at), dim);
                    norm_row(isa, sr, w, eps, o);
                }
            })
        })
    })
}

/// `x + a` into a new vector (not zeroed first), threaded over runs of `width`-value rows.
pub fn add_vec(x: &[f32], a: &[f32], width: usize) -> Result<Vec<f32>, KernelError> {
    check(
        a.len() == x.len() && width > 0 && x.len().is_multiple_of(width),
        || format!("{} values added to {} in rows of {width}", a.len(), x.len()),
    )?;
    // SAFETY: each row's values are written by the part that holds the row.
    Ok(unsafe {
        super::written(x.len(), |out| {
            let op = SendPtr(out.as_mut_ptr());
            over_rows(x.len() / width, x.len(), |r| {
                let span = r.start * width..r.end * width;
                let o = std::slice::from_raw_parts_mut(op.ptr().add(span.start), span.len());
                for ((o, &x), &a) in o.iter_mut().zip(&x[span.clone()]).zip(&a[span]) {
                    o.write(x + a);
                }
            })
        })
    })
}

/// One row's RMSNorm into `out` (every value written): `w · (x / sqrt(mean(x²) + eps))`, the
/// arithmetic every norm here shares (the layer norms, the fused add and norm, q/k's per-head
/// norms), so they give the same bits.
fn norm_row(isa: Isa, x: &[f32], w: &[f32], eps: f32, out: &mut [std::mem::MaybeUninit<f32>]) {
    let ms = simd::dot(isa, x, x) / x.len() as f32;
    let scale = 1.0 / (ms + eps).sqrt();
    for ((o, &x), &w) in out.iter_mut().zip(x).zip(w) {
        o.write(w * (x * scale));
    }
}

/// Checks that `x` is rows of `w.len()` values.
fn rms_rows_of(x: &[f32], w: &[f32]) -> Result<(), KernelError> {
    let dim = w.len();
    check(dim > 0 && x.len().is_multiple_of(dim), || {
        format!("{} values are not rows of {dim}", x.len())
    })
}

/// Every row of `x` normed into `out` (as many values), each value written once.
fn rms_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [std::mem::MaybeUninit<f32>]) {
    let dim = w.len();
    let rows = x.len() / dim;
    let isa = Isa::get();
    let op = SendPtr(out.as_mut_ptr());
    over_rows(rows, x.len(), |r| {
        for row in r {
            let xr = &x[row * dim..(row + 1) * dim];
            // SAFETY: each task writes its own rows.
            let o = unsafe { std::slice::from_raw_parts_mut(op.ptr().add(row * dim), dim) };
            norm_row(isa, xr, w, eps, o);
        }
    });
}

/// The softmax of `x` in place, float32, sums in the canonical lane order.
pub fn softmax(x: &mut [f32]) {
    simd::softmax(Isa::get(), x, 1.0);
}

/// The maximum of `x` and the first index holding it (`-inf` and 0 when empty or all NaN).
fn max_at(x: &[f32]) -> (f32, usize) {
    let (mut m, mut at) = (f32::NEG_INFINITY, 0);
    for (i, &v) in x.iter().enumerate() {
        if v > m {
            (m, at) = (v, i);
        }
    }
    (m, at)
}

/// Per row of `x` `[rows, width]`: the maximum, the first index holding it, and
/// `Σ exp(x - max)` (canonical lane order): a row's softmax maximum is `1 / sum`, its
/// log-softmax `x - max - ln(sum)`.
pub fn row_stats(x: &[f32], width: usize) -> Result<Vec<(f32, usize, f32)>, KernelError> {
    check(width > 0 && x.len().is_multiple_of(width), || {
        format!("{} values are not rows of {width}", x.len())
    })?;
    let rows = x.len() / width;
    let isa = Isa::get();
    let mut out = vec![(0f32, 0usize, 0f32); rows];
    let op = SendPtr(out.as_mut_ptr());
    over_rows(rows, x.len(), |r| {
        for row in r {
            let xr = &x[row * width..(row + 1) * width];
            let (m, at) = max_at(xr);
            let sum = simd::exp_sum(isa, xr, m);
            // SAFETY: each task writes its own rows.
            unsafe { *op.ptr().add(row) = (m, at, sum) };
        }
    });
    Ok(out)
}

/// How [`split_heads`] turns a fused q/k/v product into heads.
#[derive(Debug, Clone, Copy)]
pub struct HeadSplit<'a> {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Biases of q `[n_heads · head_dim]` and k `[n_kv_heads · head_dim]` added first (Huginn's
    /// learned q/k bias).
    pub qk_bias: Option<(&'a [f32], &'a [f32])>,
    /// Per-head RMSNorm weights of q and k `[head_dim]` (Qwen3), with their epsilon.
    pub qk_norm: Option<(&'a [f32], &'a [f32], f32)>,
    /// Which dims RoPE pairs: `false`, dim `i` with `i + rotary_dim / 2` (GPT-NeoX's "half"
    /// layout); `true`, dims `2i` and `2i + 1` (the original "interleaved" or complex form,
    /// Huginn's). Pair `i` turns by angle `i` of the row either way.
    pub interleaved: bool,
    /// Leading dims of a head that RoPE rotates (`head_dim`, or fewer under partial rotary
    /// embeddings: LLaDA2 rotates half); the rest pass through.
    pub rotary_dim: usize,
    /// RoPE of every row, `[rows, rotary_dim / 2]` each (GPT-NeoX "half" layout over the
    /// rotary dims).
    pub cos: &'a [f32],
    pub sin: &'a [f32],
}

/// Splits `qkv` `[rows, (H + 2 H_kv) · D]` (q, k and v side by side) into head-major q
/// `[H, rows, D]`, k and v `[H_kv, rows, D]`: q and k biased and normed per head when asked,
/// then rotated; v copied. One pass over the product instead of a copy per step. RoPE as the
/// references compute it: `x1·cos - x2·sin`, `x1·sin + x2·cos`.
pub fn split_heads(
    qkv: &[f32],
    rows: usize,
    s: &HeadSplit,
    q: &mut [f32],
    k: &mut [f32],
    v: &mut [f32],
) -> Result<(), KernelError> {
    check_split(qkv, rows, s)?;
    let (h, hkv, d) = (s.n_heads, s.n_kv_heads, s.head_dim);
    check(
        q.len() == h * rows * d && k.len() == hkv * rows * d && v.len() == k.len(),
        || "q/k/v outputs of the wrong size".into(),
    )?;
    // SAFETY: the kernel writes floats only.
    unsafe {
        split_heads_into(
            qkv,
            rows,
            s,
            [
                super::as_uninit(q),
                super::as_uninit(k),
                super::as_uninit(v),
            ],
        );
    }
    Ok(())
}

/// [`split_heads`] into new vectors q, k and v (not zeroed first: every value is written).
pub fn split_heads_vecs(
    qkv: &[f32],
    rows: usize,
    s: &HeadSplit,
) -> Result<[Vec<f32>; 3], KernelError> {
    check_split(qkv, rows, s)?;
    let (h, hkv, d) = (s.n_heads, s.n_kv_heads, s.head_dim);
    let lens = [h * rows * d, hkv * rows * d, hkv * rows * d];
    // SAFETY: `split_heads_into` writes every value of each.
    Ok(unsafe { super::written_each(lens, |qkv_out| split_heads_into(qkv, rows, s, qkv_out)) })
}

/// Why `qkv` and `s` do not make a head split of `rows` rows (the outputs aside).
fn check_split(qkv: &[f32], rows: usize, s: &HeadSplit) -> Result<(), KernelError> {
    let (h, hkv, d, rot) = (s.n_heads, s.n_kv_heads, s.head_dim, s.rotary_dim);
    let width = (h + 2 * hkv) * d;
    check(d % 2 == 0 && qkv.len() == rows * width, || {
        format!("{} values are not {rows} rows of {width}", qkv.len())
    })?;
    check(rot % 2 == 0 && rot <= d, || {
        format!("{rot} rotary dims of a {d}-dim head")
    })?;
    check(
        s.cos.len() >= rows * rot / 2 && s.sin.len() >= rows * rot / 2,
        || format!("RoPE rows for {rows} rows of {rot} dims"),
    )?;
    check(
        s.qk_bias
            .is_none_or(|(qb, kb)| qb.len() == h * d && kb.len() == hkv * d),
        || format!("q/k biases of {h} and {hkv} heads of {d}"),
    )
}

/// The head split (checked by the callers) into q, k and v, every value written. Threaded over
/// runs of rows, each row's heads in order: the product's rows are read front to back (one
/// head's column of every row, the order before, read 256 bytes in every 6 KB and left each
/// read waiting on the cache).
fn split_heads_into(
    qkv: &[f32],
    rows: usize,
    s: &HeadSplit,
    [q, k, v]: [&mut [std::mem::MaybeUninit<f32>]; 3],
) {
    let (h, hkv, d, rot) = (s.n_heads, s.n_kv_heads, s.head_dim, s.rotary_dim);
    let width = (h + 2 * hkv) * d;
    debug_assert!(q.len() == h * rows * d && k.len() == hkv * rows * d && v.len() == k.len());
    let isa = Isa::get();
    let (qp, kp, vp) = (
        SendPtr(q.as_mut_ptr()),
        SendPtr(k.as_mut_ptr()),
        SendPtr(v.as_mut_ptr()),
    );
    // Unit u of a row: query head u, key head u - H, value head u - H - H_kv.
    let run = |range: std::ops::Range<usize>| {
        let scratch = |wanted: bool| if wanted { vec![0f32; d] } else { Vec::new() };
        let (mut biased, mut normed) = (scratch(s.qk_bias.is_some()), scratch(s.qk_norm.is_some()));
        for r in range {
            let row = &qkv[r * width..(r + 1) * width];
            let half = rot / 2;
            let (cos, sin) = (
                &s.cos[r * half..(r + 1) * half],
                &s.sin[r * half..(r + 1) * half],
            );
            for (u, mut x) in row.chunks_exact(d).enumerate() {
                let (head, dst, norm, bias, rotate) = if u < h {
                    let bias = s.qk_bias.map(|(b, _)| &b[u * d..(u + 1) * d]);
                    (u, qp.ptr(), s.qk_norm.map(|(w, _, e)| (w, e)), bias, true)
                } else if u < h + hkv {
                    let head = u - h;
                    let bias = s.qk_bias.map(|(_, b)| &b[head * d..(head + 1) * d]);
                    (
                        head,
                        kp.ptr(),
                        s.qk_norm.map(|(_, w, e)| (w, e)),
                        bias,
                        true,
                    )
                } else {
                    (u - h - hkv, vp.ptr(), None, None, false)
                };
                // SAFETY: each row's heads are written by the part that holds the row.
                let out =
                    unsafe { std::slice::from_raw_parts_mut(dst.add((head * rows + r) * d), d) };
                if let Some(b) = bias {
                    for ((o, &x), &b) in biased.iter_mut().zip(x).zip(b) {
                        *o = x + b;
                    }
                    x = &biased;
                }
                if let Some((w, eps)) = norm {
                    // SAFETY: the norm writes floats only.
                    norm_row(isa, x, w, eps, unsafe { super::as_uninit(&mut normed) });
                    x = &normed;
                }
                if rotate {
                    if s.interleaved {
                        let pairs = out[..rot].chunks_exact_mut(2).zip(x[..rot].chunks_exact(2));
                        for ((o, p), (&c, &sn)) in pairs.zip(cos.iter().zip(sin)) {
                            o[0].write(p[0] * c - p[1] * sn);
                            o[1].write(p[0] * sn + p[1] * c);
                        }
                    } else {
                        simd::rotate_halves(isa, &x[..rot], cos, sin, &mut out[..rot]);
                    }
                    copy_into(&mut out[rot..], &x[rot..]);
                } else {
                    copy_into(out, x);
                }
            }
        }
    };
    over_rows(rows, qkv.len(), run);
}

/// `dst[i] = src[i]` for every value of `dst`.
fn copy_into(dst: &mut [std::mem::MaybeUninit<f32>], src: &[f32]) {
    for (o, &x) in dst.iter_mut().zip(src) {
        o.write(x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_mul_is_the_gated_activation() {
        let hidden = 37;
        let gu: Vec<f32> = (0..3 * 2 * hidden)
            .map(|i| ((i * 29 % 97) as f32 - 48.0) * 0.21)
            .collect();
        let mut out = vec![0f32; 3 * hidden];
        silu_mul(&gu, hidden, &mut out).unwrap();
        for r in 0..3 {
            for j in 0..hidden {
                let g = f64::from(gu[r * 2 * hidden + j]);
                let u = f64::from(gu[r * 2 * hidden + hidden + j]);
                let want = g / ((-g).exp() + 1.0) * u;
                let got = f64::from(out[r * hidden + j]);
                assert!(
                    (got - want).abs() <= 2e-6 * want.abs().max(1e-3),
                    "{got} vs {want}"
                );
            }
        }
        assert!(silu_mul(&gu, 5, &mut out).is_err());
        assert!(silu_mul_vec(&gu, 5).is_err());
        assert!(silu_mul_vec(&gu, 0).is_err());
        // Every value written: from NaNs, and into a vector not zeroed, the same bits.
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let mut from_nan = vec![f32::NAN; 3 * hidden];
        silu_mul(&gu, hidden, &mut from_nan).unwrap();
        assert_eq!(bits(&from_nan), bits(&out));
        assert_eq!(bits(&silu_mul_vec(&gu, hidden).unwrap()), bits(&out));
        let mut gelu = vec![f32::NAN; 3 * hidden];
        gelu_tanh_mul(&gu, hidden, &mut gelu).unwrap();
        assert!(gelu.iter().all(|v| v.is_finite()));
        assert_eq!(bits(&gelu_tanh_mul_vec(&gu, hidden).unwrap()), bits(&gelu));
    }

    /// `split_heads` into buffers of NaNs and `split_heads_vecs` (not zeroed) give `want`'s
    /// bits: every value is written.
    fn assert_every_value_written(qkv: &[f32], rows: usize, s: &HeadSplit, want: [&[f32]; 3]) {
        let mut got = want.map(|w| vec![f32::NAN; w.len()]);
        let [q, k, v] = &mut got;
        split_heads(qkv, rows, s, q, k, v).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (g, w) in got.iter().zip(want) {
            assert_eq!(bits(g), bits(w));
        }
        for (g, w) in split_heads_vecs(qkv, rows, s).unwrap().iter().zip(want) {
            assert_eq!(bits(g), bits(w));
        }
    }

    /// The fused residual add and norm give the bits of the add and then [`rms_norm`], alone
    /// and threaded over rows; `add_vec` the add's; bad shapes are refused.
    #[test]
    fn the_fused_add_and_norm_give_the_bits_of_the_two_steps() {
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (rows, dim) in [(3usize, 37usize), (90, 512)] {
            let x: Vec<f32> = (0..rows * dim)
                .map(|i| (i as f32 * 0.013).sin() * 2.0)
                .collect();
            let a: Vec<f32> = (0..rows * dim).map(|i| (i as f32 * 0.029).cos()).collect();
            let w: Vec<f32> = (0..dim).map(|i| 0.5 + i as f32 * 0.01).collect();
            let sum: Vec<f32> = x.iter().zip(&a).map(|(x, a)| x + a).collect();
            let mut normed = vec![f32::NAN; sum.len()];
            rms_norm(&sum, &w, 1e-5, &mut normed).unwrap();
            let [s, n] = add_rms_norm_vecs(&x, &a, &w, 1e-5).unwrap();
            assert_eq!(bits(&s), bits(&sum), "sum, {rows} rows");
            assert_eq!(bits(&n), bits(&normed), "norm, {rows} rows");
            assert_eq!(bits(&add_vec(&x, &a, dim).unwrap()), bits(&sum));
        }
        assert!(add_rms_norm_vecs(&[1.0; 8], &[1.0; 7], &[1.0; 4], 1e-5).is_err());
        assert!(add_rms_norm_vecs(&[1.0; 8], &[1.0; 8], &[1.0; 3], 1e-5).is_err());
        assert!(add_vec(&[1.0; 8], &[1.0; 7], 4).is_err());
        assert!(add_vec(&[1.0; 8], &[1.0; 8], 3).is_err());
    }

    /// A split of many rows runs over row runs on the pool's threads; every head of every row
    /// is what the scalar definition gives, bit for bit, in both RoPE layouts and with the
    /// biases and norms.
    #[test]
    fn a_threaded_split_gives_each_rows_heads_their_bits() {
        let (h, hkv, d, rows) = (6, 2, 64, 90);
        let width = (h + 2 * hkv) * d;
        assert!(rows * width >= PARALLEL_FROM);
        let qkv: Vec<f32> = (0..rows * width)
            .map(|i| (i as f32 * 0.0137).sin())
            .collect();
        let cos: Vec<f32> = (0..rows * d / 2)
            .map(|i| (i as f32 * 0.021).cos())
            .collect();
        let sin: Vec<f32> = (0..rows * d / 2)
            .map(|i| (i as f32 * 0.021).sin())
            .collect();
        let (wq, wk): (Vec<f32>, Vec<f32>) = (0..d).map(|i| (1.0 + i as f32 * 0.01, 0.9)).unzip();
        let qb: Vec<f32> = (0..h * d).map(|i| i as f32 * 1e-3).collect();
        let kb: Vec<f32> = (0..hkv * d).map(|i| -(i as f32) * 1e-3).collect();
        for (interleaved, bias, norm) in [
            (false, false, false),
            (true, true, false),
            (false, false, true),
        ] {
            let s = HeadSplit {
                n_heads: h,
                n_kv_heads: hkv,
                head_dim: d,
                qk_bias: bias.then_some((&qb[..], &kb[..])),
                qk_norm: norm.then_some((&wq[..], &wk[..], 1e-6)),
                interleaved,
                rotary_dim: d,
                cos: &cos,
                sin: &sin,
            };
            let (mut q, mut kv) = (
                vec![0f32; h * rows * d],
                vec![vec![0f32; hkv * rows * d]; 2],
            );
            for r in 0..rows {
                let (c, sn) = (
                    &cos[r * d / 2..(r + 1) * d / 2],
                    &sin[r * d / 2..(r + 1) * d / 2],
                );
                for u in 0..h + 2 * hkv {
                    let mut x: Vec<f32> = qkv[r * width + u * d..r * width + (u + 1) * d].to_vec();
                    let (out, head) = match u {
                        u if u < h => (&mut q, u),
                        u if u < h + hkv => (&mut kv[0], u - h),
                        u => (&mut kv[1], u - h - hkv),
                    };
                    let out = &mut out[(head * rows + r) * d..(head * rows + r + 1) * d];
                    if u >= h + hkv {
                        out.copy_from_slice(&x);
                        continue;
                    }
                    if bias {
                        let b = if u < h { &qb[u * d..] } else { &kb[head * d..] };
                        x.iter_mut().zip(b).for_each(|(x, b)| *x += b);
                    }
                    if norm {
                        let w = if u < h { &wq } else { &wk };
                        let ms = simd::dot(Isa::get(), &x, &x) / d as f32;
                        let scale = 1.0 / (ms + 1e-6).sqrt();
                        x.iter_mut().zip(w).for_each(|(x, w)| *x = w * (*x * scale));
                    }
                    for i in 0..d / 2 {
                        let (a, b) = if interleaved {
                            (2 * i, 2 * i + 1)
                        } else {
                            (i, i + d / 2)
                        };
                        out[a] = x[a] * c[i] - x[b] * sn[i];
                        out[b] = x[a] * sn[i] + x[b] * c[i];
                    }
                }
            }
            assert_every_value_written(&qkv, rows, &s, [&q, &kv[0], &kv[1]]);
        }
    }

    #[test]
    fn heads_are_split_normed_and_rotated() {
        let (h, hkv, d, rows) = (2, 1, 4, 3);
        let width = (h + 2 * hkv) * d;
        let qkv: Vec<f32> = (0..rows * width).map(|i| (i as f32 * 0.37).sin()).collect();
        let cos: Vec<f32> = (0..rows * d / 2).map(|i| (i as f32 * 0.2).cos()).collect();
        let sin: Vec<f32> = (0..rows * d / 2).map(|i| (i as f32 * 0.2).sin()).collect();
        let wq = [1.0f32, 2.0, 0.5, 1.5];
        let wk = [0.7f32; 4];
        let split = HeadSplit {
            n_heads: h,
            n_kv_heads: hkv,
            head_dim: d,
            qk_bias: None,
            qk_norm: Some((&wq, &wk, 1e-6)),
            interleaved: false,
            rotary_dim: d,
            cos: &cos,
            sin: &sin,
        };
        let (mut q, mut k, mut v) = (
            vec![0f32; h * rows * d],
            vec![0f32; rows * d],
            vec![0f32; rows * d],
        );
        split_heads(&qkv, rows, &split, &mut q, &mut k, &mut v).unwrap();
        assert_every_value_written(&qkv, rows, &split, [&q, &k, &v]);
        for r in 0..rows {
            // v: a copy of the last head's slice.
            assert_eq!(
                v[r * d..(r + 1) * d],
                qkv[r * width + 3 * d..r * width + 4 * d]
            );
            // q head 1: normed with wq, then rotated with row r's angles.
            let x = &qkv[r * width + d..r * width + 2 * d];
            let ms = x.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let n: Vec<f32> = x
                .iter()
                .zip(&wq)
                .map(|(x, w)| w * (x / (ms + 1e-6).sqrt()))
                .collect();
            let (c, s) = (&cos[r * 2..r * 2 + 2], &sin[r * 2..r * 2 + 2]);
            let want = [
                n[0] * c[0] - n[2] * s[0],
                n[1] * c[1] - n[3] * s[1],
                n[0] * s[0] + n[2] * c[0],
                n[1] * s[1] + n[3] * c[1],
            ];
            for (g, w) in q[(rows + r) * d..(rows + r + 1) * d].iter().zip(want) {
                assert!((g - w).abs() < 1e-5, "{g} vs {w}");
            }
        }
        // Partial rotary (LLaDA2): the first two dims rotate as one pair, the rest pass.
        let partial = HeadSplit {
            qk_norm: None,
            rotary_dim: 2,
            cos: &cos[..rows],
            sin: &sin[..rows],
            ..split
        };
        split_heads(&qkv, rows, &partial, &mut q, &mut k, &mut v).unwrap();
        assert_every_value_written(&qkv, rows, &partial, [&q, &k, &v]);
        for r in 0..rows {
            let x = &qkv[r * width..r * width + d];
            let (c, s) = (cos[r], sin[r]);
            let want = [x[0] * c - x[1] * s, x[0] * s + x[1] * c, x[2], x[3]];
            for (g, w) in q[r * d..(r + 1) * d].iter().zip(want) {
                assert!((g - w).abs() < 1e-6, "{g} vs {w}");
            }
        }
        // Huginn: q/k biased, then rotated in interleaved pairs, bit for bit as the sum and
        // the two products are written.
        let qb: Vec<f32> = (0..h * d).map(|i| i as f32 * 0.11 - 0.3).collect();
        let kb: Vec<f32> = (0..hkv * d).map(|i| 0.2 - i as f32 * 0.07).collect();
        let huginn = HeadSplit {
            qk_bias: Some((&qb, &kb)),
            qk_norm: None,
            interleaved: true,
            ..split
        };
        split_heads(&qkv, rows, &huginn, &mut q, &mut k, &mut v).unwrap();
        assert_every_value_written(&qkv, rows, &huginn, [&q, &k, &v]);
        for r in 0..rows {
            let (c, s) = (&cos[r * 2..r * 2 + 2], &sin[r * 2..r * 2 + 2]);
            for (head, out, bias, col) in [
                (0, &q[r * d..(r + 1) * d], &qb[..d], 0),
                (1, &q[(rows + r) * d..(rows + r + 1) * d], &qb[d..], d),
                (0, &k[r * d..(r + 1) * d], &kb[..], 2 * d),
            ] {
                let x: Vec<f32> = qkv[r * width + col..r * width + col + d]
                    .iter()
                    .zip(bias)
                    .map(|(x, b)| x + b)
                    .collect();
                let want = [
                    x[0] * c[0] - x[1] * s[0],
                    x[0] * s[0] + x[1] * c[0],
                    x[2] * c[1] - x[3] * s[1],
                    x[2] * s[1] + x[3] * c[1],
                ];
                assert_eq!(out, want, "head {head} of row {r}");
            }
            assert_eq!(
                v[r * d..(r + 1) * d],
                qkv[r * width + 3 * d..r * width + 4 * d]
            );
        }
        let short = HeadSplit {
            qk_bias: Some((&qb[..d], &kb)),
            ..huginn
        };
        assert!(split_heads(&qkv, rows, &short, &mut q, &mut k, &mut v).is_err());
        assert!(split_heads_vecs(&qkv, rows, &short).is_err());
        assert!(split_heads_vecs(&qkv[1..], rows, &huginn).is_err());
    }

    #[test]
    fn rms_norm_scales_rows_to_unit_mean_square() {
        let dim = 19;
        let x: Vec<f32> = (0..2 * dim).map(|i| (i as f32 - 7.0) * 0.3).collect();
        let w: Vec<f32> = (0..dim).map(|i| 1.0 + i as f32 * 0.01).collect();
        let mut out = vec![f32::NAN; x.len()];
        rms_norm(&x, &w, 1e-6, &mut out).unwrap();
        // Every value written: from NaNs above, and into a vector not zeroed, the same bits.
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&rms_norm_vec(&x, &w, 1e-6).unwrap()), bits(&out));
        assert!(rms_norm_vec(&x[1..], &w, 1e-6).is_err());
        assert!(rms_norm_vec(&x, &[], 1e-6).is_err());
        assert!(rms_norm(&x, &w, 1e-6, &mut out[1..]).is_err());
        for r in 0..2 {
            let xr = &x[r * dim..(r + 1) * dim];
            let ms = xr.iter().map(|v| f64::from(v * v)).sum::<f64>() / dim as f64;
            for j in 0..dim {
                let want = f64::from(w[j]) * f64::from(xr[j]) / (ms + 1e-6).sqrt();
                assert!((f64::from(out[r * dim + j]) - want).abs() < 1e-5);
            }
        }
    }
}

/// `out[r][j] = gelu_tanh(gu[r][j]) · gu[r][hidden + j]` for rows `gu` `[rows, 2·hidden]`
/// (Gemma's gated MLP: GELU's tanh approximation).
pub fn gelu_tanh_mul(gu: &[f32], hidden: usize, out: &mut [f32]) -> Result<(), KernelError> {
    gated_into(gu, hidden, out, simd::gelu_tanh_mul)
}

/// [`gelu_tanh_mul`] into a new vector (not zeroed first: every value is written).
pub fn gelu_tanh_mul_vec(gu: &[f32], hidden: usize) -> Result<Vec<f32>, KernelError> {
    gated_vec(gu, hidden, simd::gelu_tanh_mul)
}

/// `x ← cap · tanh(x / cap)` over rows of `width` in place (Gemma's logit soft cap).
pub fn soft_cap(x: &mut [f32], width: usize, cap: f32) -> Result<(), KernelError> {
    check(width > 0 && x.len().is_multiple_of(width), || {
        format!("{} values are not rows of {width}", x.len())
    })?;
    let rows = x.len() / width;
    let isa = Isa::get();
    let xp = SendPtr(x.as_mut_ptr());
    let elems = x.len();
    over_rows(rows, elems, |r| {
        // SAFETY: each task writes its own rows.
        let xs = unsafe {
            std::slice::from_raw_parts_mut(xp.ptr().add(r.start * width), r.len() * width)
        };
        simd::soft_cap(isa, xs, cap);
    });
    Ok(())
}

/// What an entropy-bounded sampler needs of one row of logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowEntropy {
    /// The maximum and the first index holding it.
    pub max: f32,
    pub argmax: usize,
    /// `Σ exp(x - max)`.
    pub sum: f32,
    /// The entropy of `softmax(x)`, `ln(sum) + Σ exp(x - max)·(max - x) / sum`.
    pub entropy: f32,
}

/// [`RowEntropy`] of every row of `x` `[rows, width]`, threaded over rows; the same bits on
/// every instruction set.
pub fn row_entropy(x: &[f32], width: usize) -> Result<Vec<RowEntropy>, KernelError> {
    check(width > 0 && x.len().is_multiple_of(width), || {
        format!("{} values are not rows of {width}", x.len())
    })?;
    let rows = x.len() / width;
    let isa = Isa::get();
    let zero = RowEntropy {
        max: 0.0,
        argmax: 0,
        sum: 0.0,
        entropy: 0.0,
    };
    let mut out = vec![zero; rows];
    let op = SendPtr(out.as_mut_ptr());
    over_rows(rows, x.len(), |r| {
        for row in r {
            let xr = &x[row * width..(row + 1) * width];
            let (m, at) = max_at(xr);
            let (s0, s1) = simd::exp_sums(isa, xr, m);
            // SAFETY: each task writes its own rows.
            unsafe {
                *op.ptr().add(row) = RowEntropy {
                    max: m,
                    argmax: at,
                    sum: s0,
                    entropy: s0.ln() + s1 / s0,
                }
            };
        }
    });
    Ok(out)
}

/// The index a uniform `u` in `[0, 1)` draws from `softmax(x)` for a row `x` whose
/// [`RowEntropy`] is `stats` (inverse transform in index order).
pub fn sample_row(x: &[f32], stats: &RowEntropy, u: f32) -> usize {
    simd::sample(Isa::get(), x, stats.max, stats.sum, u)
}
