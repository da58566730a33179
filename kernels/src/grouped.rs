//! Grouped matmul over layer-stacked weights: `y[r] = x[r] · W[w(g)]ᵀ` for every row `r` of
//! group `g`, with the weights of all layers stacked once at load time as `[L, out, in]` (the
//! checkpoints' `Linear` layout) and read in place.
//!
//! Diagonal batching (ARMT) runs the cells `(segment, layer)` of one step together: each cell is
//! a group of rows (its segment plus memory tokens) that needs its own layer's projection. One
//! launch covers every group; groups may have different row counts (a request's partial last
//! segment, several requests at the same layer) and several groups may use the same layer.

use std::ops::Range;

use crate::{check, KernelError};

/// One group: contiguous rows of `x` and the index of its weight in the stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub rows: Range<u32>,
    pub weight: u32,
}

/// Checks shapes and that the groups tile the rows in order.
pub fn validate(
    groups: &[Group],
    rows: usize,
    layers: usize,
    k: usize,
    n: usize,
    x_len: usize,
    w_len: usize,
) -> Result<(), KernelError> {
    check(x_len == rows * k, || {
        format!("x has {x_len} values, want {rows}x{k}")
    })?;
    check(w_len == layers * n * k, || {
        format!("w has {w_len} values, want {layers}x{n}x{k}")
    })?;
    let mut next = 0u32;
    for (i, g) in groups.iter().enumerate() {
        check(g.rows.start == next && g.rows.start <= g.rows.end, || {
            format!("group {i} rows {:?} do not follow row {next}", g.rows)
        })?;
        check((g.weight as usize) < layers, || {
            format!("group {i} uses weight {} of {layers}", g.weight)
        })?;
        next = g.rows.end;
    }
    check(next as usize == rows, || {
        format!("groups cover {next} of {rows} rows")
    })
}

/// The CPU reference. `x` `[rows, k]`, `w` `[layers, n, k]`, result `[rows, n]`, float32
/// accumulation.
pub fn grouped_matmul(
    groups: &[Group],
    x: &[f32],
    w: &[f32],
    layers: usize,
    k: usize,
    n: usize,
) -> Result<Vec<f32>, KernelError> {
    let rows = groups.last().map_or(0, |g| g.rows.end as usize);
    validate(groups, rows, layers, k, n, x.len(), w.len())?;
    let mut y = vec![0f32; rows * n];
    for g in groups {
        let wl = &w[g.weight as usize * n * k..][..n * k];
        for r in g.rows.clone() {
            let xr = &x[r as usize * k..][..k];
            let yr = &mut y[r as usize * n..][..n];
            for (o, wo) in yr.iter_mut().zip(wl.chunks_exact(k)) {
                *o = xr.iter().zip(wo).map(|(a, b)| a * b).sum();
            }
        }
    }
    Ok(y)
}

/// Tiles of `tile` rows that never straddle a group: `(group, first row, rows)`; the CUDA
/// kernel's grid walks this table so every tile multiplies by one weight.
pub fn row_tiles(groups: &[Group], tile: u32) -> Vec<[u32; 3]> {
    let mut out = Vec::new();
    for (i, g) in groups.iter().enumerate() {
        let mut r = g.rows.start;
        while r < g.rows.end {
            let len = tile.min(g.rows.end - r);
            out.push([i as u32, r, len]);
            r += len;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_stay_inside_their_group() {
        let groups = [
            Group {
                rows: 0..5,
                weight: 2,
            },
            Group {
                rows: 5..5,
                weight: 0,
            },
            Group {
                rows: 5..9,
                weight: 2,
            },
        ];
        assert_eq!(row_tiles(&groups, 4), vec![[0, 0, 4], [0, 4, 1], [2, 5, 4]]);
    }

    #[test]
    fn bad_groups_are_refused() {
        let g = [Group {
            rows: 0..2,
            weight: 3,
        }];
        assert!(grouped_matmul(&g, &[0.0; 4], &[0.0; 12], 3, 2, 2).is_err());
    }
}
