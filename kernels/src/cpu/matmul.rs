//! `y = x · Wᵀ (+ b)` for a linear layer whose weight `W` `[n, k]` (the checkpoints' `Linear`
//! layout) is packed once, at load, into panels of [`NR`] output columns.
//!
//! Layout: panel `p` holds weight rows `p·NR .. p·NR + NR` transposed, `[k][NR]` (the last
//! panel padded with zero rows), so the kernel reads one contiguous stream per panel.
//!
//! Kernel: a register tile of `MR` rows of `x` by the `NR` columns of one panel. For every
//! `kk` in ascending order it loads the panel's `NR` weights of row `kk` and, for each of the
//! `MR` rows, broadcasts `x[i][kk]` and accumulates with fused multiply-adds. Every output is
//! the sum, in order, of one FMA chain per block of [`KC`] consecutive `kk` (blocked summation:
//! the error of a long sum grows with the block, not the whole length), whatever `MR` is: the
//! result of a row never depends on which rows share its call (see the module doc of
//! [`super`]). A one-row
//! call (decode) streams each weight once at the memory's pace; a call of many rows reuses
//! each panel, from the caches, for all of them (compute-bound).
//!
//! Weights may be stored as bfloat16 ([`WeightDtype::Bf16`]): half the bytes to stream, widened
//! to float32 in registers (a bf16 value is the top half of a float32), accumulated in float32.
//!
//! Work split: the panels are cut into contiguous runs, one per pool thread (each thread
//! streams its own part of the weights); with fewer panels than threads the rows are split.

use crate::{check, KernelError};

use super::aligned::{Aligned, Filling};
use super::simd::Isa;
use super::{split, SendPtr};

pub use super::simd::{has_bf16_dot, has_int8_dot};

/// Output columns per panel.
pub const NR: usize = 32;
const _: () = assert!(NR == super::amx::PANEL_COLUMNS);
/// Panel rows (of `k`) per block of the blocked sum.
pub const KC: usize = 256;
/// How far ahead of the panel row being multiplied the kernel asks for the panel.
const PREFETCH_BYTES: usize = 2048;
/// Row tiles that share each block of a panel.
const GROUP_TILES: usize = 8;
/// Rows per register tile, the most any instruction set uses.
const MR_MAX: usize = 8;

/// How packed weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    #[default]
    F32,
    /// bfloat16 (round to nearest even), widened to float32 in registers.
    Bf16,
    /// bfloat16 weights multiplied by activations rounded to bfloat16, products of pairs
    /// summed into float32 accumulators: AVX512-BF16's `vdpbf16ps` where the CPU has it (twice
    /// the float32 FMA rate), the same arithmetic in float32 FMAs elsewhere (the same results
    /// up to summation order).
    Bf16Dot,
    /// 8-bit integers with one float32 scale per output channel (symmetric, `max |w| / 127`),
    /// widened to float32 in registers and the channel's scale applied to its sum: a quarter of
    /// float32's bytes to stream.
    Int8,
    /// 8-bit weights as [`WeightDtype::Int8`] times activations quantised to 8 bits per row at
    /// each product (symmetric, `max |x| / 127`), the products summed exactly in 32-bit
    /// integers and scaled once per output: AVX512-VNNI's `vpdpbusd` where the CPU has it, the
    /// same integer sums elsewhere, so every path gives the same bits. At most
    /// [`INT8_DOT_MAX_K`] inputs (the integer sums stay within 32 bits).
    Int8Dot,
    /// 4-bit integers (`-7..=7`) with one float32 scale per output channel and group of
    /// [`Q4_GROUP`] consecutive inputs (symmetric, `max |w| / 7` over the group), dequantised in
    /// registers: an eighth of float32's bytes plus the scales.
    Q4,
    /// [`WeightDtype::Q4`]'s weights times activations quantised to 8 bits per row, as
    /// [`WeightDtype::Int8Dot`]: each group's products summed exactly in 32-bit integers
    /// (`vpdpbusd` on the nibbles widened in registers, or the same sums elsewhere), scaled by
    /// the group's scale into a float32 sum per output: the same bits on every path.
    Q4Dot,
}

impl WeightDtype {
    /// Every storage, in the order the command line lists them.
    pub const ALL: [WeightDtype; 7] = [
        WeightDtype::F32,
        WeightDtype::Bf16,
        WeightDtype::Bf16Dot,
        WeightDtype::Int8,
        WeightDtype::Int8Dot,
        WeightDtype::Q4,
        WeightDtype::Q4Dot,
    ];

    /// The name `--weight-dtype` takes.
    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "f32",
            WeightDtype::Bf16 => "bf16",
            WeightDtype::Bf16Dot => "bf16-dot",
            WeightDtype::Int8 => "int8",
            WeightDtype::Int8Dot => "int8-dot",
            WeightDtype::Q4 => "q4",
            WeightDtype::Q4Dot => "q4-dot",
        }
    }
}

/// Inputs (`k`) per scale of [`WeightDtype::Q4`].
pub const Q4_GROUP: usize = 32;

/// Most inputs of a [`WeightDtype::Int8Dot`] weight: `65536 · 255 · 127` fits an `i32`.
pub const INT8_DOT_MAX_K: usize = 65_536;

#[derive(Debug, Clone)]
enum Store {
    F32(Aligned<f32>),
    Bf16(Aligned<u16>),
    /// Panel `p` as `[ceil(k / 2)][NR]` words, word `(j, c)` holding the bfloat16 weights of
    /// rows `2j` (low half) and `2j + 1` (high half, 0 past `k`) of column `c`: what one
    /// `vdpbf16ps` lane multiplies.
    Bf16Pairs(Aligned<u32>),
    /// Panels as the float32 store, values `round(w / scale)`, and each output column's scale
    /// (`panels · NR`, 1 past `n`).
    I8 {
        values: Aligned<i8>,
        scales: Vec<f32>,
    },
    /// Panel `p` as `[ceil(k / 4)][NR]` words, word `(j, c)` holding the 8-bit weights of rows
    /// `4j .. 4j + 4` of column `c` (row `4j` in the low byte, 0 past `k`): what one `vpdpbusd`
    /// lane multiplies. Each output column's scale and the sum of its quantised weights
    /// (`panels · NR`).
    I8Quads {
        words: Aligned<u32>,
        scales: Vec<f32>,
        sums: Vec<i32>,
    },
    /// Panel `p` as `[groups · 4][NR]` words (`groups = ceil(k / Q4_GROUP)`), word `(j, c)`
    /// holding inputs `8j .. 8j + 8` of column `c` as `q + 8`: input `8j + 2i` in the low
    /// nibble of byte `i`, `8j + 2i + 1` in its high nibble (8, a zero, past `k`); per panel the
    /// scales `[groups][NR]` and each group's integer correction `128 · Σ q + 1024 · Q4_GROUP`
    /// (what the offsets of both operands add to the group's sum of products).
    Q4Octets {
        words: Aligned<u32>,
        scales: Vec<f32>,
        corr: Vec<i32>,
    },
    /// Panel `p` as `[k][NR / 2]` bytes, byte `b` of row `kk` holding column `b` in its low
    /// nibble and column `b + 16` in its high nibble (each `q + 8`), and per panel the scales
    /// `[ceil(k / Q4_GROUP)][NR]`.
    Q4 {
        nibbles: Aligned<u8>,
        scales: Vec<f32>,
    },
}

/// `(lo, hi)` as one word of two bfloat16.
fn bf16_pair(lo: f32, hi: f32) -> u32 {
    u32::from(f32_to_bf16(lo)) | (u32::from(f32_to_bf16(hi)) << 16)
}

/// One scale per output channel (`panels · NR`): `max |w| / 127` over the channel's inputs, 1
/// for a channel of zeros (and the padding past `n`).
fn channel_scales(w: &[f32], n: usize, k: usize, panels: usize) -> Vec<f32> {
    (0..panels * NR)
        .map(|row| {
            let max = if row < n {
                w[row * k..(row + 1) * k]
                    .iter()
                    .fold(0f32, |m, v| m.max(v.abs()))
            } else {
                0.0
            };
            if max > 0.0 && max.is_finite() {
                max / 127.0
            } else {
                1.0
            }
        })
        .collect()
}

/// One scale per output column and group of [`Q4_GROUP`] inputs, `[panels][groups][NR]`:
/// `max |w| / 7` over the group, 1 for a group of zeros.
fn group_scales(at: &impl Fn(usize, usize, usize) -> f32, k: usize, panels: usize) -> Vec<f32> {
    let groups = k.div_ceil(Q4_GROUP);
    let mut scales = vec![1f32; panels * groups * NR];
    for p in 0..panels {
        for g in 0..groups {
            for c in 0..NR {
                let ks = g * Q4_GROUP..((g + 1) * Q4_GROUP).min(k);
                let max = ks.map(|kk| at(p, kk, c).abs()).fold(0f32, f32::max);
                if max > 0.0 && max.is_finite() {
                    scales[(p * groups + g) * NR + c] = max / 7.0;
                }
            }
        }
    }
    scales
}

/// `v / scale` rounded to an 8-bit integer in `-127..=127`.
fn quantize8(v: f32, scale: f32) -> i8 {
    (v / scale).round().clamp(-127.0, 127.0) as i8
}

/// What multiplies the bfloat16 pairs of [`WeightDtype::Bf16Dot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PairUnit {
    /// AMX tiles ([`super::amx`]).
    Amx,
    /// AVX512-BF16's `vdpbf16ps`.
    Dot,
    /// Float32 FMAs of the widened values: the same products.
    Fma,
}

impl PairUnit {
    /// The best unit for `isa` on this CPU (asked on every product: no allocation): AMX and
    /// AVX512-BF16 need the AVX-512 path.
    pub(crate) fn for_isa(isa: Isa) -> Self {
        match (isa == Isa::Avx512 && has_bf16_dot(), super::amx::enabled()) {
            (true, true) => Self::Amx,
            (true, false) => Self::Dot,
            (false, _) => Self::Fma,
        }
    }

    /// Every unit `isa` can use on this CPU, best first (tests compare them).
    #[cfg(test)]
    pub(crate) fn available(isa: Isa) -> Vec<Self> {
        match Self::for_isa(isa) {
            Self::Amx => vec![Self::Amx, Self::Dot, Self::Fma],
            Self::Dot => vec![Self::Dot, Self::Fma],
            Self::Fma => vec![Self::Fma],
        }
    }
}

/// What multiplies bfloat16 pairs ([`WeightDtype::Bf16Dot`]) in this process: `amx` (AMX
/// tiles), `avx512-bf16` (`vdpbf16ps`) or `fma` (float32 FMAs of the widened values).
pub fn bf16_unit() -> &'static str {
    match PairUnit::for_isa(Isa::get()) {
        PairUnit::Amx => "amx",
        PairUnit::Dot => "avx512-bf16",
        PairUnit::Fma => "fma",
    }
}

/// What multiplies 8-bit quads ([`WeightDtype::Int8Dot`]) in this process: `amx` (AMX-INT8
/// tiles), `avx512-vnni` (`vpdpbusd`) or `integer` (the same sums in plain code).
pub fn int8_unit() -> &'static str {
    match (vnni(Isa::get()), super::amx::int8_enabled()) {
        (true, true) => "amx",
        (true, false) => "avx512-vnni",
        (false, _) => "integer",
    }
}

/// A linear layer's weight `[n, k]`, packed for [`linear`].
#[derive(Debug, Clone)]
pub struct PackedWeight {
    n: usize,
    k: usize,
    store: Store,
}

/// Rounds to the nearest bfloat16, ties to even (NaN stays NaN).
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let round = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// [`f32_to_bf16`] of every value of `x` into `out` (the bf16 K/V cache's page writes).
pub fn round_to_bf16(x: &[f32], out: &mut [u16]) {
    assert_eq!(x.len(), out.len(), "one bfloat16 per value");
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if Isa::get() == Isa::Avx512 {
        // SAFETY: AVX512F was detected; whole chunks of 16 values only.
        done = unsafe { round_to_bf16_avx512(x, out) };
    }
    for (o, &v) in out[done..].iter_mut().zip(&x[done..]) {
        *o = f32_to_bf16(v);
    }
}

/// [`round_to_bf16`] over whole chunks of 16 values; returns the values written.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn round_to_bf16_avx512(x: &[f32], out: &mut [u16]) -> usize {
    use std::arch::x86_64::*;
    let chunks = x.len() / 16;
    for c in 0..chunks {
        let half = bf16_halves_avx512(_mm512_loadu_ps(x.as_ptr().add(16 * c)));
        _mm256_storeu_si256(
            out.as_mut_ptr().add(16 * c) as *mut __m256i,
            _mm512_cvtepi32_epi16(half),
        );
    }
    chunks * 16
}

/// The float32 value of a bfloat16.
pub fn bf16_to_f32(x: u16) -> f32 {
    f32::from_bits(u32::from(x) << 16)
}

impl PackedWeight {
    /// Packs `w` (row-major `[n, k]`).
    pub fn pack(w: &[f32], n: usize, k: usize, dtype: WeightDtype) -> Result<Self, KernelError> {
        check(w.len() == n * k, || {
            format!("weight has {} values, want {n}x{k}", w.len())
        })?;
        let panels = n.div_ceil(NR);
        let len = panels * k * NR;
        let at = |p: usize, kk: usize, c: usize| -> f32 {
            let row = p * NR + c;
            if row < n {
                w[row * k + kk]
            } else {
                0.0
            }
        };
        let store = match dtype {
            WeightDtype::F32 => {
                let mut out = Filling::new(len);
                for p in 0..panels {
                    for kk in 0..k {
                        out.extend((0..NR).map(|c| at(p, kk, c)));
                    }
                }
                Store::F32(out.finish())
            }
            WeightDtype::Bf16 => {
                let mut out = Filling::new(len);
                for p in 0..panels {
                    for kk in 0..k {
                        out.extend((0..NR).map(|c| f32_to_bf16(at(p, kk, c))));
                    }
                }
                Store::Bf16(out.finish())
            }
            WeightDtype::Bf16Dot => {
                let kp = k.div_ceil(2);
                let mut out = Filling::new(panels * kp * NR);
                for p in 0..panels {
                    for j in 0..kp {
                        out.extend((0..NR).map(|c| {
                            let hi = if 2 * j + 1 < k {
                                at(p, 2 * j + 1, c)
                            } else {
                                0.0
                            };
                            bf16_pair(at(p, 2 * j, c), hi)
                        }));
                    }
                }
                Store::Bf16Pairs(out.finish())
            }
            WeightDtype::Int8 => {
                let scales = channel_scales(w, n, k, panels);
                let mut values = Filling::new(len);
                for p in 0..panels {
                    for kk in 0..k {
                        values.extend((0..NR).map(|c| quantize8(at(p, kk, c), scales[p * NR + c])));
                    }
                }
                Store::I8 {
                    values: values.finish(),
                    scales,
                }
            }
            WeightDtype::Int8Dot => {
                check(k <= INT8_DOT_MAX_K, || {
                    format!(
                        "int8-dot weights take at most {INT8_DOT_MAX_K} inputs, this one has {k}"
                    )
                })?;
                let scales = channel_scales(w, n, k, panels);
                let kq = k.div_ceil(4);
                let mut words = Filling::new(panels * kq * NR);
                let mut sums = vec![0i32; panels * NR];
                for p in 0..panels {
                    for j in 0..kq {
                        words.extend((0..NR).map(|c| {
                            let mut word = 0u32;
                            for b in 0..4 {
                                let kk = 4 * j + b;
                                if kk < k {
                                    let q = quantize8(at(p, kk, c), scales[p * NR + c]);
                                    sums[p * NR + c] += i32::from(q);
                                    word |= u32::from(q as u8) << (8 * b);
                                }
                            }
                            word
                        }));
                    }
                }
                Store::I8Quads {
                    words: words.finish(),
                    scales,
                    sums,
                }
            }
            WeightDtype::Q4 => {
                let groups = k.div_ceil(Q4_GROUP);
                let scales = group_scales(&at, k, panels);
                let mut nibbles = Filling::new(panels * k * NR / 2);
                for p in 0..panels {
                    for kk in 0..k {
                        let g = kk / Q4_GROUP;
                        let q = |c: usize| -> u8 {
                            let s = scales[(p * groups + g) * NR + c];
                            ((at(p, kk, c) / s).round().clamp(-7.0, 7.0) as i8 + 8) as u8
                        };
                        nibbles.extend((0..NR / 2).map(|b| q(b) | (q(b + NR / 2) << 4)));
                    }
                }
                Store::Q4 {
                    nibbles: nibbles.finish(),
                    scales,
                }
            }
            WeightDtype::Q4Dot => {
                let groups = k.div_ceil(Q4_GROUP);
                let scales = group_scales(&at, k, panels);
                let nj = groups * Q4_GROUP / 8;
                let mut words = Filling::new(panels * nj * NR);
                let mut corr = vec![1024 * Q4_GROUP as i32; panels * groups * NR];
                for p in 0..panels {
                    for j in 0..nj {
                        let g = 8 * j / Q4_GROUP;
                        words.extend((0..NR).map(|c| {
                            let s = scales[(p * groups + g) * NR + c];
                            let mut word = 0u32;
                            for i in 0..8 {
                                let kk = 8 * j + i;
                                let q = if kk < k {
                                    (at(p, kk, c) / s).round().clamp(-7.0, 7.0) as i32
                                } else {
                                    0
                                };
                                corr[(p * groups + g) * NR + c] += 128 * q;
                                word |= ((q + 8) as u32) << (8 * (i / 2) + 4 * (i % 2));
                            }
                            word
                        }));
                    }
                }
                Store::Q4Octets {
                    words: words.finish(),
                    scales,
                    corr,
                }
            }
        };
        Ok(Self { n, k, store })
    }

    /// Packs `b` (row-major `[k, n]`, the transposed layout: `y = x · b`) as float32, for a
    /// product whose right operand is made per call (e.g. a memory matrix).
    pub fn pack_kn(b: &[f32], k: usize, n: usize) -> Result<Self, KernelError> {
        check(b.len() == k * n, || {
            format!("operand has {} values, want {k}x{n}", b.len())
        })?;
        let panels = n.div_ceil(NR);
        let mut out = Aligned::zeroed(panels * k * NR);
        super::by_parts(&mut out, k * NR, panels, k * n, |ps, dst| {
            for kk in 0..k {
                for p in ps.clone() {
                    let cols = NR.min(n - p * NR);
                    let at = (p - ps.start) * k * NR + kk * NR;
                    dst[at..at + cols].copy_from_slice(&b[kk * n + p * NR..kk * n + p * NR + cols]);
                }
            }
        });
        Ok(Self {
            n,
            k,
            store: Store::F32(out),
        })
    }

    /// Packs `b` (row-major `[k, n]`, as [`PackedWeight::pack_kn`]) as bfloat16 pairs along
    /// `k` ([`WeightDtype::Bf16Dot`]: rounded to nearest even), for a per-call right operand
    /// in the bf16 compute mode.
    pub fn pack_kn_pairs(b: &[f32], k: usize, n: usize) -> Result<Self, KernelError> {
        check(b.len() == k * n, || {
            format!("operand has {} values, want {k}x{n}", b.len())
        })?;
        let (kp, panels, isa) = (k.div_ceil(2), n.div_ceil(NR), Isa::get());
        let mut out = Aligned::zeroed(panels * kp * NR);
        super::by_parts(&mut out, kp * NR, panels, k * n, |ps, dst| {
            for j in 0..kp {
                let lo = &b[2 * j * n..(2 * j + 1) * n];
                let hi = (2 * j + 1 < k).then(|| &b[(2 * j + 1) * n..(2 * j + 2) * n]);
                for p in ps.clone() {
                    let cols = p * NR..(p * NR + NR).min(n);
                    let at = (p - ps.start) * kp * NR + j * NR;
                    pack_column_pairs(
                        isa,
                        &lo[cols.clone()],
                        hi.map(|h| &h[cols.clone()]),
                        &mut dst[at..at + cols.len()],
                    );
                }
            }
        });
        Ok(Self {
            n,
            k,
            store: Store::Bf16Pairs(out),
        })
    }

    /// Output features (`n`).
    pub fn out_features(&self) -> usize {
        self.n
    }

    /// Input features (`k`).
    pub fn in_features(&self) -> usize {
        self.k
    }

    pub fn dtype(&self) -> WeightDtype {
        match self.store {
            Store::F32(_) => WeightDtype::F32,
            Store::Bf16(_) => WeightDtype::Bf16,
            Store::Bf16Pairs(_) => WeightDtype::Bf16Dot,
            Store::I8 { .. } => WeightDtype::Int8,
            Store::I8Quads { .. } => WeightDtype::Int8Dot,
            Store::Q4Octets { .. } => WeightDtype::Q4Dot,
            Store::Q4 { .. } => WeightDtype::Q4,
        }
    }

    /// Bytes the packed weight occupies.
    pub fn bytes(&self) -> usize {
        match &self.store {
            Store::F32(v) => v.len() * 4,
            Store::Bf16(v) => v.len() * 2,
            Store::Bf16Pairs(v) => v.len() * 4,
            Store::I8 { values, scales } => values.len() + scales.len() * 4,
            Store::I8Quads {
                words,
                scales,
                sums,
            } => words.len() * 4 + scales.len() * 4 + sums.len() * 4,
            Store::Q4Octets {
                words,
                scales,
                corr,
            } => words.len() * 4 + scales.len() * 4 + corr.len() * 4,
            Store::Q4 { nibbles, scales } => nibbles.len() + scales.len() * 4,
        }
    }

    /// Weight row `j` (`k` values, as stored: bf16 weights come back rounded), e.g. an
    /// embedding row of a head tied to the embeddings.
    pub fn row_into(&self, j: usize, out: &mut [f32]) -> Result<(), KernelError> {
        check(j < self.n, || format!("row {j} of a {}-row weight", self.n))?;
        check(out.len() == self.k, || {
            format!("row buffer of {}, want {}", out.len(), self.k)
        })?;
        let base = (j / NR) * self.k * NR + j % NR;
        match &self.store {
            Store::F32(v) => out
                .iter_mut()
                .enumerate()
                .for_each(|(kk, o)| *o = v[base + kk * NR]),
            Store::Bf16(v) => out
                .iter_mut()
                .enumerate()
                .for_each(|(kk, o)| *o = bf16_to_f32(v[base + kk * NR])),
            Store::I8 { values, scales } => out
                .iter_mut()
                .enumerate()
                .for_each(|(kk, o)| *o = f32::from(values[base + kk * NR]) * scales[j]),
            Store::Q4 { nibbles, scales } => {
                let (p, c, groups) = (j / NR, j % NR, self.k.div_ceil(Q4_GROUP));
                let (b, shift) = (c % (NR / 2), 4 * (c / (NR / 2)));
                out.iter_mut().enumerate().for_each(|(kk, o)| {
                    let q = (nibbles[(p * self.k + kk) * NR / 2 + b] >> shift) & 0xF;
                    let s = scales[(p * groups + kk / Q4_GROUP) * NR + c];
                    *o = (f32::from(q) - 8.0) * s;
                })
            }
            Store::Bf16Pairs(v) => out.iter_mut().enumerate().for_each(|(kk, o)| {
                let word = v[(j / NR) * self.k.div_ceil(2) * NR + (kk / 2) * NR + j % NR];
                *o = bf16_to_f32((word >> (16 * (kk % 2))) as u16);
            }),
            Store::Q4Octets { words, scales, .. } => {
                let (p, c, groups) = (j / NR, j % NR, self.k.div_ceil(Q4_GROUP));
                let nj = groups * Q4_GROUP / 8;
                out.iter_mut().enumerate().for_each(|(kk, o)| {
                    let word = words[(p * nj + kk / 8) * NR + c];
                    let i = kk % 8;
                    let q = ((word >> (8 * (i / 2) + 4 * (i % 2))) & 0xF) as i32 - 8;
                    *o = q as f32 * scales[(p * groups + kk / Q4_GROUP) * NR + c];
                })
            }
            Store::I8Quads { words, scales, .. } => {
                out.iter_mut().enumerate().for_each(|(kk, o)| {
                    let word = words[(j / NR) * self.k.div_ceil(4) * NR + (kk / 4) * NR + j % NR];
                    *o = f32::from((word >> (8 * (kk % 4))) as u8 as i8) * scales[j];
                })
            }
        }
        Ok(())
    }

    /// The weight `[n, k]` row-major, as stored.
    pub fn unpack(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n * self.k];
        for (j, row) in out.chunks_mut(self.k.max(1)).enumerate().take(self.n) {
            self.row_into(j, row).expect("in range");
        }
        out
    }
}

/// `y[i, j] = Σ_kk x[i, kk] · W[j, kk] (+ bias[j])` for `m` rows of `x` (row-major `[m, k]`),
/// into `y` (row-major `[m, n]`), split over the pool's threads.
pub fn linear(
    x: &[f32],
    m: usize,
    w: &PackedWeight,
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    linear_with(Isa::get(), super::threads(), x, m, w, bias, y)
}

/// [`linear`] into a new vector of `m · n` outputs. Where the products run on AMX tiles
/// (bfloat16 pairs or 8-bit quads) they write every output once, so the vector is not zeroed
/// first (zeroing a many-row output on the calling thread while the pool waited was 5-6% of a
/// LLaDA canvas forward); elsewhere it is zeroed and [`linear`] fills it.
pub fn linear_vec(
    x: &[f32],
    m: usize,
    w: &PackedWeight,
    bias: Option<&[f32]>,
) -> Result<Vec<f32>, KernelError> {
    let (n, k, isa) = (w.n, w.k, Isa::get());
    let shapes_agree = x.len() == m * k && bias.is_none_or(|b| b.len() == n) && m * n * k > 0;
    match &w.store {
        Store::Bf16Pairs(words) if shapes_agree && PairUnit::for_isa(isa) == PairUnit::Amx => {
            let panels = (&words[..], k.div_ceil(2) * NR);
            // SAFETY: `amx_pairs` writes each of the `m · n` outputs.
            return Ok(unsafe {
                super::written(m * n, |out| {
                    amx_pairs(isa, super::threads(), x, (m, k, n), panels, bias, out);
                })
            });
        }
        Store::I8Quads {
            words,
            scales,
            sums,
        } if shapes_agree && vnni(isa) && super::amx::int8_enabled() => {
            let weights = (&words[..], &scales[..], &sums[..]);
            // SAFETY: `amx_quads` writes each of the `m · n` outputs.
            return Ok(unsafe {
                super::written(m * n, |out| {
                    amx_quads(isa, super::threads(), x, (m, k, n), weights, bias, out);
                })
            });
        }
        _ => {}
    }
    let mut y = vec![0f32; m * n];
    linear(x, m, w, bias, &mut y)?;
    Ok(y)
}

/// [`linear`] on a given instruction set and thread count (tests compare them).
pub fn linear_with(
    isa: Isa,
    threads: usize,
    x: &[f32],
    m: usize,
    w: &PackedWeight,
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let (n, k) = (w.n, w.k);
    check(x.len() == m * k, || {
        format!("x has {} values, want {m}x{k}", x.len())
    })?;
    check(y.len() == m * n, || {
        format!("y has {} values, want {m}x{n}", y.len())
    })?;
    if let Some(b) = bias {
        check(b.len() == n, || {
            format!("bias has {} values, want {n}", b.len())
        })?;
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        // Empty sums: the bias alone.
        for row in y.chunks_mut(n) {
            match bias {
                Some(b) => row.copy_from_slice(b),
                None => row.fill(0.0),
            }
        }
        return Ok(());
    }
    if let Store::Bf16Pairs(words) = &w.store {
        bf16_dot(
            isa,
            PairUnit::for_isa(isa),
            threads,
            x,
            m,
            k,
            n,
            (words, k.div_ceil(2) * NR),
            bias,
            y,
        );
        return Ok(());
    }
    if let Store::I8Quads {
        words,
        scales,
        sums,
    } = &w.store
    {
        let tiles = vnni(isa) && super::amx::int8_enabled();
        return int8_dot(
            isa,
            tiles,
            threads,
            x,
            m,
            k,
            n,
            (words, scales, sums),
            bias,
            y,
        );
    }
    if let Store::Q4Octets {
        words,
        scales,
        corr,
    } = &w.store
    {
        return q4_dot(isa, threads, x, m, k, n, (words, scales, corr), bias, y);
    }
    let panels = n.div_ceil(NR);
    // Row tiles of the instruction set's register tile; `x` repacked tile by tile as
    // `[k][rows]`, so a kernel broadcasts every row's value of `kk` from one stream.
    let tiles = row_tiles(isa, m);
    let a = pack_rows(x, k, &tiles, threads);
    let yp = SendPtr(y.as_mut_ptr());
    let run = |panels: std::ops::Range<usize>, tiles: &[(usize, usize)]| {
        // SAFETY: every task writes the outputs of its own panels and rows only.
        unsafe { run_block(isa, &a, k, w, bias, yp, n, panels, tiles) }
    };
    on_threads(m * n * k, threads, panels, &tiles, &run);
    Ok(())
}

/// The work of one task: a run of panels times a run of row tiles `(first row, rows)`.
type BlockRun<'a> = dyn Fn(std::ops::Range<usize>, &[(usize, usize)]) + Sync + 'a;

/// Runs `run(panels, row tiles)` over every panel and row tile of a product of `macs`
/// multiply-adds: on the caller alone below ~64k of them (a second thread costs more than it
/// saves), else on `threads` pool threads, the panels cut into contiguous runs (each thread
/// streams its own part of the weights), or the row tiles when there are fewer panels than
/// threads.
fn on_threads(
    macs: usize,
    threads: usize,
    panels: usize,
    tiles: &[(usize, usize)],
    run: &BlockRun<'_>,
) {
    if threads <= 1 || macs < 1 << 16 {
        run(0..panels, tiles);
    } else if panels >= threads {
        let parts: Vec<_> = split(panels, threads).collect();
        super::pool::pool().run(parts.len(), &|i| run(parts[i].clone(), tiles));
    } else {
        let parts: Vec<_> = split(tiles.len(), threads).collect();
        super::pool::pool().run(parts.len(), &|i| run(0..panels, &tiles[parts[i].clone()]));
    }
}

/// Row tiles `(first row, rows)` of `mr` rows over `m` rows, the last one shorter.
fn fixed_tiles(m: usize, mr: usize) -> Vec<(usize, usize)> {
    (0..m).step_by(mr).map(|i| (i, mr.min(m - i))).collect()
}

/// `x` `[m, k]` repacked tile by tile: tile `(i, mr)` holds rows `i..i + mr` as `[k][mr]`, at
/// offset `i · k`; the tiles split over `threads` pool threads when there are enough values.
fn pack_rows(x: &[f32], k: usize, tiles: &[(usize, usize)], threads: usize) -> Vec<f32> {
    if let [(_, 1)] = tiles {
        return x.to_vec();
    }
    let mut a = vec![0f32; x.len()];
    let ap = SendPtr(a.as_mut_ptr());
    let pack = |tiles: &[(usize, usize)]| {
        for &(i, mr) in tiles {
            // SAFETY: tile (i, mr) owns `a[i · k..(i + mr) · k]`, no other task writes it, and
            // `a` outlives every task.
            let dst = unsafe { std::slice::from_raw_parts_mut(ap.ptr().add(i * k), mr * k) };
            for r in 0..mr {
                let row = &x[(i + r) * k..(i + r + 1) * k];
                for (kk, &v) in row.iter().enumerate() {
                    dst[kk * mr + r] = v;
                }
            }
        }
    };
    if threads > 1 && tiles.len() > 1 && x.len() >= 1 << 14 {
        let parts: Vec<_> = split(tiles.len(), threads).collect();
        super::pool::pool().run(parts.len(), &|t| pack(&tiles[parts[t].clone()]));
    } else {
        pack(tiles);
    }
    a
}

/// Row tiles of `m` rows for `isa`'s register tile.
fn row_tiles(isa: Isa, m: usize) -> Vec<(usize, usize)> {
    let tile_rows = match isa {
        Isa::Avx2 => 6,
        Isa::Avx512 | Isa::Portable => MR_MAX,
    };
    (0..m)
        .step_by(tile_rows)
        .map(|i| (i, tile_rows.min(m - i)))
        .collect()
}

/// On the calling thread, `c[i][j] = Σ_kk a[i][kk] · B[kk][j]` for `a` row-major `[m, k]` and
/// `B` `[k, n]` given as [`NR`]-column panels (panel `p` from `panels[p · panel_stride]`, its
/// first `k` rows of `NR` read: `[k][NR]`, the last zero-padded), into `c` with row stride
/// `ldc`: the kernel of [`linear`] for operands built per call (the scores and weighted values
/// of attention, over a leading part of the keys packed).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_panels(
    isa: Isa,
    a: &[f32],
    m: usize,
    k: usize,
    panels: &[f32],
    panel_stride: usize,
    n: usize,
    c: &mut [f32],
    ldc: usize,
) {
    assert!(k * NR <= panel_stride || n == 0);
    assert!(
        a.len() >= m * k
            && panels.len() >= n.div_ceil(NR).saturating_sub(1) * panel_stride + k * NR
    );
    let tiles = row_tiles(isa, m);
    // On AVX512 the rows are read where they are (broadcast from each row in turn): these
    // operands are built per call, and repacking them cost more than the locality it buys.
    let in_place = cfg!(target_arch = "x86_64") && isa == Isa::Avx512;
    let packed = if in_place {
        Vec::new()
    } else {
        pack_rows(&a[..m * k], k, &tiles, 1)
    };
    each_panel_tile(isa, &tiles, n, c, ldc, |p, i, mr, tile| {
        let panel = &panels[p * panel_stride..p * panel_stride + k * NR];
        if in_place {
            #[cfg(target_arch = "x86_64")]
            {
                macro_rules! by_rows {
                    ($($m:literal)*) => {
                        match mr {
                            // SAFETY: AVX512 was detected on this machine; rows i..i + mr
                            // of `a` hold k values each.
                            $($m => unsafe {
                                tile_avx512_row_major::<$m>(&a[i * k..(i + mr) * k], k, panel, tile)
                            },)*
                            _ => unreachable!("tile of {mr} rows"),
                        }
                    };
                }
                by_rows!(1 2 3 4 5 6 7 8);
            }
        } else {
            let at = &packed[i * k..(i + mr) * k];
            tile_dispatch(
                isa,
                mr,
                at,
                k,
                panel,
                tile,
                true,
                Prefetch::Ahead(PREFETCH_BYTES),
            );
        }
    });
}

/// For every panel `p` of `n` columns and row tile `(i, mr)`: `tile(p, i, mr, acc)` computes
/// the `mr x NR` tile into `acc`, written to rows `i..i + mr`, columns `p · NR..` of `c` (row
/// stride `ldc`): the loop of the per-call products ([`gemm_panels`], [`bf16_panels`]).
fn each_panel_tile(
    isa: Isa,
    tiles: &[(usize, usize)],
    n: usize,
    c: &mut [f32],
    ldc: usize,
    mut tile: impl FnMut(usize, usize, usize, &mut [f32; MR_MAX * NR]),
) {
    let m = tiles.last().map_or(0, |&(i, mr)| i + mr);
    // The tiles are written through a pointer: `c` must hold every output.
    assert!(n <= ldc && (m == 0 || c.len() >= (m - 1) * ldc + n));
    let mut acc = [0f32; MR_MAX * NR];
    for p in 0..n.div_ceil(NR) {
        let cols = NR.min(n - p * NR);
        for &(i, mr) in tiles {
            tile(p, i, mr, &mut acc);
            // SAFETY: rows i..i + mr of `c` hold columns p · NR..p · NR + cols (asserted
            // above).
            unsafe {
                write_tile(
                    isa,
                    &acc,
                    mr,
                    cols,
                    None,
                    None,
                    c.as_mut_ptr().add(i * ldc + p * NR),
                    ldc,
                )
            };
        }
    }
}

/// Computes outputs of `panels` for the row `tiles`.
///
/// # Safety
/// `y` points to `[m, n]` floats; no other task writes these panels' columns of these rows.
#[allow(clippy::too_many_arguments)]
unsafe fn run_block(
    isa: Isa,
    a: &[f32],
    k: usize,
    w: &PackedWeight,
    bias: Option<&[f32]>,
    y: SendPtr<f32>,
    n: usize,
    panels: std::ops::Range<usize>,
    tiles: &[(usize, usize)],
) {
    let mut accs = [[0f32; MR_MAX * NR]; GROUP_TILES];
    for p in panels {
        let cols = NR.min(n - p * NR);
        for group in tiles.chunks(GROUP_TILES) {
            // One block of the panel's rows at a time for every tile of the group: the block is
            // read from memory once and stays in L1 for the other tiles. Each block's partial
            // sum is added to the output's running total, in block order.
            for k0 in (0..k).step_by(KC) {
                let kb = KC.min(k - k0);
                for (t, (&(i, mr), acc)) in group.iter().zip(accs.iter_mut()).enumerate() {
                    let at = &a[i * k + k0 * mr..i * k + (k0 + kb) * mr];
                    let start = k0 == 0;
                    let range = p * k * NR + k0 * NR..p * k * NR + (k0 + kb) * NR;
                    // The block stays in L1 for the group's tiles; see [`Prefetch::for_tile`].
                    let prefetch = |elem: usize| {
                        let (row, block) = (NR * elem, kb * NR * elem);
                        Prefetch::for_tile(t, group.len(), block, block, row)
                    };
                    match &w.store {
                        Store::F32(v) => {
                            tile_dispatch(isa, mr, at, kb, &v[range], acc, start, prefetch(4))
                        }
                        Store::Bf16(v) => {
                            tile_dispatch(isa, mr, at, kb, &v[range], acc, start, prefetch(2))
                        }
                        Store::I8 { values, .. } => {
                            tile_dispatch(isa, mr, at, kb, &values[range], acc, start, prefetch(1))
                        }
                        Store::Q4 { nibbles, scales } => {
                            let groups = k.div_ceil(Q4_GROUP);
                            let nb = &nibbles[(p * k + k0) * NR / 2..(p * k + k0 + kb) * NR / 2];
                            let sc =
                                &scales[(p * groups + k0 / Q4_GROUP) * NR..(p + 1) * groups * NR];
                            q4_tile(isa, mr, at, kb, nb, sc, acc, start)
                        }
                        Store::Bf16Pairs(_) | Store::I8Quads { .. } | Store::Q4Octets { .. } => {
                            unreachable!("bf16 pairs and int8 quads take their own paths")
                        }
                    }
                }
            }
            // Int8: each column's sum times its channel's scale.
            let scales = match &w.store {
                Store::I8 { scales, .. } => Some(&scales[p * NR..(p + 1) * NR]),
                _ => None,
            };
            let bias = bias.map(|b| &b[p * NR..p * NR + cols]);
            for (&(i, mr), acc) in group.iter().zip(accs.iter()) {
                write_tile(isa, acc, mr, cols, scales, bias, y.0.add(i * n + p * NR), n);
            }
        }
    }
}

/// Elements a panel may be stored in.
trait PanelElem: Copy {
    fn to_f32(self) -> f32;
    #[cfg(target_arch = "x86_64")]
    /// 16 consecutive elements as floats.
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
    #[cfg(target_arch = "x86_64")]
    /// 8 consecutive elements as floats.
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl PanelElem for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

impl PanelElem for u16 {
    fn to_f32(self) -> f32 {
        bf16_to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}

impl PanelElem for i8 {
    fn to_f32(self) -> f32 {
        f32::from(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    }
}

/// One `mr x NR` tile into `tile` (row-major, `NR` per row); `x` is the tile's rows packed
/// `[k][mr]`. Every output's chain over these `k` starts from zero; with `start` it is stored,
/// else added to the value in `tile` (blocked summation: the partial sums of successive
/// k-blocks are added in order, which keeps the rounding error of long sums down).
#[allow(clippy::too_many_arguments)]
fn tile_dispatch<E: PanelElem>(
    isa: Isa,
    mr: usize,
    x: &[f32],
    k: usize,
    panel: &[E],
    tile: &mut [f32; MR_MAX * NR],
    start: bool,
    prefetch: Prefetch,
) {
    debug_assert!(x.len() == mr * k && panel.len() == k * NR);
    macro_rules! by_rows {
        ($f:ident, $($m:literal)*) => {
            match mr {
                $($m => $f::<$m, E>(x, k, panel, tile, start, prefetch),)*
                _ => unreachable!("tile of {mr} rows"),
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the instruction set was detected on this machine.
        Isa::Avx512 => unsafe { by_rows!(tile_avx512, 1 2 3 4 5 6 7 8) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { by_rows!(tile_avx2_rows, 1 2 3 4 5 6) },
        _ => tile_portable(mr, x, k, panel, tile, start),
    }
}

fn tile_portable<E: PanelElem>(
    mr: usize,
    x: &[f32],
    k: usize,
    panel: &[E],
    tile: &mut [f32; MR_MAX * NR],
    start: bool,
) {
    for r in 0..mr {
        let mut acc = [0f32; NR];
        for kk in 0..k {
            let xv = x[kk * mr + r];
            let wrow = &panel[kk * NR..(kk + 1) * NR];
            for (a, &wv) in acc.iter_mut().zip(wrow) {
                *a = xv.mul_add(wv.to_f32(), *a);
            }
        }
        let t = &mut tile[r * NR..(r + 1) * NR];
        if start {
            t.copy_from_slice(&acc);
        } else {
            t.iter_mut().zip(&acc).for_each(|(t, a)| *t += a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_avx512<const MR: usize, E: PanelElem>(
    x: &[f32],
    k: usize,
    panel: &[E],
    tile: &mut [f32; MR_MAX * NR],
    start: bool,
    prefetch: Prefetch,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let xp = x.as_ptr();
    let bp = panel.as_ptr();
    let mut stream = Stream::new(prefetch);
    let row = size_of::<E>() * NR;
    for kk in 0..k {
        stream.row(bp, kk * row, row);
        let b0 = E::load16(bp.add(kk * NR));
        let b1 = E::load16(bp.add(kk * NR + 16));
        for (r, a) in acc.iter_mut().enumerate() {
            let xv = _mm512_set1_ps(*xp.add(kk * MR + r));
            a[0] = _mm512_fmadd_ps(xv, b0, a[0]);
            a[1] = _mm512_fmadd_ps(xv, b1, a[1]);
        }
    }
    store_tile_avx512(&acc, tile, start);
}

/// What a tile asks the cache for while it multiplies a block of a panel. Offsets are bytes
/// past the panel pointer the tile kernel reads from.
#[derive(Debug, Clone, Copy)]
enum Prefetch {
    /// A panel row (two lines) this many bytes past each row it reads.
    Ahead(usize),
    /// The lines from `from` on, `step` bytes more per row it reads.
    Share { from: usize, step: usize },
}

impl Prefetch {
    /// For tile `t` of a group of `tiles` that share a block of panel rows of `row` bytes, the
    /// next block `next` bytes past the kernel's panel pointer. One tile streams its block,
    /// asking just ahead. Several ask for a share of the next block each, a line at a time
    /// over their rows, so memory streams at an even rate while they compute (the next block
    /// asked for at once by the later tiles came in bursts, and the first tile of each block
    /// waited for it).
    fn for_tile(t: usize, tiles: usize, next: usize, block: usize, row: usize) -> Self {
        if tiles <= 1 {
            Self::Ahead(PREFETCH_BYTES)
        } else {
            // Shares one after another, rounded up so that together they cover the block.
            let step = row.div_ceil(tiles);
            Self::Share {
                from: next + t * step * (block / row),
                step,
            }
        }
    }
}

/// A tile's [`Prefetch`] as it goes: [`Stream::row`] for every panel row it reads.
#[cfg(target_arch = "x86_64")]
struct Stream {
    prefetch: Prefetch,
    /// `Share`: bytes asked for so far, and the next line to ask for.
    asked: usize,
    line: usize,
}

#[cfg(target_arch = "x86_64")]
impl Stream {
    #[inline(always)]
    fn new(prefetch: Prefetch) -> Self {
        let from = match prefetch {
            Prefetch::Share { from, .. } => from,
            Prefetch::Ahead(_) => 0,
        };
        Self {
            prefetch,
            asked: from,
            line: from,
        }
    }

    /// The prefetches due as the kernel reads the panel row `at` bytes past `base`, a row of
    /// `row_bytes`. An address past the panel is never dereferenced; prefetching it is a no-op.
    #[inline(always)]
    unsafe fn row<T>(&mut self, base: *const T, at: usize, row_bytes: usize) {
        use std::arch::x86_64::*;
        let base = base as *const i8;
        match self.prefetch {
            Prefetch::Ahead(ahead) => {
                let next = base.wrapping_add(at + ahead);
                _mm_prefetch::<_MM_HINT_T0>(next);
                if row_bytes > 64 {
                    _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(64));
                }
            }
            Prefetch::Share { step, .. } => {
                self.asked += step;
                while self.line < self.asked {
                    _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(self.line));
                    self.line += 64;
                }
            }
        }
    }
}

/// [`tile_avx512`] for rows stored one after another (`x` is `[MR][k]`, row-major) rather than
/// packed: each step broadcasts the value of every row at `kk`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512_row_major<const MR: usize>(
    x: &[f32],
    k: usize,
    panel: &[f32],
    tile: &mut [f32; MR_MAX * NR],
) {
    use std::arch::x86_64::*;
    debug_assert!(x.len() == MR * k && panel.len() == k * NR);
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let xp = x.as_ptr();
    let bp = panel.as_ptr();
    let mut stream = Stream::new(Prefetch::Ahead(PREFETCH_BYTES));
    for kk in 0..k {
        stream.row(bp, kk * NR * 4, NR * 4);
        let b0 = _mm512_loadu_ps(bp.add(kk * NR));
        let b1 = _mm512_loadu_ps(bp.add(kk * NR + 16));
        for (r, a) in acc.iter_mut().enumerate() {
            let xv = _mm512_set1_ps(*xp.add(r * k + kk));
            a[0] = _mm512_fmadd_ps(xv, b0, a[0]);
            a[1] = _mm512_fmadd_ps(xv, b1, a[1]);
        }
    }
    store_tile_avx512(&acc, tile, true);
}

/// Writes a register tile's rows (two registers of 16 columns each) into `tile`: stored with
/// `start`, else added to what it holds (the next block of the blocked sum).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_tile_avx512(
    acc: &[[std::arch::x86_64::__m512; 2]],
    tile: &mut [f32; MR_MAX * NR],
    start: bool,
) {
    use std::arch::x86_64::*;
    let tp = tile.as_mut_ptr();
    for (r, a) in acc.iter().enumerate() {
        let (mut a0, mut a1) = (a[0], a[1]);
        if !start {
            a0 = _mm512_add_ps(_mm512_loadu_ps(tp.add(r * NR)), a0);
            a1 = _mm512_add_ps(_mm512_loadu_ps(tp.add(r * NR + 16)), a1);
        }
        _mm512_storeu_ps(tp.add(r * NR), a0);
        _mm512_storeu_ps(tp.add(r * NR + 16), a1);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2_rows<const MR: usize, E: PanelElem>(
    x: &[f32],
    k: usize,
    panel: &[E],
    tile: &mut [f32; MR_MAX * NR],
    start: bool,
    _prefetch: Prefetch,
) {
    use std::arch::x86_64::*;
    let xp = x.as_ptr();
    let bp = panel.as_ptr();
    let tp = tile.as_mut_ptr();
    // The panel's 32 columns in two halves of 16 (two registers each): 16 registers in all.
    for half in 0..2 {
        let off = half * 16;
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        for kk in 0..k {
            let b0 = E::load8(bp.add(kk * NR + off));
            let b1 = E::load8(bp.add(kk * NR + off + 8));
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_set1_ps(*xp.add(kk * MR + r));
                a[0] = _mm256_fmadd_ps(xv, b0, a[0]);
                a[1] = _mm256_fmadd_ps(xv, b1, a[1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let (mut a0, mut a1) = (a[0], a[1]);
            if !start {
                a0 = _mm256_add_ps(_mm256_loadu_ps(tp.add(r * NR + off)), a0);
                a1 = _mm256_add_ps(_mm256_loadu_ps(tp.add(r * NR + off + 8)), a1);
            }
            _mm256_storeu_ps(tp.add(r * NR + off), a0);
            _mm256_storeu_ps(tp.add(r * NR + off + 8), a1);
        }
    }
}

/// One `mr x NR` tile over `k` rows of a [`WeightDtype::Q4`] panel block (`nibbles`
/// `[k][NR / 2]`, `scales` from the block's first group on, `[groups][NR]`; the block starts on
/// a group boundary): each row of nibbles dequantised in registers, then as the float32 tile.
#[allow(clippy::too_many_arguments)]
fn q4_tile(
    isa: Isa,
    mr: usize,
    x: &[f32],
    k: usize,
    nibbles: &[u8],
    scales: &[f32],
    tile: &mut [f32; MR_MAX * NR],
    start: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        macro_rules! by_rows {
            ($($m:literal)*) => {
                match mr {
                    // SAFETY: the instruction set was detected on this machine.
                    $($m => unsafe { q4_tile_avx512::<$m>(x, k, nibbles, scales, tile, start) },)*
                    _ => unreachable!("tile of {mr} rows"),
                }
            };
        }
        return by_rows!(1 2 3 4 5 6 7 8);
    }
    let _ = isa;
    let half = NR / 2;
    for r in 0..mr {
        let mut acc = [0f32; NR];
        for kk in 0..k {
            let xv = x[kk * mr + r];
            let s = &scales[(kk / Q4_GROUP) * NR..(kk / Q4_GROUP + 1) * NR];
            let row = &nibbles[kk * half..(kk + 1) * half];
            for (c, a) in acc.iter_mut().enumerate() {
                let q = (row[c % half] >> (4 * (c / half))) & 0xF;
                *a = xv.mul_add((f32::from(q) - 8.0) * s[c], *a);
            }
        }
        let t = &mut tile[r * NR..(r + 1) * NR];
        if start {
            t.copy_from_slice(&acc);
        } else {
            t.iter_mut().zip(&acc).for_each(|(t, a)| *t += a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn q4_tile_avx512<const MR: usize>(
    x: &[f32],
    k: usize,
    nibbles: &[u8],
    scales: &[f32],
    tile: &mut [f32; MR_MAX * NR],
    start: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let (xp, np, sp) = (x.as_ptr(), nibbles.as_ptr(), scales.as_ptr());
    let (mask, eight) = (_mm512_set1_epi32(0xF), _mm512_set1_epi32(8));
    let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    for kk in 0..k {
        if kk % Q4_GROUP == 0 {
            let g = kk / Q4_GROUP;
            s0 = _mm512_loadu_ps(sp.add(g * NR));
            s1 = _mm512_loadu_ps(sp.add(g * NR + 16));
        }
        _mm_prefetch::<_MM_HINT_T0>((np.wrapping_add(kk * NR / 2) as *const i8).wrapping_add(512));
        let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(np.add(kk * NR / 2) as *const __m128i));
        let lo = _mm512_sub_epi32(_mm512_and_si512(v, mask), eight);
        let hi = _mm512_sub_epi32(_mm512_srli_epi32::<4>(v), eight);
        let b0 = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), s0);
        let b1 = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), s1);
        for (r, a) in acc.iter_mut().enumerate() {
            let xv = _mm512_set1_ps(*xp.add(kk * MR + r));
            a[0] = _mm512_fmadd_ps(xv, b0, a[0]);
            a[1] = _mm512_fmadd_ps(xv, b1, a[1]);
        }
    }
    store_tile_avx512(&acc, tile, start);
}

/// `x` `[m, k]` rounded to bfloat16 pairs times the pair panels on AMX tiles into `y`
/// (`[m, n]`, every value written once: see [`super::amx::bf16_dot`]).
fn amx_pairs(
    isa: Isa,
    threads: usize,
    x: &[f32],
    (m, k, n): (usize, usize, usize),
    panels: (&[u32], usize),
    bias: Option<&[f32]>,
    y: &mut [std::mem::MaybeUninit<f32>],
) {
    let rows = |i: usize, dst: &mut [u32]| pack_row_pairs(isa, &x[i * k..(i + 1) * k], dst, 0, 1);
    let a = (
        m,
        k.div_ceil(2),
        &rows as &(dyn Fn(usize, &mut [u32]) + Sync),
    );
    super::amx::bf16_dot(threads, a, n, panels, bias, y);
}

/// Pairs of `k` per block of the blocked sum on the bfloat16 path.
const KC_PAIRS: usize = KC / 2;

/// [`linear_with`] for weights stored as [`WeightDtype::Bf16Dot`]: `x` rounded to bfloat16 and
/// packed tile by tile as `[ceil(k / 2)][mr]` pairs, each `mr x NR` tile accumulated in float32
/// by `vdpbf16ps` (or the same products in float32 FMAs), block by block of [`KC`] values of
/// `k`. Panel `p` starts at `words[p · panel_stride]` (`ceil(k / 2) · NR` for weights; more
/// when a call reads the leading rows of longer panels, as attention does).
#[allow(clippy::too_many_arguments)]
fn bf16_dot(
    isa: Isa,
    unit: PairUnit,
    threads: usize,
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
    (words, panel_stride): (&[u32], usize),
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    let kp = k.div_ceil(2);
    if unit == PairUnit::Amx {
        // SAFETY: the tiles write only floats.
        let y = unsafe { super::as_uninit(y) };
        return amx_pairs(isa, threads, x, (m, k, n), (words, panel_stride), bias, y);
    }
    let panels = n.div_ceil(NR);
    let tiles = fixed_tiles(m, MR_MAX);
    let a = pack_pairs(isa, threads, x, k, &tiles);
    let dot = unit == PairUnit::Dot;
    let yp = SendPtr(y.as_mut_ptr());
    let run = |panels: std::ops::Range<usize>, tiles: &[(usize, usize)]| {
        let mut accs = [[0f32; MR_MAX * NR]; GROUP_TILES];
        for p in panels {
            let cols = NR.min(n - p * NR);
            for group in tiles.chunks(GROUP_TILES) {
                // One block of the panel at a time for every tile of the group: the block is
                // read once and stays in L1 for the others (as the float32 path does).
                for j0 in (0..kp).step_by(KC_PAIRS) {
                    let jb = KC_PAIRS.min(kp - j0);
                    let at = p * panel_stride;
                    let panel = &words[at + j0 * NR..at + (j0 + jb) * NR];
                    for (t, (&(i, mr), tile)) in group.iter().zip(accs.iter_mut()).enumerate() {
                        let at = &a[i * kp + j0 * mr..i * kp + (j0 + jb) * mr];
                        let (row, block) = (NR * 4, jb * NR * 4);
                        let prefetch = Prefetch::for_tile(t, group.len(), block, block, row);
                        bf16_tile(dot, mr, at, jb, panel, tile, j0 == 0, prefetch);
                    }
                }
                let bias = bias.map(|b| &b[p * NR..p * NR + cols]);
                for (&(i, mr), tile) in group.iter().zip(accs.iter()) {
                    // SAFETY: every task writes the outputs of its own panels and rows only:
                    // rows i..i + mr, columns p · NR..p · NR + cols, of `y` (`[m, n]`).
                    unsafe {
                        write_tile(
                            isa,
                            tile,
                            mr,
                            cols,
                            None,
                            bias,
                            yp.ptr().add(i * n + p * NR),
                            n,
                        )
                    };
                }
            }
        }
    };
    on_threads(m * n * k, threads, panels, &tiles, &run);
}

/// `x` `[m, k]` rounded to bfloat16 ([`f32_to_bf16`]) and packed tile by tile: tile `(i, mr)`
/// at offset `i · ceil(k / 2)` holds `[ceil(k / 2)][mr]` pairs of its rows (a 0 after an odd
/// `k`). The tiles are split over the pool's threads when there are enough values to pay for
/// it; AVX512 rounds 16 values at a time, bit for bit as the scalar rounding.
fn pack_pairs(isa: Isa, threads: usize, x: &[f32], k: usize, tiles: &[(usize, usize)]) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let m = tiles.last().map_or(0, |&(i, mr)| i + mr);
    let mut a = vec![0u32; m * kp];
    let ap = SendPtr(a.as_mut_ptr());
    let pack = |tiles: &[(usize, usize)]| {
        for &(i, mr) in tiles {
            // SAFETY: tile (i, mr) owns `a[i · kp..(i + mr) · kp]`, no other task writes it,
            // and `a` outlives every task.
            let dst = unsafe { std::slice::from_raw_parts_mut(ap.ptr().add(i * kp), mr * kp) };
            for r in 0..mr {
                pack_row_pairs(isa, &x[(i + r) * k..(i + r + 1) * k], dst, r, mr);
            }
        }
    };
    if threads > 1 && tiles.len() > 1 && m * k >= 1 << 14 {
        let parts: Vec<_> = split(tiles.len(), threads).collect();
        super::pool::pool().run(parts.len(), &|t| pack(&tiles[parts[t].clone()]));
    } else {
        pack(tiles);
    }
    a
}

/// Row `r` of a tile of `mr` rows: `dst[j · mr + r]` holds the pair `row[2j]`, `row[2j + 1]`.
pub(crate) fn pack_row_pairs(isa: Isa, row: &[f32], dst: &mut [u32], r: usize, mr: usize) {
    let k = row.len();
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: AVX512F was detected (the instruction set says so); the function reads
        // `row` and writes `dst[j · mr + r]` for the pairs of its whole 16-value chunks only.
        done = unsafe { pack_row_pairs_avx512(row, dst, r, mr) };
    }
    for j in done..k.div_ceil(2) {
        let hi = if 2 * j + 1 < k { row[2 * j + 1] } else { 0.0 };
        dst[j * mr + r] = bf16_pair(row[2 * j], hi);
    }
}

/// [`pack_row_pairs`] over the row's whole chunks of 16 values; returns the pairs written.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_row_pairs_avx512(row: &[f32], dst: &mut [u32], r: usize, mr: usize) -> usize {
    use std::arch::x86_64::*;
    let chunks = row.len() / 16;
    let mut words = [0u32; 8];
    for c in 0..chunks {
        let half = bf16_halves_avx512(_mm512_loadu_ps(row.as_ptr().add(16 * c)));
        // Each 64-bit lane holds (value 2w, value 2w + 1): the pair is lo | hi << 16.
        let pairs = _mm512_or_si512(
            _mm512_and_si512(half, _mm512_set1_epi64(0xFFFF)),
            _mm512_srli_epi64::<16>(half),
        );
        if mr == 1 {
            // One row: its pairs are contiguous.
            _mm256_storeu_si256(
                dst.as_mut_ptr().add(8 * c) as *mut __m256i,
                _mm512_cvtepi64_epi32(pairs),
            );
            continue;
        }
        _mm256_storeu_si256(
            words.as_mut_ptr() as *mut __m256i,
            _mm512_cvtepi64_epi32(pairs),
        );
        for (t, &w) in words.iter().enumerate() {
            dst[(8 * c + t) * mr + r] = w;
        }
    }
    chunks * 8
}

/// [`f32_to_bf16`] on 16 lanes: each 32-bit lane holds its value's bfloat16 in the low half.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn bf16_halves_avx512(v: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let bits = _mm512_castps_si512(v);
    // Round to nearest even on the upper half; a NaN keeps its upper half, made quiet.
    let upper = _mm512_srli_epi32::<16>(bits);
    let lsb = _mm512_and_si512(upper, _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb);
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, bias));
    let quiet = _mm512_or_si512(upper, _mm512_set1_epi32(0x40));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    _mm512_mask_blend_epi32(nan, rounded, quiet)
}

/// `dst[c]` = the pair (`lo[c]`, `hi[c]`) rounded to bfloat16 (`hi` 0 when `None`): two rows of
/// `B` `[k, n]` (rows `2j`, `2j + 1`) as one row of a bfloat16 pair panel.
pub(crate) fn pack_column_pairs(isa: Isa, lo: &[f32], hi: Option<&[f32]>, dst: &mut [u32]) {
    let n = dst.len();
    debug_assert!(lo.len() >= n && hi.is_none_or(|h| h.len() >= n));
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: AVX512F was detected; whole chunks of 16 of the `n` values only.
        done = unsafe { pack_column_pairs_avx512(lo, hi, dst) };
    }
    for c in done..n {
        dst[c] = bf16_pair(lo[c], hi.map_or(0.0, |h| h[c]));
    }
}

/// [`pack_column_pairs`] over whole chunks of 16 values; returns the values written.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_column_pairs_avx512(lo: &[f32], hi: Option<&[f32]>, dst: &mut [u32]) -> usize {
    use std::arch::x86_64::*;
    let chunks = dst.len() / 16;
    for c in 0..chunks {
        let l = bf16_halves_avx512(_mm512_loadu_ps(lo.as_ptr().add(16 * c)));
        let h = match hi {
            Some(h) => {
                _mm512_slli_epi32::<16>(bf16_halves_avx512(_mm512_loadu_ps(h.as_ptr().add(16 * c))))
            }
            None => _mm512_setzero_si512(),
        };
        let w = _mm512_or_si512(_mm512_and_si512(l, _mm512_set1_epi32(0xFFFF)), h);
        _mm512_storeu_si512(dst.as_mut_ptr().add(16 * c) as *mut _, w);
    }
    chunks * 16
}

/// [`pack_column_pairs`] of rows already in bfloat16 (the bf16 K/V cache's values): `dst[c]` =
/// `lo[c] | hi[c] << 16` (`hi` 0 when `None`).
pub(crate) fn pack_bf16_column_pairs(isa: Isa, lo: &[u16], hi: Option<&[u16]>, dst: &mut [u32]) {
    let n = dst.len();
    debug_assert!(lo.len() >= n && hi.is_none_or(|h| h.len() >= n));
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: AVX512F was detected; whole chunks of 16 of the `n` values only.
        done = unsafe { pack_bf16_column_pairs_avx512(lo, hi, dst) };
    }
    for c in done..n {
        dst[c] = u32::from(lo[c]) | hi.map_or(0, |h| u32::from(h[c]) << 16);
    }
}

/// [`pack_bf16_column_pairs`] over whole chunks of 16 values; returns the values written.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_bf16_column_pairs_avx512(lo: &[u16], hi: Option<&[u16]>, dst: &mut [u32]) -> usize {
    use std::arch::x86_64::*;
    let chunks = dst.len() / 16;
    let widen = |p: *const u16| _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
    for c in 0..chunks {
        let l = widen(lo.as_ptr().add(16 * c));
        let w = match hi {
            Some(h) => _mm512_or_si512(l, _mm512_slli_epi32::<16>(widen(h.as_ptr().add(16 * c)))),
            None => l,
        };
        _mm512_storeu_si512(dst.as_mut_ptr().add(16 * c) as *mut _, w);
    }
    chunks * 16
}

/// On the calling thread, `c [m, n] = a [m, k] · B` with `a` row-major float32 rounded to
/// bfloat16 and `B` given as bfloat16 pair panels (per [`NR`] columns, from
/// `words[p · panel_stride]`, its first `ceil(k / 2)` rows of `NR` words read, the pair of rows
/// `2j`, `2j + 1`; zero-padded), accumulated in float32: attention's products in bf16 compute,
/// by the kernel of [`WeightDtype::Bf16Dot`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn bf16_panels(
    isa: Isa,
    a: &[f32],
    m: usize,
    k: usize,
    words: &[u32],
    panel_stride: usize,
    n: usize,
    c: &mut [f32],
) {
    let (kp, panels) = (k.div_ceil(2), n.div_ceil(NR));
    assert!(kp * NR <= panel_stride || n == 0);
    assert!(a.len() >= m * k && c.len() >= m * n);
    assert!(words.len() >= panels.saturating_sub(1) * panel_stride + kp * NR);
    if PairUnit::for_isa(isa) == PairUnit::Amx {
        // On AMX tiles, on this thread, as the weights' products.
        // SAFETY: the tiles write only floats.
        let c = unsafe { super::as_uninit(&mut c[..m * n]) };
        return amx_pairs(isa, 1, a, (m, k, n), (words, panel_stride), None, c);
    }
    #[cfg(target_arch = "x86_64")]
    if has_bf16_dot() && isa == Isa::Avx512 {
        // The rows as bfloat16 pairs, row-major `[m][kp]`: a contiguous conversion (no
        // scatter into tiles) that the kernel broadcasts from row by row.
        let mut rows = vec![0u32; m * kp];
        for (row, dst) in a[..m * k].chunks(k).zip(rows.chunks_mut(kp)) {
            pack_row_pairs(isa, row, dst, 0, 1);
        }
        each_panel_tile(isa, &fixed_tiles(m, MR_MAX), n, c, n, |p, i, mr, tile| {
            let panel = &words[p * panel_stride..p * panel_stride + kp * NR];
            let at = &rows[i * kp..(i + mr) * kp];
            macro_rules! by_rows {
                ($($m:literal)*) => {
                    match mr {
                        // SAFETY: the CPU has AVX512-BF16; `at` holds mr rows of kp pairs and
                        // `panel` kp rows of NR pairs.
                        $($m => unsafe { bf16_tile_avx512_row_major::<$m>(at, kp, panel, tile) },)*
                        _ => unreachable!("tile of {mr} rows"),
                    }
                };
            }
            by_rows!(1 2 3 4 5 6 7 8);
        });
        return;
    }
    // Elsewhere the weights' path.
    bf16_dot(
        isa,
        PairUnit::for_isa(isa),
        1,
        &a[..m * k],
        m,
        k,
        n,
        (words, panel_stride),
        None,
        &mut c[..m * n],
    );
}

/// [`bf16_tile_avx512`] over rows stored one after another (`a` is `[MR][kp]` pairs) rather
/// than packed by tile, the whole sum in one pass.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn bf16_tile_avx512_row_major<const MR: usize>(
    a: &[u32],
    kp: usize,
    panel: &[u32],
    tile: &mut [f32; MR_MAX * NR],
) {
    use std::arch::x86_64::*;
    debug_assert!(a.len() == MR * kp && panel.len() == kp * NR);
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let (ap, bp) = (a.as_ptr(), panel.as_ptr());
    for j in 0..kp {
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(j * NR) as *const _));
        let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(j * NR + 16) as *const _));
        for (r, acc) in acc.iter_mut().enumerate() {
            let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(r * kp + j) as i32));
            acc[0] = _mm512_dpbf16_ps(acc[0], av, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], av, b1);
        }
    }
    store_tile_avx512(&acc, tile, true);
}

/// Writes a finished `mr x NR` tile's first `cols` columns, times `scales` then plus `bias`
/// (`cols` values each, when given), to `mr` rows of `ld` floats from `out`.
///
/// # Safety
/// `out.add(r · ld + c)` must be writable for every `r < mr`, `c < cols`.
#[allow(clippy::too_many_arguments)]
unsafe fn write_tile(
    isa: Isa,
    tile: &[f32; MR_MAX * NR],
    mr: usize,
    cols: usize,
    scales: Option<&[f32]>,
    bias: Option<&[f32]>,
    out: *mut f32,
    ld: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: AVX512F was detected; the caller's promise covers the masked stores.
        return unsafe { write_tile_avx512(tile, mr, cols, scales, bias, out, ld) };
    }
    for r in 0..mr {
        for c in 0..cols {
            let mut v = tile[r * NR + c];
            if let Some(s) = scales {
                v *= s[c];
            }
            if let Some(b) = bias {
                v += b[c];
            }
            // SAFETY: the caller's promise.
            unsafe { *out.add(r * ld + c) = v };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn write_tile_avx512(
    tile: &[f32; MR_MAX * NR],
    mr: usize,
    cols: usize,
    scales: Option<&[f32]>,
    bias: Option<&[f32]>,
    out: *mut f32,
    ld: usize,
) {
    use std::arch::x86_64::*;
    let mask = super::simd::chunk_mask;
    let (m0, m1) = (mask(cols), mask(cols.saturating_sub(16)));
    let load = |v: Option<&[f32]>| match v {
        Some(v) => (
            _mm512_maskz_loadu_ps(m0, v.as_ptr()),
            _mm512_maskz_loadu_ps(m1, v.as_ptr().wrapping_add(16)),
        ),
        None => (_mm512_setzero_ps(), _mm512_setzero_ps()),
    };
    let ((b0, b1), (s0, s1)) = (load(bias), load(scales));
    let tp = tile.as_ptr();
    for r in 0..mr {
        let (mut v0, mut v1) = (
            _mm512_loadu_ps(tp.add(r * NR)),
            _mm512_loadu_ps(tp.add(r * NR + 16)),
        );
        if scales.is_some() {
            v0 = _mm512_mul_ps(v0, s0);
            v1 = _mm512_mul_ps(v1, s1);
        }
        if bias.is_some() {
            v0 = _mm512_add_ps(v0, b0);
            v1 = _mm512_add_ps(v1, b1);
        }
        _mm512_mask_storeu_ps(out.wrapping_add(r * ld), m0, v0);
        _mm512_mask_storeu_ps(out.wrapping_add(r * ld + 16), m1, v1);
    }
}

/// One `mr x NR` tile of the bfloat16 path over `jb` pairs; `start` stores, else adds; the
/// panel is asked for as `prefetch` says.
#[allow(clippy::too_many_arguments)]
fn bf16_tile(
    dot: bool,
    mr: usize,
    a: &[u32],
    jb: usize,
    panel: &[u32],
    tile: &mut [f32; MR_MAX * NR],
    start: bool,
    prefetch: Prefetch,
) {
    #[cfg(target_arch = "x86_64")]
    if dot {
        macro_rules! by_rows {
            ($($m:literal)*) => {
                match mr {
                    // SAFETY: `dot` says the CPU has AVX512-BF16.
                    $($m => unsafe { bf16_tile_avx512::<$m>(a, jb, panel, tile, start, prefetch) },)*
                    _ => unreachable!("tile of {mr} rows"),
                }
            };
        }
        return by_rows!(1 2 3 4 5 6 7 8);
    }
    let _ = (dot, prefetch);
    let half = |w: u32, h: usize| bf16_to_f32((w >> (16 * h)) as u16);
    for r in 0..mr {
        let mut acc = [0f32; NR];
        for j in 0..jb {
            let av = a[j * mr + r];
            let (a0, a1) = (half(av, 0), half(av, 1));
            for (c, acc) in acc.iter_mut().enumerate() {
                let w = panel[j * NR + c];
                *acc = a1.mul_add(half(w, 1), a0.mul_add(half(w, 0), *acc));
            }
        }
        let t = &mut tile[r * NR..(r + 1) * NR];
        if start {
            t.copy_from_slice(&acc);
        } else {
            t.iter_mut().zip(&acc).for_each(|(t, a)| *t += a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn bf16_tile_avx512<const MR: usize>(
    a: &[u32],
    jb: usize,
    panel: &[u32],
    tile: &mut [f32; MR_MAX * NR],
    start: bool,
    prefetch: Prefetch,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let (ap, bp) = (a.as_ptr(), panel.as_ptr());
    let mut stream = Stream::new(prefetch);
    for j in 0..jb {
        stream.row(bp, j * NR * 4, NR * 4);
        let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(j * NR) as *const _));
        let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(j * NR + 16) as *const _));
        for (r, acc) in acc.iter_mut().enumerate() {
            let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(j * MR + r) as i32));
            acc[0] = _mm512_dpbf16_ps(acc[0], av, b0);
            acc[1] = _mm512_dpbf16_ps(acc[1], av, b1);
        }
    }
    store_tile_avx512(&acc, tile, start);
}

/// A row's 8-bit scale, `max |x| / 127` (1 for a row of zeros); NaN when the row holds a value
/// that is not finite, so its outputs are NaN as in float32.
fn row_scale(row: &[f32]) -> f32 {
    if !row.iter().all(|v| v.is_finite()) {
        return f32::NAN;
    }
    let max = row.iter().fold(0f32, |a, v| a.max(v.abs()));
    if max > 0.0 {
        max / 127.0
    } else {
        1.0
    }
}

/// Rows of `x` quantised for [`WeightDtype::Int8Dot`]: per row its scale ([`row_scale`])
/// and its values `q + 128` (unsigned, what `vpdpbusd` takes) four to a word, row-major
/// `[m][ceil(k / 4)]`; 128 (zero) past `k`. The rows split over `threads` pool threads when
/// there are enough values; AVX512 quantises 16 values at a time, bit for bit [`quantize8`].
fn quantize_rows(isa: Isa, threads: usize, x: &[f32], m: usize, k: usize) -> (Vec<f32>, Vec<u32>) {
    let kq = k.div_ceil(4);
    let mut scales = vec![0f32; m];
    let mut quads = vec![0u32; m * kq];
    let (sp, qp) = (SendPtr(scales.as_mut_ptr()), SendPtr(quads.as_mut_ptr()));
    let rows = |range: std::ops::Range<usize>| {
        for r in range {
            let row = &x[r * k..(r + 1) * k];
            // SAFETY: row r owns `scales[r]` and `quads[r · kq..(r + 1) · kq]`; no other task
            // writes them and both outlive every task.
            let (scale, out) = unsafe {
                (
                    &mut *sp.ptr().add(r),
                    std::slice::from_raw_parts_mut(qp.ptr().add(r * kq), kq),
                )
            };
            *scale = row_scale(row);
            quantize_row(isa, row, *scale, out);
        }
    };
    if threads > 1 && m > 1 && m * k >= 1 << 15 {
        let parts: Vec<_> = split(m, threads).collect();
        super::pool::pool().run(parts.len(), &|t| rows(parts[t].clone()));
    } else {
        rows(0..m);
    }
    (scales, quads)
}

/// One row of [`quantize_rows`] into its `ceil(k / 4)` words.
fn quantize_row(isa: Isa, row: &[f32], s: f32, out: &mut [u32]) {
    let k = row.len();
    if s.is_nan() {
        out.fill(0x8080_8080);
        return;
    }
    // Values already written (the whole blocks of 16, on AVX512).
    let done = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX512 was detected on this machine; `out` holds `ceil(k / 4)` words.
        Isa::Avx512 => unsafe { quantize_row_avx512(row, s, out) },
        _ => 0,
    };
    let q = |kk: usize| -> u32 {
        if kk < k {
            (i32::from(quantize8(row[kk], s)) + 128) as u32
        } else {
            128
        }
    };
    for (j, w) in out.iter_mut().enumerate().skip(done / 4) {
        *w = q(4 * j) | q(4 * j + 1) << 8 | q(4 * j + 2) << 16 | q(4 * j + 3) << 24;
    }
}

/// The whole blocks of 16 values of [`quantize_row`]; returns how many values it wrote.
/// `round` (half away from zero) is rebuilt from truncation: `t = trunc(y)`, plus `±1` where
/// `|y − t| ≥ 0.5` (`y − t` is exact), and a NaN quotient gives 0 as `as i8` does.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn quantize_row_avx512(row: &[f32], s: f32, out: &mut [u32]) -> usize {
    use std::arch::x86_64::*;
    let n = row.len() / 16 * 16;
    let sv = _mm512_set1_ps(s);
    let (half, one) = (_mm512_set1_ps(0.5), _mm512_set1_ps(1.0));
    let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    let sign = _mm512_set1_epi32(i32::MIN);
    let offset = _mm512_set1_epi32(128);
    let dst = out.as_mut_ptr() as *mut u8;
    for i in (0..n).step_by(16) {
        let y = _mm512_div_ps(_mm512_loadu_ps(row.as_ptr().add(i)), sv);
        let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
        let frac = _mm512_castsi512_ps(_mm512_andnot_si512(
            sign,
            _mm512_castps_si512(_mm512_sub_ps(y, t)),
        ));
        let away = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, half);
        let unit = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_and_si512(sign, _mm512_castps_si512(y)),
            _mm512_castps_si512(one),
        ));
        let r = _mm512_mask_add_ps(t, away, t, unit);
        let r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r), r);
        let r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
        let b = _mm512_add_epi32(_mm512_cvttps_epi32(r), offset);
        _mm_storeu_si128(dst.add(i) as *mut __m128i, _mm512_cvtepi32_epi8(b));
    }
    n
}

/// Whether the 8-bit paths run `vpdpbusd` on `isa` (else the same integer sums in plain Rust).
fn vnni(isa: Isa) -> bool {
    has_int8_dot() && isa == Isa::Avx512
}

/// Rows per register tile of the 4-bit path.
const MR_INT8: usize = 4;

/// Groups of 32 `k` per block of the 4-bit path (a block of a panel is 16 KiB).
const KC_Q4_GROUPS: usize = 32;

/// Rows per register tile of the int8 path.
const MR_I8: usize = 8;

/// Quads of `k` per block of the int8 path (a block of a panel is 16 KiB, as on the bf16 path).
const KC_QUADS: usize = 128;

/// [`int8_dot`] on AMX-INT8 tiles: the same integer sums as the VNNI path, so the same bits,
/// into `y`, every one of whose `m · n` values it writes.
#[allow(clippy::too_many_arguments)]
fn amx_quads(
    isa: Isa,
    threads: usize,
    x: &[f32],
    (m, k, n): (usize, usize, usize),
    (words, scales, sums): (&[u32], &[f32], &[i32]),
    bias: Option<&[f32]>,
    y: &mut [std::mem::MaybeUninit<f32>],
) {
    let kq = k.div_ceil(4);
    let (row_scales, quads) = quantize_rows(isa, threads, x, m, k);
    let write = |row: usize, cs: std::ops::Range<usize>, acc: &[i32; NR], out: *mut f32| {
        let bias = bias.map(|b| &b[cs.clone()]);
        // SAFETY: the tile kernel passes the output row's `cs.len()` columns.
        unsafe {
            write_int8_row(
                isa,
                acc,
                &sums[cs.clone()],
                &scales[cs],
                bias,
                row_scales[row],
                out,
            )
        }
    };
    let fill = |i: usize, dst: &mut [u32]| dst[..kq].copy_from_slice(&quads[i * kq..(i + 1) * kq]);
    let rows = (m, kq, &fill as &(dyn Fn(usize, &mut [u32]) + Sync));
    super::amx::int8_dot(threads, rows, n, (words, kq * NR), &write, y);
}

/// [`WeightDtype::Int8Dot`]: every row quantised, its integer products with a panel summed in
/// `i32` by `vpdpbusd` (`dot`) or in plain integer arithmetic (the same sums), then
/// `(sum − 128 · Σ w) · s_x · s_w (+ bias)` per output. As on the bf16 path, a group of row
/// tiles shares each block of a panel while it is in L1 (integer sums, so the blocking changes
/// no bit).
#[allow(clippy::too_many_arguments)]
fn int8_dot(
    isa: Isa,
    tiles: bool,
    threads: usize,
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
    (words, scales, sums): (&[u32], &[f32], &[i32]),
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    if tiles {
        // SAFETY: the tiles write only floats.
        let y = unsafe { super::as_uninit(y) };
        amx_quads(isa, threads, x, (m, k, n), (words, scales, sums), bias, y);
        return Ok(());
    }
    let kq = k.div_ceil(4);
    let panels = n.div_ceil(NR);
    let dot = vnni(isa);
    let (row_scales, quads) = quantize_rows(isa, threads, x, m, k);
    let tiles = fixed_tiles(m, MR_I8);
    let yp = SendPtr(y.as_mut_ptr());
    let run = |panels: std::ops::Range<usize>, tiles: &[(usize, usize)]| {
        let mut accs = [[[0i32; NR]; MR_I8]; GROUP_TILES];
        for p in panels {
            let cols = NR.min(n - p * NR);
            for group in tiles.chunks(GROUP_TILES) {
                for j0 in (0..kq).step_by(KC_QUADS) {
                    let jb = KC_QUADS.min(kq - j0);
                    let panel = &words[p * kq * NR + j0 * NR..p * kq * NR + (j0 + jb) * NR];
                    for (t, (&(i, mr), acc)) in group.iter().zip(accs.iter_mut()).enumerate() {
                        let (row, block) = (NR * 4, jb * NR * 4);
                        let prefetch = Prefetch::for_tile(t, group.len(), block, block, row);
                        let a = &quads[i * kq..(i + mr) * kq];
                        int8_tile(dot, mr, a, kq, j0..j0 + jb, panel, acc, prefetch);
                    }
                }
                let cs = p * NR..p * NR + cols;
                let bias = bias.map(|b| &b[cs.clone()]);
                for (&(i, mr), acc) in group.iter().zip(accs.iter()) {
                    for (r, acc) in acc.iter().enumerate().take(mr) {
                        // SAFETY: every task writes the outputs of its own panels and rows only:
                        // row i + r, columns p · NR..p · NR + cols, of `y` (`[m, n]`).
                        unsafe {
                            let out = yp.ptr().add((i + r) * n + p * NR);
                            let sx = row_scales[i + r];
                            write_int8_row(
                                isa,
                                acc,
                                &sums[cs.clone()],
                                &scales[cs.clone()],
                                bias,
                                sx,
                                out,
                            );
                        }
                    }
                }
            }
        }
    };
    on_threads(m * n * k, threads, panels, &tiles, &run);
    Ok(())
}

/// Writes one row of an int8 tile: `(sum − 128 · Σ w) · (s_x · s_w) (+ bias)` for the
/// `sums.len()` columns there are (16 at a time on AVX512, the same operations in the same
/// order, so the same bits).
///
/// # Safety
/// `out` points to `sums.len()` writable floats.
unsafe fn write_int8_row(
    isa: Isa,
    acc: &[i32; NR],
    sums: &[i32],
    scales: &[f32],
    bias: Option<&[f32]>,
    sx: f32,
    out: *mut f32,
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        return write_int8_row_avx512(acc, sums, scales, bias, sx, out);
    }
    let _ = isa;
    for (c, &sum) in acc.iter().enumerate().take(sums.len()) {
        let mut v = (sum - 128 * sums[c]) as f32 * (sx * scales[c]);
        if let Some(b) = bias {
            v += b[c];
        }
        *out.add(c) = v;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn write_int8_row_avx512(
    acc: &[i32; NR],
    sums: &[i32],
    scales: &[f32],
    bias: Option<&[f32]>,
    sx: f32,
    out: *mut f32,
) {
    use std::arch::x86_64::*;
    let cols = sums.len();
    let sxv = _mm512_set1_ps(sx);
    for c0 in (0..cols).step_by(16) {
        let mask = super::simd::chunk_mask(cols - c0);
        let sum = _mm512_loadu_si512(acc.as_ptr().add(c0) as *const _);
        let w = _mm512_maskz_loadu_epi32(mask, sums.as_ptr().add(c0));
        let d = _mm512_sub_epi32(sum, _mm512_slli_epi32::<7>(w));
        let scale = _mm512_mul_ps(sxv, _mm512_maskz_loadu_ps(mask, scales.as_ptr().add(c0)));
        let mut v = _mm512_mul_ps(_mm512_cvtepi32_ps(d), scale);
        if let Some(b) = bias {
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, b.as_ptr().add(c0)));
        }
        _mm512_mask_storeu_ps(out.add(c0), mask, v);
    }
}

/// One `mr x NR` tile of the int8 path over the quads `js` of `a` (`mr` rows of `kq` quads,
/// row-major) and `panel` (those quads' rows of the panel): the sums are stored when the range
/// starts at 0, else added; the panel is asked for as `prefetch` says.
#[allow(clippy::too_many_arguments)]
fn int8_tile(
    dot: bool,
    mr: usize,
    a: &[u32],
    kq: usize,
    js: std::ops::Range<usize>,
    panel: &[u32],
    acc: &mut [[i32; NR]; MR_I8],
    prefetch: Prefetch,
) {
    #[cfg(target_arch = "x86_64")]
    if dot {
        macro_rules! by_rows {
            ($($m:literal)*) => {
                match mr {
                    // SAFETY: `dot` says the CPU has AVX512-VNNI.
                    $($m => unsafe { int8_tile_avx512::<$m>(a, kq, js, panel, acc, prefetch) },)*
                    _ => unreachable!("tile of {mr} rows"),
                }
            };
        }
        return by_rows!(1 2 3 4 5 6 7 8);
    }
    let _ = (dot, prefetch);
    for (r, acc) in acc.iter_mut().enumerate().take(mr) {
        if js.start == 0 {
            acc.fill(0);
        }
        for (jj, j) in js.clone().enumerate() {
            let av = a[r * kq + j];
            for (c, acc) in acc.iter_mut().enumerate() {
                let w = panel[jj * NR + c];
                for b in 0..4 {
                    let xa = ((av >> (8 * b)) & 0xFF) as i32;
                    let wb = i32::from((w >> (8 * b)) as u8 as i8);
                    *acc += xa * wb;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn int8_tile_avx512<const MR: usize>(
    a: &[u32],
    kq: usize,
    js: std::ops::Range<usize>,
    panel: &[u32],
    acc_out: &mut [[i32; NR]; MR_I8],
    prefetch: Prefetch,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_si512(); 2]; MR];
    if js.start > 0 {
        for (r, acc) in acc.iter_mut().enumerate() {
            acc[0] = _mm512_loadu_si512(acc_out[r].as_ptr() as *const _);
            acc[1] = _mm512_loadu_si512(acc_out[r].as_ptr().add(16) as *const _);
        }
    }
    let (ap, bp) = (a.as_ptr(), panel.as_ptr());
    let mut stream = Stream::new(prefetch);
    for (jj, j) in js.enumerate() {
        stream.row(bp, jj * NR * 4, NR * 4);
        let b0 = _mm512_loadu_si512(bp.add(jj * NR) as *const _);
        let b1 = _mm512_loadu_si512(bp.add(jj * NR + 16) as *const _);
        for (r, acc) in acc.iter_mut().enumerate() {
            let av = _mm512_set1_epi32(*ap.add(r * kq + j) as i32);
            acc[0] = _mm512_dpbusd_epi32(acc[0], av, b0);
            acc[1] = _mm512_dpbusd_epi32(acc[1], av, b1);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        _mm512_storeu_si512(acc_out[r].as_mut_ptr() as *mut _, acc[0]);
        _mm512_storeu_si512(acc_out[r].as_mut_ptr().add(16) as *mut _, acc[1]);
    }
}

/// Rows of `x` quantised for [`WeightDtype::Q4Dot`], as [`quantize_rows`] but in words of
/// the even and of the odd inputs of each octet (`[m][groups · 4][2]`, matching the low and
/// high nibbles of [`Store::Q4Octets`]), and each row's sum of its quantised values per group
/// (`[m][groups]`).
fn quantize_rows_q4(
    isa: Isa,
    threads: usize,
    x: &[f32],
    m: usize,
    k: usize,
) -> (Vec<f32>, Vec<u32>, Vec<i32>) {
    let groups = k.div_ceil(Q4_GROUP);
    let nj = groups * Q4_GROUP / 8;
    let mut scales = vec![0f32; m];
    let mut words = vec![0u32; m * nj * 2];
    let mut sums = vec![0i32; m * groups];
    let (sp, wp, gp) = (
        SendPtr(scales.as_mut_ptr()),
        SendPtr(words.as_mut_ptr()),
        SendPtr(sums.as_mut_ptr()),
    );
    let rows = |range: std::ops::Range<usize>| {
        // The row's values `q + 128` in order, four to a word ([`quantize_row`]), padded with
        // 128 (zero) to whole groups.
        let mut bytes = vec![0u32; nj * 2];
        for r in range {
            let row = &x[r * k..(r + 1) * k];
            // SAFETY: row r owns `scales[r]`, its `2 · nj` words and its `groups` sums; no
            // other task writes them and all outlive every task.
            let (scale, out, sum) = unsafe {
                (
                    &mut *sp.ptr().add(r),
                    std::slice::from_raw_parts_mut(wp.ptr().add(r * nj * 2), nj * 2),
                    std::slice::from_raw_parts_mut(gp.ptr().add(r * groups), groups),
                )
            };
            *scale = row_scale(row);
            let kq = k.div_ceil(4);
            quantize_row(isa, row, *scale, &mut bytes[..kq]);
            bytes[kq..].fill(0x8080_8080);
            let b = |kk: usize| (bytes[kk / 4] >> (8 * (kk % 4))) & 0xFF;
            for j in 0..nj {
                for half in 0..2 {
                    let mut word = 0u32;
                    for i in 0..4 {
                        let v = b(8 * j + 2 * i + half);
                        sum[8 * j / Q4_GROUP] += v as i32 - 128;
                        word |= v << (8 * i);
                    }
                    out[2 * j + half] = word;
                }
            }
        }
    };
    if threads > 1 && m > 1 && m * k >= 1 << 15 {
        let parts: Vec<_> = split(m, threads).collect();
        super::pool::pool().run(parts.len(), &|t| rows(parts[t].clone()));
    } else {
        rows(0..m);
    }
    (scales, words, sums)
}

/// [`WeightDtype::Q4Dot`]: per row, per group, the integer products of the quantised row and
/// the group's nibbles (offsets removed), times the group's scale, summed into float32 in group
/// order; then times the row's scale (+ bias).
#[allow(clippy::too_many_arguments)]
fn q4_dot(
    isa: Isa,
    threads: usize,
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
    (words, scales, corr): (&[u32], &[f32], &[i32]),
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let groups = k.div_ceil(Q4_GROUP);
    let nj = groups * Q4_GROUP / 8;
    let panels = n.div_ceil(NR);
    let dot = vnni(isa);
    let (row_scales, quads, sums) = quantize_rows_q4(isa, threads, x, m, k);
    let tiles = fixed_tiles(m, MR_INT8);
    let yp = SendPtr(y.as_mut_ptr());
    let run = |panels: std::ops::Range<usize>, tiles: &[(usize, usize)]| {
        let mut accs = [[[0f32; NR]; MR_INT8]; GROUP_TILES];
        for p in panels {
            let cols = NR.min(n - p * NR);
            let panel = Q4Panel {
                words: &words[p * nj * NR..(p + 1) * nj * NR],
                scales: &scales[p * groups * NR..(p + 1) * groups * NR],
                corr: &corr[p * groups * NR..(p + 1) * groups * NR],
                groups,
            };
            for group in tiles.chunks(GROUP_TILES) {
                // As on the int8 path: a block of the panel's groups at a time for every tile
                // of the group, in group order (each output's sum in the same order).
                for g0 in (0..groups).step_by(KC_Q4_GROUPS) {
                    let gs = g0..groups.min(g0 + KC_Q4_GROUPS);
                    for (t, (&(i, mr), acc)) in group.iter().zip(accs.iter_mut()).enumerate() {
                        // Offsets from the panel's first row (the kernel reads the whole panel).
                        let row = NR * 4;
                        let rows = |g: usize| g * Q4_GROUP / 8;
                        let block = rows(gs.len()) * row;
                        let next = rows(gs.end) * row;
                        let prefetch = Prefetch::for_tile(t, group.len(), next, block, row);
                        let a = &quads[i * nj * 2..(i + mr) * nj * 2];
                        let s = &sums[i * groups..(i + mr) * groups];
                        q4_tile_dot(dot, mr, a, s, &panel, gs.clone(), acc, prefetch);
                    }
                }
                for (&(i, mr), acc) in group.iter().zip(accs.iter()) {
                    for (r, acc) in acc.iter().enumerate().take(mr) {
                        let sx = row_scales[i + r];
                        // SAFETY: every task writes the outputs of its own panels and rows only.
                        let out = unsafe { yp.ptr().add((i + r) * n + p * NR) };
                        for (c, &sum) in acc.iter().enumerate().take(cols) {
                            let mut v = sum * sx;
                            if let Some(b) = bias {
                                v += b[p * NR + c];
                            }
                            // SAFETY: as above.
                            unsafe { *out.add(c) = v };
                        }
                    }
                }
            }
        }
    };
    on_threads(m * n * k, threads, panels, &tiles, &run);
    Ok(())
}

/// One panel of a [`Store::Q4Octets`] weight.
struct Q4Panel<'a> {
    words: &'a [u32],
    scales: &'a [f32],
    corr: &'a [i32],
    groups: usize,
}

/// One `mr x NR` tile of the q4 path: `a` holds `mr` rows of `groups · 4` (even, odd) word
/// pairs, `sums` their per-group sums.
#[allow(clippy::too_many_arguments)]
fn q4_tile_dot(
    dot: bool,
    mr: usize,
    a: &[u32],
    sums: &[i32],
    panel: &Q4Panel<'_>,
    gs: std::ops::Range<usize>,
    acc: &mut [[f32; NR]; MR_INT8],
    prefetch: Prefetch,
) {
    #[cfg(target_arch = "x86_64")]
    if dot {
        macro_rules! by_rows {
            ($($m:literal)*) => {
                match mr {
                    // SAFETY: `dot` says the CPU has AVX512-VNNI.
                    $($m => unsafe { q4_dot_tile_avx512::<$m>(a, sums, panel, gs, acc, prefetch) },)*
                    _ => unreachable!("tile of {mr} rows"),
                }
            };
        }
        return by_rows!(1 2 3 4);
    }
    let _ = (dot, prefetch);
    let nj = panel.groups * Q4_GROUP / 8;
    for (r, acc) in acc.iter_mut().enumerate().take(mr) {
        if gs.start == 0 {
            acc.fill(0.0);
        }
        for g in gs.clone() {
            for (c, acc) in acc.iter_mut().enumerate() {
                let mut t = 0i32;
                for j in g * Q4_GROUP / 8..(g + 1) * Q4_GROUP / 8 {
                    let w = panel.words[j * NR + c];
                    for half in 0..2 {
                        let av = a[(r * nj + j) * 2 + half];
                        for i in 0..4 {
                            let xa = ((av >> (8 * i)) & 0xFF) as i32;
                            let wq = ((w >> (8 * i + 4 * half)) & 0xF) as i32;
                            t += xa * wq;
                        }
                    }
                }
                let t = t - 8 * sums[r * panel.groups + g] - panel.corr[g * NR + c];
                *acc = (t as f32).mul_add(panel.scales[g * NR + c], *acc);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn q4_dot_tile_avx512<const MR: usize>(
    a: &[u32],
    sums: &[i32],
    panel: &Q4Panel<'_>,
    gs: std::ops::Range<usize>,
    acc_out: &mut [[f32; NR]; MR_INT8],
    prefetch: Prefetch,
) {
    use std::arch::x86_64::*;
    let nj = panel.groups * Q4_GROUP / 8;
    let mut facc = [[_mm512_setzero_ps(); 2]; MR];
    if gs.start > 0 {
        for (r, facc) in facc.iter_mut().enumerate() {
            facc[0] = _mm512_loadu_ps(acc_out[r].as_ptr());
            facc[1] = _mm512_loadu_ps(acc_out[r].as_ptr().add(16));
        }
    }
    let low = _mm512_set1_epi32(0x0F0F_0F0F);
    let (ap, wp) = (a.as_ptr(), panel.words.as_ptr());
    let mut stream = Stream::new(prefetch);
    for g in gs {
        let mut iacc = [[_mm512_setzero_si512(); 2]; MR];
        for j in g * Q4_GROUP / 8..(g + 1) * Q4_GROUP / 8 {
            stream.row(wp, j * NR * 4, NR * 4);
            let w0 = _mm512_loadu_si512(wp.add(j * NR) as *const _);
            let w1 = _mm512_loadu_si512(wp.add(j * NR + 16) as *const _);
            let lo = [_mm512_and_si512(w0, low), _mm512_and_si512(w1, low)];
            let hi = [
                _mm512_and_si512(_mm512_srli_epi32::<4>(w0), low),
                _mm512_and_si512(_mm512_srli_epi32::<4>(w1), low),
            ];
            for (r, iacc) in iacc.iter_mut().enumerate() {
                let even = _mm512_set1_epi32(*ap.add((r * nj + j) * 2) as i32);
                let odd = _mm512_set1_epi32(*ap.add((r * nj + j) * 2 + 1) as i32);
                for h in 0..2 {
                    iacc[h] = _mm512_dpbusd_epi32(iacc[h], even, lo[h]);
                    iacc[h] = _mm512_dpbusd_epi32(iacc[h], odd, hi[h]);
                }
            }
        }
        for (r, (iacc, facc)) in iacc.iter().zip(facc.iter_mut()).enumerate() {
            let rs = _mm512_set1_epi32(8 * sums[r * panel.groups + g]);
            for h in 0..2 {
                let corr = _mm512_loadu_si512(panel.corr.as_ptr().add(g * NR + 16 * h) as *const _);
                let t = _mm512_sub_epi32(_mm512_sub_epi32(iacc[h], rs), corr);
                let sc = _mm512_loadu_ps(panel.scales.as_ptr().add(g * NR + 16 * h));
                facc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sc, facc[h]);
            }
        }
    }
    for (r, facc) in facc.iter().enumerate() {
        _mm512_storeu_ps(acc_out[r].as_mut_ptr(), facc[0]);
        _mm512_storeu_ps(acc_out[r].as_mut_ptr().add(16), facc[1]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pairs of bfloat16 rows pack to the words their float32 values pack to, on every
    /// instruction set, whole chunks and tails.
    #[test]
    fn bf16_column_pairs_are_the_pairs_of_their_values() {
        for n in [5, 16, 40] {
            let lo: Vec<u16> = (0..n).map(|i| f32_to_bf16(i as f32 * 0.37 - 3.0)).collect();
            let hi: Vec<u16> = (0..n).map(|i| f32_to_bf16(1.5 - i as f32 * 0.11)).collect();
            let wide = |x: &[u16]| x.iter().map(|&b| bf16_to_f32(b)).collect::<Vec<f32>>();
            for isa in Isa::available() {
                for h in [None, Some(&hi[..])] {
                    let (mut got, mut want) = (vec![0u32; n], vec![0u32; n]);
                    pack_bf16_column_pairs(isa, &lo, h, &mut got);
                    let hw = h.map(wide);
                    pack_column_pairs(isa, &wide(&lo), hw.as_deref(), &mut want);
                    assert_eq!(got, want, "{isa:?} n{n}");
                }
            }
        }
    }

    /// The bfloat16 packing and the tile write-out give the same bits on every instruction set
    /// the CPU has: odd and short rows, NaN, infinities, subnormals, signed zeros, values
    /// halfway between two bfloat16s; with and without bias, whole and partial panels.
    #[test]
    fn bf16_packing_and_tile_writes_match_the_scalar_path() {
        let special = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-40,
            -1e-42,
            0.0,
            -0.0,
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
            f32::MAX,
            -f32::MIN_POSITIVE,
        ];
        for k in [1, 15, 16, 17, 33, 64, 101] {
            for m in [1, 5, 8, 19] {
                let mut x = data(m * k, (m * 31 + k) as u32);
                for (i, v) in x.iter_mut().enumerate().filter(|(i, _)| i % 7 == 3) {
                    *v = special[i % special.len()];
                }
                let tiles = fixed_tiles(m, MR_MAX);
                let scalar = pack_pairs(Isa::Portable, 1, &x, k, &tiles);
                for isa in Isa::available() {
                    for threads in [1, 2] {
                        let got = pack_pairs(isa, threads, &x, k, &tiles);
                        assert_eq!(got, scalar, "{isa:?}, k {k}, m {m}, {threads} threads");
                    }
                }
            }
        }
        let tile: [f32; MR_MAX * NR] = std::array::from_fn(|i| i as f32 * 0.5 - 7.0);
        let bias: Vec<f32> = (0..NR).map(|c| c as f32 * 0.25).collect();
        let scales: Vec<f32> = (0..NR).map(|c| 1.0 + c as f32 / 64.0).collect();
        for cols in [1, 15, 16, 17, 31, 32] {
            for (sc, b) in [
                (None, None),
                (None, Some(&bias[..cols])),
                (Some(&scales[..cols]), Some(&bias[..cols])),
            ] {
                let ld = 40;
                let mut want = vec![-1f32; MR_MAX * ld];
                let mut got = want.clone();
                // SAFETY: both buffers hold MR_MAX rows of `ld` floats.
                unsafe {
                    write_tile(Isa::Portable, &tile, 6, cols, sc, b, want.as_mut_ptr(), ld);
                    write_tile(Isa::get(), &tile, 6, cols, sc, b, got.as_mut_ptr(), ld);
                }
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "cols {cols}"
                );
            }
        }
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// The reference: per output, one FMA chain per block of `KC` in ascending `k`, the
    /// blocks' sums added in order, then the bias.
    fn reference(
        x: &[f32],
        m: usize,
        w: &[f32],
        n: usize,
        k: usize,
        b: Option<&[f32]>,
    ) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut total = 0f32;
                for k0 in (0..k).step_by(KC) {
                    let mut acc = 0f32;
                    for kk in k0..(k0 + KC).min(k) {
                        acc = x[i * k + kk].mul_add(w[j * k + kk], acc);
                    }
                    total = if k0 == 0 { acc } else { total + acc };
                }
                y[i * n + j] = total + b.map_or(0.0, |b| b[j]);
            }
        }
        y
    }

    #[test]
    fn a_group_of_tiles_asks_for_the_whole_next_block_once() {
        // Every path's block: float32 (32 KiB), bf16 and bf16 pairs, int8 and q4 rows.
        for (rows, row) in [
            (KC, NR * 4),
            (KC, NR * 2),
            (KC_PAIRS, NR * 4),
            (KC_QUADS, NR * 4),
        ] {
            let block = rows * row;
            let next = 3 * block;
            assert!(matches!(
                Prefetch::for_tile(0, 1, next, block, row),
                Prefetch::Ahead(PREFETCH_BYTES)
            ));
            for tiles in 2..=GROUP_TILES {
                // The shares follow one another and cover the next block (past its end by
                // less than the rounding up), each asked for over the tile's rows.
                let mut at = next;
                for t in 0..tiles {
                    let Prefetch::Share { from, step } =
                        Prefetch::for_tile(t, tiles, next, block, row)
                    else {
                        panic!("{tiles} tiles share the next block");
                    };
                    assert_eq!(from, at, "tile {t} of {tiles}");
                    assert!(step > 0);
                    at += step * rows;
                }
                assert!(
                    at >= next + block && at - (next + block) < tiles * rows,
                    "{tiles} tiles"
                );
            }
        }
    }

    #[test]
    fn every_instruction_set_and_thread_count_gives_the_reference_bits() {
        for &(m, n, k) in &[
            (2, 3, 0),
            (1, 1, 1),
            (1, 33, 7),
            (3, 64, 40),
            (9, 70, 129),
            (17, 31, 64),
            // Three of the kernel's k-blocks, and more row tiles than one group holds.
            (70, 40, 600),
        ] {
            let x = data(m * k, 1);
            let w = data(n * k, 2);
            let b = data(n, 3);
            for bias in [None, Some(&b[..])] {
                let want = reference(&x, m, &w, n, k, bias);
                let packed = PackedWeight::pack(&w, n, k, WeightDtype::F32).unwrap();
                for isa in Isa::available() {
                    for threads in [1, 2, 3] {
                        let mut y = vec![f32::NAN; m * n];
                        linear_with(isa, threads, &x, m, &packed, bias, &mut y).unwrap();
                        assert_eq!(y, want, "{isa:?} x{threads} m{m} n{n} k{k}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_right_operand_packed_as_given_is_its_transpose_packed_as_a_weight() {
        // In float32, and as bfloat16 pairs (odd k: the last pair's high half is 0): the same
        // words as the transpose packed as a weight, so the same bits; 301 x 260 is packed on
        // the pool's threads, a panel range each.
        for (k, n) in [(11, 45), (40, 64), (37, 17), (301, 260)] {
            let b = data(k * n, 6);
            let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let x = data(3 * k, 7);
            let (mut y1, mut y2) = (vec![0f32; 3 * n], vec![0f32; 3 * n]);
            let as_given = PackedWeight::pack_kn(&b, k, n).unwrap();
            linear(&x, 3, &as_given, None, &mut y1).unwrap();
            let w = PackedWeight::pack(&bt, n, k, WeightDtype::F32).unwrap();
            linear(&x, 3, &w, None, &mut y2).unwrap();
            assert_eq!(y1, y2, "{k}x{n} f32");
            let pairs = PackedWeight::pack_kn_pairs(&b, k, n).unwrap();
            assert_eq!(pairs.dtype(), WeightDtype::Bf16Dot);
            linear(&x, 3, &pairs, None, &mut y1).unwrap();
            let w = PackedWeight::pack(&bt, n, k, WeightDtype::Bf16Dot).unwrap();
            linear(&x, 3, &w, None, &mut y2).unwrap();
            assert_eq!(y1, y2, "{k}x{n}");
        }
        let (k, n) = (11, 45);
        assert!(PackedWeight::pack_kn_pairs(&data(k * n, 4), k + 1, n).is_err());
    }

    #[test]
    fn a_rows_result_does_not_depend_on_the_rows_beside_it() {
        let (n, k) = (96, 200);
        let w = PackedWeight::pack(&data(n * k, 5), n, k, WeightDtype::F32).unwrap();
        let x = data(13 * k, 6);
        let mut all = vec![0f32; 13 * n];
        linear(&x, 13, &w, None, &mut all).unwrap();
        for i in 0..13 {
            let mut one = vec![0f32; n];
            linear(&x[i * k..(i + 1) * k], 1, &w, None, &mut one).unwrap();
            assert_eq!(one, all[i * n..(i + 1) * n]);
        }
    }

    #[test]
    fn bf16_weights_compute_with_the_rounded_weights_in_f32() {
        let (m, n, k) = (5, 40, 33);
        let x = data(m * k, 7);
        let w = data(n * k, 8);
        let packed = PackedWeight::pack(&w, n, k, WeightDtype::Bf16).unwrap();
        let rounded: Vec<f32> = w.iter().map(|&v| bf16_to_f32(f32_to_bf16(v))).collect();
        assert_eq!(packed.unpack(), rounded);
        let want = reference(&x, m, &rounded, n, k, None);
        for isa in Isa::available() {
            let mut y = vec![0f32; m * n];
            linear_with(isa, 2, &x, m, &packed, None, &mut y).unwrap();
            assert_eq!(y, want, "{isa:?}");
        }
        assert_eq!(packed.bytes(), 2 * NR * 2 * k);
    }

    #[test]
    fn bf16_rounding_is_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3F80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even 1.0.
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3F80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3F82);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(bf16_to_f32(f32_to_bf16(-2.5)), -2.5);
    }

    #[test]
    fn rows_and_unpack_give_back_the_weight() {
        let (n, k) = (37, 9);
        let w = data(n * k, 9);
        let p = PackedWeight::pack(&w, n, k, WeightDtype::F32).unwrap();
        assert_eq!(p.unpack(), w);
        let mut row = vec![0f32; k];
        p.row_into(36, &mut row).unwrap();
        assert_eq!(row, w[36 * k..]);
        assert!(p.row_into(37, &mut row).is_err());
    }

    #[test]
    fn shapes_that_do_not_match_are_refused() {
        let p = PackedWeight::pack(&[0.0; 6], 2, 3, WeightDtype::F32).unwrap();
        let mut y = [0f32; 2];
        assert!(linear(&[0.0; 4], 1, &p, None, &mut y).is_err());
        assert!(linear(&[0.0; 3], 1, &p, Some(&[0.0]), &mut y).is_err());
        assert!(PackedWeight::pack(&[0.0; 5], 2, 3, WeightDtype::F32).is_err());
    }

    /// `x · Wᵀ + bias` through `packed` on every instruction set and thread count equals the
    /// float64 product of `x` (each value through `round`, the activations' rounding of the
    /// storage) with the stored weight, within float32 summation error; and the last row alone
    /// gives what it gave among the others.
    #[allow(clippy::too_many_arguments)]
    fn assert_products(
        packed: &PackedWeight,
        x: &[f32],
        round: impl Fn(f32) -> f32,
        bias: &[f32],
        (m, n, k): (usize, usize, usize),
    ) {
        let stored = packed.unpack();
        let mut want = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k)
                    .map(|kk| f64::from(round(x[i * k + kk])) * f64::from(stored[j * k + kk]))
                    .sum();
                want[i * n + j] = dot + f64::from(bias[j]);
            }
        }
        let close_to = |y: &[f32], what: &str, bias_in: bool| {
            for (i, (g, w)) in y.iter().zip(&want).enumerate() {
                let w = if bias_in {
                    *w
                } else {
                    w - f64::from(bias[i % n])
                };
                assert!(
                    (f64::from(*g) - w).abs() <= 1e-5 * (1.0 + w.abs()) * (k as f64).sqrt(),
                    "{what} m={m} n={n} k={k}: {g} vs {w}"
                );
            }
        };
        let close = |y: &[f32], what: &str| close_to(y, what, true);
        for isa in Isa::available() {
            for threads in [1, 2] {
                let mut y = vec![0f32; m * n];
                linear_with(isa, threads, x, m, packed, Some(bias), &mut y).unwrap();
                close(&y, &format!("{isa:?} x{threads}"));
            }
        }
        // bfloat16 pairs: every unit this CPU has (AMX tiles, AVX512-BF16, float32 FMAs; the
        // call above takes the best), each row's bits on each unit whatever rows share its call.
        if let Store::Bf16Pairs(words) = &packed.store {
            let isa = Isa::get();
            if !PairUnit::available(isa).contains(&PairUnit::Amx) {
                eprintln!("this CPU or kernel gives no AMX tiles: the AMX unit is not compared");
            }
            let panels = (&words[..], k.div_ceil(2) * NR);
            for unit in PairUnit::available(isa) {
                // Outputs start as NaN: a path that leaves one unwritten fails.
                let with = |threads: usize, x: &[f32], m: usize, bias: Option<&[f32]>| {
                    let mut y = vec![f32::NAN; m * n];
                    bf16_dot(isa, unit, threads, x, m, k, n, panels, bias, &mut y);
                    y
                };
                let product = |threads: usize, x: &[f32], m: usize| with(threads, x, m, Some(bias));
                for threads in [1, 2] {
                    close(&product(threads, x, m), &format!("{unit:?} x{threads}"));
                    let y = with(threads, x, m, None);
                    close_to(&y, &format!("{unit:?} x{threads} without a bias"), false);
                }
                let all = product(2, x, m);
                for i in 0..m {
                    let alone = product(1, &x[i * k..(i + 1) * k], 1);
                    assert_eq!(alone, &all[i * n..(i + 1) * n], "{unit:?} row {i}, k={k}");
                }
            }
        }
        // Every row's bits whatever rows share its call.
        let mut all = vec![0f32; m * n];
        linear(x, m, packed, Some(bias), &mut all).unwrap();
        for i in 0..m {
            let mut alone = vec![0f32; n];
            linear(&x[i * k..(i + 1) * k], 1, packed, Some(bias), &mut alone).unwrap();
            assert_eq!(
                alone,
                &all[i * n..(i + 1) * n],
                "row {i}, m={m} n={n} k={k}"
            );
        }
    }

    /// The int8 dot-product path against its definition computed here independently: weights
    /// and each row of activations quantised symmetrically to -127..=127, the integer products
    /// summed in 64 bits, times the two scales, plus the bias; bit for bit on every instruction
    /// set (VNNI where the CPU has it) and thread count, a row's result whatever rows share its
    /// call, `k` not a multiple of 4, ragged panels, rows of zeros and of non-finite values.
    #[test]
    fn int8_dot_products_match_their_definition_on_every_path() {
        if !has_int8_dot() {
            eprintln!("this CPU has no AVX512-VNNI: only the integer path is compared");
        } else if !crate::cpu::amx::int8_enabled() {
            eprintln!("this CPU or kernel gives no AMX-INT8 tiles: the tile path is not compared");
        }
        for &(m, n, k) in &[
            (1, 70, 257),
            (3, 33, 100),
            (4, 64, 64),
            (9, 40, 5),
            (6, 96, 1030),
            // More row tiles than a group and blocks of k: the blocked sums.
            (70, 40, 600),
            (17, 33, 1030),
            // AMX-INT8's 16-row tiles, whole and with quads past the last 16-quad step.
            (16, 64, 256),
            (40, 64, 520),
        ] {
            let mut x = data(m * k, (m * 7 + k) as u32);
            let w = data(n * k, (n + 3 * k) as u32);
            let bias = data(n, 5);
            if m >= 3 {
                x[k..2 * k].fill(0.0);
                x[2 * k + 1] = f32::INFINITY;
            }
            let packed = PackedWeight::pack(&w, n, k, WeightDtype::Int8Dot).unwrap();
            assert_eq!(packed.dtype(), WeightDtype::Int8Dot);
            let scale = |v: &[f32]| {
                let max = v.iter().fold(0f32, |a, v| a.max(v.abs()));
                if max > 0.0 {
                    max / 127.0
                } else {
                    1.0
                }
            };
            let q = |v: f32, s: f32| (v / s).round().clamp(-127.0, 127.0) as i64;
            let mut want = vec![0f32; m * n];
            for i in 0..m {
                let row = &x[i * k..(i + 1) * k];
                let sx = if row.iter().all(|v| v.is_finite()) {
                    scale(row)
                } else {
                    f32::NAN
                };
                for j in 0..n {
                    let wr = &w[j * k..(j + 1) * k];
                    let sw = scale(wr);
                    let dot: i64 = (0..k).map(|kk| q(row[kk], sx) * q(wr[kk], sw)).sum();
                    want[i * n + j] = dot as f32 * (sx * sw) + bias[j];
                }
            }
            for isa in Isa::available() {
                for threads in [1, 2] {
                    let mut y = vec![0f32; m * n];
                    linear_with(isa, threads, &x, m, &packed, Some(&bias), &mut y).unwrap();
                    for (g, w) in y.iter().zip(&want) {
                        assert!(
                            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                            "{isa:?} x{threads} m={m} n={n} k={k}: {g} vs {w}"
                        );
                    }
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            // Both 8-bit units where this CPU has them (VNNI, and AMX-INT8 tiles, which
            // `linear` takes when present): the definition's bits.
            let Store::I8Quads {
                words,
                scales,
                sums,
            } = &packed.store
            else {
                unreachable!("int8-dot packs quads")
            };
            let isa = Isa::get();
            for tiles in [false, true] {
                if !vnni(isa) || (tiles && !crate::cpu::amx::int8_enabled()) {
                    continue;
                }
                let mut y = vec![0f32; m * n];
                let store = (&words[..], &scales[..], &sums[..]);
                int8_dot(isa, tiles, 2, &x, m, k, n, store, Some(&bias), &mut y).unwrap();
                assert_eq!(bits(&y), bits(&want), "tiles {tiles} m={m} n={n} k={k}");
            }
            let mut alone = vec![0f32; n];
            linear(&x[(m - 1) * k..], 1, &packed, Some(&bias), &mut alone).unwrap();
            let mut all = vec![0f32; m * n];
            linear(&x, m, &packed, Some(&bias), &mut all).unwrap();
            assert_eq!(bits(&alone), bits(&all[(m - 1) * n..]), "m={m} n={n} k={k}");
            // The stored weight: each value its channel's quantised one.
            let stored = packed.unpack();
            for j in 0..n {
                let sw = scale(&w[j * k..(j + 1) * k]);
                for kk in 0..k {
                    assert_eq!(stored[j * k + kk], q(w[j * k + kk], sw) as f32 * sw);
                }
            }
        }
        let too_long = vec![0f32; INT8_DOT_MAX_K + 1];
        assert!(
            PackedWeight::pack(&too_long, 1, INT8_DOT_MAX_K + 1, WeightDtype::Int8Dot).is_err()
        );
    }

    /// The q4 dot-product path against its definition computed here independently: weights
    /// quantised to -7..=7 per column and group of 32 inputs, each row of activations to
    /// -127..=127, each group's integer products summed, times the group's scale added into a
    /// float32 sum in group order (one fused multiply-add each), times the row's scale, plus the
    /// bias; bit for bit on every path, with `k` not a multiple of 8 or of the group, ragged
    /// panels and rows of zeros and of non-finite values.
    /// The 16-wide quantiser gives the scalar one's bytes: ties rounded away from zero,
    /// values past ±127 clamped, infinities, signed zeros, and a NaN quotient (0 / 0) as 0.
    #[test]
    fn int8_row_quantisation_is_the_scalar_one_on_every_path() {
        let mut row: Vec<f32> = (0..83).map(|i| (i as f32 - 41.0) * 0.5).collect();
        row.extend([
            126.5, -126.5, 127.5, -127.5, 1e30, -1e30, 0.0, -0.0, 1e-40, -1e-40,
        ]);
        row.extend([
            f32::INFINITY,
            f32::NEG_INFINITY,
            2.499_999_8,
            -2.500_000_2,
            0.499_999_97,
        ]);
        for s in [1.0f32, 0.37, 3.0, 0.0] {
            let mut want = vec![0u32; row.len().div_ceil(4)];
            quantize_row(Isa::Portable, &row, s, &mut want);
            for isa in Isa::available() {
                let mut got = vec![0u32; want.len()];
                quantize_row(isa, &row, s, &mut got);
                assert_eq!(got, want, "{isa:?} scale {s}");
            }
        }
    }

    #[test]
    fn q4_dot_products_match_their_definition_on_every_path() {
        for &(m, n, k) in &[
            (1, 70, 257),
            (3, 33, 100),
            (4, 64, 64),
            (9, 40, 5),
            (6, 96, 1030),
            // Enough values that the rows are quantised on every pool thread; more row tiles
            // than a group and more groups of k than a block.
            (70, 40, 600),
            (37, 33, 1100),
        ] {
            let mut x = data(m * k, (m * 11 + k) as u32);
            let w = data(n * k, (n + 5 * k) as u32);
            let bias = data(n, 9);
            if m >= 3 {
                x[k..2 * k].fill(0.0);
                x[2 * k + 1] = f32::NAN;
            }
            let packed = PackedWeight::pack(&w, n, k, WeightDtype::Q4Dot).unwrap();
            assert_eq!(packed.dtype(), WeightDtype::Q4Dot);
            let absmax = |v: &[f32]| v.iter().fold(0f32, |a, v| a.max(v.abs()));
            let groups = k.div_ceil(Q4_GROUP);
            let mut want = vec![0f32; m * n];
            for i in 0..m {
                let row = &x[i * k..(i + 1) * k];
                let mx = absmax(row);
                let sx = if !row.iter().all(|v| v.is_finite()) {
                    f32::NAN
                } else if mx > 0.0 {
                    mx / 127.0
                } else {
                    1.0
                };
                let qx = |kk: usize| (row[kk] / sx).round().clamp(-127.0, 127.0) as i64;
                for j in 0..n {
                    let mut acc = 0f32;
                    for g in 0..groups {
                        let ks = g * Q4_GROUP..((g + 1) * Q4_GROUP).min(k);
                        let wg = &w[j * k + ks.start..j * k + ks.end];
                        let mw = absmax(wg);
                        let sw = if mw > 0.0 { mw / 7.0 } else { 1.0 };
                        let t: i64 = ks
                            .clone()
                            .map(|kk| {
                                let qw = (w[j * k + kk] / sw).round().clamp(-7.0, 7.0) as i64;
                                if sx.is_nan() {
                                    0
                                } else {
                                    qx(kk) * qw
                                }
                            })
                            .sum();
                        acc = (t as f32).mul_add(sw, acc);
                    }
                    let mut v = acc * sx;
                    v += bias[j];
                    want[i * n + j] = v;
                }
            }
            for isa in Isa::available() {
                for threads in [1, 2] {
                    let mut y = vec![0f32; m * n];
                    linear_with(isa, threads, &x, m, &packed, Some(&bias), &mut y).unwrap();
                    for (g, w) in y.iter().zip(&want) {
                        assert!(
                            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                            "{isa:?} x{threads} m={m} n={n} k={k}: {g} vs {w}"
                        );
                    }
                }
            }
            // The stored weight: each value its group's quantised one.
            let stored = packed.unpack();
            for j in 0..n {
                for kk in 0..k {
                    let g = kk / Q4_GROUP;
                    let wg = &w[j * k + g * Q4_GROUP..j * k + ((g + 1) * Q4_GROUP).min(k)];
                    let mw = absmax(wg);
                    let sw = if mw > 0.0 { mw / 7.0 } else { 1.0 };
                    let q = (w[j * k + kk] / sw).round().clamp(-7.0, 7.0);
                    assert_eq!(stored[j * k + kk], q * sw, "{j} {kk}");
                }
            }
        }
    }

    /// The bfloat16 dot-product path: activations and weights rounded to bfloat16, products
    /// summed in float32, against a float64 sum of the same rounded values; every unit the CPU
    /// has (AMX tiles, AVX512-BF16, the float32-FMA path); a row's result whatever rows share
    /// its call, on each unit; odd `k`, ragged panels; the stored weight read back.
    #[test]
    fn bf16_dot_products_match_their_definition_on_every_path() {
        let r = |v: f32| bf16_to_f32(f32_to_bf16(v));
        // 13 and 16 rows: a group of two tiles. Around AMX's 16-row tiles, with and without
        // pairs past the last whole 16-pair step, one and several units of 32 rows; whole
        // tiles and panels whose sums go straight to the outputs (48, 50 and 64 rows: a unit
        // of one tile after one of two, a partial tile, one and two blocks of `k`).
        for &(m, n, k) in &[
            (1, 40, 7),
            (5, 33, 300),
            (19, 70, 513),
            (8, 32, 1),
            (13, 70, 513),
            (16, 33, 300),
            (1, 64, 64),
            (3, 33, 31),
            (15, 70, 300),
            (16, 32, 64),
            (17, 33, 513),
            (31, 96, 96),
            (40, 70, 1000),
            (70, 65, 129),
            (48, 64, 64),
            (50, 70, 64),
            (64, 96, 320),
            (64, 64, 1024),
        ] {
            let x = data(m * k, 3 + k as u32);
            let w = data(n * k, 7 + n as u32);
            let bias = data(n, 11);
            let packed = PackedWeight::pack(&w, n, k, WeightDtype::Bf16Dot).unwrap();
            assert_eq!(packed.dtype(), WeightDtype::Bf16Dot);
            let back = packed.unpack();
            assert!(
                back.iter().zip(&w).all(|(b, &w)| *b == r(w)),
                "stored weights"
            );
            assert_products(&packed, &x, r, &bias, (m, n, k));
        }
    }

    /// `linear_vec` (outputs not zeroed first on AMX tiles) gives `linear`'s bits, with and
    /// without a bias, on every store; `linear` starts from NaNs, so an output the tiles left
    /// unwritten fails; bad shapes are refused as `linear` refuses them.
    #[test]
    fn linear_vec_gives_the_bits_of_linear() {
        for dtype in [WeightDtype::F32, WeightDtype::Bf16Dot, WeightDtype::Int8Dot] {
            for &(m, n, k) in &[
                (1, 40, 7),
                (16, 32, 64),
                (50, 70, 64),
                (64, 96, 320),
                (19, 70, 513),
            ] {
                let x = data(m * k, 31 + k as u32);
                let w = data(n * k, 37 + n as u32);
                let bias = data(n, 41);
                let packed = PackedWeight::pack(&w, n, k, dtype).unwrap();
                for b in [None, Some(&bias[..])] {
                    let mut want = vec![f32::NAN; m * n];
                    linear(&x, m, &packed, b, &mut want).unwrap();
                    let got = linear_vec(&x, m, &packed, b).unwrap();
                    assert_eq!(
                        got,
                        want,
                        "{dtype:?} m={m} n={n} k={k} bias {}",
                        b.is_some()
                    );
                }
            }
            let packed = PackedWeight::pack(&data(64, 1), 8, 8, dtype).unwrap();
            assert!(linear_vec(&data(9, 2), 1, &packed, None).is_err());
            assert!(linear_vec(&data(8, 2), 1, &packed, Some(&[0.0; 3])).is_err());
        }
    }

    /// Int8 weights: the stored weight is the per-channel dequantised one (within half a
    /// quantum of the original), every path gives the product of `x` with it (float64
    /// reference, float32 tolerance), and a row's result does not depend on its call.
    #[test]
    fn int8_weights_multiply_as_their_dequantised_values_on_every_path() {
        for &(m, n, k) in &[(1, 40, 7), (5, 33, 300), (19, 70, 513)] {
            let x = data(m * k, 5 + k as u32);
            let mut w = data(n * k, 9 + n as u32);
            w[3] = 0.0;
            // One all-zero channel (scale 1, every value 0).
            if n > 2 {
                w[k..2 * k].iter_mut().for_each(|v| *v = 0.0);
            }
            let bias = data(n, 13);
            let packed = PackedWeight::pack(&w, n, k, WeightDtype::Int8).unwrap();
            assert_eq!(packed.dtype(), WeightDtype::Int8);
            let deq = packed.unpack();
            for j in 0..n {
                let row = &w[j * k..(j + 1) * k];
                let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (d, v) in deq[j * k..(j + 1) * k].iter().zip(row) {
                    assert!(
                        (d - v).abs() <= max / 254.0 + 1e-7,
                        "channel {j}: {d} vs {v}"
                    );
                }
            }
            assert_products(&packed, &x, |v| v, &bias, (m, n, k));
        }
    }

    /// q4 weights: the stored weight is the group-wise dequantised one (within half a quantum
    /// of the original, the quantum a seventh of its group's largest magnitude), every path
    /// gives the product of `x` with it, and a row's result does not depend on its call.
    #[test]
    fn q4_weights_multiply_as_their_dequantised_values_on_every_path() {
        for &(m, n, k) in &[(1, 40, 7), (5, 33, 300), (19, 70, 513), (3, 32, 64)] {
            let x = data(m * k, 15 + k as u32);
            let mut w = data(n * k, 19 + n as u32);
            w[..k.min(40)].iter_mut().for_each(|v| *v = 0.0);
            let bias = data(n, 23);
            let packed = PackedWeight::pack(&w, n, k, WeightDtype::Q4).unwrap();
            assert_eq!(packed.dtype(), WeightDtype::Q4);
            let deq = packed.unpack();
            for j in 0..n {
                for g in 0..k.div_ceil(Q4_GROUP) {
                    let ks = g * Q4_GROUP..((g + 1) * Q4_GROUP).min(k);
                    let max = ks
                        .clone()
                        .map(|kk| w[j * k + kk].abs())
                        .fold(0f32, f32::max);
                    for kk in ks {
                        let (d, v) = (deq[j * k + kk], w[j * k + kk]);
                        assert!(
                            (d - v).abs() <= max / 14.0 + 1e-6,
                            "({j}, {kk}): {d} vs {v}"
                        );
                    }
                }
            }
            assert_products(&packed, &x, |v| v, &bias, (m, n, k));
        }
    }
}
