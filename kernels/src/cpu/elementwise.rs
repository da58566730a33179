//! Row-wise operations between the products of a block, threaded over rows: the gated SiLU of
//! an MLP and RMSNorm.

use super::simd::{self, Isa};
use super::{split, threads, SendPtr};
use crate::{check, ShapeError};

/// Elements below which one thread does the whole call.
const PARALLEL_FROM: usize = 1 << 15;

/// Runs `f(rows)` over contiguous runs of `0..n_rows` on the pool (inline when small).
fn over_rows(n_rows: usize, elems: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    let t = threads();
    if t <= 1 || elems < PARALLEL_FROM || n_rows < 2 {
        f(0..n_rows);
        return;
    }
    rayon::scope(|s| {
        for r in split(n_rows, t) {
            let f = &f;
            s.spawn(move |_| f(r));
        }
    });
}

/// `out[r][j] = silu(gu[r][j]) · gu[r][hidden + j]` for rows `gu` `[rows, 2·hidden]` (the gate
/// and up projections side by side): `silu(g) = g / (exp(-g) + 1)`.
pub fn silu_mul(gu: &[f32], hidden: usize, out: &mut [f32]) -> Result<(), ShapeError> {
    check(hidden > 0 && gu.len().is_multiple_of(2 * hidden), || {
        format!("{} values are not rows of 2 x {hidden}", gu.len())
    })?;
    let rows = gu.len() / (2 * hidden);
    check(out.len() == rows * hidden, || {
        format!("out has {} values, want {rows}x{hidden}", out.len())
    })?;
    let isa = Isa::get();
    let op = SendPtr(out.as_mut_ptr());
    over_rows(rows, out.len(), |r| {
        for row in r {
            let g = &gu[row * 2 * hidden..row * 2 * hidden + hidden];
            let u = &gu[row * 2 * hidden + hidden..(row + 1) * 2 * hidden];
            // SAFETY: each task writes its own rows.
            let o = unsafe { std::slice::from_raw_parts_mut(op.ptr().add(row * hidden), hidden) };
            simd::silu_mul(isa, g, u, o);
        }
    });
    Ok(())
}

/// `out[r] = w · x[r] / sqrt(mean(x[r]²) + eps)` for rows `x` `[rows, dim]`, the statistic
/// accumulated in the canonical lane order.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) -> Result<(), ShapeError> {
    let dim = w.len();
    check(
        dim > 0 && x.len().is_multiple_of(dim) && out.len() == x.len(),
        || format!("{} / {} values are not rows of {dim}", x.len(), out.len()),
    )?;
    let rows = x.len() / dim;
    let isa = Isa::get();
    let op = SendPtr(out.as_mut_ptr());
    over_rows(rows, x.len(), |r| {
        for row in r {
            let xr = &x[row * dim..(row + 1) * dim];
            // SAFETY: each task writes its own rows.
            let o = unsafe { std::slice::from_raw_parts_mut(op.ptr().add(row * dim), dim) };
            let ms = simd::dot(isa, xr, xr) / dim as f32;
            let scale = 1.0 / (ms + eps).sqrt();
            for ((o, &x), &w) in o.iter_mut().zip(xr).zip(w) {
                *o = w * (x * scale);
            }
        }
    });
    Ok(())
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
    }

    #[test]
    fn rms_norm_scales_rows_to_unit_mean_square() {
        let dim = 19;
        let x: Vec<f32> = (0..2 * dim).map(|i| (i as f32 - 7.0) * 0.3).collect();
        let w: Vec<f32> = (0..dim).map(|i| 1.0 + i as f32 * 0.01).collect();
        let mut out = vec![0f32; x.len()];
        rms_norm(&x, &w, 1e-6, &mut out).unwrap();
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
