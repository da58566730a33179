"""Train a small ARMT (associative recurrent memory on Llama) and write it in upstream's layout.

Objective (Rodkin et al., 2024): next-token prediction over sequences of several segments.
Each segment runs through the Llama backbone as `[embed(segment), P]` (P: the learned memory
tokens) at positions 0..n; before every layer each row reads that layer's associative memory,
after it the memory rows write it (DPFP features, delta rule; the correction term is off, see
`Config.correction`), and the loss backpropagates through the memories across every segment of
the sequence. The semantics are those the server implements (`services/models/src/armt/memory.rs`).

Data: prose windows, and key-value recall sequences: facts ("The key q is 5.") in the early
segments among prose, questions about them ("The key q is") in the last, so that answering
needs the memory.

    python training/armt.py --out models/armt-tiny --threads 1 --minutes 80   # the committed run
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

SPECIALS = ["<unk>", "<s>", "</s>"]
BOS = EOS = -1  # set by `main` from the tokenizer


class Config:
    hidden = 256
    heads = 4
    kv_heads = 2
    head_dim = 64
    layers = 4
    intermediate = 576
    vocab = 2048
    rope_theta = 10000.0
    eps = 1e-6
    segment = 64
    mem_tokens = 8
    d_mem = 16
    nu = 3
    segments = 4
    # ARMT's `correction` (gamma = clip(1 - k·z / |k|², 0, 1) on z's update) lets A grow along
    # keys z no longer counts, so the read A·phi(q) / (z·phi(q)) is unbounded; training with it
    # turned into NaN after ~370 steps here. Without it (gamma = 1) z counts every key written
    # and the read is bounded by the largest value written: what this checkpoint uses.
    correction = False

    @property
    def d_key(self):
        return 2 * self.nu * self.d_mem


def dpfp(x, nu):
    u = torch.cat([F.relu(x), F.relu(-x)], dim=-1)
    return torch.cat([u * torch.roll(u, j, dims=-1) for j in range(1, nu + 1)], dim=-1)


class AssociativeLayer(nn.Module):
    """One decoder layer with its memory's projections; the memory (A, z) is passed in."""

    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.W_mq = nn.Linear(c.hidden, c.d_mem, bias=False)
        self.W_mk = nn.Linear(c.hidden, c.d_mem, bias=False)
        self.W_mv = nn.Linear(c.hidden, c.hidden, bias=False)
        self.W_mb = nn.Linear(c.hidden, 1, bias=True)
        self.layer = layers.DecoderLayer(c, qk_norm=False)

    def forward(self, h, memory):
        """h [b, n, d]; memory None (never written) or (A [b, d_key, d], z [b, d_key])."""
        c = self.c
        if memory is not None:
            a, z = memory
            q = dpfp(self.W_mq(h).float(), c.nu)
            h = h + (torch.einsum("bnk,bkd->bnd", q, a) / (torch.einsum("bnk,bk->bn", q, z) + 1e-5)[..., None]).to(h.dtype)
        out = self.layer(h, torch.arange(h.shape[1], device=h.device))
        o = out[:, -c.mem_tokens :]
        k = dpfp(self.W_mk(o).float(), c.nu)
        v = self.W_mv(o).float()
        beta = torch.sigmoid(self.W_mb(o).float())  # [b, M, 1]
        if memory is None:
            a = torch.zeros(h.shape[0], c.d_key, c.hidden, device=h.device)
            z = torch.zeros(h.shape[0], c.d_key, device=h.device)
            v_prev, gamma = torch.zeros_like(v), torch.ones_like(beta)
        else:
            den = torch.einsum("bmk,bk->bm", k, z)[..., None] + 1e-5
            v_prev = torch.einsum("bmk,bkd->bmd", k, a) / den
            gamma = (1 - den / ((k * k).sum(-1, keepdim=True) + 1e-5)).clamp(0, 1)
            if not c.correction:
                gamma = torch.ones_like(beta)
        a = a + torch.einsum("bmk,bmd->bkd", beta * k, v - v_prev)
        z = z + (gamma * k).sum(1)
        return out, (a, z)


class Armt(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(AssociativeLayer(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.hidden, eps=c.eps)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        self.memory = nn.Parameter(torch.randn(c.mem_tokens, c.hidden) * 0.02)
        for name, p in self.named_parameters():
            if p.dim() == 2 and name != "memory":
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        """Logits [b, T, V] of sequences of whole segments, memories carried across segments."""
        c = self.c
        b = ids.shape[0]
        memories = [None] * c.layers
        logits = []
        for seg in ids.split(c.segment, dim=1):
            h = torch.cat([self.embed_tokens(seg), self.memory[None].expand(b, -1, -1).to(self.embed_tokens.weight.dtype)], 1)
            for i, layer in enumerate(self.layers):
                h, memories[i] = layer(h, memories[i])
            logits.append(self.lm_head(self.norm(h[:, : seg.shape[1]])))
        return torch.cat(logits, 1)

    def upstream_tensors(self) -> dict:
        out = {"memory_cell.memory": self.memory}
        for k, v in self.state_dict().items():
            if k.startswith("layers."):
                out["memory_cell." + k] = v
            elif k.startswith("lm_head"):
                out["memory_cell.model." + k] = v
            elif k != "memory":
                out["memory_cell.model.model." + k] = v
        return out


KEYS = "abcdefghijklmnopqrstuvwxyz"


def fact_tokens(tok, key: str, value: int) -> tuple[list[int], list[int], list[int]]:
    """The ids of a fact (" The key q is 5."), of its question (" The key q is") and of the
    question's answer (" 5."): the one format every recall row and lookup uses."""
    return (
        tok.encode(f" The key {key} is {value}.").ids,
        tok.encode(f" The key {key} is").ids,
        tok.encode(f" {value}.").ids,
    )


def recall_sequence(
    tok,
    filler,
    c: Config,
    rng: random.Random,
    segments: int | None = None,
    facts=(2, 4),
    local: bool = False,
    back: list | None = None,
):
    """(ids, [(answer start, answer ids)]) over `segments` whole segments (default
    `c.segments`): `facts` (a range) key-value facts ("The key q is 5.", a letter and a digit)
    at random places among prose in the segments before the last, never across a segment's
    end, and the questions about them ("The key q is") in the last, so that answering needs the
    memory. `local` puts the facts in the last segment too, just before the questions: the
    in-context form of the task, which teaches the lookup the memory has to serve. `back`, when
    given, receives for each answer how many segments before the question its fact is."""
    n_seg = segments or c.segments
    seg = c.segment
    keys = rng.sample(KEYS, rng.randint(*facts))
    values = {k: rng.randrange(10) for k in keys}
    tokens = {k: fact_tokens(tok, k, values[k]) for k in keys}
    statements = {k: tokens[k][0] for k in keys}
    room = [seg] * (n_seg - 1)
    home = {}
    for k in keys:
        fits = [j for j, r in enumerate(room) if r >= len(statements[k])]
        if local or fits:  # (short smoke segments hold fewer)
            home[k] = n_seg - 1 if local else rng.choice(fits)
            if not local:
                room[home[k]] -= len(statements[k])
    keys = [k for k in keys if k in home]
    ids: list[int] = []
    for j in range(n_seg - 1):
        pieces = [statements[k] for k in keys if home[k] == j]
        free = seg - sum(map(len, pieces))
        cuts = sorted(rng.randrange(free + 1) for _ in pieces)
        s = rng.randrange(0, len(filler) - seg)
        prose = filler[s : s + free]
        prev = 0
        for cut, piece in zip(cuts, pieces):
            ids += prose[prev:cut] + piece
            prev = cut
        ids += prose[prev:]
    s = rng.randrange(0, len(filler) - seg)
    ids += filler[s : s + rng.randrange(8)]
    if local:
        ids += [t for k in keys for t in statements[k]]
    answers = []
    for k in rng.sample(keys, len(keys)):
        _, q, a = tokens[k]
        answers.append((len(ids) + len(q), a))
        if back is not None:
            back.append(n_seg - 1 - home[k])
        ids += q + a
    total = n_seg * seg
    s = rng.randrange(0, len(filler) - seg)
    ids = (ids + filler[s : s + seg])[:total]
    return ids, [(p, a) for p, a in answers if p + len(a) <= total]


def lookup_episodes(tok, filler, c: Config, rng: random.Random, segments: int):
    """(ids, [(answer start, answer ids)]) of `segments` segments that are each a whole
    in-context lookup: 2 to 4 facts, then questions about all of them in a random order, padded
    with prose. Every answer is in its facts' segment, so these teach the lookup by key (an
    induction over "key q is" that the question repeats) densely, before the memory has to
    carry it across segments."""
    ids: list[int] = []
    answers = []
    for _ in range(segments):
        base = len(ids)
        keys = rng.sample(KEYS, rng.randint(2, 4))
        values = {k: rng.randrange(10) for k in keys}
        s = rng.randrange(0, len(filler) - c.segment)
        part = filler[s : s + rng.randrange(4)]
        tokens = {k: fact_tokens(tok, k, values[k]) for k in keys}
        part += [t for k in keys for t in tokens[k][0]]
        for k in rng.sample(keys, len(keys)):
            _, q, a = tokens[k]
            if len(part) + len(q) + len(a) > c.segment:
                break
            answers.append((base + len(part) + len(q), a))
            part += q + a
        s = rng.randrange(0, len(filler) - c.segment)
        ids += (part + filler[s : s + c.segment])[: c.segment]
    return ids, answers


def main():
    parser = common.base_args(__doc__.splitlines()[0], minutes=90)
    parser.add_argument("--answer-weight", type=float, default=1.0, help="extra weight of the recall answers' loss")
    parser.add_argument("--d-mem", type=int, default=Config.d_mem, help="width of the memory's keys before DPFP")
    parser.add_argument("--min-facts", type=int, default=1, help="fewest facts in a recall row, from the start")
    parser.add_argument(
        "--lookup-phase",
        type=float,
        default=0.0,
        help="share of the budget in [0, 1), before the curriculum, whose recall rows are in-context lookups in every segment",
    )
    parser.add_argument("--no-curriculum", dest="curriculum", action="store_false", help="full-length recall from the start")
    args = parser.parse_args()
    if not 0 <= args.lookup_phase < 1:
        parser.error("--lookup-phase is a share of the budget in [0, 1)")
    device, docs = common.setup(args)
    c = Config()
    c.d_mem = args.d_mem
    if args.smoke:
        c.segment, c.segments = 32, 3
    base = common.train_tokenizer(docs["train"], args.seed)
    global BOS, EOS
    tok = common.with_specials(base, SPECIALS)
    BOS, EOS = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    train = common.token_stream(tok, docs["train"], EOS)
    held = common.token_stream(tok, docs["held_out"], EOS)
    model = Armt(c).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"ARMT: {n_params / 1e6:.2f} M parameters, {len(train)} training prose tokens", flush=True)
    rng = random.Random(args.seed)
    total = c.segment * c.segments
    def held_out():
        loss = held_out_loss(model, held, total, device)
        recall = recall_accuracy(model, tok, held, c, device, 40)
        local = recall_accuracy(model, tok, held, c, device, 40, local=True)
        print(f"step {trainer.prog.step}: held-out loss {loss:.3f}, recall {recall:.2f}, in context {local:.2f}", flush=True)
        return loss

    trainer = common.Trainer(model, args, device, 6000, held_out)

    def loss_of(prose, recall, answer_mask):
        """Next-token loss over every token, plus `--answer-weight` times the mean loss of the
        recall answers' digits: they are under 1% of the tokens, and without the extra term
        the gradient that teaches the memory to hold the facts is too faint (an 80-minute run
        without it answered at chance)."""
        lp = F.cross_entropy(model(prose[:, :-1]).flatten(0, 1).float(), prose[:, 1:].flatten(), reduction="none")
        lr = F.cross_entropy(model(recall[:, :-1]).flatten(0, 1).float(), recall[:, 1:].flatten(), reduction="none")
        mask = answer_mask.flatten()
        everything = torch.cat([lp, lr]).mean()
        return everything + args.answer_weight * (lr * mask).sum() / mask.sum().clamp(min=1)

    while trainer.running():
        rows = []
        for _ in range(8):
            s = rng.randrange(0, len(train) - total - 1)
            rows.append(train[s : s + total + 1])
        # curriculum: the first 15% of the budget recalls one or two facts one segment back,
        # the next 15% up to two segments back, the rest up to the full context's; a quarter
        # of the recall rows (a tenth after the first 30%) are in-context
        frac = trainer.prog.fraction() if args.curriculum else 1.0
        # `--lookup-phase`: first, every segment of every recall row is an in-context lookup;
        # the curriculum runs over the rest of the budget
        lookup = args.curriculum and frac < args.lookup_phase
        frac = max(0.0, (frac - args.lookup_phase) / (1 - args.lookup_phase)) if args.curriculum else frac
        n_seg = rng.randint(2, c.segments if frac >= 0.3 else min(c.segments, 2 if frac < 0.15 else 3))
        least = max(1, args.min_facts)
        facts = (least, max(2, least)) if frac < 0.15 else (max(2, least), 4)
        recall, mask = [], []
        for _ in range(8):
            local = args.curriculum and rng.random() < (0.25 if frac < 0.3 else 0.1)
            if lookup:
                ids, answers = lookup_episodes(tok, train, c, rng, c.segments)
            else:
                ids, answers = recall_sequence(tok, train, c, rng, n_seg, facts, local)
            m = [0.0] * len(ids)
            for start, a in answers:
                # the digit (the answer's token that needs the memory) is ids[start + 1]:
                # target t is token t + 1
                m[start] = 1.0
            recall.append(ids + [EOS])
            mask.append(m)
        x = torch.tensor(rows, device=device)
        y = torch.tensor(recall, device=device)
        m = torch.tensor(mask, device=device)
        trainer.step(lambda: loss_of(x, y, m), x.numel() + y.numel())
    final = trainer.finish()
    prog = trainer.prog
    accuracy = recall_accuracy(model, tok, held, c, device, 10 if args.smoke else 200)
    report = {
        "family": "armt",
        "parameters": n_params,
        **prog.summary(),
        "device": str(device),
        "held_out_loss": final,
        "unigram_held_out_loss": common.unigram_loss(train, held, c.vocab),
        "held_out_recall_accuracy_python": accuracy,
        "held_out_recall_in_context_accuracy_python": recall_accuracy(
            model, tok, held, c, device, 10 if args.smoke else 200, local=True
        ),
    }
    print(report, flush=True)
    config = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "hidden_size": c.hidden,
        "initializer_range": 0.02,
        "intermediate_size": c.intermediate,
        "max_position_embeddings": 4096,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": c.heads,
        "num_hidden_layers": c.layers,
        "num_key_value_heads": c.kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": c.eps,
        "rope_scaling": None,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": c.vocab,
    }
    armt_config = {
        "num_mem_tokens": c.mem_tokens,
        "d_mem": c.d_mem,
        "layers_attr": "model.layers",
        "wrap_pos": False,
        "correction": c.correction,
        "segment_size": c.segment,
        "segment_alignment": "left",
        "k2": -1,
    }
    out = Path(args.out)
    common.save_checkpoint(out, model.upstream_tensors(), config, tok, {"armt_config.json": armt_config})
    common.write_report(out, report)
    common.plot_loss(prog, out / "loss.png", f"ARMT {n_params / 1e6:.1f}M: next-token loss over {c.segments} segments")


@torch.no_grad()
def held_out_loss(model, stream, total, device, n=32, seed=7) -> float:
    rng = random.Random(seed)
    starts = [rng.randrange(0, len(stream) - total - 1) for _ in range(n)]
    x = torch.tensor([stream[s : s + total + 1] for s in starts], device=device)
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten()).item()


@torch.no_grad()
def recall_accuracy(model, tok, held, c, device, n, local: bool = False) -> float:
    """Share of held-out recall questions (2 to 4 facts; `local`: in the question's segment)
    whose whole answer is the argmax (teacher forced)."""
    rng = random.Random(99)
    right = count = 0
    for _ in range(n):
        ids, answers = recall_sequence(tok, held, c, rng, local=local)
        logits = model(torch.tensor([ids], device=device))[0]
        for start, a in answers[:1]:
            # every token of the answer (" 5."), each from the true tokens before it
            pred = logits[start - 1 : start - 1 + len(a)].argmax(-1).tolist()
            right += int(pred == a)
            count += 1
    return right / max(count, 1)


if __name__ == "__main__":
    main()
