//! This machine's ceilings, measured, for roofline fractions: the rate at which all threads
//! can stream a buffer far larger than the last-level cache, and the rate of fused
//! multiply-adds with operands in registers.

use std::time::Instant;

use super::simd::Isa;
use std::sync::Mutex;

use super::pool::pool;
use super::{split, threads};

/// Bytes per second that the pool's threads read from a `bytes`-byte buffer (best of `reps`
/// passes, each thread summing its own contiguous part with vector loads).
pub fn read_bandwidth(bytes: usize, reps: usize) -> f64 {
    let n = bytes / 4;
    let buf: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let t = threads();
    let mut best = f64::INFINITY;
    let mut sink = 0f32;
    for _ in 0..reps.max(1) {
        let start = Instant::now();
        let parts: Vec<_> = split(n, t).collect();
        let sums: Vec<Mutex<f32>> = parts.iter().map(|_| Mutex::new(0.0)).collect();
        pool().run(parts.len(), &|i| {
            *sums[i].lock().expect("sum") = sum(Isa::get(), &buf[parts[i].clone()]);
        });
        let sums: Vec<f32> = sums
            .into_iter()
            .map(|m| m.into_inner().expect("sum"))
            .collect();
        best = best.min(start.elapsed().as_secs_f64());
        sink += sums.iter().sum::<f32>();
    }
    std::hint::black_box(sink);
    (n * 4) as f64 / best
}

/// Floating-point operations per second of fused multiply-adds on every pool thread, operands
/// in registers (the arithmetic ceiling no kernel can pass).
pub fn fma_peak(seconds: f64) -> f64 {
    rate(seconds, || fma_loop(Isa::get(), 1 << 22))
}

/// Operations per second of `round` (which returns the operations it did) run on every pool
/// thread at once, repeated for `seconds`.
fn rate(seconds: f64, round: impl Fn() -> f64 + Sync) -> f64 {
    let t = threads();
    let start = Instant::now();
    let mut flops = 0f64;
    while start.elapsed().as_secs_f64() < seconds {
        let per: Vec<Mutex<f64>> = (0..t).map(|_| Mutex::new(0.0)).collect();
        pool().run(t, &|i| {
            *per[i].lock().expect("flops") = round();
        });
        flops += per
            .into_iter()
            .map(|m| m.into_inner().expect("flops"))
            .sum::<f64>();
    }
    flops / start.elapsed().as_secs_f64()
}

/// Floating-point operations per second of bfloat16 pair products (`vdpbf16ps`: 2 products and
/// 2 additions per float32 lane) on every pool thread, operands in registers; `None` where the
/// CPU has no AVX512-BF16.
pub fn bf16_dot_peak(seconds: f64) -> Option<f64> {
    if !super::simd::has_bf16_dot() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has AVX512-BF16 (checked above).
    return Some(rate(seconds, || unsafe { dot_bf16_avx512(1 << 22) }));
    #[cfg(not(target_arch = "x86_64"))]
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_bf16_avx512(iters: usize) -> f64 {
    use std::arch::x86_64::*;
    let mut a = [_mm512_set1_ps(1.0); 12];
    let b: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3f80_3f80));
    let c: __m512bh = std::mem::transmute(_mm512_set1_epi32(0x3380_3380));
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = _mm512_dpbf16_ps(*x, b, c);
        }
    }
    std::hint::black_box(a);
    (iters * 12 * 16 * 4) as f64
}

/// Floating-point operations per second of bfloat16 pair products on AMX tiles
/// (`tdpbf16ps`, operands in tiles) on every pool thread; `None` where this process has no
/// AMX tiles ([`super::amx::enabled`]).
pub fn amx_bf16_peak(seconds: f64) -> Option<f64> {
    if !super::amx::enabled() {
        return None;
    }
    Some(rate(seconds, || super::amx::peak_loop(1 << 16, false)))
}

/// Integer operations per second of 8-bit products on AMX tiles (`tdpbusd`, operands in
/// tiles, counted as FLOPs are) on every pool thread; `None` where this process has no
/// AMX-INT8 tiles ([`super::amx::int8_enabled`]).
pub fn amx_int8_peak(seconds: f64) -> Option<f64> {
    if !super::amx::int8_enabled() {
        return None;
    }
    Some(rate(seconds, || super::amx::peak_loop(1 << 16, true)))
}

/// Integer operations per second of 8-bit products (`vpdpbusd`: 4 products and 4 additions per
/// 32-bit lane, counted as FLOPs are) on every pool thread, operands in registers; `None` where
/// the CPU has no AVX512-VNNI.
pub fn int8_dot_peak(seconds: f64) -> Option<f64> {
    if !super::simd::has_int8_dot() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has AVX512-VNNI (checked above).
    return Some(rate(seconds, || unsafe { dot_int8_avx512(1 << 22) }));
    #[cfg(not(target_arch = "x86_64"))]
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn dot_int8_avx512(iters: usize) -> f64 {
    use std::arch::x86_64::*;
    let mut a = [_mm512_setzero_si512(); 12];
    let b = _mm512_set1_epi32(0x0101_0101);
    let c = _mm512_set1_epi32(0x0102_0304);
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = _mm512_dpbusd_epi32(*x, b, c);
        }
    }
    std::hint::black_box(a);
    (iters * 12 * 16 * 8) as f64
}

fn sum(isa: Isa, x: &[f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set was detected on this machine.
        Isa::Avx512 => unsafe { sum_avx512(x) },
        _ => x.iter().sum(),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_avx512(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 4];
    let p = x.as_ptr();
    let mut i = 0;
    while i + 64 <= x.len() {
        for (j, a) in acc.iter_mut().enumerate() {
            *a = _mm512_add_ps(*a, _mm512_loadu_ps(p.add(i + 16 * j)));
        }
        i += 64;
    }
    let s = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(s) + x[i..].iter().sum::<f32>()
}

/// Runs `iters` rounds of independent FMA chains; returns the FLOPs done.
fn fma_loop(isa: Isa, iters: usize) -> f64 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512 => unsafe { fma_avx512(iters) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { fma_avx2(iters) },
        _ => {
            let mut a = [1f32; 8];
            for _ in 0..iters {
                for x in a.iter_mut() {
                    *x = x.mul_add(0.999_999, 1e-7);
                }
            }
            std::hint::black_box(a);
            (iters * 8 * 2) as f64
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_avx512(iters: usize) -> f64 {
    use std::arch::x86_64::*;
    let mut a = [_mm512_set1_ps(1.0); 12];
    let (b, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = _mm512_fmadd_ps(*x, b, c);
        }
    }
    std::hint::black_box(a);
    (iters * 12 * 16 * 2) as f64
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_avx2(iters: usize) -> f64 {
    use std::arch::x86_64::*;
    let mut a = [_mm256_set1_ps(1.0); 12];
    let (b, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = _mm256_fmadd_ps(*x, b, c);
        }
    }
    std::hint::black_box(a);
    (iters * 12 * 8 * 2) as f64
}
