"""Train a small Huginn (recurrent depth) and write it in huginn-0125's layout.

Objective (Geiping et al., 2025, section 3): next-token prediction through a prelude, a core
block iterated r times on a latent state that starts from noise and receives the prelude's
output at every step (input injection through the adapter), and a coda. Per step the number
of iterations is drawn from the paper's log-normal Poisson distribution around the mean
recurrence, and gradients flow only through the last `mean_backprop_depth` iterations
(truncated backpropagation; earlier ones run without a graph).

    python training/huginn.py --out models/huginn-tiny        # about 90 minutes on 2 cores
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# Huginn's special tokens, in its tokenizer's order.
SPECIALS = [
    "<|begin_text|>",
    "<|end_text|>",
    "<|begin_header|>",
    "<|end_header|>",
    "<|end_turn|>",
    "<|pad|>",
]
BEGIN = END = -1  # set by `main` from the tokenizer


class Config:
    n_embd = 256
    n_heads = 4
    prelude = 1
    core = 2
    coda = 1
    intermediate = 576
    vocab = 2048
    block_size = 1024
    rope_base = 50000.0
    eps = 1e-6
    mean_recurrence = 8
    mean_backprop_depth = 4
    seq_len = 256

    @property
    def head_dim(self):
        return self.n_embd // self.n_heads

    @property
    def effective_depth(self):
        return self.prelude + self.coda + self.core * self.mean_recurrence

    @property
    def std(self):
        return math.sqrt(2 / (5 * self.n_embd))  # "takase"

    @property
    def embed_scale(self):
        return math.sqrt(self.n_embd)


def freqs(c: Config, t: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    d = c.head_dim
    inv = 1.0 / (c.rope_base ** (torch.arange(0, d, 2, device=device, dtype=torch.float32)[: d // 2] / d))
    ang = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def rope_interleaved(x, cos, sin):
    """Complex-multiplication RoPE on pairs (x[2i], x[2i+1]) of [b, t, h, d], in float32."""
    b, t, h, d = x.shape
    xf = x.float().view(b, t, h, d // 2, 2)
    a, bb = xf[..., 0], xf[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([a * cos - bb * sin, a * sin + bb * cos], dim=-1).view(b, t, h, d).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.Wqkv = nn.Linear(c.n_embd, 3 * c.n_embd, bias=False)
        self.proj = nn.Linear(c.n_embd, c.n_embd, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, c.n_heads, c.head_dim))

    def forward(self, x, cos, sin):
        b, t, e = x.shape
        h, d = self.c.n_heads, self.c.head_dim
        q, k, v = self.Wqkv(x).view(b, t, 3, h, d).unbind(2)
        q = rope_interleaved(q + self.qk_bias[0], cos, sin)
        k = rope_interleaved(k + self.qk_bias[1], cos, sin)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, e))


class Mlp(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.fc = nn.Linear(c.n_embd, 2 * c.intermediate, bias=False)
        self.proj = nn.Linear(c.intermediate, c.n_embd, bias=False)

    def forward(self, x):
        g, u = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(g) * u)


class SandwichBlock(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.norm_1 = nn.RMSNorm(c.n_embd, eps=c.eps)
        self.attn = Attention(c)
        self.norm_2 = nn.RMSNorm(c.n_embd, eps=c.eps)
        self.norm_3 = nn.RMSNorm(c.n_embd, eps=c.eps)
        self.mlp = Mlp(c)
        self.norm_4 = nn.RMSNorm(c.n_embd, eps=c.eps)

    def forward(self, x, cos, sin):
        h = self.norm_2(x + self.attn(self.norm_1(x), cos, sin))
        return self.norm_4(h + self.mlp(self.norm_3(h)))


class Huginn(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c.vocab, c.n_embd)
        self.prelude = nn.ModuleList(SandwichBlock(c) for _ in range(c.prelude))
        self.adapter = nn.Linear(2 * c.n_embd, c.n_embd, bias=False)
        self.core_block = nn.ModuleList(SandwichBlock(c) for _ in range(c.core))
        self.coda = nn.ModuleList(SandwichBlock(c) for _ in range(c.coda))
        self.ln_f = nn.RMSNorm(c.n_embd, eps=c.eps)
        out_std = c.std / math.sqrt(2 * c.effective_depth)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.trunc_normal_(p, std=out_std if name.endswith("proj.weight") else c.std, a=-3 * c.std, b=3 * c.std)

    def initial_state(self, like, gen=None):
        s = torch.empty_like(like, dtype=torch.float32)
        nn.init.trunc_normal_(s, std=self.c.std, a=-3 * self.c.std, b=3 * self.c.std, generator=gen)
        return (s * self.c.embed_scale).to(like.dtype)

    def core_step(self, state, injected, cos, sin):
        x = self.adapter(torch.cat([state, injected], dim=-1))
        for b in self.core_block:
            x = b(x, cos, sin)
        return x

    def forward(self, ids, steps_no_grad: int, steps_grad: int, gen=None):
        t = ids.shape[1]
        cos, sin = freqs(self.c, t, ids.device)
        x = self.wte(ids) * self.c.embed_scale
        for b in self.prelude:
            x = b(x, cos, sin)
        state = self.initial_state(x, gen)
        with torch.no_grad():
            for _ in range(steps_no_grad):
                state = self.core_step(state, x, cos, sin)
        for _ in range(steps_grad):
            state = self.core_step(state, x, cos, sin)
        y = self.ln_f(state)
        for b in self.coda:
            y = b(y, cos, sin)
        return F.linear(self.ln_f(y), self.wte.weight)

    def upstream_tensors(self) -> dict:
        out = {"transformer." + k: v for k, v in self.state_dict().items()}
        cos, sin = freqs(self.c, self.c.block_size, "cpu")
        out["freqs_cis"] = torch.stack([cos, sin], dim=-1)[None, :, None]
        return out


def sample_recurrence(c: Config, rng: random.Random) -> tuple[int, int]:
    """(iterations without gradient, with gradient): r ~ Poisson(exp(N(log r̄ - σ²/2, σ))) + 1."""
    sigma = 0.5
    rate = math.exp(rng.gauss(math.log(c.mean_recurrence) - sigma**2 / 2, sigma))
    r, threshold, prod = 0, math.exp(-rate), rng.random()
    while prod > threshold:  # Knuth's Poisson sampler
        r += 1
        prod *= rng.random()
    r += 1
    k = min(r, c.mean_backprop_depth)
    return r - k, k


def windows(stream, n, length, rng):
    starts = [rng.randrange(0, len(stream) - length - 1) for _ in range(n)]
    return torch.tensor([stream[s : s + length + 1] for s in starts])


def task_rows(tok, examples, n, length):
    rows = []
    for _ in range(n):
        row = []
        while len(row) < length + 1:
            _, p, a = next(examples)
            row += [BEGIN] + tok.encode(p + a).ids + [END]
        rows.append(row[: length + 1])
    return torch.tensor(rows)


@torch.no_grad()
def held_out_loss(model, stream, length, device, n=32, seed=7) -> float:
    rng = random.Random(seed)
    x = windows(stream, n, length, rng).to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = model(x[:, :-1], model.c.mean_recurrence, 0, gen)
    return F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten()).item()


@torch.no_grad()
def generate(model, prompt: list[int], n: int, device, seed=0) -> list[int]:
    """Greedy static-r decoding at the mean recurrence (a monitor, not the server)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def last_logits(ids):
        return model(torch.tensor([ids], device=device), model.c.mean_recurrence, 0, gen)[0, -1]

    return common.greedy(last_logits, prompt, n, END)


def main():
    args = common.base_args(__doc__.splitlines()[0], minutes=90).parse_args()
    device, docs = common.setup(args)
    c = Config()
    if args.smoke:
        c.seq_len = 64
    base = common.train_tokenizer(docs["train"], args.seed)
    from tokenizers import processors

    global BEGIN, END
    tok = common.with_specials(base, SPECIALS)
    BEGIN, END = tok.token_to_id(SPECIALS[0]), tok.token_to_id(SPECIALS[1])
    # Huginn's template: `<|begin_text|> $A <|end_text|>` (the server drops the trailing end).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIALS[0]} $A {SPECIALS[1]}",
        pair="$A $B:1",
        special_tokens=[(SPECIALS[0], BEGIN), (SPECIALS[1], END)],
    )
    train = common.token_stream(tok, docs["train"], END, BEGIN)
    held = common.token_stream(tok, docs["held_out"], END, BEGIN)
    held_len = min(c.seq_len, len(held) - 2)
    model = Huginn(c).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Huginn: {n_params / 1e6:.2f} M parameters, {len(train)} training prose tokens", flush=True)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    examples = common.task_examples(args.seed, "train")
    trainer = common.Trainer(model, args, device, 5000, lambda: held_out_loss(model, held, held_len, device))

    def loss_of(x, no_grad, with_grad):
        logits = model(x[:, :-1], no_grad, with_grad)
        return F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())

    while trainer.running():
        x = torch.cat([windows(train, 12, c.seq_len, rng), task_rows(tok, examples, 4, c.seq_len)]).to(device)
        recurrence = sample_recurrence(c, rng)
        trainer.step(lambda: loss_of(x, *recurrence), x.numel())
    final = trainer.finish()
    prog = trainer.prog
    encode = lambda text: [BEGIN] + tok.encode(text, add_special_tokens=False).ids  # noqa: E731
    accuracy = common.task_accuracy(lambda p: tok.decode(generate(model, encode(p), 16, device)), 2 if args.smoke else 100)
    prompt = "In the beginning, God"
    sample = tok.decode(generate(model, encode(prompt), 8 if args.smoke else 32, device))
    report = {
        "family": "huginn",
        "parameters": n_params,
        **prog.summary(),
        "device": str(device),
        "held_out_loss": final,
        "unigram_held_out_loss": common.unigram_loss(train, held, c.vocab),
        "held_out_accuracy_python_static_r": accuracy,
        "sample": prompt + sample,
    }
    print(report, flush=True)
    config = {
        "activation_checkpoint_impl": "per-iteration",
        "architecture_class_name": "RecurrentGPT",
        "architectures": ["RavenForCausalLM"],
        "auto_map": {
            "AutoConfig": "raven_config_minimal.RavenConfig",
            "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
        },
        "bias": False,
        "block_class_name": "SandwichBlock",
        "block_size": c.block_size,
        "bos_token_id": BEGIN,
        "effective_expected_depth": c.effective_depth,
        "eos_token_id": END,
        "head_dim": c.head_dim,
        "init_orthogonal": False,
        "init_strategy": "takase",
        "init_values": {
            "embed_scale": c.embed_scale,
            "embedding": c.std,
            "out_proj": c.std / math.sqrt(2 * c.effective_depth),
            "std": c.std,
        },
        "injection_type": "linear",
        "intermediate_size": c.intermediate,
        "mean_backprop_depth": c.mean_backprop_depth,
        "mean_recurrence": c.mean_recurrence,
        "mlp_class_name": "GatedMLP",
        "model_type": "huginn_raven",
        "n_embd": c.n_embd,
        "n_heads": c.n_heads,
        "n_layers": c.prelude + c.core + c.coda,
        "n_layers_in_coda": c.coda,
        "n_layers_in_prelude": c.prelude,
        "n_layers_in_recurrent_block": c.core,
        "nonlin_name": "SiLU",
        "norm_class_name": "RMSNorm_llama",
        "norm_eps": c.eps,
        "num_key_value_heads": c.n_heads,
        "pad_token_id": tok.token_to_id("<|pad|>"),
        "padded_vocab_size": c.vocab,
        "padding_multiple": 64,
        "qk_bias": True,
        "rope_base": c.rope_base,
        "sampling_scheme": "poisson-lognormal-filling",
        "state_init": "like-init",
        "test_time_noise": 0,
        "test_time_noise_type": "fixed",
        "tie_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": c.vocab,
    }
    out = Path(args.out)
    common.save_checkpoint(out, model.upstream_tensors(), config, tok, keep_f32=("freqs_cis",))
    common.write_report(out, report)
    common.plot_loss(prog, out / "loss.png", f"Huginn {n_params / 1e6:.1f}M: next-token loss at random depth")


if __name__ == "__main__":
    main()
