//! Intel AMX tiles (Sapphire Rapids and later Xeons) for the products of bfloat16 pairs
//! ([`super::matmul::WeightDtype::Bf16Dot`]): `tdpbf16ps` multiplies a 16-row by 32-value
//! tile of activations with a 32-value by 16-column tile of weights into 16 x 16 float32
//! accumulators, sixteen times the work of one `vdpbf16ps`.
//!
//! Operands: the weights' panels are already what a weight tile wants (`[ceil(k / 2)][NR]`
//! words, each the pair of rows `2j`, `2j + 1` of a column, one panel row 128 bytes): the
//! tile of pairs `16s .. 16s + 16` and columns `0..16` (or `16..32`) is 16 rows of 64 bytes
//! at a stride of 128. The activations are rounded to bfloat16 pairs, row-major `[m][kp]`: a
//! tile is 16 rows of 16 pairs at a stride of `4 kp` bytes.
//!
//! Summation: each output is one chain of tile products over the pairs in ascending groups
//! of 16 (the hardware's order within a group), then the odd pairs past the last whole group
//! by `vdpbf16ps`. No blocked sum as on the vector paths: the inputs' bfloat16 rounding
//! (2⁻⁹) dwarfs a float32 chain's error over any `k` a model has. The order depends on `k`
//! only, never on the rows beside a row or the thread count, so a row's result is the same
//! alone and packed (batch invariance), as on every other path. Against AVX512-BF16 the
//! results differ by summation order only.
//!
//! Linux gives a process tile data only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); the
//! request is made once, before the first tile instruction, and AMX is not used when it is
//! refused. `WAVEFRONT_AMX=0` turns AMX off (the AVX512-BF16 path runs instead).

use super::{split, SendPtr};
use crate::cpu::matmul::NR;

/// Pairs of `k` per tile step (a tile row is 64 bytes).
const STEP: usize = 16;
/// Steps per block of `k` when several units share a panel.
const BLOCK_STEPS: usize = 8;
/// Rows per register tile of activations.
const TILE_ROWS: usize = 16;
/// How far ahead of the step it multiplies a tile asks for the weights, in bytes.
const AHEAD: usize = 4 << 10;

/// Whether this process multiplies bfloat16 pairs on AMX tiles: the CPU has AMX-BF16 (and
/// AVX512-BF16, for the pairs past the last whole step), Linux granted tile data, and
/// `WAVEFRONT_AMX` is not `0`. Decided once.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let off = std::env::var("WAVEFRONT_AMX").is_ok_and(|v| v.trim() == "0");
        !off && usable()
    })
}

/// Whether the CPU has AMX-BF16 and tiles, and the kernel lets this process use them.
fn usable() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        use std::arch::x86_64::__cpuid_count;
        if !super::matmul::has_bf16_dot() {
            return false;
        }
        // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
        let leaf = __cpuid_count(7, 0);
        if leaf.edx & (1 << 22) == 0 || leaf.edx & (1 << 24) == 0 {
            return false;
        }
        // SAFETY: a system call with no memory operands; it only changes what the process
        // may use.
        unsafe { request_tile_data() }
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    false
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: asks Linux for tile data in this
/// process's (every thread's) register state; true when granted.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
unsafe fn request_tile_data() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: the caller's promise; the system call clobbers rcx and r11 only.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

/// Runs `iters` rounds of four independent `tdpbf16ps` (operands in tiles, as a product of
/// many rows keeps them) on this thread; returns the floating-point operations done (two per
/// product of a pair's value, as the other peaks count them).
///
/// Callers check [`enabled`] first.
pub(crate) fn peak_loop(iters: usize) -> f64 {
    assert!(enabled(), "AMX tiles are not available to this process");
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::asm;
        let config = TileConfig::new(TILE_ROWS);
        let ones = vec![0x3f80_3f80u32; TILE_ROWS * STEP];
        // SAFETY: `enabled` said the CPU has AMX-BF16 and Linux granted tile data; the loads
        // read `ones` (16 rows of 64 bytes).
        unsafe {
            asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack));
            asm!(
                "tileloadd tmm4, [{a} + {s}*1]",
                "tileloadd tmm5, [{a} + {s}*1]",
                "tileloadd tmm6, [{a} + {s}*1]",
                "tileloadd tmm7, [{a} + {s}*1]",
                a = in(reg) ones.as_ptr(),
                s = in(reg) STEP * 4,
                options(nostack, readonly),
            );
            for _ in 0..iters {
                asm!(
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    options(nostack, nomem),
                );
            }
            asm!("tilerelease", options(nostack, nomem));
        }
        (iters * 4 * TILE_ROWS * NR / 2 * STEP * 2 * 2) as f64
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("AMX is x86-64 only")
}

/// `y[i, j] = Σ_kk x[i, kk] · W[j, kk] (+ bias[j])` on AMX tiles, `x` (`[m, k]`) rounded to
/// bfloat16 pairs; `words[p · panel_stride..]` is panel `p` of `n` columns as `[ceil(k / 2)][NR]`
/// pairs, `y` row-major `[m, n]`. The panels are split over `threads` pool threads (each
/// streams its own part of the weights), or the 32-row tiles when there are fewer panels.
///
/// Callers check [`enabled`] first.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bf16_dot(
    threads: usize,
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
    (words, panel_stride): (&[u32], usize),
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    assert!(enabled(), "AMX tiles are not available to this process");
    let (kp, panels) = (k.div_ceil(2), n.div_ceil(NR));
    assert!(x.len() >= m * k && y.len() >= m * n);
    assert!(kp * NR <= panel_stride || panels == 0);
    assert!(words.len() >= panels.saturating_sub(1) * panel_stride + kp * NR);
    assert!(bias.is_none_or(|b| b.len() >= n));
    let a = Activations::pack(threads, x, m, k);
    // Units of work: up to two activation tiles, `(first tile, tiles)`.
    let units: Vec<(usize, usize)> = (0..a.tiles)
        .step_by(2)
        .map(|t| (t, 2.min(a.tiles - t)))
        .collect();
    let yp = SendPtr(y.as_mut_ptr());
    let run = |panels: std::ops::Range<usize>, units: &[(usize, usize)]| {
        let job = Job {
            a: &a,
            m,
            n,
            words,
            panel_stride,
            bias,
            y: yp,
        };
        // SAFETY: `enabled` said the CPU has AMX-BF16 and AVX512-BF16 and Linux granted tile
        // data; the asserts above bound every read; each task writes its own panels' columns
        // of its own rows.
        unsafe { job.run(panels, units) }
    };
    let macs = m * n * k;
    if threads <= 1 || macs < 1 << 16 {
        run(0..panels, &units);
    } else if panels >= threads {
        let parts: Vec<_> = split(panels, threads).collect();
        super::pool::pool().run(parts.len(), &|i| run(parts[i].clone(), &units));
    } else {
        let parts: Vec<_> = split(units.len(), threads).collect();
        super::pool::pool().run(parts.len(), &|i| run(0..panels, &units[parts[i].clone()]));
    }
}

/// The activations as AMX reads them: rows in tiles of 16 (`min(m, 16)` rows when `m` is
/// smaller; the last tile padded with rows of zeros), each tile as `steps` blocks of its rows'
/// 16 pairs, `[tile][step][row][16]` words: every tile load reads 1 KB (or `64 · rows` bytes)
/// in one run, whatever `k` (rows `4 kp` bytes apart alias in the L1 cache when `kp` is a
/// multiple of 1024). The last step's pairs past `kp` are 0.
struct Activations {
    words: Vec<u32>,
    /// Rows per tile, and tiles.
    rows: usize,
    tiles: usize,
    /// Pairs per row, and steps (blocks of 16 pairs, the last one maybe partial).
    kp: usize,
    steps: usize,
}

impl Activations {
    fn pack(threads: usize, x: &[f32], m: usize, k: usize) -> Self {
        let (kp, rows) = (k.div_ceil(2), m.min(TILE_ROWS));
        let (tiles, steps) = (m.div_ceil(rows), kp.div_ceil(STEP));
        let tile_len = steps * rows * STEP;
        let mut words = vec![0u32; tiles * tile_len];
        let isa = super::simd::Isa::get();
        let pack = |t: usize, dst: &mut [u32]| {
            let mut row_pairs = vec![0u32; steps * STEP];
            for r in 0..rows.min(m - t * rows) {
                let i = t * rows + r;
                super::matmul::pack_row_pairs(isa, &x[i * k..(i + 1) * k], &mut row_pairs, 0, 1);
                for (s, chunk) in row_pairs.chunks(STEP).enumerate() {
                    let at = (s * rows + r) * STEP;
                    dst[at..at + STEP].copy_from_slice(chunk);
                }
            }
        };
        if threads > 1 && tiles > 1 && m * k >= 1 << 14 {
            let parts: Vec<_> = split(tiles, threads).collect();
            let mut rest = &mut words[..];
            let mut slices = Vec::with_capacity(parts.len());
            for r in &parts {
                let (head, tail) = rest.split_at_mut(r.len() * tile_len);
                slices.push(std::sync::Mutex::new(head));
                rest = tail;
            }
            super::pool::pool().run(parts.len(), &|i| {
                let mut dst = slices[i].lock().unwrap_or_else(|e| e.into_inner());
                for (j, t) in parts[i].clone().enumerate() {
                    pack(t, &mut dst[j * tile_len..(j + 1) * tile_len]);
                }
            });
        } else {
            for (t, dst) in words.chunks_mut(tile_len).enumerate() {
                pack(t, dst);
            }
        }
        Self {
            words,
            rows,
            tiles,
            kp,
            steps,
        }
    }

    /// Tile `t`'s block of step `s`.
    fn block(&self, t: usize, s: usize) -> *const u32 {
        self.words[(t * self.steps + s) * self.rows * STEP..].as_ptr()
    }
}

/// One call's operands, as [`bf16_dot`] takes them.
struct Job<'a> {
    a: &'a Activations,
    m: usize,
    n: usize,
    words: &'a [u32],
    panel_stride: usize,
    bias: Option<&'a [f32]>,
    y: SendPtr<f32>,
}

/// The tile configuration `ldtilecfg` reads: palette 1; tiles 0-3 the accumulators (`rows`
/// rows of 16 floats), 4-5 the activations (`rows` rows of 16 pairs), 6-7 the weights (16 rows
/// of 16 pairs).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new(rows: usize) -> Self {
        debug_assert!((1..=TILE_ROWS).contains(&rows));
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
            c[48 + t] = if t >= 6 { STEP as u8 } else { rows as u8 };
        }
        Self(c)
    }
}

impl Job<'_> {
    /// Every panel of `panels` for every unit (one or two activation tiles) of `units`, on
    /// this thread.
    ///
    /// # Safety
    /// AMX-BF16 and AVX512-BF16 are present and tile data granted; no other task writes these
    /// panels' columns of these units' rows.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn run(&self, panels: std::ops::Range<usize>, units: &[(usize, usize)]) {
        use std::arch::asm;
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let a = self.a;
        let config = TileConfig::new(a.rows);
        // Whole steps; the pairs past them are added by `finish_row`.
        let whole = a.kp / STEP;
        let (ldb, ldc) = (NR * 4, NR * 4);
        let lda = STEP * 4;
        // SAFETY: the caller's promise; the configuration is 64 aligned bytes.
        unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack)) };
        // With one unit the accumulators stay in their tiles over the whole `k`. With more,
        // `k` goes in blocks of `BLOCK_STEPS` steps, every unit's block against the panel's
        // block while it is in L1 (the activations' block comes from L2; streaming both from
        // L2 left the tiles waiting on it), the accumulators kept in `acc` between blocks:
        // the same sums in the same order either way.
        let block = if units.len() > 1 {
            BLOCK_STEPS
        } else {
            whole.max(1)
        };
        let unit_len = 2 * TILE_ROWS * NR;
        let mut acc = vec![0f32; units.len() * unit_len];
        for p in panels {
            let panel = self.words.as_ptr().add(p * self.panel_stride);
            let cols = NR.min(self.n - p * NR);
            if whole == 0 {
                acc.fill(0.0);
            }
            for s0 in (0..whole).step_by(block) {
                for (u, &(t, count)) in units.iter().enumerate() {
                    let two = count == 2;
                    let c = acc[u * unit_len..].as_mut_ptr() as *mut u8;
                    let c1 = c.add(TILE_ROWS * ldc);
                    if s0 == 0 {
                        asm!(
                            "tilezero tmm0",
                            "tilezero tmm1",
                            "tilezero tmm2",
                            "tilezero tmm3",
                            options(nostack, nomem)
                        );
                    } else {
                        asm!(
                            "tileloadd tmm0, [{c} + {ldc}*1]",
                            "tileloadd tmm1, [{c} + {ldc}*1 + 64]",
                            "tileloadd tmm2, [{c1} + {ldc}*1]",
                            "tileloadd tmm3, [{c1} + {ldc}*1 + 64]",
                            c = in(reg) c,
                            c1 = in(reg) c1,
                            ldc = in(reg) ldc,
                            options(nostack, readonly),
                        );
                    }
                    for s in s0..(s0 + block).min(whole) {
                        let b = (panel as *const u8).add(s * STEP * ldb);
                        // The first unit asks for the weights `AHEAD` bytes on (past the
                        // panel: the next panel's, which this thread reads next); the
                        // hardware's prefetchers alone left the tile loads waiting on memory.
                        if u == 0 {
                            for line in (0..STEP * ldb).step_by(64) {
                                let at = b.wrapping_add(AHEAD + line) as *const i8;
                                _mm_prefetch::<_MM_HINT_T0>(at);
                            }
                        }
                        let a0 = a.block(t, s);
                        if two {
                            asm!(
                                "tileloadd tmm4, [{a0} + {lda}*1]",
                                "tileloadd tmm6, [{b} + {ldb}*1]",
                                "tdpbf16ps tmm0, tmm4, tmm6",
                                "tileloadd tmm5, [{a1} + {lda}*1]",
                                "tdpbf16ps tmm2, tmm5, tmm6",
                                "tileloadd tmm7, [{b} + {ldb}*1 + 64]",
                                "tdpbf16ps tmm1, tmm4, tmm7",
                                "tdpbf16ps tmm3, tmm5, tmm7",
                                a0 = in(reg) a0,
                                a1 = in(reg) a.block(t + 1, s),
                                b = in(reg) b,
                                lda = in(reg) lda,
                                ldb = in(reg) ldb,
                                options(nostack, readonly),
                            );
                        } else {
                            asm!(
                                "tileloadd tmm4, [{a0} + {lda}*1]",
                                "tileloadd tmm6, [{b} + {ldb}*1]",
                                "tdpbf16ps tmm0, tmm4, tmm6",
                                "tileloadd tmm7, [{b} + {ldb}*1 + 64]",
                                "tdpbf16ps tmm1, tmm4, tmm7",
                                a0 = in(reg) a0,
                                b = in(reg) b,
                                lda = in(reg) lda,
                                ldb = in(reg) ldb,
                                options(nostack, readonly),
                            );
                        }
                    }
                    asm!(
                        "tilestored [{c} + {ldc}*1], tmm0",
                        "tilestored [{c} + {ldc}*1 + 64], tmm1",
                        "tilestored [{c1} + {ldc}*1], tmm2",
                        "tilestored [{c1} + {ldc}*1 + 64], tmm3",
                        c = in(reg) c,
                        c1 = in(reg) c1,
                        ldc = in(reg) ldc,
                        options(nostack),
                    );
                }
            }
            // Accumulator row `h · 16 + r` of a unit is row `r` of its tile `t + h`; padding
            // rows are not written.
            for (u, &(t, count)) in units.iter().enumerate() {
                for h in 0..count {
                    for r in 0..a.rows.min(self.m - (t + h) * a.rows) {
                        let at = u * unit_len + (h * TILE_ROWS + r) * NR;
                        self.finish_row(&acc[at..at + NR], t + h, r, panel, p, cols);
                    }
                }
            }
        }
        asm!("tilerelease", options(nostack, nomem));
    }

    /// Row `r` of tile `t`: its columns of panel `p` (`cols` of them), the tiles' sums `acc`
    /// plus the pairs past the last whole step by `vdpbf16ps`, plus the bias.
    ///
    /// # Safety
    /// As [`Job::run`].
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn finish_row(
        &self,
        acc: &[f32],
        t: usize,
        r: usize,
        panel: *const u32,
        p: usize,
        cols: usize,
    ) {
        use std::arch::x86_64::*;
        let a = self.a;
        let mut v0 = _mm512_loadu_ps(acc.as_ptr());
        let mut v1 = _mm512_loadu_ps(acc.as_ptr().add(16));
        let whole = a.kp / STEP;
        if whole < a.steps {
            let ap = a.block(t, whole).add(r * STEP);
            for j in whole * STEP..a.kp {
                let av: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*ap.add(j - whole * STEP) as i32));
                let b0: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(panel.add(j * NR) as *const _));
                let b1: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(panel.add(j * NR + 16) as *const _));
                v0 = _mm512_dpbf16_ps(v0, av, b0);
                v1 = _mm512_dpbf16_ps(v1, av, b1);
            }
        }
        let mask = super::simd::chunk_mask;
        let (m0, m1) = (mask(cols), mask(cols.saturating_sub(16)));
        if let Some(b) = self.bias {
            let b = b.as_ptr().add(p * NR);
            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, b));
            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, b.wrapping_add(16)));
        }
        let row = t * a.rows + r;
        let out = self.y.ptr().add(row * self.n + p * NR);
        _mm512_mask_storeu_ps(out, m0, v0);
        _mm512_mask_storeu_ps(out.wrapping_add(16), m1, v1);
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn run(&self, _: std::ops::Range<usize>, _: &[(usize, usize)]) {
        unreachable!("AMX is x86-64 only")
    }
}
