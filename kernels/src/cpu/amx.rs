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

/// Output columns per weight panel: [`super::matmul::NR`], which checks that the two agree.
pub(crate) const PANEL_COLUMNS: usize = 32;
const NR: usize = PANEL_COLUMNS;

/// Pairs of `k` per tile step (a tile row is 64 bytes).
const STEP: usize = 16;
/// Steps per block of `k` when several units share a panel: the panel's block (2 KB a step)
/// stays in L1 while the units pass over it, and each unit's accumulators go to memory and
/// back once a block.
const BLOCK_STEPS: usize = 16;
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

/// Whether this process multiplies 8-bit quads on AMX tiles: the CPU has AMX-INT8 (and
/// AVX512-VNNI, for the quads past the last whole step) and [`enabled`] holds.
pub fn int8_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // CPUID leaf 7: EDX bit 25 AMX-INT8.
            let leaf = std::arch::x86_64::__cpuid_count(7, 0);
            leaf.edx & (1 << 25) != 0 && super::simd::has_int8_dot() && enabled()
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// Whether the CPU has AMX-BF16 and tiles, and the kernel lets this process use them.
fn usable() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        use std::arch::x86_64::__cpuid_count;
        // The tiles' kernel also runs AVX512-BF16 and VNNI on the pairs and quads past its
        // last whole step.
        if !super::simd::has_bf16_dot() || !super::simd::has_int8_dot() {
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

/// Runs `iters` rounds of four independent tile products (`tdpbf16ps`, or `tdpbusd` with
/// `int8`; operands in tiles, as a product of many rows keeps them) on this thread; returns
/// the operations done (two per product of a value, as the other peaks count them).
///
/// Callers check [`enabled`] (and [`int8_enabled`] with `int8`) first.
pub(crate) fn peak_loop(iters: usize, int8: bool) -> f64 {
    assert!(
        enabled() && (!int8 || int8_enabled()),
        "AMX tiles are not available"
    );
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::asm;
        let config = TileConfig::new(TILE_ROWS);
        let ones = vec![0x3f80_3f80u32; TILE_ROWS * STEP];
        // SAFETY: the CPU has the tiles and Linux granted tile data (the assert); the loads
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
            macro_rules! four {
                ($op:literal) => {
                    for _ in 0..iters {
                        asm!(
                            concat!($op, " tmm0, tmm4, tmm6"),
                            concat!($op, " tmm1, tmm4, tmm7"),
                            concat!($op, " tmm2, tmm5, tmm6"),
                            concat!($op, " tmm3, tmm5, tmm7"),
                            options(nostack, nomem),
                        );
                    }
                };
            }
            if int8 {
                four!("tdpbusd");
            } else {
                four!("tdpbf16ps");
            }
            asm!("tilerelease", options(nostack, nomem));
        }
        // 16 rows x 16 columns x 64 bytes of `k` per tile row (32 pairs or 64 quads' values).
        let per_byte = if int8 { 1 } else { 2 };
        (iters * 4 * TILE_ROWS * (NR / 2) * (STEP * 4 / per_byte) * 2) as f64
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("AMX is x86-64 only")
}

/// The activations' rows as a product takes them: `(m, words per row, fill)`, where
/// `fill(i, dst)` writes row `i`'s words (bfloat16 pairs or 8-bit quads) to the start of `dst`.
pub(crate) type Rows<'a> = (usize, usize, &'a (dyn Fn(usize, &mut [u32]) + Sync));

/// `y[i, j] = Σ a[i] · W[j] (+ bias[j])` on AMX tiles for `rows` of bfloat16 pairs;
/// `words[p · panel_stride..]` is panel `p` of `n` columns as `[kp][NR]` pairs, `y` row-major
/// `[m, n]`. The panels are split over `threads` pool threads (each streams its own part of
/// the weights), or the 32-row units when there are fewer panels. Every one of the first
/// `m · n` values of `y` is written, once, with a float (each panel's columns of each row),
/// so `y` may come from the allocator as it is: a caller takes the values as initialised
/// after the call (`Vec::set_len`) without zeroing them first.
///
/// Callers check [`enabled`] first.
pub(crate) fn bf16_dot(
    threads: usize,
    rows: Rows<'_>,
    n: usize,
    panels: (&[u32], usize),
    bias: Option<&[f32]>,
    y: &mut [std::mem::MaybeUninit<f32>],
) {
    assert!(enabled(), "AMX tiles are not available to this process");
    assert!(bias.is_none_or(|b| b.len() >= n));
    let a = Activations::pack(rows);
    let out = (SendPtr(y.as_mut_ptr().cast::<f32>()), y.len());
    // SAFETY: `y`'s values, borrowed for the call; only floats are written to them.
    unsafe { run_units(threads, &a, n, panels, Finish::Bf16 { bias }, out) };
}

/// Makes one output row (its index, the panel's columns `cs`) from its 32-bit sums, into
/// `out` (`cs.len()` floats).
pub(crate) type WriteInt8<'a> =
    dyn Fn(usize, std::ops::Range<usize>, &[i32; NR], *mut f32) + Sync + 'a;

/// The 8-bit products of [`super::matmul::WeightDtype::Int8Dot`] on AMX-INT8 tiles
/// (`tdpbusd`): `rows` of 8-bit quads (activations quantised to `q + 128`, four to a word);
/// `panels` the 8-bit weight quads' panels (the weight tiles' layout as they are). Each row's
/// sums go to `write` (the VNNI path's scaling: the integer sums are exact, so the outputs
/// have its bits).
///
/// Callers check [`int8_enabled`] first.
pub(crate) fn int8_dot(
    threads: usize,
    rows: Rows<'_>,
    n: usize,
    panels: (&[u32], usize),
    write: &WriteInt8<'_>,
    y: &mut [std::mem::MaybeUninit<f32>],
) {
    assert!(
        int8_enabled(),
        "AMX-INT8 tiles are not available to this process"
    );
    let a = Activations::pack(rows);
    let out = (SendPtr(y.as_mut_ptr().cast::<f32>()), y.len());
    // SAFETY: `y`'s values, borrowed for the call; `write` puts floats in every one.
    unsafe { run_units(threads, &a, n, panels, Finish::Int8(write), out) };
}

/// Every panel of `words` times the activations `a` into the `len` floats at `yp` (row-major
/// `[m, n]`, each written once), on `threads` pool threads.
///
/// # Safety
/// `yp` points to `len` floats' worth of memory this call may write and no one else touches
/// during it.
unsafe fn run_units(
    threads: usize,
    a: &Activations,
    n: usize,
    (words, panel_stride): (&[u32], usize),
    finish: Finish<'_>,
    (yp, len): (SendPtr<f32>, usize),
) {
    let (m, panels) = (a.m, n.div_ceil(NR));
    assert!(len >= m * n);
    assert!(a.kw * NR <= panel_stride || panels == 0);
    assert!(words.len() >= panels.saturating_sub(1) * panel_stride + a.kw * NR);
    // Units of work: up to two activation tiles, `(first tile, tiles)`.
    let units: Vec<(usize, usize)> = (0..a.tiles)
        .step_by(2)
        .map(|t| (t, 2.min(a.tiles - t)))
        .collect();
    let run = |panels: std::ops::Range<usize>, units: &[(usize, usize)]| {
        let job = Job {
            a,
            n,
            words,
            panel_stride,
            finish,
            y: yp,
        };
        // SAFETY: the callers checked that the CPU has the tiles (and the vector instructions
        // of the tails) and Linux granted tile data; the asserts above bound every read; each
        // task writes its own panels' columns of its own rows.
        unsafe {
            match finish {
                Finish::Bf16 { .. } => job.run::<false>(panels, units),
                Finish::Int8(_) => job.run::<true>(panels, units),
            }
        }
    };
    let macs = m * n * a.kw;
    if threads <= 1 || macs < 1 << 15 {
        run(0..panels, &units);
    } else if panels >= threads {
        // Several units: four runs of panels a thread, claimed as threads come free (a
        // thread that starts late or shares its core's tiles takes fewer). A lone unit (one or
        // two activation tiles: decode, small batches) streams its panels in one run a
        // thread, which keeps its prefetch ahead of its tile loads.
        let per_thread = if units.len() > 1 { 4 } else { 1 };
        let parts: Vec<_> = split(panels, (per_thread * threads).min(panels)).collect();
        super::pool::pool().run(parts.len(), &|i| run(parts[i].clone(), &units));
    } else {
        let parts: Vec<_> = split(units.len(), threads).collect();
        super::pool::pool().run(parts.len(), &|i| run(0..panels, &units[parts[i].clone()]));
    }
}

/// How a product's sums become outputs.
#[derive(Clone, Copy)]
enum Finish<'a> {
    /// Float32 sums of bfloat16 pair products, plus the bias.
    Bf16 { bias: Option<&'a [f32]> },
    /// 32-bit integer sums of 8-bit products, made outputs by the caller's function.
    Int8(&'a WriteInt8<'a>),
}

/// The activations as AMX reads them: rows in tiles of 16 (`min(m, 16)` rows when `m` is
/// smaller; the last tile padded with rows of zeros), each tile as `steps` blocks of its rows'
/// 16 words (bfloat16 pairs or 8-bit quads), `[tile][step][row][16]`: every tile load reads 1
/// KB (or `64 · rows` bytes) in one run, whatever `k` (rows `4 kw` bytes apart alias in the L1
/// cache when `kw` is a multiple of 1024). The last step's words past `kw` are 0.
struct Activations {
    words: super::aligned::Aligned<u32>,
    /// Rows, rows per tile, and tiles.
    m: usize,
    rows: usize,
    tiles: usize,
    /// Words per row, and steps (blocks of 16 words, the last one maybe partial).
    kw: usize,
    steps: usize,
}

impl Activations {
    /// `m` rows of `kw` words, row `i` written by `fill(i, its words)` (`16 · steps` of them,
    /// those past `kw` left 0), on the pool's threads when there are enough.
    fn pack((m, kw, fill): Rows<'_>) -> Self {
        let rows = m.min(TILE_ROWS);
        let (tiles, steps) = (m.div_ceil(rows), kw.div_ceil(STEP));
        let tile_len = steps * rows * STEP;
        // Each tile's rows go through `row` (in L1) into their blocks; the padding rows of the
        // last tile are zeros. Every word is written, so the buffer is not zeroed first.
        let pack = |ts: std::ops::Range<usize>, dst: &mut [std::mem::MaybeUninit<u32>]| {
            let mut row = vec![0u32; steps * STEP];
            for (j, t) in ts.enumerate() {
                let tile = &mut dst[j * tile_len..(j + 1) * tile_len];
                for r in 0..rows {
                    if t * rows + r < m {
                        fill(t * rows + r, &mut row);
                    } else {
                        row.fill(0);
                    }
                    for (s, chunk) in row.chunks_exact(STEP).enumerate() {
                        let at = (s * rows + r) * STEP;
                        let block = &mut tile[at..at + STEP];
                        // SAFETY: `block` and `chunk` are 16 words each and do not overlap.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                chunk.as_ptr(),
                                block.as_mut_ptr().cast::<u32>(),
                                STEP,
                            )
                        };
                    }
                }
            }
        };
        // SAFETY: the parts write every word of their tiles, and the tiles cover the buffer.
        let words = unsafe {
            super::aligned::Aligned::written(tiles * tile_len, |dst| {
                super::by_parts(dst, tile_len, tiles, m * kw * 8, pack)
            })
        };
        Self {
            words,
            m,
            rows,
            tiles,
            kw,
            steps,
        }
    }

    /// Tile `t`'s block of step `s`.
    fn block(&self, t: usize, s: usize) -> *const u32 {
        self.words[(t * self.steps + s) * self.rows * STEP..].as_ptr()
    }
}

/// One call's operands.
struct Job<'a> {
    a: &'a Activations,
    n: usize,
    words: &'a [u32],
    panel_stride: usize,
    finish: Finish<'a>,
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

/// One step of a unit: the activation tiles' block at `a0` (and `a1`), the weights' block at
/// `b`, multiplied by `$op` (`tdpbf16ps` or `tdpbusd`) into the accumulator tiles.
#[cfg(target_arch = "x86_64")]
macro_rules! step {
    ($op:literal, two, $a0:expr, $a1:expr, $b:expr, $lda:expr, $ldb:expr) => {
        std::arch::asm!(
            "tileloadd tmm4, [{a0} + {lda}*1]",
            "tileloadd tmm6, [{b} + {ldb}*1]",
            concat!($op, " tmm0, tmm4, tmm6"),
            "tileloadd tmm5, [{a1} + {lda}*1]",
            concat!($op, " tmm2, tmm5, tmm6"),
            "tileloadd tmm7, [{b} + {ldb}*1 + 64]",
            concat!($op, " tmm1, tmm4, tmm7"),
            concat!($op, " tmm3, tmm5, tmm7"),
            a0 = in(reg) $a0,
            a1 = in(reg) $a1,
            b = in(reg) $b,
            lda = in(reg) $lda,
            ldb = in(reg) $ldb,
            options(nostack, readonly),
        )
    };
    ($op:literal, one, $a0:expr, $b:expr, $lda:expr, $ldb:expr) => {
        std::arch::asm!(
            "tileloadd tmm4, [{a0} + {lda}*1]",
            "tileloadd tmm6, [{b} + {ldb}*1]",
            concat!($op, " tmm0, tmm4, tmm6"),
            "tileloadd tmm7, [{b} + {ldb}*1 + 64]",
            concat!($op, " tmm1, tmm4, tmm7"),
            a0 = in(reg) $a0,
            b = in(reg) $b,
            lda = in(reg) $lda,
            ldb = in(reg) $ldb,
            options(nostack, readonly),
        )
    };
}

impl Job<'_> {
    /// Every panel of `panels` for every unit (one or two activation tiles) of `units`, on
    /// this thread: bfloat16 pairs (`tdpbf16ps`), or 8-bit quads with `INT8` (`tdpbusd`).
    ///
    /// # Safety
    /// The CPU has the tiles (AMX-BF16, or AMX-INT8 with `INT8`) and the tails' vector
    /// instructions (AVX512-BF16, or AVX512-VNNI), tile data is granted; no other task writes
    /// these panels' columns of these units' rows.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bf16,avx512vnni")]
    unsafe fn run<const INT8: bool>(
        &self,
        panels: std::ops::Range<usize>,
        units: &[(usize, usize)],
    ) {
        use std::arch::asm;
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let a = self.a;
        let config = TileConfig::new(a.rows);
        // Whole steps; the words past them are added by `finish_row`.
        let whole = a.kw / STEP;
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
        // Cache-line aligned: a tile row that straddles two lines loads and stores at a
        // fraction of the rate of one that does not.
        let mut acc = super::aligned::Aligned::<f32>::zeroed(units.len() * unit_len);
        // A unit whose sums are its outputs as they are (bfloat16 products without a bias or
        // pairs past the last whole step, whole 16-row tiles, a whole panel of columns) stores
        // its accumulators straight into `y` after its last block.
        let direct = |t: usize, count: usize, cols: usize| {
            matches!(self.finish, Finish::Bf16 { bias: None })
                && whole == a.steps
                && a.rows == TILE_ROWS
                && (t + count) * TILE_ROWS <= a.m
                && cols == NR
        };
        let ldy = self.n * 4;
        for p in panels {
            let panel = self.words.as_ptr().add(p * self.panel_stride);
            let cols = NR.min(self.n - p * NR);
            if whole == 0 {
                acc.fill(0.0);
            }
            for s0 in (0..whole).step_by(block) {
                let end = (s0 + block).min(whole);
                let last = end == whole;
                // The next block's start (the panels lie one after another) and its lines.
                let block_end = if last {
                    panel.wrapping_add(self.panel_stride) as *const u8
                } else {
                    (panel as *const u8).wrapping_add(end * STEP * ldb)
                };
                let next_steps = if last { whole } else { whole - end }.min(block);
                let next_lines = next_steps * STEP * ldb / 64;
                for (u, &(t, count)) in units.iter().enumerate() {
                    let two = count == 2;
                    let spill = acc[u * unit_len..].as_mut_ptr() as *mut u8;
                    if s0 == 0 {
                        asm!(
                            "tilezero tmm0",
                            "tilezero tmm1",
                            "tilezero tmm2",
                            "tilezero tmm3",
                            options(nostack, nomem)
                        );
                    } else {
                        let (c, c1) = (spill, spill.add(TILE_ROWS * ldc));
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
                    for s in s0..end {
                        let b = (panel as *const u8).add(s * STEP * ldb);
                        if units.len() == 1 {
                            // A lone unit asks for the weights `AHEAD` bytes on (past the
                            // panel: the next panel's, which this thread reads next); the
                            // hardware's prefetchers alone left the tile loads waiting on
                            // memory.
                            for line in (0..STEP * ldb).step_by(64) {
                                let at = b.wrapping_add(AHEAD + line) as *const i8;
                                _mm_prefetch::<_MM_HINT_T0>(at);
                            }
                        } else {
                            // Several units ask for the next block (this panel's, or the next
                            // panel's first) into L2 in equal shares, a few lines a step: it
                            // streams in while they compute instead of holding the first
                            // unit's tile loads.
                            let i = u * (end - s0) + (s - s0);
                            let shares = units.len() * (end - s0);
                            for line in (i * next_lines / shares)..((i + 1) * next_lines / shares) {
                                let at = block_end.wrapping_add(line * 64) as *const i8;
                                _mm_prefetch::<_MM_HINT_T1>(at);
                            }
                        }
                        let (a0, a1) = (a.block(t, s), a.block(t + usize::from(two), s));
                        match (INT8, two) {
                            (false, true) => step!("tdpbf16ps", two, a0, a1, b, lda, ldb),
                            (false, false) => step!("tdpbf16ps", one, a0, b, lda, ldb),
                            (true, true) => step!("tdpbusd", two, a0, a1, b, lda, ldb),
                            (true, false) => step!("tdpbusd", one, a0, b, lda, ldb),
                        }
                    }
                    // The unit's sums: into `y` after the last block when they are its
                    // outputs, into `acc` otherwise (tiles 2 and 3 only with two tiles: with
                    // one, the rows after it in `y` are another unit's).
                    let (c, ldc) = if last && direct(t, count, cols) {
                        let at = self.y.ptr().add(t * TILE_ROWS * self.n + p * NR);
                        (at as *mut u8, ldy)
                    } else {
                        (spill, ldc)
                    };
                    asm!(
                        "tilestored [{c} + {ldc}*1], tmm0",
                        "tilestored [{c} + {ldc}*1 + 64], tmm1",
                        c = in(reg) c,
                        ldc = in(reg) ldc,
                        options(nostack),
                    );
                    if two {
                        asm!(
                            "tilestored [{c} + {ldc}*1], tmm2",
                            "tilestored [{c} + {ldc}*1 + 64], tmm3",
                            c = in(reg) c.add(TILE_ROWS * ldc),
                            ldc = in(reg) ldc,
                            options(nostack),
                        );
                    }
                }
            }
            // Accumulator row `h · 16 + r` of a unit is row `r` of its tile `t + h`; padding
            // rows are not written.
            for (u, &(t, count)) in units.iter().enumerate() {
                if whole > 0 && direct(t, count, cols) {
                    continue;
                }
                for h in 0..count {
                    for r in 0..a.rows.min(a.m - (t + h) * a.rows) {
                        let at = u * unit_len + (h * TILE_ROWS + r) * NR;
                        let sums = acc[at..at + NR].as_ptr();
                        self.finish_row(sums, t + h, r, panel, p, cols);
                    }
                }
            }
        }
        asm!("tilerelease", options(nostack, nomem));
    }

    /// Row `r` of tile `t`: its columns of panel `p` (`cols` of them) from the tiles' sums at
    /// `acc` (32 floats, or 32-bit integers for 8-bit products), plus the words past the last
    /// whole step by `vdpbf16ps` (or `vpdpbusd`), made outputs as [`Finish`] says.
    ///
    /// # Safety
    /// As [`Job::run`]; `acc` points to 32 values.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bf16,avx512vnni")]
    unsafe fn finish_row(
        &self,
        acc: *const f32,
        t: usize,
        r: usize,
        panel: *const u32,
        p: usize,
        cols: usize,
    ) {
        use std::arch::x86_64::*;
        let a = self.a;
        let mut v0 = _mm512_loadu_ps(acc);
        let mut v1 = _mm512_loadu_ps(acc.add(16));
        let whole = a.kw / STEP;
        let int8 = matches!(self.finish, Finish::Int8(_));
        if whole < a.steps {
            let ap = a.block(t, whole).add(r * STEP);
            for j in whole * STEP..a.kw {
                let av = _mm512_set1_epi32(*ap.add(j - whole * STEP) as i32);
                let b0 = _mm512_loadu_si512(panel.add(j * NR) as *const _);
                let b1 = _mm512_loadu_si512(panel.add(j * NR + 16) as *const _);
                if int8 {
                    let (s0, s1) = (_mm512_castps_si512(v0), _mm512_castps_si512(v1));
                    v0 = _mm512_castsi512_ps(_mm512_dpbusd_epi32(s0, av, b0));
                    v1 = _mm512_castsi512_ps(_mm512_dpbusd_epi32(s1, av, b1));
                } else {
                    let av: __m512bh = std::mem::transmute(av);
                    v0 = _mm512_dpbf16_ps(v0, av, std::mem::transmute::<__m512i, __m512bh>(b0));
                    v1 = _mm512_dpbf16_ps(v1, av, std::mem::transmute::<__m512i, __m512bh>(b1));
                }
            }
        }
        let row = t * a.rows + r;
        let out = self.y.ptr().add(row * self.n + p * NR);
        let cs = p * NR..p * NR + cols;
        match self.finish {
            Finish::Int8(write) => {
                let mut ints = [0i32; NR];
                _mm512_storeu_si512(ints.as_mut_ptr() as *mut _, _mm512_castps_si512(v0));
                _mm512_storeu_si512(ints.as_mut_ptr().add(16) as *mut _, _mm512_castps_si512(v1));
                write(row, cs, &ints, out);
            }
            Finish::Bf16 { bias } => {
                let mask = super::simd::chunk_mask;
                let (m0, m1) = (mask(cols), mask(cols.saturating_sub(16)));
                if let Some(b) = bias {
                    let b = b.as_ptr().add(p * NR);
                    v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, b));
                    v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, b.wrapping_add(16)));
                }
                _mm512_mask_storeu_ps(out, m0, v0);
                _mm512_mask_storeu_ps(out.wrapping_add(16), m1, v1);
            }
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    unsafe fn run<const INT8: bool>(&self, _: std::ops::Range<usize>, _: &[(usize, usize)]) {
        unreachable!("AMX is x86-64 only")
    }
}
