//! CPU kernels for the work that dominates a forward on this server's first device, the CPU:
//! linear layers over weights packed once at load ([`matmul`]) and attention over keys read
//! where they live ([`attention`]), both spread over the machine's cores.
//!
//! Why not candle's CPU matmul: it calls the `gemm` crate, which on stable Rust has no
//! AVX-512 path and runs a one-row product (decode) on one core, so a decode step used half
//! the memory bandwidth of PyTorch on the same machine (docs/benchmarks.md has the profile).
//!
//! Determinism: every output of [`matmul::linear`] is one fused multiply-add chain over `k`
//! in ascending order, whatever the number of rows, the thread count or the instruction set
//! (AVX-512, AVX2 + FMA, or the portable fallback, all with single-rounding FMAs). A request's
//! logits are therefore bit-identical whether its rows run alone or packed with other
//! requests' rows: batch invariance holds by construction, not up to summation noise.
//! The reduced-precision products keep this per path: bf16 pair products on AMX tiles
//! ([`amx`], where the CPU and the kernel give them), AVX512-BF16 or float32 FMAs each sum a
//! row in an order fixed by `k` alone; those paths differ from one another in summation order.
//!
//! Threads: the work of one call is split over the kernels' own pool ([`pool`]: the calling
//! thread and `--threads - 1` workers that spin between calls), the machine's cores by
//! default. A call returns when its work is done, so kernels need no synchronisation with
//! the caller.

mod aligned;
pub mod amx;
pub mod attention;
pub mod elementwise;
pub mod matmul;
pub mod peaks;
pub mod pool;
mod simd;

pub use matmul::{bf16_to_f32, bf16_unit, f32_to_bf16, int8_unit, round_to_bf16};

/// `y` as values a callee may leave uninitialised.
///
/// # Safety
/// Only initialised values (floats) may be written through the result: `y` is read as floats
/// afterwards.
pub(crate) unsafe fn as_uninit(y: &mut [f32]) -> &mut [std::mem::MaybeUninit<f32>] {
    // SAFETY: the same layout; the caller's promise keeps `y` initialised.
    unsafe { &mut *(y as *mut [f32] as *mut [std::mem::MaybeUninit<f32>]) }
}

/// A new vector of `len` floats that `fill` writes, not zeroed first (zeroing a many-row
/// output on the calling thread while the pool waits was 5-6% of a LLaDA canvas forward; the
/// allocator serves these sizes from recycled memory, so a zeroed vector costs a `memset`).
///
/// # Safety
/// `fill` writes a float to every one of the `len` values (or panics).
pub(crate) unsafe fn written(
    len: usize,
    fill: impl FnOnce(&mut [std::mem::MaybeUninit<f32>]),
) -> Vec<f32> {
    // SAFETY: the caller's promise.
    let [y] = unsafe { written_each([len], |[out]| fill(out)) };
    y
}

/// [`written`] for several vectors at once (`lens[i]` floats each), all filled by one call.
///
/// # Safety
/// `fill` writes a float to every value of every one (or panics).
pub(crate) unsafe fn written_each<const N: usize>(
    lens: [usize; N],
    fill: impl FnOnce([&mut [std::mem::MaybeUninit<f32>]; N]),
) -> [Vec<f32>; N] {
    let mut out = lens.map(Vec::with_capacity);
    let mut at = lens.into_iter();
    fill(out.each_mut().map(|v| {
        let len = at.next().expect("one length a vector");
        &mut v.spare_capacity_mut()[..len]
    }));
    for (y, len) in out.iter_mut().zip(lens) {
        // SAFETY: the caller's promise: `fill` wrote every value.
        unsafe { y.set_len(len) };
    }
    out
}

/// Threads a kernel call splits its work over.
pub fn threads() -> usize {
    pool::pool().threads()
}

/// Sets the size of the pool the kernels run on ([`pool`]). Call once at start-up, before any
/// kernel runs; `Err` when the pool was already started.
pub fn init_threads(n: usize) -> Result<(), crate::KernelError> {
    pool::init(n.max(1))
}

/// The instruction set the kernels of this process use, decided once.
pub fn isa() -> &'static str {
    simd::Isa::get().name()
}

/// A raw pointer that may cross to pool threads: every user writes a disjoint part of the
/// buffer it points into, and the call that made it outlives every task.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);
// SAFETY: see the type's doc; tasks write disjoint elements and the owner waits for them.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the whole `SendPtr`, not its field).
    pub(crate) fn ptr(&self) -> *mut T {
        self.0
    }
}

/// Runs `pack(parts, their part of out)` over `panels` parts of `panel_len` values each of
/// `out` (a per-call operand's panels or tiles), split over the pool's threads when the
/// operand has enough values (`work`) to pay for it: packed on every core instead of on the
/// caller alone.
pub(crate) fn by_parts<T: Send>(
    out: &mut [T],
    panel_len: usize,
    panels: usize,
    work: usize,
    pack: impl Fn(std::ops::Range<usize>, &mut [T]) + Sync,
) {
    let threads = threads();
    if threads <= 1 || panels < 2 || work < 1 << 16 {
        return pack(0..panels, out);
    }
    let parts: Vec<_> = split(panels, threads).collect();
    let mut rest = &mut out[..];
    let mut slices = Vec::with_capacity(parts.len());
    for r in &parts {
        let (head, tail) = rest.split_at_mut(r.len() * panel_len);
        slices.push(std::sync::Mutex::new(head));
        rest = tail;
    }
    pool::pool().run(parts.len(), &|i| {
        let mut dst = slices[i].lock().unwrap_or_else(|e| e.into_inner());
        pack(parts[i].clone(), &mut dst)
    });
}

/// Splits `0..n` into at most `parts` contiguous ranges of near-equal length.
pub(crate) fn split(n: usize, parts: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let parts = parts.clamp(1, n.max(1));
    let (base, extra) = (n / parts, n % parts);
    (0..parts).map(move |p| {
        let start = p * base + p.min(extra);
        start..start + base + usize::from(p < extra)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_tiles_the_range_in_order() {
        for n in 0..20 {
            for parts in 1..6 {
                let r: Vec<_> = split(n, parts).collect();
                assert_eq!(r.first().map_or(0, |r| r.start), 0);
                assert_eq!(r.last().map_or(0, |r| r.end), n);
                assert!(r.windows(2).all(|w| w[0].end == w[1].start));
                let (lo, hi) = r.iter().fold((usize::MAX, 0), |(lo, hi), r| {
                    (lo.min(r.len()), hi.max(r.len()))
                });
                assert!(hi - lo.min(hi) <= 1);
            }
        }
    }
}
