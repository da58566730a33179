//! Rows into K/V pages: a call's fresh keys or values `[heads, n, head_dim]` written to the
//! rows of a page arena `[heads, rows, head_dim]` that its sequence's page table names, one
//! destination row per source row. Where a sequence's rows are consecutive buffer indices a
//! copy per page does this; where they are scattered (SureLock's unlocked positions, the
//! positions of a canvas a cache leaves out) a copy per run of consecutive indices would be
//! a launch each, so the device writes every row bound for one arena in one launch.

use crate::{check, KernelError};

/// A slot that leaves its row out (the row goes to another arena).
pub const SKIP_ROW: u32 = u32::MAX;

/// Sizes and strides of one scatter: `src` rows `[heads, n, head_dim]` with head stride
/// `src_head_stride` and row stride `src_row_stride` (elements; a row's values consecutive),
/// into a contiguous `[heads, dst_rows, head_dim]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScatterDims {
    pub heads: usize,
    pub n: usize,
    pub head_dim: usize,
    pub dst_rows: usize,
    pub src_head_stride: usize,
    pub src_row_stride: usize,
}

impl ScatterDims {
    /// Checks that `slots` (one per row: a destination row, or [`SKIP_ROW`]) are in range and
    /// distinct and that both buffers span what the sizes say.
    pub fn check(&self, dst_len: usize, src_len: usize, slots: &[u32]) -> Result<(), KernelError> {
        let Self {
            heads,
            n,
            head_dim,
            dst_rows,
            src_head_stride,
            src_row_stride,
        } = *self;
        check(slots.len() == n, || {
            format!("{} slots for {n} rows", slots.len())
        })?;
        if heads == 0 || n == 0 || head_dim == 0 {
            return Ok(());
        }
        check(dst_len >= heads * dst_rows * head_dim, || {
            format!("a destination of {dst_len} elements is not [{heads}, {dst_rows}, {head_dim}]")
        })?;
        let src_end = (heads - 1) * src_head_stride + (n - 1) * src_row_stride + head_dim;
        check(src_len >= src_end, || {
            format!("a source of {src_len} elements ends before element {src_end} of its rows")
        })?;
        let mut taken: Vec<u32> = slots.iter().copied().filter(|&s| s != SKIP_ROW).collect();
        check(taken.iter().all(|&s| (s as usize) < dst_rows), || {
            format!("a slot is past the destination's {dst_rows} rows")
        })?;
        taken.sort_unstable();
        check(taken.windows(2).all(|w| w[0] != w[1]), || {
            "two rows go to one slot".into()
        })
    }
}

/// The CPU reference (and the host path): row `r` of `src` into row `slots[r]` of `dst`,
/// every head; rows whose slot is [`SKIP_ROW`] are left out.
pub fn scatter_rows<T: Copy>(
    dst: &mut [T],
    src: &[T],
    dims: &ScatterDims,
    slots: &[u32],
) -> Result<(), KernelError> {
    dims.check(dst.len(), src.len(), slots)?;
    let d = dims.head_dim;
    for h in 0..dims.heads {
        for (r, &slot) in slots.iter().enumerate() {
            if slot == SKIP_ROW {
                continue;
            }
            let to = (h * dims.dst_rows + slot as usize) * d;
            let from = h * dims.src_head_stride + r * dims.src_row_stride;
            dst[to..to + d].copy_from_slice(&src[from..from + d]);
        }
    }
    Ok(())
}
