//! Which vector instructions this process uses, detected once at run time.

use std::mem::MaybeUninit;
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

/// The lanes of a 16-value chunk that hold values when `left` values remain (all of them from
/// 16 on): the mask of the chunked loops' masked loads and stores.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn chunk_mask(left: usize) -> u16 {
    if left >= LANES {
        0xFFFF
    } else {
        ((1u32 << left) - 1) as u16
    }
}

/// An element of stored keys and values: float32, or bfloat16 (`u16`, a float32's upper half:
/// the bf16 K/V cache). Read as float32 exactly, so a product over bfloat16 keys has the bits
/// of the same product over the float32 values they stand for.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// The slice as float32, when it is (the AVX2 paths take float32 only).
    fn as_f32(x: &[Self]) -> Option<&[f32]>;
    /// The 16 elements from `p` as floats, lanes outside `m` zero (and not read).
    ///
    /// # Safety
    /// AVX-512F is present and the lanes of `m` are readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16m(p: *const Self, m: u16) -> std::arch::x86_64::__m512;
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn as_f32(x: &[Self]) -> Option<&[f32]> {
        Some(x)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16m(p: *const Self, m: u16) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_maskz_loadu_ps(m, p)
    }
}

impl Elem for u16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self) << 16)
    }
    #[inline(always)]
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16m(p: *const Self, m: u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let h = if m == 0xFFFF {
            _mm256_loadu_si256(p as *const __m256i)
        } else {
            // A short tail: only its lanes are read (AVX-512F has no masked 16-bit load).
            let mut t = [0u16; LANES];
            for (i, v) in t.iter_mut().enumerate() {
                if m & (1 << i) != 0 {
                    *v = *p.add(i);
                }
            }
            _mm256_loadu_si256(t.as_ptr() as *const __m256i)
        };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
}

/// Asks the cache hierarchy for the lines of `x` ahead of use (a hint: no effect on results).
/// Keys and values read page by page come in runs of a few KiB at scattered addresses, where
/// the hardware prefetcher starts late on every run.
#[inline]
pub(crate) fn prefetch<T>(x: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        for line in x.chunks((64 / size_of::<T>().max(1)).max(1)) {
            // SAFETY: a prefetch of an address inside a live slice; it never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// `Σ a[i]·b[i]` in one order on every instruction set: lane `j` accumulates the elements
/// `i ≡ j (mod 16)` with fused multiply-adds in ascending `i` (missing tail elements count as
/// `0·0`), then the lanes are summed pairwise `j + (j + 8)`, `j + (j + 4)`, `j + (j + 2)`,
/// `j + (j + 1)`.
pub(crate) fn dot<T: Elem>(isa: Isa, a: &[f32], b: &[T]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    match (isa, T::as_f32(b)) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set was detected on this machine.
        (Isa::Avx512, _) => unsafe { dot_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx2, Some(b)) => unsafe { dot_avx2(a, b) },
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

fn dot_portable<T: Elem>(a: &[f32], b: &[T]) -> f32 {
    let mut l = [0f32; LANES];
    let n = a.len().div_ceil(LANES) * LANES;
    for i in 0..n {
        let (x, y) = if i < a.len() {
            (a[i], b[i].to_f32())
        } else {
            (0.0, 0.0)
        };
        l[i % LANES] = x.mul_add(y, l[i % LANES]);
    }
    reduce_lanes(l)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512<T: Elem>(a: &[f32], b: &[T]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len();
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i + LANES <= n {
        acc = _mm512_fmadd_ps(
            _mm512_loadu_ps(ap.add(i)),
            T::load16m(bp.add(i), 0xFFFF),
            acc,
        );
        i += LANES;
    }
    if i < n {
        let m: __mmask16 = (1u32 << (n - i)) as u16 - 1;
        let x = _mm512_maskz_loadu_ps(m, ap.add(i));
        let y = T::load16m(bp.add(i), m);
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
pub(crate) fn axpy<T: Elem>(isa: Isa, alpha: f32, x: &[T], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    match (isa, T::as_f32(x)) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set was detected on this machine.
        (Isa::Avx512, _) => unsafe { axpy_avx512(alpha, x, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above (AVX2 machines have FMA here: `Isa::available`).
        (Isa::Avx2, Some(x)) => unsafe { axpy_avx2(alpha, x, y) },
        _ => y
            .iter_mut()
            .zip(x)
            .for_each(|(y, &x)| *y = alpha.mul_add(x.to_f32(), *y)),
    }
}

/// `out[j] = dot(q, keys[j])` for every key, bit for bit [`dot`] of each key alone. On AVX-512
/// sixteen keys share each load of `q`, and their lanes are summed in [`dot`]'s order by a
/// transposing tree of shuffles (four additions for sixteen keys at each level) instead of a
/// store and fifteen scalar additions per key: the scores of decode attention.
///
/// `ahead` are rows read soon after (the next keys): the lines of `ahead[j]` are asked for as
/// key `j` is multiplied, so memory streams at the rate the keys are used.
pub(crate) fn dots<T: Elem>(isa: Isa, q: &[f32], keys: &[&[T]], out: &mut [f32], ahead: &[&[T]]) {
    debug_assert_eq!(keys.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        for (c, (ks, o)) in keys.chunks(LANES).zip(out.chunks_mut(LANES)).enumerate() {
            let next = &ahead[(c * LANES).min(ahead.len())..((c + 1) * LANES).min(ahead.len())];
            // SAFETY: the instruction set was detected on this machine; every key holds
            // `q.len()` values (checked in debug builds).
            unsafe { dots16_avx512(q, ks, o, next) };
        }
        return;
    }
    for (j, (k, o)) in keys.iter().zip(out).enumerate() {
        if let Some(next) = ahead.get(j) {
            prefetch(next);
        }
        *o = dot(isa, q, k);
    }
}

/// [`dots`] of up to 16 keys.
///
/// # Safety
/// AVX-512F is present, `keys` holds 1 to 16 slices of `q.len()` values and `out` as many.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dots16_avx512<T: Elem>(q: &[f32], keys: &[&[T]], out: &mut [f32], ahead: &[&[T]]) {
    use std::arch::x86_64::*;
    let n = q.len();
    // Missing keys (a short last chunk) read the first key again; their sums are dropped.
    let mut ptr = [keys[0].as_ptr(); LANES];
    for (p, k) in ptr.iter_mut().zip(keys) {
        debug_assert_eq!(k.len(), n);
        *p = k.as_ptr();
    }
    // Lane j of acc[key] accumulates the elements i ≡ j (mod 16), as `dot_avx512` does.
    // Key by key, so the keys are read in address order (a run of keys is contiguous).
    let mut acc = [_mm512_setzero_ps(); LANES];
    for (j, (a, p)) in acc.iter_mut().zip(&ptr).enumerate() {
        if let Some(next) = ahead.get(j) {
            prefetch(next);
        }
        let mut i = 0;
        while i < n {
            let m = chunk_mask(n - i);
            let x = _mm512_maskz_loadu_ps(m, q.as_ptr().add(i));
            *a = _mm512_fmadd_ps(x, T::load16m(p.add(i), m), *a);
            i += LANES;
        }
    }
    // l[j] += l[j + 8]: keys 2m and 2m + 1 side by side, eight partial sums each.
    let mut s1 = [_mm512_setzero_ps(); 8];
    for (m, s) in s1.iter_mut().enumerate() {
        let (a, b) = (acc[2 * m], acc[2 * m + 1]);
        *s = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xEE>(a, b),
        );
    }
    // l[j] += l[j + 4]: 128-bit lane L of s2[m] holds key 4m + L's four partial sums.
    let mut s2 = [_mm512_setzero_ps(); 4];
    for (m, s) in s2.iter_mut().enumerate() {
        let (a, b) = (s1[2 * m], s1[2 * m + 1]);
        *s = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        );
    }
    // l[j] += l[j + 2]: lane L of s3[m] holds keys 8m + L and 8m + 4 + L, two sums each.
    let mut s3 = [_mm512_setzero_ps(); 2];
    for (m, s) in s3.iter_mut().enumerate() {
        let (a, b) = (s2[2 * m], s2[2 * m + 1]);
        *s = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(a, b),
            _mm512_shuffle_ps::<0xEE>(a, b),
        );
    }
    // l[0] + l[1]: element 4L + e holds key L + 4e; put key k at element k.
    let (a, b) = (s3[0], s3[1]);
    let sums = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(a, b),
        _mm512_shuffle_ps::<0xDD>(a, b),
    );
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    let sums = _mm512_permutexvar_ps(order, sums);
    _mm512_mask_storeu_ps(out.as_mut_ptr(), chunk_mask(out.len()), sums);
}

/// `acc += Σ_t probs[t]·values[t]` in key order, keys of probability 0 skipped: bit for bit
/// [`axpy`] key by key. On AVX-512, for head sizes of 16 to 256 in multiples of 16, `acc`
/// stays in registers over all the keys (the weighted values of decode attention).
/// `ahead` as for [`dots`].
pub(crate) fn weighted_sum<T: Elem>(
    isa: Isa,
    probs: &[f32],
    values: &[&[T]],
    acc: &mut [f32],
    ahead: &[&[T]],
) {
    debug_assert_eq!(probs.len(), values.len());
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: the instruction set was detected on this machine; every value row holds
        // `acc.len()` values (checked in debug builds).
        unsafe {
            match acc.len() {
                16 => return weighted_avx512::<T, 1>(probs, values, acc, ahead),
                32 => return weighted_avx512::<T, 2>(probs, values, acc, ahead),
                64 => return weighted_avx512::<T, 4>(probs, values, acc, ahead),
                128 => return weighted_avx512::<T, 8>(probs, values, acc, ahead),
                256 => return weighted_avx512::<T, 16>(probs, values, acc, ahead),
                _ => {}
            }
        }
    }
    for (j, (&p, v)) in probs.iter().zip(values).enumerate() {
        if let Some(next) = ahead.get(j) {
            prefetch(next);
        }
        if p != 0.0 {
            axpy(isa, p, v, acc);
        }
    }
}

/// [`weighted_sum`] over `16·N` values.
///
/// # Safety
/// AVX-512F is present, `acc` holds `16·N` values and every value row as many.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn weighted_avx512<T: Elem, const N: usize>(
    probs: &[f32],
    values: &[&[T]],
    acc: &mut [f32],
    ahead: &[&[T]],
) {
    use std::arch::x86_64::*;
    let mut r = [_mm512_setzero_ps(); N];
    for (j, r) in r.iter_mut().enumerate() {
        *r = _mm512_loadu_ps(acc.as_ptr().add(j * LANES));
    }
    for (j, (&p, v)) in probs.iter().zip(values).enumerate() {
        debug_assert_eq!(v.len(), N * LANES);
        if let Some(next) = ahead.get(j) {
            prefetch(next);
        }
        if p != 0.0 {
            let a = _mm512_set1_ps(p);
            for (j, r) in r.iter_mut().enumerate() {
                *r = _mm512_fmadd_ps(a, T::load16m(v.as_ptr().add(j * LANES), 0xFFFF), *r);
            }
        }
    }
    for (j, r) in r.iter().enumerate() {
        _mm512_storeu_ps(acc.as_mut_ptr().add(j * LANES), *r);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy_avx512<T: Elem>(alpha: f32, x: &[T], y: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = x.len();
    let a = _mm512_set1_ps(alpha);
    let (xp, yp) = (x.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    while i + LANES <= n {
        let r = _mm512_fmadd_ps(a, T::load16m(xp.add(i), 0xFFFF), _mm512_loadu_ps(yp.add(i)));
        _mm512_storeu_ps(yp.add(i), r);
        i += LANES;
    }
    if i < n {
        let m: __mmask16 = (1u32 << (n - i)) as u16 - 1;
        let r = _mm512_fmadd_ps(
            a,
            T::load16m(xp.add(i), m),
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

/// `exp(x)` from IEEE operations only (Cephes' single-precision polynomial on
/// `r = x - n·ln 2`, then `2^n` from the exponent bits), so every instruction set gives the same
/// bits; about 1 ulp from the exact value; 0 below `-87.3` (where `e^x` is not a normal float),
/// infinity above 88.
#[inline(always)]
fn exp_scalar(x: f32) -> f32 {
    if x < EXP_MIN {
        return 0.0;
    }
    if x > EXP_MAX {
        return f32::INFINITY;
    }
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_P[0];
    for &c in &EXP_P[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

const EXP_MIN: f32 = -87.3;
const EXP_MAX: f32 = 88.0;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// The softmax of `x · scale` in place, in float32: each value times `scale`, the maximum,
/// `exp(x - max)` and their sum (in the canonical lane order of [`dot`]), then each divided by
/// the sum; a row of only `-inf` becomes zeros. The same bits on every instruction set.
pub(crate) fn softmax(isa: Isa, x: &mut [f32], scale: f32) {
    let m = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set was detected on this machine.
        Isa::Avx512 => unsafe { scale_max_avx512(x, scale) },
        _ => x.iter_mut().fold(f32::NEG_INFINITY, |m, v| {
            *v *= scale;
            m.max(*v)
        }),
    };
    if m == f32::NEG_INFINITY {
        x.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set was detected on this machine.
        Isa::Avx512 => unsafe {
            let sum = exp_sum_avx512(x, m);
            divide_avx512(x, sum)
        },
        _ => {
            let mut l = [0f32; LANES];
            for (i, v) in x.iter_mut().enumerate() {
                *v = exp_scalar(*v - m);
                l[i % LANES] += *v;
            }
            let sum = reduce_lanes(l);
            x.iter_mut().for_each(|v| *v /= sum);
        }
    }
}

/// `x[i] *= scale` and the maximum of the products (NaNs ignored, as `f32::max` does).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scale_max_avx512(x: &mut [f32], scale: f32) -> f32 {
    use std::arch::x86_64::*;
    let (n, p) = (x.len(), x.as_mut_ptr());
    let sv = _mm512_set1_ps(scale);
    let mut mv = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < n {
        let mask = chunk_mask(n - i);
        let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, p.add(i)), sv);
        _mm512_mask_storeu_ps(p.add(i), mask, v);
        // `max(v, m)` returns `m` where `v` is NaN; lanes past the end keep `m`.
        mv = _mm512_mask_max_ps(mv, mask, v, mv);
        i += LANES;
    }
    _mm512_reduce_max_ps(mv)
}

/// `x[i] /= d`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn divide_avx512(x: &mut [f32], d: f32) {
    use std::arch::x86_64::*;
    let (n, p) = (x.len(), x.as_mut_ptr());
    let dv = _mm512_set1_ps(d);
    let mut i = 0;
    while i < n {
        let mask = chunk_mask(n - i);
        let v = _mm512_div_ps(_mm512_maskz_loadu_ps(mask, p.add(i)), dv);
        _mm512_mask_storeu_ps(p.add(i), mask, v);
        i += LANES;
    }
}

/// `Σ exp(x[i] - m)` without writing the exponentials, in the canonical lane order.
pub(crate) fn exp_sum(isa: Isa, x: &[f32], m: f32) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set was detected on this machine.
        Isa::Avx512 => unsafe { exp_sum_ro_avx512(x, m) },
        _ => {
            let mut l = [0f32; LANES];
            for (i, v) in x.iter().enumerate() {
                l[i % LANES] += exp_scalar(*v - m);
            }
            reduce_lanes(l)
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_sum_ro_avx512(x: &[f32], m: f32) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len();
    let p = x.as_ptr();
    let mv = _mm512_set1_ps(m);
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        let mask = chunk_mask(n - i);
        let v = _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, p.add(i)), mv);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(mask, exp_avx512(v)));
        i += LANES;
    }
    let mut l = [0f32; LANES];
    _mm512_storeu_ps(l.as_mut_ptr(), acc);
    reduce_lanes(l)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_sum_avx512(x: &mut [f32], m: f32) -> f32 {
    use std::arch::x86_64::*;
    let n = x.len();
    let p = x.as_mut_ptr();
    let mv = _mm512_set1_ps(m);
    let mut acc = _mm512_setzero_ps();
    let mut i = 0;
    while i < n {
        let mask = chunk_mask(n - i);
        let v = _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, p.add(i)), mv);
        let e = exp_avx512(v);
        _mm512_mask_storeu_ps(p.add(i), mask, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(mask, e));
        i += LANES;
    }
    let mut l = [0f32; LANES];
    _mm512_storeu_ps(l.as_mut_ptr(), acc);
    reduce_lanes(l)
}

/// [`exp_scalar`] on 16 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_MIN));
    let big = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(EXP_MAX));
    let x = _mm512_min_ps(x, _mm512_set1_ps(EXP_MAX));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
    let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_P[0]);
    for &c in &EXP_P[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let y = _mm512_add_ps(
        _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
        _mm512_set1_ps(1.0),
    );
    let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(n),
        _mm512_set1_epi32(127),
    ));
    let e = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
    let e = _mm512_mask_mov_ps(e, small, _mm512_setzero_ps());
    _mm512_mask_mov_ps(e, big, _mm512_set1_ps(f32::INFINITY))
}

/// RoPE in GPT-NeoX's "half" layout: with `x = [x1, x2]` and `o = [o1, o2]` (halves of
/// `cos.len()` values each), `o1 = x1·cos - x2·sin` and `o2 = x1·sin + x2·cos`, every value of
/// `o` written. The vector form multiplies and adds as the scalar one does (no fused
/// multiply-add), so the bits are the same on every path.
pub(crate) fn rotate_halves(
    isa: Isa,
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    o: &mut [MaybeUninit<f32>],
) {
    let half = x.len() / 2;
    assert!(x.len() == 2 * half && o.len() == x.len() && cos.len() >= half && sin.len() >= half);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set was detected on this machine; the lengths are checked.
        Isa::Avx512 => unsafe { rotate_halves_avx512(x, cos, sin, o) },
        _ => {
            let (o1, o2) = o.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (x[i], x[i + half]);
                o1[i].write(x1 * cos[i] - x2 * sin[i]);
                o2[i].write(x1 * sin[i] + x2 * cos[i]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rotate_halves_avx512(x: &[f32], cos: &[f32], sin: &[f32], o: &mut [MaybeUninit<f32>]) {
    use std::arch::x86_64::*;
    let half = x.len() / 2;
    let (xp, op) = (x.as_ptr(), o.as_mut_ptr().cast::<f32>());
    let mut i = 0;
    while i < half {
        let mask = chunk_mask(half - i);
        let x1 = _mm512_maskz_loadu_ps(mask, xp.add(i));
        let x2 = _mm512_maskz_loadu_ps(mask, xp.add(half + i));
        let c = _mm512_maskz_loadu_ps(mask, cos.as_ptr().add(i));
        let s = _mm512_maskz_loadu_ps(mask, sin.as_ptr().add(i));
        let o1 = _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s));
        let o2 = _mm512_add_ps(_mm512_mul_ps(x1, s), _mm512_mul_ps(x2, c));
        _mm512_mask_storeu_ps(op.add(i), mask, o1);
        _mm512_mask_storeu_ps(op.add(half + i), mask, o2);
        i += LANES;
    }
}

/// `o[j] = g[j] / (exp(-g[j]) + 1) · u[j]` (SiLU of the gate times up), the same bits on every
/// instruction set.
pub(crate) fn silu_mul(isa: Isa, g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set was detected on this machine.
        Isa::Avx512 => unsafe { silu_mul_avx512(g, u, o) },
        _ => {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                o.write(g / (exp_scalar(-g) + 1.0) * u);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
    use std::arch::x86_64::*;
    let n = o.len();
    let one = _mm512_set1_ps(1.0);
    let mut i = 0;
    while i < n {
        let mask = chunk_mask(n - i);
        let gv = _mm512_maskz_loadu_ps(mask, g.as_ptr().add(i));
        let uv = _mm512_maskz_loadu_ps(mask, u.as_ptr().add(i));
        let e = exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        let r = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(e, one)), uv);
        _mm512_mask_storeu_ps(o.as_mut_ptr().add(i).cast::<f32>(), mask, r);
        i += LANES;
    }
}

/// `√(2/π)`, the tanh approximation of GELU's scale.
const GELU_K: f32 = 0.797_884_6;

/// `o[j] = gelu_tanh(g[j]) · u[j]`, GELU's tanh approximation written as
/// `g · sigmoid(2·√(2/π)·(g + 0.044715·g³)) = g / (exp(-2·√(2/π)·(g + 0.044715·g³)) + 1)` (the
/// same function as `0.5·g·(1 + tanh(√(2/π)·(g + 0.044715·g³)))`), the same bits on every
/// instruction set.
pub(crate) fn gelu_tanh_mul(isa: Isa, g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set was detected on this machine.
        Isa::Avx512 => unsafe { gelu_tanh_mul_avx512(g, u, o) },
        _ => {
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                let y = (-2.0 * GELU_K) * (0.044_715 * g * g).mul_add(g, g);
                o.write(g / (exp_scalar(y) + 1.0) * u);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gelu_tanh_mul_avx512(g: &[f32], u: &[f32], o: &mut [MaybeUninit<f32>]) {
    use std::arch::x86_64::*;
    let n = o.len();
    let one = _mm512_set1_ps(1.0);
    let c = _mm512_set1_ps(0.044_715);
    let k = _mm512_set1_ps(-2.0 * GELU_K);
    let mut i = 0;
    while i < n {
        let mask = chunk_mask(n - i);
        let gv = _mm512_maskz_loadu_ps(mask, g.as_ptr().add(i));
        let uv = _mm512_maskz_loadu_ps(mask, u.as_ptr().add(i));
        let g3 = _mm512_mul_ps(_mm512_mul_ps(c, gv), gv);
        let y = _mm512_mul_ps(k, _mm512_fmadd_ps(g3, gv, gv));
        let e = exp_avx512(y);
        let r = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(e, one)), uv);
        _mm512_mask_storeu_ps(o.as_mut_ptr().add(i).cast::<f32>(), mask, r);
        i += LANES;
    }
}

/// `x ← cap · tanh(x / cap)` in place (Gemma's logit soft cap), with
/// `tanh(y) = 1 - 2 / (exp(2y) + 1)`: the same bits on every instruction set, within a few
/// `1e-7 · cap` of the exact value.
pub(crate) fn soft_cap(isa: Isa, x: &mut [f32], cap: f32) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set was detected on this machine.
        Isa::Avx512 => unsafe { soft_cap_avx512(x, cap) },
        _ => {
            let s = 2.0 / cap;
            for v in x.iter_mut() {
                *v = cap * (1.0 - 2.0 / (exp_scalar(*v * s) + 1.0));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn soft_cap_avx512(x: &mut [f32], cap: f32) {
    use std::arch::x86_64::*;
    let n = x.len();
    let p = x.as_mut_ptr();
    let (one, two) = (_mm512_set1_ps(1.0), _mm512_set1_ps(2.0));
    let (s, c) = (_mm512_set1_ps(2.0 / cap), _mm512_set1_ps(cap));
    let mut i = 0;
    while i < n {
        let mask = chunk_mask(n - i);
        let v = _mm512_maskz_loadu_ps(mask, p.add(i));
        let e = exp_avx512(_mm512_mul_ps(v, s));
        let t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(e, one)));
        _mm512_mask_storeu_ps(p.add(i), mask, _mm512_mul_ps(c, t));
        i += LANES;
    }
}

/// `(Σ exp(x[i] - m), Σ exp(x[i] - m) · (m - x[i]))` in the canonical lane order: a row's
/// softmax normaliser and what its entropy needs (`H = ln s0 + s1 / s0`, no cancellation).
pub(crate) fn exp_sums(isa: Isa, x: &[f32], m: f32) -> (f32, f32) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set was detected on this machine.
        Isa::Avx512 => unsafe { exp_sums_avx512(x, m) },
        _ => {
            let (mut l0, mut l1) = ([0f32; LANES], [0f32; LANES]);
            for (i, &v) in x.iter().enumerate() {
                let d = m - v;
                let e = exp_scalar(-d);
                l0[i % LANES] += e;
                l1[i % LANES] = e.mul_add(d, l1[i % LANES]);
            }
            (reduce_lanes(l0), reduce_lanes(l1))
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_sums_avx512(x: &[f32], m: f32) -> (f32, f32) {
    use std::arch::x86_64::*;
    let n = x.len();
    let p = x.as_ptr();
    let mv = _mm512_set1_ps(m);
    let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut i = 0;
    while i < n {
        let mask = chunk_mask(n - i);
        let d = _mm512_sub_ps(mv, _mm512_maskz_loadu_ps(mask, p.add(i)));
        let e = _mm512_maskz_mov_ps(mask, exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), d)));
        a0 = _mm512_add_ps(a0, e);
        a1 = _mm512_fmadd_ps(e, _mm512_maskz_mov_ps(mask, d), a1);
        i += LANES;
    }
    let (mut l0, mut l1) = ([0f32; LANES], [0f32; LANES]);
    _mm512_storeu_ps(l0.as_mut_ptr(), a0);
    _mm512_storeu_ps(l1.as_mut_ptr(), a1);
    (reduce_lanes(l0), reduce_lanes(l1))
}

/// The index a uniform `u` in `[0, 1)` draws from `softmax(x)` (`m` its maximum, `s0` its
/// normaliser from [`exp_sums`]): the first index whose cumulative `exp(x - m)` exceeds
/// `u · s0`, found 16 values at a time (each block summed in the canonical lane order), then
/// within the block. The same index on every instruction set.
pub(crate) fn sample(isa: Isa, x: &[f32], m: f32, s0: f32, u: f32) -> usize {
    let target = u * s0;
    let mut acc = 0f32;
    let mut start = 0;
    while start < x.len() {
        let end = (start + LANES).min(x.len());
        let block = exp_sum(isa, &x[start..end], m);
        if acc + block > target {
            for (j, &v) in x[start..end].iter().enumerate() {
                acc += exp_scalar(v - m);
                if acc > target {
                    return start + j;
                }
            }
            // Rounding inside the block: its last index.
            return end - 1;
        }
        acc += block;
        start = end;
    }
    // Rounding left the total below the target: the last index with any mass.
    x.iter()
        .rposition(|&v| exp_scalar(v - m) > 0.0)
        .unwrap_or(0)
}

/// Whether this CPU multiplies bfloat16 pairs (`avx512bf16`).
pub fn has_bf16_dot() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this CPU multiplies 8-bit quads (`avx512vnni`).
pub fn has_int8_dot() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vnni")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_rotate_to_the_same_bits_on_every_instruction_set() {
        for half in [32usize, 5, 17] {
            let x: Vec<f32> = (0..2 * half)
                .map(|i| (i as f32 * 0.731).sin() * 3.0)
                .collect();
            let cos: Vec<f32> = (0..half).map(|i| (i as f32 * 0.3).cos()).collect();
            let sin: Vec<f32> = (0..half).map(|i| (i as f32 * 0.3).sin()).collect();
            let want: Vec<u32> = (0..2 * half)
                .map(|j| {
                    let i = j % half;
                    let (x1, x2) = (x[i], x[i + half]);
                    let v = if j < half {
                        x1 * cos[i] - x2 * sin[i]
                    } else {
                        x1 * sin[i] + x2 * cos[i]
                    };
                    v.to_bits()
                })
                .collect();
            for isa in Isa::available() {
                let mut o = vec![MaybeUninit::new(f32::NAN); 2 * half];
                rotate_halves(isa, &x, &cos, &sin, &mut o);
                // SAFETY: every value was initialised (NaN, then the kernel's write).
                let got: Vec<u32> = o
                    .iter()
                    .map(|v| unsafe { v.assume_init() }.to_bits())
                    .collect();
                assert_eq!(got, want, "{} with halves of {half}", isa.name());
            }
        }
    }

    #[test]
    fn softmax_matches_libm_closely_and_gives_the_same_bits_everywhere() {
        let x: Vec<f32> = (0..77)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37)
            .chain([f32::NEG_INFINITY, -200.0])
            .collect();
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = x.iter().map(|&v| f64::from(v - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        let mut want = x.clone();
        softmax(Isa::Portable, &mut want, 1.0);
        for (w, e) in want.iter().zip(&e) {
            assert!(
                (f64::from(*w) - e / sum).abs() <= 1e-6 * (e / sum) + 1e-30,
                "{w} vs {}",
                e / sum
            );
        }
        for isa in Isa::available() {
            let mut got = x.clone();
            softmax(isa, &mut got, 1.0);
            assert_eq!(got, want, "{isa:?}");
        }
        let mut none = vec![f32::NEG_INFINITY; 3];
        softmax(Isa::get(), &mut none, 1.0);
        assert_eq!(none, [0.0; 3]);
        for v in [0.0f32, -1e-3, -0.5, -1.0, -10.0, -87.0] {
            let rel = (f64::from(exp_scalar(v)) - f64::from(v).exp()).abs() / f64::from(v).exp();
            assert!(rel < 3e-7, "exp({v}): {rel}");
        }
    }

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

    #[test]
    fn many_keys_give_the_bits_of_one_key_at_a_time() {
        let val = |i: usize, s: usize| ((i * 37 + s * 11) % 23) as f32 / 7.0 - 1.6;
        for d in [1, 15, 16, 40, 64, 128, 256] {
            let q: Vec<f32> = (0..d).map(|i| val(i, 1)).collect();
            for keys in [1, 5, 16, 17, 33, 70] {
                let rows: Vec<Vec<f32>> = (0..keys)
                    .map(|t| (0..d).map(|i| val(i, t + 2)).collect())
                    .collect();
                let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
                // Probabilities with zeros (skipped) and an accumulator that starts non-zero.
                let probs: Vec<f32> = (0..keys)
                    .map(|t| if t % 3 == 1 { 0.0 } else { val(t, 5) / 3.0 })
                    .collect();
                let start: Vec<f32> = (0..d).map(|i| val(i, 9)).collect();
                let mut want_acc = start.clone();
                for (&p, v) in probs.iter().zip(&refs) {
                    if p != 0.0 {
                        axpy(Isa::Portable, p, v, &mut want_acc);
                    }
                }
                for isa in Isa::available() {
                    let mut got = vec![0f32; keys];
                    dots(isa, &q, &refs, &mut got, &refs[1..]);
                    for (t, g) in got.iter().enumerate() {
                        let want = dot_portable(&q, refs[t]);
                        assert_eq!(g.to_bits(), want.to_bits(), "{isa:?} d{d} key {t}/{keys}");
                    }
                    let mut acc = start.clone();
                    weighted_sum(isa, &probs, &refs, &mut acc, &[]);
                    assert_eq!(acc, want_acc, "{isa:?} d{d} keys {keys}");
                }
            }
        }
    }

    #[test]
    fn gemma_kernels_match_their_definitions_and_give_the_same_bits_everywhere() {
        let x: Vec<f32> = (0..83)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.11)
            .chain([0.0, 1e-4, -1e-4, 40.0, -40.0, 300.0, -300.0])
            .collect();
        let u: Vec<f32> = x.iter().map(|v| 0.5 - v * 0.01).collect();
        // GELU (tanh approximation) times up, against its definition in float64.
        let mut want = vec![0f32; x.len()];
        // SAFETY: the kernel writes floats only.
        gelu_tanh_mul(Isa::Portable, &x, &u, unsafe {
            super::super::as_uninit(&mut want)
        });
        for ((w, &g), &up) in want.iter().zip(&x).zip(&u) {
            let g = f64::from(g);
            let exact = 0.5
                * g
                * (1.0 + (0.797_884_560_8 * (g + 0.044_715 * g * g * g)).tanh())
                * f64::from(up);
            assert!(
                (f64::from(*w) - exact).abs() <= 1e-6 * (1.0 + exact.abs()),
                "{w} vs {exact}"
            );
        }
        for isa in Isa::available() {
            let mut got = vec![0f32; x.len()];
            // SAFETY: as above.
            gelu_tanh_mul(isa, &x, &u, unsafe { super::super::as_uninit(&mut got) });
            assert_eq!(got, want, "{isa:?}");
        }
        // The soft cap, within a few 1e-7 of the cap.
        let mut want = x.clone();
        soft_cap(Isa::Portable, &mut want, 30.0);
        for (w, &v) in want.iter().zip(&x) {
            let exact = 30.0 * (f64::from(v) / 30.0).tanh();
            assert!(
                (f64::from(*w) - exact).abs() <= 30.0 * 2e-7,
                "{w} vs {exact}"
            );
        }
        for isa in Isa::available() {
            let mut got = x.clone();
            soft_cap(isa, &mut got, 30.0);
            assert_eq!(got, want, "{isa:?}");
        }
        // The softmax sums, and a draw by inverse transform.
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let (s0, s1) = exp_sums(Isa::Portable, &x, m);
        let e: Vec<f64> = x.iter().map(|&v| f64::from(v - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        let h: f64 = -e
            .iter()
            .zip(&x)
            .map(|(e, &v)| e / sum * (f64::from(v - m) - sum.ln()))
            .sum::<f64>();
        assert!((f64::from(s0) - sum).abs() <= 1e-6 * sum);
        assert!((f64::from(s0.ln() + s1 / s0) - h).abs() <= 1e-6, "entropy");
        for isa in Isa::available() {
            assert_eq!(exp_sums(isa, &x, m), (s0, s1), "{isa:?}");
        }
        // Draws, on values whose exponentials are all normal floats.
        let x: Vec<f32> = x.into_iter().filter(|v| v.abs() < 60.0).collect();
        let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let (s0, _) = exp_sums(Isa::Portable, &x, m);
        let e: Vec<f64> = x.iter().map(|&v| f64::from(v - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        let mut cum = 0.0;
        for q in [0.0f32, 0.1, 0.37, 0.5, 0.9, 0.999] {
            let want = e
                .iter()
                .position(|&v| {
                    cum += v;
                    cum > f64::from(q) * sum
                })
                .expect("a draw");
            cum = 0.0;
            for isa in Isa::available() {
                assert_eq!(sample(isa, &x, m, s0, q), want, "{isa:?} u = {q}");
            }
        }
    }
}
