"""Torch layers the Llama-shaped families share (Llama for ARMT, Qwen3 for ReFusion; LLaDA
uses the RoPE), under the Hugging Face parameter names their checkpoints use."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def rope_half(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of [b, h, t, d] at positions [b, t] (or [t]), in float32."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.float()[..., None] * inv
    if ang.dim() == 3:
        ang = ang[:, None]
    emb = torch.cat([ang, ang], dim=-1)
    xf = x.float()
    half = torch.cat([-xf[..., d // 2 :], xf[..., : d // 2]], dim=-1)
    return (xf * emb.cos() + half * emb.sin()).to(x.dtype)


class GatedMlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Causal grouped-query attention; `qk_norm` adds Qwen3's per-head RMSNorm of q and k."""

    def __init__(self, c, qk_norm: bool):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        if qk_norm:
            self.q_norm = nn.RMSNorm(c.head_dim, eps=c.eps)
            self.k_norm = nn.RMSNorm(c.head_dim, eps=c.eps)
        self.qk_norm = qk_norm

    def forward(self, x, positions):
        b, t, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(b, t, c.heads, c.head_dim)
        k = self.k_proj(x).view(b, t, c.kv_heads, c.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope_half(q, positions, c.rope_theta), rope_half(k, positions, c.rope_theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: `x += attn(norm(x))`, `x += mlp(norm(x))`."""

    def __init__(self, c, qk_norm: bool):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden, eps=c.eps)
        self.self_attn = Attention(c, qk_norm)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden, eps=c.eps)
        self.mlp = GatedMlp(c.hidden, c.intermediate)

    def forward(self, x, positions):
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))
