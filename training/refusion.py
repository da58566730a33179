"""Train a small ReFusion (slot diffusion on Qwen3) and write it in ReFusion's layout.

Objective (ReFusion, section 4.3): each (prompt, response) pair's response is cut into slots
of k tokens (k drawn per batch from {4, 8}); a random share t ~ U(0, 1) of the slots is masked;
the clean slots are put in a random order after the prompt and the masked slots follow in
their original order, every token keeping its original position id (RoPE on explicit
positions, causal attention). The loss is the sum of an autoregressive loss on the clean
slots (each token predicts the next one of its slot; a slot's first token is the planning
step's to predict, so it is not scored from the slot before it) and a denoising loss on the
masked slots (each masked position predicts its own token, weighted by 1 / t). Padding after
a short response is not scored.

Pairs: task lines (prompt, answer + `<|im_end|>`), and prose windows cut at a random point
(prompt: 8 to 32 tokens, response: the next 64).

    python training/refusion.py --out models/refusion-tiny    # about 90 minutes on 2 cores
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import layers  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"]
PAD = EOS = MASK = -1  # set by `main` from the tokenizer
IGNORE = -100


class Config:
    hidden = 256
    heads = 4
    kv_heads = 2
    head_dim = 64
    layers = 4
    intermediate = 640
    vocab = 2048
    rope_theta = 1_000_000.0
    eps = 1e-6
    response_len = 64
    slot_sizes = (4, 8)


class Qwen3(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(layers.DecoderLayer(c, qk_norm=True) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.hidden, eps=c.eps)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids, positions):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.lm_head(self.norm(x))

    def upstream_tensors(self) -> dict:
        out = {}
        for k, v in self.state_dict().items():
            out[k if k.startswith("lm_head") else "model." + k] = v
        return out


def corrupt(prompt: list[int], response: list[int], k: int, length: int, rng: random.Random):
    """One training row: (ids, positions, AR targets, denoising targets, denoising weights).

    The response is padded with PAD to `length` (a multiple of k); PAD is never a target."""
    response = (response + [PAD] * length)[:length]
    p = len(prompt)
    slots = [list(range(p + i, p + i + k)) for i in range(0, length, k)]
    t = rng.random()
    masked = [s for s in slots if rng.random() < t]
    clean = [s for s in slots if s not in masked]
    rng.shuffle(clean)
    full = prompt + response
    ids, pos, ar, dn, w = list(prompt), list(range(p)), [IGNORE] * p, [IGNORE] * p, [0.0] * p
    for s in clean:
        for j, q in enumerate(s):
            ids.append(full[q])
            pos.append(q)
            nxt = full[s[j + 1]] if j + 1 < k else PAD
            ar.append(nxt if nxt != PAD else IGNORE)
            dn.append(IGNORE)
            w.append(0.0)
    for s in sorted(masked):
        for q in s:
            ids.append(MASK)
            pos.append(q)
            ar.append(IGNORE)
            dn.append(full[q] if full[q] != PAD else IGNORE)
            w.append(1.0 / max(t, 1e-3))
    return ids, pos, ar, dn, w


def batch(rows):
    n = max(len(r[0]) for r in rows)
    pad = lambda xs, v: [x + [v] * (n - len(x)) for x in xs]  # noqa: E731
    ids, pos, ar, dn, w = zip(*rows)
    return (
        torch.tensor(pad(ids, PAD)),
        torch.tensor([p + list(range(p[-1] + 1, p[-1] + 1 + n - len(p))) for p in pos]),
        torch.tensor(pad(ar, IGNORE)),
        torch.tensor(pad(dn, IGNORE)),
        torch.tensor(pad(w, 0.0)),
    )


def loss_of(model, ids, pos, ar, dn, w):
    logits = model(ids, pos).float()
    flat = logits.flatten(0, 1)
    n_targets = ((ar != IGNORE) | (dn != IGNORE)).sum().clamp(min=1)
    ar_loss = F.cross_entropy(flat, ar.flatten(), ignore_index=IGNORE, reduction="sum")
    dn_each = F.cross_entropy(flat, dn.flatten().clamp(min=0), reduction="none") * (dn.flatten() != IGNORE)
    dn_loss = (dn_each * w.flatten()).sum()
    return (ar_loss + dn_loss) / n_targets


def prose_rows(stream, n, k, c, rng):
    rows = []
    for _ in range(n):
        p = rng.randint(8, 32)
        s = rng.randrange(0, len(stream) - p - c.response_len)
        rows.append(corrupt(stream[s : s + p], stream[s + p : s + p + c.response_len], k, c.response_len, rng))
    return rows


def task_row(tok, prompt, answer, k, rng):
    a = tok.encode(answer).ids + [EOS]
    length = -(-len(a) // k) * k
    return corrupt(tok.encode(prompt).ids, a, k, length, rng)


@torch.no_grad()
def held_out_loss(model, stream, c, device, n=64, seed=7) -> float:
    """Next-token loss on held-out prose read left to right (contiguous positions)."""
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(stream) - c.response_len - 1) for _ in range(n)]
    x = torch.tensor([stream[s : s + c.response_len + 1] for s in starts], device=device)
    pos = torch.arange(c.response_len, device=device).expand(n, -1)
    logits = model(x[:, :-1], pos)
    return F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten()).item()


@torch.no_grad()
def greedy(model, prompt: list[int], n: int, device) -> list[int]:
    """Left-to-right greedy decoding (ReFusion's `ar` path; a monitor, not the server)."""

    def last_logits(ids):
        return model(torch.tensor([ids], device=device), torch.arange(len(ids), device=device)[None])[0, -1]

    return common.greedy(last_logits, prompt, n, EOS)


def main():
    args = common.base_args(__doc__.splitlines()[0], minutes=90).parse_args()
    device, docs = common.setup(args)
    c = Config()
    if args.smoke:
        c.response_len = 16
    base = common.train_tokenizer(docs["train"], args.seed)
    global PAD, EOS, MASK
    tok = common.with_specials(base, SPECIALS)
    PAD, EOS, MASK = (tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_end|>", "<|mask|>"))
    train = common.token_stream(tok, docs["train"], PAD)
    held = common.token_stream(tok, docs["held_out"], PAD)
    model = Qwen3(c).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"ReFusion: {n_params / 1e6:.2f} M parameters, {len(train)} training prose tokens", flush=True)
    rng = random.Random(args.seed)
    examples = common.task_examples(args.seed, "train")
    trainer = common.Trainer(model, args, device, 8000, lambda: held_out_loss(model, held, c, device))
    while trainer.running():
        k = rng.choice(c.slot_sizes)
        rows = prose_rows(train, 24, k, c, rng)
        rows += [task_row(tok, p, a, k, rng) for _, p, a in (next(examples) for _ in range(64))]
        ids, pos, ar, dn, w = (t.to(device) for t in batch(rows))
        trainer.step(lambda: loss_of(model, ids, pos, ar, dn, w), ids.numel())
    final = trainer.finish()
    prog = trainer.prog
    accuracy = common.task_accuracy(
        lambda p: tok.decode(greedy(model, tok.encode(p).ids, 16, device)), 2 if args.smoke else 100
    )
    prompt = "In the beginning, God"
    report = {
        "family": "refusion",
        "parameters": n_params,
        **prog.summary(),
        "device": str(device),
        "held_out_loss": final,
        "unigram_held_out_loss": common.unigram_loss(train, held, c.vocab),
        "held_out_accuracy_python_left_to_right": accuracy,
        "sample": prompt + tok.decode(greedy(model, tok.encode(prompt).ids, 32, device)),
    }
    print(report, flush=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": tok.token_to_id("<|beginoftext|>"),
        "eos_token_id": EOS,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "hidden_size": c.hidden,
        "initializer_range": 0.02,
        "intermediate_size": c.intermediate,
        "mask_token_id": MASK,
        "max_position_embeddings": 40960,
        "max_window_layers": c.layers,
        "model_type": "qwen3",
        "num_attention_heads": c.heads,
        "num_hidden_layers": c.layers,
        "num_key_value_heads": c.kv_heads,
        "rms_norm_eps": c.eps,
        "rope_scaling": None,
        "rope_theta": c.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": False,
        "use_sliding_window": False,
        "vocab_size": c.vocab,
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": common.added_tokens_decoder(tok, SPECIALS),
        "additional_special_tokens": ["<|beginoftext|>", "<|mask|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    out = Path(args.out)
    common.save_checkpoint(out, model.upstream_tensors(), config, tok, {"tokenizer_config.json": tokenizer_config})
    common.write_report(out, report)
    common.plot_loss(prog, out / "loss.png", f"ReFusion {n_params / 1e6:.1f}M: slot AR + denoising loss")


if __name__ == "__main__":
    main()
