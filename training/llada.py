"""Train a small LLaDA (masked diffusion) and write it in LLaDA-8B-Instruct's layout.

Objective (LLaDA, eq. 3 and its SFT form): draw t ~ U(0, 1) per sequence, mask each token
with probability p = (1 - eps) t + eps, and score the model's prediction of each masked
token weighted by 1 / p. Prose windows are masked anywhere and the loss is averaged over
all positions (pre-training); task lines keep their prompt unmasked, mask only the answer
and its EOS padding, and divide each sequence's loss by that answer's length (SFT). Prose
windows are also trained in that SFT form (a clean prefix, the rest masked with ratio t):
the pattern semi-autoregressive decoding meets, a clean context and a masked tail. Without
them the model wrote a sixth non-words in a half-kept word order (training/README.md).

    python training/llada.py --out models/llada-tiny --threads 1   # 90 minutes; the other core can train another
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
import layers  # noqa: E402

BOS = EOS = MASK = -1  # set by `main` from the tokenizer

SPECIALS = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|mdm_mask|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
# LLaDA-8B-Instruct's chat template.
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)


class Config:
    d_model = 256
    n_heads = 4
    n_layers = 4
    mlp_hidden = 576
    vocab = 2048
    rope_theta = 500000.0
    eps = 1e-5
    prose_len = 128
    task_len = 32


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        d = c.d_model
        self.c = c
        self.attn_norm = nn.RMSNorm(d, eps=c.eps)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_norm = nn.RMSNorm(d, eps=c.eps)
        self.ff_proj = nn.Linear(d, c.mlp_hidden, bias=False)  # the gate (SiLU applied)
        self.up_proj = nn.Linear(d, c.mlp_hidden, bias=False)
        self.ff_out = nn.Linear(c.mlp_hidden, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.c.n_heads
        y = self.attn_norm(x)
        q, k, v = (p(y).view(b, t, h, d // h).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        pos = torch.arange(t, device=x.device)
        q, k = layers.rope_half(q, pos, self.c.rope_theta), layers.rope_half(k, pos, self.c.rope_theta)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.attn_out(a)
        y = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(y)) * self.up_proj(y))


class LLaDA(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c.vocab, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.RMSNorm(c.d_model, eps=c.eps)
        self.ff_out = nn.Linear(c.d_model, c.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * c.n_layers) if name.endswith(("attn_out.weight", "ff_out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, ids):
        x = self.wte(ids)
        for b in self.blocks:
            x = b(x)
        return self.ff_out(self.ln_f(x))

    def load_upstream(self, path: Path):
        """Weights from a checkpoint under LLaDA-8B-Instruct's tensor names (`upstream_tensors`)."""
        from safetensors.torch import load_file

        prefix = "model.transformer."
        state = {k[len(prefix) :]: v.float() for k, v in load_file(str(path)).items()}
        self.load_state_dict(state)

    def upstream_tensors(self) -> dict:
        """The state dict under LLaDA-8B-Instruct's tensor names."""
        out = {}
        for k, v in self.state_dict().items():
            out["model.transformer." + k] = v
        return out


def mask_for(ids: torch.Tensor, maskable: torch.Tensor, gen: torch.Generator, eps: float = 1e-3):
    """Masks row i with ratio t_i, stratified over the batch (t_i ~ U(i/b, (i+1)/b)): each t is
    still U(0, 1), so the loss keeps its expectation, with less variance between steps."""
    b = ids.shape[0]
    t = (torch.arange(b, device=ids.device)[:, None] + torch.rand(b, 1, generator=gen, device=ids.device)) / b
    p = (1 - eps) * t + eps
    masked = (torch.rand(ids.shape, generator=gen, device=ids.device) < p) & maskable
    return torch.where(masked, torch.full_like(ids, MASK), ids), masked, p.expand_as(ids)


def prose_batch(stream, n, length, rng):
    starts = [rng.randrange(0, len(stream) - length) for _ in range(n)]
    return torch.tensor([stream[s : s + length] for s in starts])


def chat_prompt(prompt: str) -> str:
    """`prompt` as one user message rendered by CHAT_TEMPLATE, with the assistant's header."""
    return (
        f"{SPECIALS[0]}<|start_header_id|>user<|end_header_id|>\n\n{prompt.strip()}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def task_batch(tok, examples, n, length, canvas=None, chat_share=0.0, rng=None):
    """Task lines as `prompt answer <eos> <eos> ...`, and the maskable (answer) part. No BOS:
    a served prompt is the task's text as typed. With `canvas`, every answer is padded with
    EOS to at least `canvas` tokens (to the longest prompt's length plus `canvas`), as LLaDA's
    SFT pads each answer to the batch's length: the model learns to fill a canvas of that
    length with the answer and then EOS, the pattern a served canvas of that length meets.
    A `chat_share` of the lines are chat turns instead: the prompt as a user message under
    CHAT_TEMPLATE, the answer (without its leading space) closed by `<|eot_id|>`."""
    pairs = []
    eot = tok.token_to_id("<|eot_id|>")
    for _ in range(n):
        _, prompt, ans = next(examples)
        if chat_share and rng.random() < chat_share:
            pairs.append((tok.encode(chat_prompt(prompt)).ids, tok.encode(ans.strip()).ids + [eot, EOS]))
        else:
            pairs.append((tok.encode(prompt).ids, tok.encode(ans).ids + [EOS]))
    if canvas is not None:
        length = max(len(p) for p, _ in pairs) + canvas
    rows, answer = [], []
    for p, a in pairs:
        rows.append((p + a + [EOS] * length)[:length])
        answer.append([0] * len(p) + [1] * (length - len(p)))
    return torch.tensor(rows), torch.tensor(answer, dtype=torch.bool)


def continuation_batch(stream, n, length, rng):
    """Prose in LLaDA's SFT form: windows of `length` whose first P tokens (P uniform in
    [2, length / 2]) are the clean prompt and the rest the response to mask. This is the
    pattern semi-autoregressive decoding meets (a clean prefix, a masked tail ending where
    the canvas ends), which masking whole windows anywhere almost never draws."""
    rows = prose_batch(stream, n, length, rng)
    prompt = torch.tensor([rng.randint(2, length // 2) for _ in range(n)])[:, None]
    return rows, torch.arange(length)[None, :] >= prompt


def sft_loss(model, ids, answer, gen):
    """The SFT loss: mask only `answer` positions, weight each masked token by 1 / p, divide
    each row's loss by its answer's length, average over rows."""
    noisy, masked, p = mask_for(ids, answer, gen)
    logits = model(noisy)
    ce = F.cross_entropy(logits[masked].float(), ids[masked], reduction="none") / p[masked]
    lengths = answer.sum(1, keepdim=True).expand_as(ids)[masked]
    return (ce / lengths).sum() / ids.shape[0]


def losses(model, prose, tasks, task_answer, gen, continuation=None):
    noisy, masked, p = mask_for(prose, torch.ones_like(prose, dtype=torch.bool), gen)
    logits = model(noisy)
    ce = F.cross_entropy(logits[masked].float(), prose[masked], reduction="none") / p[masked]
    total = ce.sum() / prose.numel() + sft_loss(model, tasks, task_answer, gen)
    if continuation is not None:
        total = total + sft_loss(model, *continuation, gen)
    return total


@torch.no_grad()
def held_out_loss(model, stream, length, device, n=64, seed=7) -> float:
    """The masked-diffusion bound (nats/token) on held-out prose, stratified over 8 mask ratios."""
    rng = random.Random(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    total = 0.0
    for k in range(8):
        x = prose_batch(stream, n, length, rng).to(device)
        p = (k + 0.5) / 8
        masked = torch.rand(x.shape, generator=gen, device=device) < p
        logits = model(torch.where(masked, torch.full_like(x, MASK), x))
        ce = F.cross_entropy(logits[masked].float(), x[masked], reduction="sum") / p
        total += ce.item() / x.numel()
    return total / 8


@torch.no_grad()
def generate(model, prompt_ids: list[int], gen_length: int, device) -> list[int]:
    """LLaDA's low-confidence remasking, one block, one token per step, greedy."""
    x = torch.tensor([prompt_ids + [MASK] * gen_length], device=device)
    for _ in range(gen_length):
        masked = x[0] == MASK
        if not masked.any():
            break
        probs = F.softmax(model(x)[0].float(), dim=-1)
        conf, pred = probs.max(-1)
        conf = torch.where(masked, conf, torch.full_like(conf, -1.0))
        i = int(conf.argmax())
        x[0, i] = pred[i]
    return x[0, len(prompt_ids) :].tolist()


def answer_of(tok, ids: list[int]) -> str:
    if EOS in ids:
        ids = ids[: ids.index(EOS)]
    return tok.decode(ids)


def main():
    parser = common.base_args(__doc__.splitlines()[0], minutes=90)
    parser.add_argument("--prose-rows", type=int, default=12, help="prose windows per step, masked anywhere")
    parser.add_argument("--task-rows", type=int, default=48, help="task lines per step")
    parser.add_argument(
        "--continuation-rows", type=int, default=16, help="prose windows per step in the SFT form (a clean prefix, the rest masked)"
    )
    parser.add_argument("--continuation-len", type=int, default=64, help="length of those windows")
    parser.add_argument(
        "--task-canvases",
        default=None,
        help="comma-separated answer canvas lengths (e.g. 16,32,64): each step's task lines are padded "
        "with EOS to the next one in turn, their row count scaled to keep the step's task tokens "
        "(default: lines of 32 tokens, prompt included)",
    )
    parser.add_argument(
        "--chat-share", type=float, default=0.0, help="share of the task lines written as chat turns (CHAT_TEMPLATE)"
    )
    parser.add_argument(
        "--init", default=None, help="a checkpoint this script wrote: start from its weights and its tokenizer"
    )
    args = parser.parse_args()
    device, docs = common.setup(args)
    c = Config()
    if args.init:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(args.init) / "tokenizer.json"))
    else:
        tok = common.with_specials(common.train_tokenizer(docs["train"], args.seed), SPECIALS)
    global BOS, EOS, MASK
    BOS, EOS, MASK = (tok.token_to_id(s) for s in SPECIALS[:3])
    train_stream = common.token_stream(tok, docs["train"], EOS)
    held_stream = common.token_stream(tok, docs["held_out"], EOS)
    if args.smoke:
        c.prose_len, held_len = 64, 32
    else:
        held_len = c.prose_len
    model = LLaDA(c)
    if args.init:
        model.load_upstream(Path(args.init) / "model.safetensors")
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"LLaDA: {n_params / 1e6:.2f} M parameters, {len(train_stream)} training prose tokens", flush=True)
    rng = random.Random(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    examples = common.task_examples(args.seed, "train")
    trainer = common.Trainer(model, args, device, 10000, lambda: held_out_loss(model, held_stream, held_len, device))
    canvases = [int(x) for x in args.task_canvases.split(",")] if args.task_canvases else None
    while trainer.running():
        prose = prose_batch(train_stream, args.prose_rows, c.prose_len, rng).to(device)
        if canvases:
            canvas = canvases[trainer.prog.step % len(canvases)]
            # About the task tokens of `task_rows` lines of `task_len` (prompts are ~10 tokens).
            rows = max(4, round(args.task_rows * c.task_len / (10 + canvas)))
            batch = task_batch(tok, examples, rows, None, canvas, args.chat_share, rng)
        else:
            batch = task_batch(tok, examples, args.task_rows, c.task_len, None, args.chat_share, rng)
        tasks, answer = (t.to(device) for t in batch)
        cont = None
        if args.continuation_rows:
            cont = tuple(t.to(device) for t in continuation_batch(train_stream, args.continuation_rows, args.continuation_len, rng))
        n_tokens = prose.numel() + tasks.numel() + (cont[0].numel() if cont else 0)
        trainer.step(lambda: losses(model, prose, tasks, answer, gen, cont), n_tokens)
    final = trainer.finish()
    prog = trainer.prog
    accuracy = common.task_accuracy(
        lambda p: answer_of(tok, generate(model, tok.encode(p).ids, 16, device)), 2 if args.smoke else 100
    )
    # The canvases trained on besides 16, 50 prompts a task each (64 steps per answer are slow).
    more = {
        f"canvas_{n}": common.task_accuracy(
            lambda p, n=n: answer_of(tok, generate(model, tok.encode(p).ids, n, device)), 2 if args.smoke else 50
        )
        for n in (canvases or [])
        if n != 16
    }
    if args.chat_share:
        more["chat"] = common.task_accuracy(
            lambda p: answer_of(tok, generate(model, tok.encode(chat_prompt(p)).ids, 16, device)).split("<|")[0],
            2 if args.smoke else 50,
        )
    sample = tok.decode(generate(model, tok.encode("In the beginning, God").ids, 32, device))
    report = {
        "family": "llada",
        "parameters": n_params,
        **prog.summary(),
        "device": str(device),
        "held_out_loss": final,
        "unigram_held_out_loss": common.unigram_loss(train_stream, held_stream, c.vocab),
        "held_out_accuracy_python_low_confidence": accuracy,
        **{f"held_out_accuracy_python_low_confidence_{k}": a for k, a in more.items()},
        "init": args.init,
        "task_canvases": canvases,
        "chat_share": args.chat_share,
        "lr": trainer.peak,
        "sample": "In the beginning, God" + sample,
    }
    print(report, flush=True)
    out = Path(args.out)
    config = {
        "_name_or_path": "wavefront/llada-tiny",
        "activation_type": "silu",
        "alibi": False,
        "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModel": "modeling_llada.LLaDAModelLM",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        },
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "d_model": c.d_model,
        "embedding_dropout": 0.0,
        "embedding_size": c.vocab,
        "eos_token_id": EOS,
        "flash_attention": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "init_cutoff_factor": None,
        "init_device": "meta",
        "init_fn": "mitchell",
        "init_std": 0.02,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": MASK,
        "max_sequence_length": 4096,
        "mlp_hidden_size": c.mlp_hidden,
        "mlp_ratio": 4,
        "model_type": "llada",
        "multi_query_attention": None,
        "n_heads": c.n_heads,
        "n_kv_heads": c.n_heads,
        "n_layers": c.n_layers,
        "pad_token_id": EOS,
        "precision": "amp_bf16",
        "residual_dropout": 0.0,
        "rms_norm_eps": c.eps,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": c.rope_theta,
        "scale_logits": False,
        "torch_dtype": "bfloat16",
        "use_cache": False,
        "vocab_size": c.vocab,
        "weight_tying": False,
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": common.added_tokens_decoder(tok, SPECIALS),
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[1],
        "pad_token": SPECIALS[1],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    common.save_checkpoint(
        out,
        model.upstream_tensors(),
        config,
        tok,
        {
            "tokenizer_config.json": tokenizer_config,
            "generation_config.json": {"bos_token_id": BOS, "eos_token_id": EOS},
        },
    )
    common.write_report(out, report)
    common.plot_loss(prog, out / "loss.png", f"LLaDA {n_params / 1e6:.1f}M: masked-diffusion loss")


if __name__ == "__main__":
    main()
