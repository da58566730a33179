#!/usr/bin/env python3
"""What a careful float32 implementation reaches on the model `bench-numerics` measures: the same
LLaDA-shaped weights run in PyTorch (plain tensor ops in the order of upstream's
`modeling_llada.py`: RMSNorm statistic in float32, rotary embeddings at float32 angles,
`scaled_dot_product_attention`, gated SiLU MLP) in float32 and in float64, beside wavefront's
float32 and float64 logits of the same canvas.

    pip install torch safetensors
    cargo build --release -p wavefront-bench --bin bench-numerics
    target/release/bench-numerics --export /tmp/numerics
    python scripts/numerics-torch.py /tmp/numerics

Prints, against PyTorch's float64 logits: each float32 forward's logits error (max |diff| over
the logits' range) and the largest change of a row's confidence (softmax maximum, computed in
float64 as WINO does); and wavefront's float64 against PyTorch's float64 (the two references
agree, so the comparison measures float32 error, not a difference of semantics).
"""

import json
import sys

import torch
from safetensors.torch import load_file


def forward(w, cfg, ids, dtype):
    d, h = cfg["d_model"], cfg["n_heads"]
    hd = d // h
    eps = cfg["rms_norm_eps"]
    p = "model.transformer."
    get = lambda name: w[p + name].to(dtype)

    def rms(x, weight):
        # Upstream: the statistic in float32 (float64 stays float64 here: the reference).
        xf = x.to(torch.float64 if dtype == torch.float64 else torch.float32)
        var = xf.pow(2).mean(-1, keepdim=True)
        return (xf * torch.rsqrt(var + eps)).to(dtype) * weight

    n = ids.shape[0]
    pos = torch.arange(n, dtype=torch.float32)
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(pos, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def rope(t):
        t1, t2 = t[..., : hd // 2], t[..., hd // 2:]
        return t * cos + torch.cat([-t2, t1], dim=-1) * sin

    x = get("wte.weight")[ids]
    for i in range(cfg["n_layers"]):
        b = f"blocks.{i}."
        hn = rms(x, get(b + "attn_norm.weight"))
        q = (hn @ get(b + "q_proj.weight").T).view(n, h, hd).transpose(0, 1)
        k = (hn @ get(b + "k_proj.weight").T).view(n, h, hd).transpose(0, 1)
        v = (hn @ get(b + "v_proj.weight").T).view(n, h, hd).transpose(0, 1)
        att = torch.nn.functional.scaled_dot_product_attention(rope(q), rope(k), v)
        x = x + att.transpose(0, 1).reshape(n, d) @ get(b + "attn_out.weight").T
        hn = rms(x, get(b + "ff_norm.weight"))
        g = hn @ get(b + "ff_proj.weight").T
        u = hn @ get(b + "up_proj.weight").T
        x = x + (torch.nn.functional.silu(g) * u) @ get(b + "ff_out.weight").T
    x = rms(x, get("ln_f.weight"))
    return x @ get("ff_out.weight").T


def confidence(logits):
    return torch.softmax(logits.to(torch.float64), dim=-1).max(dim=-1).values


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/numerics"
    torch.set_num_threads(1)
    cfg = json.load(open(f"{out}/config.json"))
    w = load_file(f"{out}/model.safetensors")
    o = load_file(f"{out}/outputs.safetensors")
    ids = o["ids"].long()
    with torch.inference_mode():
        t64 = forward(w, cfg, ids, torch.float64)
        t32 = forward(w, cfg, ids, torch.float32)
    scale = t64.abs().max().item()
    ref_conf = confidence(t64)
    rows = [
        ("PyTorch float32", t32),
        ("wavefront float32 (CPU kernels)", o["logits_f32"]),
        ("wavefront float64 (candle, the reference)", o["logits_f64"]),
    ]
    print(f"{ids.shape[0]}-row canvas; against PyTorch float64 (largest |logit| {scale:.3f}):\n")
    print("| forward | logits max \\|diff\\| / range | confidence max \\|diff\\| |")
    print("|---|---:|---:|")
    for name, l in rows:
        l = l.to(torch.float64)
        e = (l - t64).abs().max().item() / scale
        c = (confidence(l) - ref_conf).abs().max().item()
        print(f"| {name} | {e:.2e} | {c:.2e} |")


if __name__ == "__main__":
    main()
