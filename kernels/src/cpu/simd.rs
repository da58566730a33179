//! Which vector instructions this process uses, detected once at run time.

use std::sync::OnceLock;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F (16 floats per register, 32 registers).
    Avx512,
    /// AVX2 with FMA (8 floats per register, 16 registers).
    Avx2,
    /// Plain Rust with `f32::mul_add` (same results, slower).
    Portable,
}

impl Isa {
    pub fn get() -> Self {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(Self::detect)
    }

    fn detect() -> Self {
        Self::available()[0]
    }

    /// Every instruction set this machine can run, best first (tests compare them).
    pub fn available() -> Vec<Self> {
        let mut out = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                out.push(Self::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                out.push(Self::Avx2);
            }
        }
        out.push(Self::Portable);
        out
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Avx512 => "avx512",
            Self::Avx2 => "avx2",
            Self::Portable => "portable",
        }
    }
}

/// Lanes of the canonical reduction order (one AVX-512 register).
const LANES: usize = 16;

/// `Σ a[i]·b[i]` in one order on every instruction set: lane `j` accumulates the elements
/// `i ≡ j (mod 16)` with fused multiply-adds in ascending `i` (missing tail elements count as
/// `0·0`), then the lanes are summed pairwise `j + (j + 8)`, `j + (j + 4)`, `j + (j + 2)`,
/// `j + (j + 1)`.
pub(crate) fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set was detected on this machine.
        Isa::Avx512 => unsafe { dot_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { dot_avx2(a, b) },
        _ => dot_portable(a, b),
    }
}

fn reduce_lanes(mut l: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for j in 0..w {
            l[j] += l[j + w];
        }
        w /= 2;
    }
    l[0]
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut l = [0f32; LANES];
    let n = a.len().div_ceil(LANES) * LANES;
    for i in 0..n {
        let (x, y) = if i < a.len() {
            (a[i], b[i])
        } else {
            (0.0, 0.0)
        };
        l[i % LANES] = x.mul_add(y, l[i % LANES]);
    }
    reduce_lanes(l)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len();
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i + LANES <= n {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(ap.add(i)), _mm512_loadu_ps(bp.add(i)), acc);
        i += LANES;
    }
    if i < n {
        let m: __mmask16 = (1u32 << (n - i)) as u16 - 1;
        let x = _mm512_maskz_loadu_ps(m, ap.add(i));
        let y = _mm512_maskz_loadu_ps(m, bp.add(i));
        acc = _mm512_fmadd_ps(x, y, acc);
    }
    let mut l = [0f32; LANES];
    _mm512_storeu_ps(l.as_mut_ptr(), acc);
    reduce_lanes(l)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len();
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + LANES <= n {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(ap.add(i)), _mm256_loadu_ps(bp.add(i)), lo);
        hi = _mm256_fmadd_ps(
            _mm256_loadu_ps(ap.add(i + 8)),
            _mm256_loadu_ps(bp.add(i + 8)),
            hi,
        );
        i += LANES;
    }
    let mut l = [0f32; LANES];
    _mm256_storeu_ps(l.as_mut_ptr(), lo);
    _mm256_storeu_ps(l.as_mut_ptr().add(8), hi);
    for (j, lane) in l.iter_mut().enumerate() {
        let (x, y) = if i + j < n {
            (a[i + j], b[i + j])
        } else {
            (0.0, 0.0)
        };
        if i < n {
            *lane = x.mul_add(y, *lane);
        }
    }
    reduce_lanes(l)
}

/// `y[i] = alpha·x[i] + y[i]`, each with one rounding (the same bits on every instruction set).
pub(crate) fn axpy(isa: Isa, alpha: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set was detected on this machine.
        Isa::Avx512 => unsafe { axpy_avx512(alpha, x, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above (AVX2 machines have FMA here: `Isa::available`).
        Isa::Avx2 => unsafe { axpy_avx2(alpha, x, y) },
        _ => y
            .iter_mut()
            .zip(x)
            .for_each(|(y, &x)| *y = alpha.mul_add(x, *y)),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy_avx512(alpha: f32, x: &[f32], y: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = x.len();
    let a = _mm512_set1_ps(alpha);
    let (xp, yp) = (x.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    while i + LANES <= n {
        let r = _mm512_fmadd_ps(a, _mm512_loadu_ps(xp.add(i)), _mm512_loadu_ps(yp.add(i)));
        _mm512_storeu_ps(yp.add(i), r);
        i += LANES;
    }
    if i < n {
        let m: __mmask16 = (1u32 << (n - i)) as u16 - 1;
        let r = _mm512_fmadd_ps(
            a,
            _mm512_maskz_loadu_ps(m, xp.add(i)),
            _mm512_maskz_loadu_ps(m, yp.add(i)),
        );
        _mm512_mask_storeu_ps(yp.add(i), m, r);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(alpha: f32, x: &[f32], y: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = x.len();
    let a = _mm256_set1_ps(alpha);
    let (xp, yp) = (x.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= n {
        let r = _mm256_fmadd_ps(a, _mm256_loadu_ps(xp.add(i)), _mm256_loadu_ps(yp.add(i)));
        _mm256_storeu_ps(yp.add(i), r);
        i += 8;
    }
    for j in i..n {
        y[j] = alpha.mul_add(x[j], y[j]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_and_axpy_give_the_same_bits_on_every_instruction_set() {
        for n in [0, 1, 7, 15, 16, 17, 40, 64, 129] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.3) / 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 17 % 13) as f32 - 6.1) / 7.0).collect();
            let want = dot_portable(&a, &b);
            let mut y0 = b.clone();
            axpy(Isa::Portable, 0.37, &a, &mut y0);
            for isa in Isa::available() {
                assert_eq!(dot(isa, &a, &b).to_bits(), want.to_bits(), "{isa:?} n{n}");
                let mut y = b.clone();
                axpy(isa, 0.37, &a, &mut y);
                assert_eq!(y, y0, "{isa:?} n{n}");
            }
        }
    }
}
