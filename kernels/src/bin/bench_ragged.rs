//! `bench-ragged` (`cuda` feature, on a GPU): the split-key (flash-decoding) ragged attention
//! kernel against the one-warp-per-(row, head) kernel before it, both reading paged K/V in
//! place, against the device's measured copy bandwidth (a 1 GiB device-to-device copy, bytes
//! read plus written, timed in the same run). Per shape: the two kernels alone (run table
//! uploaded beforehand), the split-key kernel with its run table's upload (what a served layer
//! pays), the K/V bytes per second and their fraction of the copy bandwidth, and the largest
//! difference between the two kernels' outputs (they sum in different orders).
//!
//! With `--concatenate`: the paged kernel against the path before paging, which first
//! concatenated every sequence's pages into one contiguous buffer per layer (one strided 2-D
//! copy per run of pages, as candle's `cat` does) and then ran the kernel over it.
//!
//! Keys sit as a served cache holds them: `[Hkv, pages · 16, D]` bf16 arenas, each sequence's
//! pages interleaved with other layers' (a decode step takes one page per layer, so a layer's
//! consecutive positions are `layers` pages apart) unless `--consecutive`; the call's own rows
//! come in a fresh buffer per sequence. Per shape: sequences × context, query rows per sequence
//! (1: decode; more: a LLaDA block, a ReFusion plan), the runs read, the time of both paths
//! (CUDA events, mean of `--iters` after warm-up), their ratio, and the bytes of K/V each path
//! moves per second. Both paths' outputs are compared bit for bit.
//!
//!   bench-ragged [--iters N] [--consecutive] [--concatenate]

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use wavefront_kernels::attention::{Mask, RaggedLayout, RaggedSeq};
use wavefront_kernels::cuda::{Kernels, KvRun, LayoutTables, RaggedDims, RaggedKernel};

const PAGE: usize = 16;
const LAYERS: usize = 32;

struct Shape {
    seqs: usize,
    context: usize,
    rows: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

fn fill(n: usize, seed: u64) -> Vec<bf16> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bf16::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0)
        })
        .collect()
}

/// `n` values on the device: a few million drawn on the host, then repeated by doubling
/// device-to-device copies (the arenas of the long shapes hold billions of values).
fn fill_device(s: &Arc<CudaStream>, n: usize, seed: u64) -> CudaSlice<bf16> {
    let chunk = fill(n.min(1 << 22), seed);
    let mut buf = s.alloc_zeros::<bf16>(n.max(1)).unwrap();
    s.memcpy_htod(&chunk, &mut buf.slice_mut(0..chunk.len()))
        .unwrap();
    let e = std::mem::size_of::<bf16>();
    let mut have = chunk.len();
    {
        let (p, _g) = buf.device_ptr_mut(s);
        while have < n {
            let m = have.min(n - have);
            // SAFETY: [0, m) and [have, have + m) lie inside the buffer and do not overlap.
            let r = unsafe {
                sys::cuMemcpyDtoDAsync_v2(p + (have * e) as u64, p, m * e, s.cu_stream())
            };
            assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "fill copy");
            have += m;
        }
    }
    buf
}

/// Copies a run `[Hkv, n, D]` (head stride `hs` elements) into `dst` at key `at` of a
/// contiguous `[Hkv, keys, D]` buffer: one 2-D copy.
#[allow(clippy::too_many_arguments)]
fn copy_run(
    s: &Arc<CudaStream>,
    src: sys::CUdeviceptr,
    hs: usize,
    n: usize,
    dst: sys::CUdeviceptr,
    keys: usize,
    at: usize,
    shape: &Shape,
) {
    let e = std::mem::size_of::<bf16>();
    let (hkv, d) = (shape.kv_heads, shape.head_dim);
    let p = sys::CUDA_MEMCPY2D_st {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: hs * e,
        dstXInBytes: at * d * e,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst,
        dstArray: std::ptr::null_mut(),
        dstPitch: keys * d * e,
        WidthInBytes: n * d * e,
        Height: hkv,
    };
    // SAFETY: both regions lie inside their buffers (the caller's runs and the key count).
    let r = unsafe { sys::cuMemcpy2DAsync_v2(&p, s.cu_stream()) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "2-D copy");
}

/// Times `f` with CUDA events: the mean of `iters` calls after 3 warm-ups, in ms.
fn time(s: &Arc<CudaStream>, iters: usize, f: &mut dyn FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let ctx = s.context();
    let start = ctx
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    let end = ctx
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap();
    start.record(s).unwrap();
    for _ in 0..iters {
        f();
    }
    end.record(s).unwrap();
    end.synchronize().unwrap();
    start.elapsed_ms(&end).unwrap() as f64 / iters as f64
}

/// The device's copy bandwidth in GB/s: a 1 GiB device-to-device copy, bytes read plus written.
fn copy_bandwidth(s: &Arc<CudaStream>) -> f64 {
    let n = 1usize << 30;
    let src = s.alloc_zeros::<u8>(n).unwrap();
    let mut dst = s.alloc_zeros::<u8>(n).unwrap();
    let ms = time(s, 10, &mut || {
        let (sp, _g1) = src.device_ptr(s);
        let (dp, _g2) = dst.device_ptr_mut(s);
        // SAFETY: both buffers hold n bytes.
        let r = unsafe { sys::cuMemcpyDtoDAsync_v2(dp, sp, n, s.cu_stream()) };
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "copy");
    });
    2.0 * n as f64 / (ms * 1e-3) / 1e9
}

fn bench(kernels: &Kernels, shape: &Shape, iters: usize, consecutive: bool, mode: Mode) {
    let s = kernels.stream().clone();
    let (h, hkv, d) = (shape.heads, shape.kv_heads, shape.head_dim);
    let cached = shape.context - shape.rows;
    let pages_per_seq = cached.div_ceil(PAGE);
    // Page ids: a sequence's page i of this layer at id (seq · pages + i) · LAYERS (the other
    // layers' pages between), or consecutive.
    let stride = if consecutive { 1 } else { LAYERS };
    let arena_pages = shape.seqs * pages_per_seq * stride;
    let arena_rows = arena_pages * PAGE;
    let ak = fill_device(&s, hkv * arena_rows * d, 1);
    let av = fill_device(&s, hkv * arena_rows * d, 2);
    let fresh: Vec<(CudaSlice<bf16>, CudaSlice<bf16>)> = (0..shape.seqs)
        .map(|i| {
            let n = hkv * shape.rows * d;
            let k = s.clone_htod(&fill(n, 10 + i as u64)).unwrap();
            let v = s.clone_htod(&fill(n, 1000 + i as u64)).unwrap();
            (k, v)
        })
        .collect();
    let mut layout = RaggedLayout {
        n_heads: h,
        n_kv_heads: hkv,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
        seqs: Vec::new(),
        row_index: Vec::new(),
        key_index: Vec::new(),
    };
    // (arena row or fresh sequence, keys)
    let mut pieces: Vec<(Result<usize, usize>, usize)> = Vec::new();
    for q in 0..shape.seqs {
        let (r0, k0) = (layout.row_index.len() as u32, layout.key_index.len() as u32);
        layout
            .row_index
            .extend((cached..shape.context).map(|i| i as u32));
        layout.key_index.extend(0..shape.context as u32);
        layout.seqs.push(RaggedSeq {
            rows: r0..r0 + shape.rows as u32,
            keys: k0..k0 + shape.context as u32,
            mask: Mask::Causal,
        });
        let mut left = cached;
        for i in 0..pages_per_seq {
            let n = left.min(PAGE);
            let row = (q * pages_per_seq + i) * stride * PAGE;
            match pieces.last_mut() {
                Some((Ok(start), len)) if *start + *len == row && *len % PAGE == 0 => *len += n,
                _ => pieces.push((Ok(row), n)),
            }
            left -= n;
        }
        pieces.push((Err(q), shape.rows));
    }
    let keys = layout.keys();
    let runs: Vec<KvRun<bf16>> = pieces
        .iter()
        .map(|&(at, n)| match at {
            Ok(row) => KvRun {
                k: ak.slice(row * d..),
                v: av.slice(row * d..),
                keys: n,
                head_stride: arena_rows * d,
            },
            Err(q) => KvRun {
                k: fresh[q].0.slice(..),
                v: fresh[q].1.slice(..),
                keys: n,
                head_stride: n * d,
            },
        })
        .collect();
    let uploaded = LayoutTables::upload(&s, &layout).unwrap();
    let tables = uploaded.tables();
    let dims = RaggedDims::of(&layout);
    let q = s.clone_htod(&fill(layout.rows() * h * d, 99)).unwrap();

    let kv_bytes = (2 * hkv * keys * d * std::mem::size_of::<bf16>()) as f64;
    if let Mode::Kernels { copy_gbs } = mode {
        let table = kernels.upload_runs(&dims, &runs).unwrap();
        let mut out_warp = s.alloc_zeros::<bf16>(layout.rows() * h * d).unwrap();
        let mut out_split = s.alloc_zeros::<bf16>(layout.rows() * h * d).unwrap();
        let mut out_head = s.alloc_zeros::<bf16>(layout.rows() * h * d).unwrap();
        let run = |kernel, out: &mut CudaSlice<bf16>| {
            kernels
                .ragged_attention_runs(kernel, &dims, &tables, &q.as_view(), &table, out)
                .unwrap();
        };
        let t_warp = time(&s, iters, &mut || run(RaggedKernel::Warp, &mut out_warp));
        let t_split = time(&s, iters, &mut || {
            run(RaggedKernel::SplitKey, &mut out_split)
        });
        let t_head = time(&s, iters, &mut || {
            run(RaggedKernel::SplitKeyPerHead, &mut out_head)
        });
        let t_upload = time(&s, iters, &mut || {
            kernels
                .ragged_attention_paged(&dims, &tables, &q.as_view(), &runs, &mut out_split)
                .unwrap();
        });
        let a = s.clone_dtoh(&out_warp).unwrap();
        let b = s.clone_dtoh(&out_split).unwrap();
        let c = s.clone_dtoh(&out_head).unwrap();
        let diff = |x: &[bf16], y: &[bf16]| {
            x.iter()
                .zip(y)
                .map(|(x, y)| (x.to_f32() - y.to_f32()).abs())
                .fold(0f32, f32::max)
        };
        let diff = diff(&a, &b).max(diff(&a, &c));
        let gbs = kv_bytes / (t_split * 1e-3) / 1e9;
        println!(
            "| {} x {} | {}/{} | {} | {} | {:.1} | {:.1} | {:.1} | {:.2}x | {:.1} | {:.0} | {:.0}% | {:.0} | {:.1e} |",
            shape.seqs,
            shape.context,
            h,
            hkv,
            shape.rows,
            runs.len(),
            t_warp * 1e3,
            t_head * 1e3,
            t_split * 1e3,
            t_warp / t_split,
            t_upload * 1e3,
            gbs,
            100.0 * gbs / copy_gbs,
            kv_bytes / (t_warp * 1e-3) / 1e9,
            diff,
        );
        assert!(
            diff < 3e-2 && b.iter().all(|x| x.to_f32().is_finite()),
            "the split-key kernel's output differs from the one-warp kernel's by {diff}"
        );
        return;
    }
    // The path before paging: the concatenated buffers only this mode uses.
    let mut out_paged = s.alloc_zeros::<bf16>(layout.rows() * h * d).unwrap();
    let mut out_cat = s.alloc_zeros::<bf16>(layout.rows() * h * d).unwrap();
    let mut cat_k = s.alloc_zeros::<bf16>(hkv * keys * d).unwrap();
    let mut cat_v = s.alloc_zeros::<bf16>(hkv * keys * d).unwrap();
    let paged = |out: &mut CudaSlice<bf16>| {
        kernels
            .ragged_attention_paged(&dims, &tables, &q.as_view(), &runs, out)
            .unwrap();
    };
    let mut concatenated = |out: &mut CudaSlice<bf16>| {
        let mut at = 0;
        {
            let (dk, _gk) = cat_k.device_ptr_mut(&s);
            let (dv, _gv) = cat_v.device_ptr_mut(&s);
            for r in &runs {
                let (kp, _g1) = r.k.device_ptr(&s);
                let (vp, _g2) = r.v.device_ptr(&s);
                copy_run(&s, kp, r.head_stride, r.keys, dk, keys, at, shape);
                copy_run(&s, vp, r.head_stride, r.keys, dv, keys, at, shape);
                at += r.keys;
            }
        }
        kernels
            .ragged_attention_with(
                &dims,
                &tables,
                &q.as_view(),
                &cat_k.as_view(),
                &cat_v.as_view(),
                out,
            )
            .unwrap();
    };
    let t_paged = time(&s, iters, &mut || paged(&mut out_paged));
    let t_cat = time(&s, iters, &mut || concatenated(&mut out_cat));
    let a = s.clone_dtoh(&out_paged).unwrap();
    let b = s.clone_dtoh(&out_cat).unwrap();
    let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
    println!(
        "| {} x {} | {}/{} | {} | {} | {:.1} | {:.1} | {:.2}x | {:.0} | {:.0} | {} |",
        shape.seqs,
        shape.context,
        h,
        hkv,
        shape.rows,
        runs.len(),
        t_cat * 1e3,
        t_paged * 1e3,
        t_cat / t_paged,
        kv_bytes / (t_cat * 1e-3) / 1e9,
        kv_bytes / (t_paged * 1e-3) / 1e9,
        if same { "yes" } else { "NO" },
    );
    assert!(
        same,
        "the paged kernel's output differs from the concatenated path's"
    );
}

#[derive(Clone, Copy)]
enum Mode {
    Kernels { copy_gbs: f64 },
    Concatenate,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let iters = args
        .iter()
        .position(|a| a == "--iters")
        .and_then(|i| args.get(i + 1))
        .map_or(20, |v| v.parse().expect("--iters N"));
    let consecutive = args.iter().any(|a| a == "--consecutive");
    let ctx = CudaContext::new(0).expect("a CUDA device");
    let kernels = Kernels::load(&ctx).expect("PTX loads");
    let ids = if consecutive {
        "consecutive ids"
    } else {
        "a layer's pages 32 ids apart"
    };
    let mode = if args.iter().any(|a| a == "--concatenate") {
        println!(
            "ragged attention, bf16, heads of 128, pages of {PAGE} ({ids}), {iters} iterations"
        );
        println!();
        println!("| sequences x context | heads / kv heads | rows / seq | runs | concatenate + kernel (us) | paged kernel (us) | ratio | GB/s of K/V, concatenated | GB/s of K/V, paged | same output |");
        println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---|");
        Mode::Concatenate
    } else {
        let copy_gbs = copy_bandwidth(kernels.stream());
        println!(
            "ragged attention, bf16, heads of 128, pages of {PAGE} ({ids}), {iters} iterations; {} multiprocessors; copy bandwidth {copy_gbs:.0} GB/s (1 GiB device to device, read + written)",
            kernels.multiprocessors()
        );
        println!();
        println!("| sequences x context | heads / kv heads | rows / seq | runs | one warp (us) | split-key, a head per block (us) | split-key, a kv group per block (us) | one warp / split-key | split-key + table upload (us) | GB/s of K/V, split-key | of copy bandwidth | GB/s of K/V, one warp | max diff |");
        println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        Mode::Kernels { copy_gbs }
    };
    // (sequences, context, rows per sequence, kv heads): decodes, then canvases and a prefill,
    // then the long decode (the largest arenas) last.
    for (seqs, context, rows, kv_heads) in [
        (1, 512, 1, 8),
        (1, 4096, 1, 8),
        (8, 4096, 1, 8),
        (32, 4096, 1, 8),
        (8, 4096, 1, 32),
        (8, 4096, 32, 8),
        (32, 1024, 32, 8),
        (8, 4096, 32, 32),
        (1, 4096, 4096, 8),
        (8, 16384, 1, 8),
    ] {
        let shape = Shape {
            seqs,
            context,
            rows,
            heads: 32,
            kv_heads,
            head_dim: 128,
        };
        bench(&kernels, &shape, iters, consecutive, mode);
    }
}
