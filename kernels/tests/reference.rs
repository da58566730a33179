//! The CPU reference implementations against independent compositions of candle ops (dense
//! per-sequence attention with an explicit mask matrix, per-group matmuls, log-softmax), on
//! random problems: ragged sequences with every mask rule, non-contiguous buffer indices and
//! grouped-query heads; groups of uneven sizes sharing weights; logits with ties.

mod common;

use candle_core::{Device, Tensor, D};
use common::{max_abs, randn};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use wavefront_kernels::attention::{ragged_attention, Mask, RaggedLayout, RaggedSeq};
use wavefront_kernels::grouped::{grouped_matmul, Group};
use wavefront_kernels::pages::{scatter_rows, ScatterDims, SKIP_ROW};
use wavefront_kernels::softmax_stats::softmax_stats;

/// A random ragged call: per sequence a buffer of `len` indices (shuffled, so rows are not in
/// buffer order), of which some are query rows and all are keys.
fn ragged(seed: u64, seqs: usize) -> (RaggedLayout, Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (h, hkv, d) = [(4, 2, 8), (2, 2, 16), (6, 1, 4)][rng.random_range(0..3)];
    let mut layout = RaggedLayout {
        n_heads: h,
        n_kv_heads: hkv,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
        seqs: Vec::new(),
        row_index: Vec::new(),
        key_index: Vec::new(),
    };
    for _ in 0..seqs {
        let len = rng.random_range(1..12u32);
        let mask = match rng.random_range(0..5) {
            0 => Mask::Bidirectional,
            1 => Mask::Causal,
            2 => Mask::BlockCausal {
                block: rng.random_range(1..=4),
            },
            3 => Mask::SegmentCausal {
                prefix: rng.random_range(0..len),
                segment: rng.random_range(1..=4),
            },
            _ => {
                let block = rng.random_range(1..=len.div_ceil(2));
                let main_len = len - block;
                Mask::ShadowBlock {
                    main_len,
                    block_start: rng.random_range(0..=main_len.saturating_sub(block)),
                }
            }
        };
        let mut buffer: Vec<u32> = (0..len).collect();
        for i in (1..buffer.len()).rev() {
            buffer.swap(i, rng.random_range(0..=i));
        }
        let n_rows = rng.random_range(0..=len) as usize;
        let r0 = layout.row_index.len() as u32;
        let k0 = layout.key_index.len() as u32;
        layout.row_index.extend(&buffer[..n_rows]);
        layout.key_index.extend(&buffer);
        layout.seqs.push(RaggedSeq {
            rows: r0..r0 + n_rows as u32,
            keys: k0..k0 + len,
            mask,
        });
    }
    let q = randn(&mut rng, layout.rows() * h * d);
    let k = randn(&mut rng, layout.keys() * hkv * d);
    let v = randn(&mut rng, layout.keys() * hkv * d);
    (layout, q, k, v)
}

/// Dense attention per sequence and head with candle, masked by an explicit 0/1 matrix.
fn dense(layout: &RaggedLayout, q: &[f32], k: &[f32], v: &[f32]) -> candle_core::Result<Vec<f32>> {
    let dev = Device::Cpu;
    let (h, hkv, d) = (layout.n_heads, layout.n_kv_heads, layout.head_dim);
    // Head-major inputs, viewed row-major (`[rows, H, D]`, `[keys, H_kv, D]`) for the loop.
    let q = Tensor::from_slice(q, (h, layout.rows(), d), &dev)?.transpose(0, 1)?;
    let k = Tensor::from_slice(k, (hkv, layout.keys(), d), &dev)?.transpose(0, 1)?;
    let v = Tensor::from_slice(v, (hkv, layout.keys(), d), &dev)?.transpose(0, 1)?;
    let mut out = Tensor::zeros((layout.rows(), h, d), candle_core::DType::F32, &dev)?;
    for s in &layout.seqs {
        let (r0, nr) = (s.rows.start as usize, s.rows.len());
        let (k0, nk) = (s.keys.start as usize, s.keys.len());
        if nr == 0 {
            continue;
        }
        let allowed: Vec<f32> = s
            .rows
            .clone()
            .flat_map(|r| s.keys.clone().map(move |j| (r, j)))
            .map(|(r, j)| {
                f32::from(u8::from(s.mask.allows(
                    layout.row_index[r as usize],
                    layout.key_index[j as usize],
                )))
            })
            .collect();
        let allowed = Tensor::from_vec(allowed, (nr, nk), &dev)?;
        let mut heads = Vec::new();
        for head in 0..h {
            let g = head / (h / hkv);
            let qh = q.narrow(0, r0, nr)?.narrow(1, head, 1)?.squeeze(1)?;
            let kh = k.narrow(0, k0, nk)?.narrow(1, g, 1)?.squeeze(1)?;
            let vh = v.narrow(0, k0, nk)?.narrow(1, g, 1)?.squeeze(1)?;
            let s = (qh.matmul(&kh.t()?)? * f64::from(layout.scale))?;
            let m = s.max_keepdim(D::Minus1)?;
            let e = (s.broadcast_sub(&m)?.exp()? * &allowed)?;
            let z = e.sum_keepdim(D::Minus1)?;
            // Rows with no allowed key: zeros (z = 0 would divide 0 by 0).
            let z = z.maximum(1e-30)?;
            heads.push(e.broadcast_div(&z)?.matmul(&vh)?.unsqueeze(1)?);
        }
        let o = Tensor::cat(&heads, 1)?;
        out = out.slice_assign(&[r0..r0 + nr, 0..h, 0..d], &o)?;
    }
    out.transpose(0, 1)?.contiguous()?.flatten_all()?.to_vec1()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn ragged_attention_equals_dense_masked_attention(seed in any::<u64>(), seqs in 1usize..6) {
        let (layout, q, k, v) = ragged(seed, seqs);
        let got = ragged_attention(&layout, &q, &k, &v).unwrap();
        let want = dense(&layout, &q, &k, &v).unwrap();
        prop_assert!(max_abs(&got, &want) < 1e-5, "diff {}", max_abs(&got, &want));
    }

    #[test]
    fn grouped_matmul_equals_per_group_matmuls(seed in any::<u64>()) {
        let mut rng = StdRng::seed_from_u64(seed);
        let (layers, k, n) = (rng.random_range(1..5), rng.random_range(1..20), rng.random_range(1..20));
        let mut groups = Vec::new();
        let mut rows = 0u32;
        for _ in 0..rng.random_range(1..6) {
            let len = rng.random_range(0..7);
            groups.push(Group { rows: rows..rows + len, weight: rng.random_range(0..layers as u32) });
            rows += len;
        }
        let x = randn(&mut rng, rows as usize * k);
        let w = randn(&mut rng, layers * n * k);
        let got = grouped_matmul(&groups, &x, &w, layers, k, n).unwrap();
        let dev = Device::Cpu;
        let xt = Tensor::from_slice(&x, (rows as usize, k), &dev).unwrap();
        let wt = Tensor::from_slice(&w, (layers, n, k), &dev).unwrap();
        let mut want = Vec::new();
        for g in &groups {
            if g.rows.is_empty() { continue; }
            let xg = xt.narrow(0, g.rows.start as usize, g.rows.len()).unwrap();
            let wg = wt.get(g.weight as usize).unwrap();
            want.extend(xg.matmul(&wg.t().unwrap()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
        }
        prop_assert!(max_abs(&got, &want) < 1e-4);
    }

    #[test]
    fn softmax_stats_equal_log_softmax(seed in any::<u64>()) {
        let mut rng = StdRng::seed_from_u64(seed);
        let (rows, vocab) = (rng.random_range(1..6), rng.random_range(1..300));
        let mut logits = randn(&mut rng, rows * vocab);
        // A tie at the maximum: the lowest id wins, as argmax.
        if vocab > 3 { logits[2] = 9.0; logits[3] = 9.0; }
        let prev_logits = randn(&mut rng, rows * vocab);
        let dev = Device::Cpu;
        let log_softmax = |x: &[f32]| -> Tensor {
            let t = Tensor::from_slice(x, (rows, vocab), &dev).unwrap();
            let m = t.max_keepdim(1).unwrap();
            let s = t.broadcast_sub(&m).unwrap();
            let lse = s.exp().unwrap().sum_keepdim(1).unwrap().log().unwrap();
            s.broadcast_sub(&lse).unwrap()
        };
        let prev: Vec<f32> = log_softmax(&prev_logits).flatten_all().unwrap().to_vec1().unwrap();
        let mut lp_out = vec![0f32; rows * vocab];
        let got = softmax_stats(&logits, vocab, Some(&prev), Some(&mut lp_out)).unwrap();
        let lp = log_softmax(&logits);
        let want_lp: Vec<f32> = lp.flatten_all().unwrap().to_vec1().unwrap();
        prop_assert!(max_abs(&lp_out, &want_lp) < 1e-5);
        let p = lp.exp().unwrap();
        let top: Vec<u32> = p.argmax(1).unwrap().to_vec1().unwrap();
        let top_p: Vec<f32> = p.max(1).unwrap().to_vec1().unwrap();
        let prev_t = Tensor::from_slice(&prev, (rows, vocab), &dev).unwrap();
        let kl: Vec<f32> = (&p * (&lp - &prev_t).unwrap()).unwrap().sum(1).unwrap().to_vec1().unwrap();
        for r in 0..rows {
            prop_assert_eq!(got[r].top_id, top[r]);
            prop_assert!((got[r].top_prob - top_p[r]).abs() < 1e-5);
            prop_assert!((got[r].kl - kl[r]).abs() < 1e-4 * (1.0 + kl[r].abs()));
        }
        if vocab > 3 { prop_assert_eq!(got[0].top_id, 2); }
    }

    #[test]
    fn scattered_rows_land_in_their_slots_and_nowhere_else(seed in any::<u64>()) {
        let mut rng = StdRng::seed_from_u64(seed);
        let (heads, head_dim, n) = (rng.random_range(1..5), rng.random_range(1..20), rng.random_range(1..30));
        let (dst_rows, all) = (n + rng.random_range(0..20), n + 3);
        // One sequence's rows of a packed call `[heads, all, head_dim]`, one row in.
        let src = randn(&mut rng, heads * all * head_dim);
        let mut free: Vec<u32> = (0..dst_rows as u32).collect();
        free.shuffle(&mut rng);
        let slots: Vec<u32> = (0..n).map(|r| if rng.random_bool(0.2) { SKIP_ROW } else { free[r] }).collect();
        let dims = ScatterDims { heads, n, head_dim, dst_rows, src_head_stride: all * head_dim, src_row_stride: head_dim };
        let before = randn(&mut rng, heads * dst_rows * head_dim);
        let mut got = before.clone();
        scatter_rows(&mut got, &src[head_dim..], &dims, &slots).unwrap();
        // Read back with candle's gathers: each written slot holds its row, every other row is as before.
        let dev = Device::Cpu;
        let gather = |v: &[f32], rows: usize, at: &[u32]| -> Vec<f32> {
            let t = Tensor::from_slice(v, (heads, rows, head_dim), &dev).unwrap();
            t.index_select(&Tensor::new(at, &dev).unwrap(), 1).unwrap().flatten_all().unwrap().to_vec1().unwrap()
        };
        let rows: Vec<u32> = (0..n as u32).filter(|&r| slots[r as usize] != SKIP_ROW).collect();
        let at: Vec<u32> = rows.iter().map(|&r| slots[r as usize]).collect();
        let sequence: Vec<f32> = Tensor::from_slice(&src, (heads, all, head_dim), &dev).unwrap()
            .narrow(1, 1, n).unwrap().contiguous().unwrap().flatten_all().unwrap().to_vec1().unwrap();
        if !rows.is_empty() {
            prop_assert_eq!(gather(&got, dst_rows, &at), gather(&sequence, n, &rows));
        }
        let others: Vec<u32> = (0..dst_rows as u32).filter(|s| !at.contains(s)).collect();
        if !others.is_empty() {
            prop_assert_eq!(gather(&got, dst_rows, &others), gather(&before, dst_rows, &others));
        }
        // Two rows to one slot are refused.
        if n > 1 {
            let mut twice = vec![SKIP_ROW; n];
            (twice[0], twice[1]) = (0, 0);
            prop_assert!(scatter_rows(&mut got, &src[head_dim..], &dims, &twice).is_err());
        }
    }
}
