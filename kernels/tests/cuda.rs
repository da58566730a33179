//! The CUDA kernels against their CPU references (`cuda` feature; needs a GPU: without one the
//! test reports that it could not run and fails, so a CUDA test run never passes silently).
#![cfg(feature = "cuda")]

mod common;

use common::{max_abs, randn};
use cudarc::driver::CudaContext;
use half::bf16;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use wavefront_kernels::attention::{ragged_attention, Mask, RaggedLayout, RaggedSeq};
use wavefront_kernels::cuda::{
    Kernels, KvRun, LayoutTables, RaggedDims, RaggedKernel, SplitPlan, MAX_HEAD_DIM_WARP,
};
use wavefront_kernels::grouped::{grouped_matmul, Group};
use wavefront_kernels::pages::{scatter_rows, ScatterDims, SKIP_ROW};
use wavefront_kernels::softmax_stats::softmax_stats;

fn layout(rng: &mut StdRng, head_dim: usize) -> RaggedLayout {
    let mut l = RaggedLayout {
        n_heads: 8,
        n_kv_heads: 2,
        head_dim,
        scale: 1.0 / (head_dim as f32).sqrt(),
        seqs: Vec::new(),
        row_index: Vec::new(),
        key_index: Vec::new(),
    };
    for s in 0..12u32 {
        let len = rng.random_range(1..300u32);
        let rows = rng.random_range(1..=len.min(40));
        let mask = match s % 5 {
            0 => Mask::Bidirectional,
            1 => Mask::Causal,
            3 => Mask::BlockCausal { block: 16 },
            4 => Mask::SegmentCausal {
                prefix: len / 2,
                segment: 4,
            },
            _ => Mask::ShadowBlock {
                main_len: len - rows.min(len / 2),
                block_start: 0,
            },
        };
        let (r0, k0) = (l.row_index.len() as u32, l.key_index.len() as u32);
        l.row_index.extend(len - rows..len);
        l.key_index.extend(0..len);
        l.seqs.push(RaggedSeq {
            rows: r0..r0 + rows,
            keys: k0..k0 + len,
            mask,
        });
    }
    l
}

#[test]
fn kernels_match_their_cpu_references() {
    let ctx = CudaContext::new(0).expect("a CUDA device (this test needs a GPU)");
    let kernels = Kernels::load(&ctx).expect("PTX loads");
    let s = kernels.stream().clone();
    let mut rng = StdRng::seed_from_u64(7);

    for d in [64, 128, 256] {
        let l = layout(&mut rng, d);
        let q = randn(&mut rng, l.rows() * l.n_heads * d);
        let k = randn(&mut rng, l.keys() * l.n_kv_heads * d);
        let v = randn(&mut rng, l.keys() * l.n_kv_heads * d);
        let want = ragged_attention(&l, &q, &k, &v).unwrap();
        let (qd, kd, vd) = (
            s.clone_htod(&q).unwrap(),
            s.clone_htod(&k).unwrap(),
            s.clone_htod(&v).unwrap(),
        );
        let mut out = s.alloc_zeros::<f32>(q.len()).unwrap();
        kernels
            .ragged_attention(&l, &qd, &kd, &vd, &mut out)
            .unwrap();
        let got = s.clone_dtoh(&out).unwrap();
        assert!(
            max_abs(&got, &want) < 1e-4,
            "f32 d={d}: {}",
            max_abs(&got, &want)
        );
        // bf16 inputs: within bf16 rounding of the f32 reference on the rounded inputs.
        let r = |x: &[f32]| x.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        let back = |x: &[bf16]| x.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
        let (qb, kb, vb) = (r(&q), r(&k), r(&v));
        let want = ragged_attention(&l, &back(&qb), &back(&kb), &back(&vb)).unwrap();
        let mut out = s.alloc_zeros::<bf16>(q.len()).unwrap();
        kernels
            .ragged_attention(
                &l,
                &s.clone_htod(&qb).unwrap(),
                &s.clone_htod(&kb).unwrap(),
                &s.clone_htod(&vb).unwrap(),
                &mut out,
            )
            .unwrap();
        let got = back(&s.clone_dtoh(&out).unwrap());
        assert!(
            max_abs(&got, &want) < 2e-2,
            "bf16 d={d}: {}",
            max_abs(&got, &want)
        );
    }

    let (layers, k, n) = (8, 320, 200);
    let mut groups = Vec::new();
    let mut rows = 0;
    for i in 0..10u32 {
        let len = rng.random_range(0..40);
        groups.push(Group {
            rows: rows..rows + len,
            weight: (i * 3) % layers as u32,
        });
        rows += len;
    }
    let x = randn(&mut rng, rows as usize * k);
    let w = randn(&mut rng, layers * n * k);
    let want = grouped_matmul(&groups, &x, &w, layers, k, n).unwrap();
    let mut y = s.alloc_zeros::<f32>(rows as usize * n).unwrap();
    kernels
        .grouped_matmul(
            &groups,
            &s.clone_htod(&x).unwrap(),
            &s.clone_htod(&w).unwrap(),
            &mut y,
            layers,
            k,
            n,
        )
        .unwrap();
    let got = s.clone_dtoh(&y).unwrap();
    assert!(
        max_abs(&got, &want) < 1e-3,
        "grouped: {}",
        max_abs(&got, &want)
    );

    let (rows, vocab) = (37, 50_000);
    let logits = randn(&mut rng, rows * vocab);
    let mut prev = vec![0f32; rows * vocab];
    softmax_stats(&randn(&mut rng, rows * vocab), vocab, None, Some(&mut prev)).unwrap();
    let mut lp_want = vec![0f32; rows * vocab];
    let want = softmax_stats(&logits, vocab, Some(&prev), Some(&mut lp_want)).unwrap();
    let mut lp = s.alloc_zeros::<f32>(rows * vocab).unwrap();
    let got = kernels
        .softmax_stats(
            &s.clone_htod(&logits).unwrap(),
            vocab,
            Some(&s.clone_htod(&prev).unwrap()),
            Some(&mut lp),
        )
        .unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.top_id, w.top_id);
        assert!((g.top_prob - w.top_prob).abs() < 1e-5 && (g.lse - w.lse).abs() < 1e-3);
        assert!(
            (g.kl - w.kl).abs() < 1e-3 * (1.0 + w.kl.abs()),
            "{g:?} {w:?}"
        );
    }
    assert!(max_abs(&s.clone_dtoh(&lp).unwrap(), &lp_want) < 1e-3);
    let none = kernels
        .softmax_stats(&s.clone_htod(&logits).unwrap(), vocab, None, None)
        .unwrap();
    assert!(none.iter().all(|r| r.kl.is_nan()));
}

/// Keys laid out as a served cache holds them: `[Hkv, pages · PAGE, D]` arenas, each sequence's
/// keys a page table of shuffled ids (runs of consecutive ids merged, as the model crate reads
/// them) followed by its fresh rows in a buffer of their own. The paged kernel, reading every
/// run in place, must give the reference's output on the keys gathered in order.
#[test]
fn the_paged_kernel_reads_keys_in_place_through_page_tables() {
    const PAGE: usize = 16;
    let ctx = CudaContext::new(0).expect("a CUDA device (this test needs a GPU)");
    let kernels = Kernels::load(&ctx).expect("PTX loads");
    let s = kernels.stream().clone();
    let mut rng = StdRng::seed_from_u64(11);
    for d in [64, 128] {
        let l = layout(&mut rng, d);
        let hkv = l.n_kv_heads;
        // Each sequence: cached keys in whole pages (its last page partly used), then fresh rows.
        let mut plan = Vec::new(); // per sequence: (page ids, cached keys, fresh keys)
        let mut next_page = 0usize;
        for seq in &l.seqs {
            let len = (seq.keys.end - seq.keys.start) as usize;
            let fresh = rng.random_range(0..=len.min(24));
            let cached = len - fresh;
            let pages = cached.div_ceil(PAGE);
            plan.push((
                (next_page..next_page + pages).collect::<Vec<_>>(),
                cached,
                fresh,
            ));
            next_page += pages;
        }
        // Shuffle page ids across the arena, keeping a few consecutive runs.
        let total_pages = next_page;
        let mut ids: Vec<usize> = (0..total_pages).collect();
        for i in (1..ids.len()).rev() {
            if rng.random_range(0..3) > 0 {
                let j = rng.random_range(0..=i);
                ids.swap(i, j);
            }
        }
        let arena_rows = total_pages * PAGE;
        let ak = randn(&mut rng, hkv * arena_rows * d);
        let av = randn(&mut rng, hkv * arena_rows * d);
        let (akd, avd) = (s.clone_htod(&ak).unwrap(), s.clone_htod(&av).unwrap());
        let mut want_k = vec![0f32; hkv * l.keys() * d];
        let mut want_v = vec![0f32; hkv * l.keys() * d];
        let mut fresh_bufs = Vec::new();
        // (arena?, first row or buffer index, keys)
        let mut pieces: Vec<(Option<usize>, usize, usize)> = Vec::new();
        let mut key = 0usize;
        for (pages, cached, fresh) in &plan {
            let mut left = *cached;
            for &p in pages {
                let n = left.min(PAGE);
                let row = ids[p] * PAGE;
                match pieces.last_mut() {
                    Some((Some(0), start, len)) if *start + *len == row && *len % PAGE == 0 => {
                        *len += n
                    }
                    _ => pieces.push((Some(0), row, n)),
                }
                for g in 0..hkv {
                    for i in 0..n {
                        let src = (g * arena_rows + row + i) * d;
                        let dst = (g * l.keys() + key + i) * d;
                        want_k[dst..dst + d].copy_from_slice(&ak[src..src + d]);
                        want_v[dst..dst + d].copy_from_slice(&av[src..src + d]);
                    }
                }
                key += n;
                left -= n;
            }
            let fk = randn(&mut rng, hkv * fresh * d);
            let fv = randn(&mut rng, hkv * fresh * d);
            for g in 0..hkv {
                for i in 0..*fresh {
                    let src = (g * fresh + i) * d;
                    let dst = (g * l.keys() + key + i) * d;
                    want_k[dst..dst + d].copy_from_slice(&fk[src..src + d]);
                    want_v[dst..dst + d].copy_from_slice(&fv[src..src + d]);
                }
            }
            pieces.push((None, fresh_bufs.len(), *fresh));
            fresh_bufs.push((s.clone_htod(&fk).unwrap(), s.clone_htod(&fv).unwrap()));
            key += fresh;
        }
        assert_eq!(key, l.keys());
        let runs: Vec<KvRun<f32>> = pieces
            .iter()
            .map(|&(arena, at, n)| match arena {
                Some(_) => KvRun {
                    k: akd.slice(at * d..),
                    v: avd.slice(at * d..),
                    keys: n,
                    head_stride: arena_rows * d,
                },
                None => KvRun {
                    k: fresh_bufs[at].0.slice(..),
                    v: fresh_bufs[at].1.slice(..),
                    keys: n,
                    head_stride: n * d,
                },
            })
            .collect();
        assert!(
            runs.len() > l.seqs.len() * 2,
            "the layout reads several runs per sequence"
        );
        let q = randn(&mut rng, l.rows() * l.n_heads * d);
        let want = ragged_attention(&l, &q, &want_k, &want_v).unwrap();
        let uploaded = LayoutTables::upload(&s, &l).unwrap();
        let tables = uploaded.tables();
        let qd = s.clone_htod(&q).unwrap();
        let mut out = s.alloc_zeros::<f32>(q.len()).unwrap();
        kernels
            .ragged_attention_paged(&RaggedDims::of(&l), &tables, &qd.as_view(), &runs, &mut out)
            .unwrap();
        let got = s.clone_dtoh(&out).unwrap();
        assert!(
            max_abs(&got, &want) < 1e-4,
            "paged f32 d={d}: {}",
            max_abs(&got, &want)
        );
        // A run table that does not add up to the call's keys is refused before any launch.
        let short = &runs[..runs.len() - 1];
        assert!(kernels
            .ragged_attention_paged(&RaggedDims::of(&l), &tables, &qd.as_view(), short, &mut out)
            .is_err());
    }
}

/// Decode rows over long caches (several splits a row, merged by the second launch), canvases
/// and prefills (one split), a sequence with no keys, every mask rule, head dims from 8 to 512
/// (96 included: a thread's dims partly past the head), kv groups of 1, 2, 4 and 8 query heads
/// (a block computes several heads of a group): the split-key kernel, grouped and one head per
/// block, against the CPU reference and against the one-warp kernel, on an output poisoned
/// with NaN so every element must be written. Fresh random inputs per case.
#[test]
fn the_split_key_kernel_matches_the_reference_at_every_head_dim_and_split() {
    let ctx = CudaContext::new(0).expect("a CUDA device (this test needs a GPU)");
    let kernels = Kernels::load(&ctx).expect("PTX loads");
    let s = kernels.stream().clone();
    let mut rng = StdRng::seed_from_u64(23);
    let masks = |len: u32, rows: u32, i: usize| match i % 8 {
        0 => Mask::Bidirectional,
        1 => Mask::Causal,
        2 => Mask::ShadowBlock {
            main_len: len - rows.min(len / 2),
            block_start: 1,
        },
        3 => Mask::BlockCausal { block: 32 },
        4 => Mask::SegmentCausal {
            prefix: len / 2,
            segment: 8,
        },
        5 => Mask::SlidingCausal { window: 100 },
        6 => Mask::RecentCache {
            cached: len - rows,
            window: 50,
        },
        _ => Mask::Causal,
    };
    let cases = [8, 16, 32, 64, 96, 128, 256, 512]
        .into_iter()
        .flat_map(|d| {
            let heads: &[(usize, usize)] = if d >= 256 {
                &[(4, 2), (2, 2), (8, 1)]
            } else {
                &[(8, 2), (8, 1), (3, 3), (4, 2)]
            };
            heads
                .iter()
                .flat_map(move |&h| ["decode", "canvas"].map(|shape| (d, h, shape)))
        });
    for (d, (n_heads, n_kv_heads), shape) in cases {
        {
            let mut l = RaggedLayout {
                n_heads,
                n_kv_heads,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
                seqs: Vec::new(),
                row_index: Vec::new(),
                key_index: Vec::new(),
            };
            let n_seqs = if shape == "decode" { 6 } else { 9 };
            for i in 0..n_seqs {
                let (len, rows) = match (shape, i) {
                    (_, 0) => (0, 1),
                    ("decode", _) => (rng.random_range(1000..4000u32), 1),
                    _ => {
                        let len = rng.random_range(40..400u32);
                        (len, rng.random_range(1..=32u32.min(len)))
                    }
                };
                let (r0, k0) = (l.row_index.len() as u32, l.key_index.len() as u32);
                l.row_index
                    .extend((0..rows).map(|r| (len + r).saturating_sub(rows)));
                l.key_index.extend(0..len);
                l.seqs.push(RaggedSeq {
                    rows: r0..r0 + rows,
                    keys: k0..k0 + len,
                    mask: masks(len.max(1), rows, i),
                });
            }
            let dims = RaggedDims::of(&l);
            let plan = SplitPlan::new(&dims, kernels.multiprocessors());
            if shape == "decode" {
                assert!(plan.splits > 1, "{d} {shape}: {plan:?}");
            }
            let q = randn(&mut rng, l.rows() * n_heads * d);
            let k = randn(&mut rng, l.keys() * n_kv_heads * d);
            let v = randn(&mut rng, l.keys() * n_kv_heads * d);
            let want = ragged_attention(&l, &q, &k, &v).unwrap();
            let (qd, kd, vd) = (
                s.clone_htod(&q).unwrap(),
                s.clone_htod(&k).unwrap(),
                s.clone_htod(&v).unwrap(),
            );
            let uploaded = LayoutTables::upload(&s, &l).unwrap();
            let run = || KvRun {
                k: kd.slice(..),
                v: vd.slice(..),
                keys: l.keys(),
                head_stride: l.keys() * d,
            };
            let got_of = |kernel| {
                let mut out = s.clone_htod(&vec![f32::NAN; q.len()]).unwrap();
                kernels
                    .ragged_attention_kernel(
                        kernel,
                        &dims,
                        &uploaded.tables(),
                        &qd.as_view(),
                        &[run()],
                        &mut out,
                    )
                    .unwrap();
                s.clone_dtoh(&out).unwrap()
            };
            let got = got_of(RaggedKernel::SplitKey);
            assert!(got.iter().all(|x| x.is_finite()), "{d} {shape}: unwritten");
            let err = max_abs(&got, &want);
            let case = format!("d={d} heads {n_heads}/{n_kv_heads} {shape} {plan:?}");
            assert!(err < 1e-4, "split f32 {case}: {err}");
            let per_head = got_of(RaggedKernel::SplitKeyPerHead);
            let err = max_abs(&per_head, &want);
            assert!(err < 1e-4, "split per head f32 {case}: {err}");
            // The sequence with no keys gets zeros.
            let r0 = l.seqs[0].rows.start as usize;
            for h in 0..n_heads {
                let at = (h * l.rows() + r0) * d;
                assert!(got[at..at + d].iter().all(|&x| x == 0.0));
            }
            if d <= MAX_HEAD_DIM_WARP {
                let warp = got_of(RaggedKernel::Warp);
                assert!(max_abs(&warp, &want) < 1e-4, "warp f32 d={d} {shape}");
            }
            // bf16 within bf16 rounding of the reference on the rounded inputs.
            let r = |x: &[f32]| x.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
            let back = |x: &[bf16]| x.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
            let (qb, kb, vb) = (r(&q), r(&k), r(&v));
            let want = ragged_attention(&l, &back(&qb), &back(&kb), &back(&vb)).unwrap();
            let (qbd, kbd, vbd) = (
                s.clone_htod(&qb).unwrap(),
                s.clone_htod(&kb).unwrap(),
                s.clone_htod(&vb).unwrap(),
            );
            let mut out = s
                .clone_htod(&vec![bf16::from_f32(f32::NAN); q.len()])
                .unwrap();
            kernels
                .ragged_attention_paged(
                    &dims,
                    &uploaded.tables(),
                    &qbd.as_view(),
                    &[KvRun {
                        k: kbd.slice(..),
                        v: vbd.slice(..),
                        keys: l.keys(),
                        head_stride: l.keys() * d,
                    }],
                    &mut out,
                )
                .unwrap();
            let got = back(&s.clone_dtoh(&out).unwrap());
            let err = max_abs(&got, &want);
            assert!(err < 2e-2, "split bf16 d={d} {shape}: {err}");
        }
    }
}

#[test]
fn scatter_rows_writes_each_row_to_its_slot_and_nothing_else() {
    let ctx = CudaContext::new(0).expect("a CUDA device (this test needs a GPU)");
    let kernels = Kernels::load(&ctx).expect("PTX loads");
    let s = kernels.stream().clone();
    let mut rng = StdRng::seed_from_u64(13);
    for (heads, n, head_dim, dst_rows) in [(4, 37, 128, 96), (1, 1, 64, 16), (8, 200, 72, 512)] {
        // The rows of one sequence within a packed call's [heads, all, head_dim], 3 rows in.
        let (all, first) = (n + 5, 3);
        let src = randn(&mut rng, heads * all * head_dim);
        let mut free: Vec<u32> = (0..dst_rows as u32).collect();
        free.shuffle(&mut rng);
        let slots: Vec<u32> = (0..n)
            .map(|r| if r % 7 == 3 { SKIP_ROW } else { free[r] })
            .collect();
        let dims = ScatterDims {
            heads,
            n,
            head_dim,
            dst_rows,
            src_head_stride: all * head_dim,
            src_row_stride: head_dim,
        };
        let before = randn(&mut rng, heads * dst_rows * head_dim);
        // Bit for bit in both element types, the rows not named unchanged.
        scatter_matches_reference(&kernels, &src, &before, first * head_dim, &dims, &slots);
        let to_bf16 = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        let (src, before) = (to_bf16(&src), to_bf16(&before));
        scatter_matches_reference(&kernels, &src, &before, first * head_dim, &dims, &slots);
    }
    // Refused before a launch: two rows to one slot, a slot past the destination.
    let dims = ScatterDims {
        heads: 1,
        n: 2,
        head_dim: 4,
        dst_rows: 4,
        src_head_stride: 8,
        src_row_stride: 4,
    };
    let srcd = s.clone_htod(&[0f32; 8]).unwrap();
    let mut dstd = s.alloc_zeros::<f32>(16).unwrap();
    for bad in [[1u32, 1], [0, 4]] {
        assert!(kernels
            .scatter_rows(&mut dstd.slice_mut(..), &srcd.slice(..), &dims, &bad)
            .is_err());
    }
}

/// The device's scatter of `src[from..]`'s rows into `before` against the CPU reference.
fn scatter_matches_reference<T>(
    kernels: &Kernels,
    src: &[T],
    before: &[T],
    from: usize,
    dims: &ScatterDims,
    slots: &[u32],
) where
    T: wavefront_kernels::cuda::Elem + Default + PartialEq + std::fmt::Debug + Unpin,
{
    let s = kernels.stream();
    let mut want = before.to_vec();
    scatter_rows(&mut want, &src[from..], dims, slots).unwrap();
    let srcd = s.clone_htod(src).unwrap();
    let mut dstd = s.clone_htod(before).unwrap();
    kernels
        .scatter_rows(&mut dstd.slice_mut(..), &srcd.slice(from..), dims, slots)
        .unwrap();
    assert_eq!(s.clone_dtoh(&dstd).unwrap(), want);
}
