#!/usr/bin/env python3
"""The shapes of `bench-forward`, built from stock `transformers` layers in PyTorch eager, timed
side by side with wavefront's in one run.

    pip install torch transformers
    cargo build --release -p wavefront-bench --bin bench-forward
    python scripts/compare-torch.py [--threads N] [--rounds R] [--weight-dtype f32|bf16|bf16-dot]
                                    [--torch-dtype f32|bf16]

Both sides run on the same number of threads (default: the machine's cores), float32 unless
asked (`--torch-dtype bf16 --weight-dtype bf16-dot`: both in bf16, PyTorch's eager bf16 modules
against wavefront's bf16 products with float32 accumulation), random weights of the same
shapes, and report the median time of one call over a fixed duration after warm-up. Rounds
alternate PyTorch and wavefront so that both see the same machine (and which goes first
alternates from round to round); the table gives each side's median over the rounds and the
ratio PyTorch time / wavefront time (above 1: wavefront is faster).

PyTorch shapes (what each wavefront shape does, in stock layers):
- decode-kv{32,512,4096}: `Qwen3Model` (hidden 512, 8 layers, 8/4 heads of 64, MLP 1536) plus
  an `nn.Linear` head over a vocabulary of 32768, one token over a `DynamicCache` of that many
  positions (cropped back after every call);
- huginn-core-{1,20}: an `nn.Linear` adapter (2048 -> 1024) and 4 `LlamaDecoderLayer`s (width
  1024, 8 heads, MLP 3456) over 1 and 20 rows after 32 cached positions, the looped stack of
  Huginn's core for one recurrence;
- llada-{160,288}: `LlamaModel` (d_model 512, 8 layers, 8 heads, MLP 1536) over a 160 / 288-row
  canvas with a zero (bidirectional) 4-D mask, no head;
- armt-segment-272: `LlamaModel` (512, 8 layers, 8/2 heads, MLP 1536) over 272 causal rows, with
  ARMT's associative-memory read and write per layer (DPFP-3 features of a 64-dim projection,
  `A` 384 x 512, `z` 384) around each decoder layer;
- head-{1,32}: `nn.Linear(1024, 32768)` over 1 and 32 rows.

End to end (`--generate`): stock `Qwen3ForCausalLM.generate` (greedy, 128 new tokens after a
32-token prompt, no end-of-sequence token) against wavefront's `ar` scheme on the same shape
served through the engine (`bench-slot-diffusion --gen-length 128`, its `ar (baseline)` row).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def timed(fn, seconds):
    fn()
    fn()
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def build(torch, dtype):
    from transformers import LlamaConfig, LlamaModel, Qwen3Config, Qwen3Model
    from transformers.cache_utils import DynamicCache
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    shapes = {}

    # Qwen3 decode over a cache.
    qcfg = Qwen3Config(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=1536, vocab_size=32768, max_position_embeddings=8192,
        attn_implementation="sdpa",
    )
    qwen = Qwen3Model(qcfg).eval().to(dtype)
    qhead = torch.nn.Linear(512, 32768, bias=False).to(dtype)
    for t in (32, 512, 4096):
        cache = DynamicCache(config=qcfg)
        ids = torch.arange(t).remainder(30000).unsqueeze(0)
        qwen(input_ids=ids, past_key_values=cache, use_cache=True)
        tok = torch.tensor([[7]])
        pos = torch.tensor([[t]])

        def step(cache=cache, tok=tok, pos=pos):
            h = qwen(input_ids=tok, position_ids=pos, past_key_values=cache, use_cache=True)
            qhead(h.last_hidden_state)
            cache.crop(-1)

        shapes[f"decode-kv{t}"] = step

    # Huginn's core: adapter + 4 Llama layers over rows after a 32-position cache.
    hcfg = LlamaConfig(
        hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        intermediate_size=3456, vocab_size=32768, max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    layers = [LlamaDecoderLayer(hcfg, i).eval().to(dtype) for i in range(4)]
    adapter = torch.nn.Linear(2048, 1024, bias=False).to(dtype)
    rope = LlamaRotaryEmbedding(hcfg)
    for rows in (1, 20):
        cache = DynamicCache(config=hcfg)
        prompt = 32
        x = torch.randn(1, prompt, 1024, dtype=dtype)
        pos = torch.arange(prompt).unsqueeze(0)
        pe = rope(x, pos)
        mask = torch.full((prompt, prompt), float("-inf")).triu(1)[None, None].to(dtype)
        for layer in layers:
            x = layer(x, attention_mask=mask, position_ids=pos, past_key_values=cache,
                      use_cache=True, position_embeddings=pe)
            x = x[0] if isinstance(x, tuple) else x
        state = torch.randn(1, rows, 1024, dtype=dtype)
        inj = torch.randn(1, rows, 1024, dtype=dtype)
        rpos = torch.arange(prompt, prompt + rows).unsqueeze(0)
        rpe = rope(state, rpos)
        rmask = torch.zeros(rows, prompt + rows)
        rmask[:, prompt:] = torch.full((rows, rows), float("-inf")).triu(1)
        rmask = rmask[None, None].to(dtype)

        def core(cache=cache, state=state, inj=inj, rpos=rpos, rpe=rpe, rmask=rmask, rows=rows):
            h = adapter(torch.cat([state, inj], dim=-1))
            for layer in layers:
                h = layer(h, attention_mask=rmask, position_ids=rpos, past_key_values=cache,
                          use_cache=True, position_embeddings=rpe)
                h = h[0] if isinstance(h, tuple) else h
            cache.crop(-rows)

        shapes[f"huginn-core-{rows}"] = core

    # LLaDA: bidirectional Llama stack over a canvas.
    lcfg = LlamaConfig(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
        intermediate_size=1536, vocab_size=32768, max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    llada = LlamaModel(lcfg).eval().to(dtype)
    for n in (160, 288):
        ids = (torch.arange(n) * 7).remainder(32000).unsqueeze(0)
        zero = torch.zeros(1, 1, n, n, dtype=dtype)
        shapes[f"llada-{n}"] = lambda ids=ids, zero=zero: llada(input_ids=ids, attention_mask=zero)

    # ARMT: causal Llama stack over a 272-row segment with associative memory read and write.
    acfg = LlamaConfig(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=1536, vocab_size=32000, max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    armt = LlamaModel(acfg).eval().to(dtype)
    d, dm, m = 512, 64, 16
    dk = 6 * dm
    wq = [torch.nn.Linear(d, dm, bias=False).to(dtype) for _ in range(8)]
    wkvb = [torch.nn.Linear(d, dm + d + 1, bias=True).to(dtype) for _ in range(8)]
    mem_a = [torch.zeros(dk, d) for _ in range(8)]
    mem_z = [torch.zeros(dk) for _ in range(8)]
    arope = armt.rotary_emb

    def dpfp(x):
        x = torch.cat([torch.relu(x), torch.relu(-x)], dim=-1)
        rolled = torch.cat([x * torch.roll(x, shifts=j, dims=-1) for j in (1, 2, 3)], dim=-1)
        return rolled

    seg = (torch.arange(256) * 13).remainder(32000).unsqueeze(0)
    mem_tokens = torch.randn(1, m, d, dtype=dtype)

    def armt_segment():
        x = torch.cat([armt.embed_tokens(seg), mem_tokens], dim=1)
        n = x.shape[1]
        pos = torch.arange(n).unsqueeze(0)
        pe = arope(x, pos)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None].to(dtype)
        for i, layer in enumerate(armt.layers):
            q = dpfp(wq[i](x).float())
            read = (q @ mem_a[i]) / (q @ mem_z[i] + 1e-5).unsqueeze(-1)
            x = x + read.to(dtype)
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
            x = x[0] if isinstance(x, tuple) else x
            p = wkvb[i](x[:, -m:]).float()
            k, v, b = dpfp(p[..., :dm]), p[..., dm:dm + d], torch.sigmoid(p[..., -1:])
            prev = (k @ mem_a[i]) / (k @ mem_z[i] + 1e-5).unsqueeze(-1)
            mem_a[i] = mem_a[i] + (k * b).transpose(-1, -2).squeeze(0) @ (v - prev).squeeze(0)
            mem_z[i] = mem_z[i] + k.sum(dim=(0, 1))
        return x

    armt_segment()
    shapes["armt-segment-272"] = armt_segment

    head = torch.nn.Linear(1024, 32768, bias=False).to(dtype)
    for rows in (1, 32):
        hidden = torch.randn(rows, 1024, dtype=dtype)
        shapes[f"head-{rows}"] = lambda hidden=hidden: head(hidden)
    return shapes


def torch_round(torch, shapes, seconds):
    with torch.inference_mode():
        return {name: timed(fn, seconds) * 1e3 for name, fn in shapes.items()}


def wavefront_round(binary, threads, seconds, weight_dtype):
    out = subprocess.run(
        [binary, "--json", "--threads", str(threads), "--seconds", str(seconds),
         "--weight-dtype", weight_dtype],
        check=True, capture_output=True, text=True,
    )
    report = json.loads(out.stdout)
    return report, {s["shape"]: s["ms"] for s in report["shapes"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--weight-dtype", default="f32", choices=["f32", "bf16", "bf16-dot"],
                    help="wavefront's weight storage")
    ap.add_argument("--torch-dtype", default="f32", choices=["f32", "bf16"],
                    help="PyTorch's module and activation dtype")
    ap.add_argument("--binary", default="target/release/bench-forward")
    ap.add_argument("--generate", action="store_true",
                    help="also time 128-token greedy generation end to end")
    a = ap.parse_args()

    import torch
    import transformers

    torch.set_num_threads(a.threads)
    shapes = build(torch, {"f32": torch.float32, "bf16": torch.bfloat16}[a.torch_dtype])
    tt, wt, report = {}, {}, None
    for r in range(a.rounds):
        # Which side goes first alternates too: of two runs back to back on these VMs the
        # second was measured 5-15% slower, whichever it was.
        for side in ("pytorch", "wavefront") if r % 2 == 0 else ("wavefront", "pytorch"):
            print(f"round {r + 1}/{a.rounds}: {side}", file=sys.stderr)
            if side == "pytorch":
                for k, v in torch_round(torch, shapes, a.seconds).items():
                    tt.setdefault(k, []).append(v)
            else:
                report, times = wavefront_round(a.binary, a.threads, a.seconds, a.weight_dtype)
                for k, v in times.items():
                    wt.setdefault(k, []).append(v)

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{a.threads} threads; PyTorch {a.torch_dtype}, wavefront weights {a.weight_dtype}; "
          f"{a.rounds} alternating rounds, "
          f"median ms per call")
    print(f"machine peaks (wavefront's measure, last round): read {report['read_bandwidth_gb_per_s']:.1f} GB/s, "
          f"FMA {report['fma_peak_gflop_per_s']:.1f} GFLOP/s\n")
    print("| shape | PyTorch ms | wavefront ms | ratio (PyTorch / wavefront) | wavefront of roofline |")
    print("|---|---:|---:|---:|---:|")
    roof = {s["shape"]: s["roofline_fraction"] for s in report["shapes"]}
    for name in shapes:
        if name not in wt:
            continue
        p, w = statistics.median(tt[name]), statistics.median(wt[name])
        print(f"| {name} | {p:.3f} | {w:.3f} | {p / w:.2f} | {100 * roof[name]:.0f}% |")
    if a.generate:
        generate(torch, a)


def generate(torch, a):
    """Stock `generate` against wavefront's `ar` scheme, 128 greedy tokens, alternating."""
    import re
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=1536, vocab_size=32768, max_position_embeddings=8192,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=0,
        attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 32000, (1, 32))
    bench = a.binary.replace("bench-forward", "bench-slot-diffusion")
    tt, wt = [], []
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        for r in range(a.rounds):
            print(f"generate round {r + 1}/{a.rounds}", file=sys.stderr)
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=128, min_new_tokens=128, do_sample=False)
            tt.append(time.perf_counter() - t)
            out = subprocess.run(
                [bench, "--gen-length", "128", "--concurrency", "1", "--threads", str(a.threads),
                 "--weight-dtype", a.weight_dtype],
                check=True, capture_output=True, text=True,
            ).stdout
            row = next(l for l in out.splitlines() if l.startswith("| ar (baseline)"))
            wt.append(float(re.split(r"\s*\|\s*", row)[4]))
    p, w = statistics.median(tt), statistics.median(wt)
    print("\n| end to end | PyTorch s | wavefront s | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| Qwen3 greedy, 32-token prompt + 128 new (`generate` / `ar` scheme) | {p:.2f} | {w:.2f} | {p / w:.2f} |")


if __name__ == "__main__":
    main()
