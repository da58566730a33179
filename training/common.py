"""What every family's training shares: the corpus, the checkable tasks, the tokenizer,
the training loop's bookkeeping (seed, device, progress, loss curve) and the checkpoint writer.

Corpus: the World English Bible (public domain), read from Debian's `sword-text-web` package
(`apt-get download sword-text-web`, or `--web-deb PATH`). Tasks: lines made here from a seed,
whose answers a program can check (see `TASKS`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import struct
import subprocess
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
SLICE = HERE / "testdata" / "web-slice.txt"

# Books of the World English Bible kept out of training: the held-out prose.
HELD_OUT_BOOKS = ("Ruth", "Jonah", "Philem", "Jude")


# --------------------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------------------


def _sword_verses(module_dir: Path) -> list[tuple[str, str]]:
    """(osis chapter id, verse text) of a SWORD zText module, in canonical order.

    zText: `*.bzs` holds one (offset, size, uncompressed size) u32 triple per zlib block,
    `*.bzv` one (block, offset, size) u32/u32/u16 entry per verse, `*.bzz` the blocks.
    """
    out = []
    for testament in ("ot", "nt"):
        bzs = (module_dir / f"{testament}.bzs").read_bytes()
        bzv = (module_dir / f"{testament}.bzv").read_bytes()
        bzz = (module_dir / f"{testament}.bzz").read_bytes()
        blocks = [struct.unpack_from("<III", bzs, i) for i in range(0, len(bzs), 12)]
        cache: dict[int, bytes] = {}
        chapter = ""
        for i in range(0, len(bzv), 10):
            block, offset, size = struct.unpack_from("<IIH", bzv, i)
            if size == 0:
                continue
            if block not in cache:
                start, length, _ = blocks[block]
                cache[block] = zlib.decompress(bzz[start : start + length])
            raw = cache[block][offset : offset + size].decode("utf-8")
            m = re.search(r'<chapter [^>]*osisID="([^"]+)"', raw)
            if m:
                chapter = m.group(1)
            out.append((chapter, raw))
    return out


def _clean(raw: str) -> str:
    text = re.sub(r"<note\b.*?</note>", " ", raw, flags=re.S)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.replace("\u201c", '"').replace("\u201d", '"').replace("\u2018", "'").replace("\u2019", "'")
    text = text.replace("\u2014", " - ").replace("\u00b6", "")
    text = re.sub(r"\s+", " ", text).strip()
    return re.sub(r" ([.,;:!?])", r"\1", text)


def _extract_deb(deb: Path, into: Path) -> Path:
    """The SWORD module directory inside a .deb (ar archive holding data.tar.*)."""
    data = deb.read_bytes()
    assert data[:8] == b"!<arch>\n", f"{deb} is not a .deb"
    pos = 8
    while pos < len(data):
        name = data[pos : pos + 16].decode().strip().rstrip("/")
        size = int(data[pos + 48 : pos + 58].decode().strip())
        body = data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)
        if name.startswith("data.tar"):
            path = into / name
            path.write_bytes(body)
            with tarfile.open(path) as tar:
                tar.extractall(into, filter="data")
    found = list(into.rglob("ot.bzz"))
    assert found, f"no SWORD zText module in {deb}"
    return found[0].parent


def corpus(web_deb: str | None = None) -> dict[str, list[str]]:
    """Chapters of the World English Bible as documents: {"train": [...], "held_out": [...]}.

    Cached as JSON under training/data/.
    """
    cache = DATA / "web.json"
    if cache.exists():
        return json.loads(cache.read_text())
    DATA.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if web_deb is None:
            subprocess.run(["apt-get", "download", "sword-text-web"], cwd=tmp, check=True)
            web_deb = str(next(tmp.glob("sword-text-web_*.deb")))
        verses = _sword_verses(_extract_deb(Path(web_deb), tmp))
    chapters: dict[str, list[str]] = {}
    for chapter, raw in verses:
        text = _clean(raw)
        if text:
            chapters.setdefault(chapter, []).append(text)
    split = {"train": [], "held_out": []}
    for chapter, texts in chapters.items():
        book = chapter.split(".")[0]
        split["held_out" if book in HELD_OUT_BOOKS else "train"].append(" ".join(texts))
    cache.write_text(json.dumps(split))
    return split


def slice_corpus() -> dict[str, list[str]]:
    """The small committed slice (Genesis 1-3) the smoke tests train on."""
    docs = [d for d in SLICE.read_text().split("\n\n") if d.strip()]
    return {"train": docs[:-1], "held_out": docs[-1:]}


# --------------------------------------------------------------------------------------
# Checkable tasks
# --------------------------------------------------------------------------------------

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10 ** rng.randint(1, 3)), rng.randrange(10 ** rng.randint(1, 3))
    return f"{a}+{b}=", f"{a + b}"


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
    return f"reverse {' '.join(word)} =", " " + " ".join(reversed(word))


def _sort(rng: random.Random) -> tuple[str, str]:
    digits = [rng.randrange(10) for _ in range(rng.randint(3, 6))]
    return f"sort {' '.join(map(str, digits))} =", " " + " ".join(map(str, sorted(digits)))


def _copy(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 6)))
    return f"copy {' '.join(word)} =", " " + " ".join(word)


TASKS = {"add": _add, "reverse": _reverse, "sort": _sort, "copy": _copy}


def held_out(prompt: str) -> bool:
    """A fixed, seed-independent tenth of all task prompts never appears in training."""
    return zlib.crc32(prompt.encode()) % 10 == 0


def task_examples(seed: int, split: str, tasks=TASKS):
    """Endless (task, prompt, answer) triples of one split ("train" or "held_out")."""
    rng = random.Random(seed)
    names = list(tasks)
    while True:
        name = rng.choice(names)
        prompt, answer = tasks[name](rng)
        if held_out(prompt) == (split == "held_out"):
            yield name, prompt, answer


def eval_set(n_per_task: int = 100, seed: int = 1234, tasks=TASKS) -> list[tuple[str, str, str]]:
    """A fixed held-out set: n distinct prompts of each task."""
    out, seen = [], set()
    for name, fn in tasks.items():
        rng = random.Random(seed + len(name))
        got = 0
        while got < n_per_task:
            prompt, answer = fn(rng)
            if held_out(prompt) and prompt not in seen:
                seen.add(prompt)
                out.append((name, prompt, answer))
                got += 1
    return out


# --------------------------------------------------------------------------------------
# Tokenizer: one byte-level BPE for every family, digits one token each; each family's
# special tokens are added after the shared vocabulary.
# --------------------------------------------------------------------------------------

BASE_VOCAB = 2000


def train_tokenizer(docs: list[str], seed: int = 0):
    """Byte-level BPE of `BASE_VOCAB` entries over the prose and a sample of task lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    cache = DATA / f"bpe-{BASE_VOCAB}-{len(docs)}.json"
    if cache.exists():
        return Tokenizer.from_file(str(cache))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tasks = task_examples(seed, "train")
    lines = [p + a for _, p, a in (next(tasks) for _ in range(20000))]
    trainer = trainers.BpeTrainer(
        vocab_size=BASE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs + lines, trainer)
    DATA.mkdir(parents=True, exist_ok=True)
    tok.save(str(cache))
    return tok


def with_specials(base, specials: list[str], post_processor=None):
    """A copy of the base tokenizer with `specials` after its vocabulary, in order (ids
    `BASE_VOCAB`, `BASE_VOCAB + 1`, ... on the full corpus; a smoke run's vocabulary is smaller)."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(base.to_str())
    first = tok.get_vocab_size()
    assert first <= BASE_VOCAB, first
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for i, s in enumerate(specials):
        assert tok.token_to_id(s) == first + i, s
    if post_processor is not None:
        tok.post_processor = post_processor
    return tok


# --------------------------------------------------------------------------------------
# The loop's bookkeeping
# --------------------------------------------------------------------------------------


def base_args(description: str, minutes: float) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--minutes", type=float, default=minutes, help="training time budget")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads")
    p.add_argument("--smoke", action="store_true", help="train on the committed slice (tests)")
    p.add_argument("--web-deb", default=None, help="a downloaded sword-text-web .deb")
    p.add_argument("--lr", type=float, default=None)
    return p


def setup(args):
    import numpy as np
    import torch

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    docs = slice_corpus() if args.smoke else corpus(args.web_deb)
    return torch.device(device), docs


def autocast(device):
    """bf16 autocast where the hardware does bf16 products (CUDA; CPUs with AVX512-BF16)."""
    import torch

    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled="avx512_bf16" in flags)


def cosine_lr(step: int, total: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@dataclass
class Progress:
    """Time-budgeted loop state: a tqdm bar with loss and tokens/s, and the loss history."""

    minutes: float
    max_steps: int | None
    estimate_steps: int

    def __post_init__(self):
        from tqdm import tqdm

        self.start = time.time()
        self.step = 0
        self.tokens = 0
        self.history: list[tuple[int, float]] = []
        self.held_out: list[tuple[int, float]] = []
        import sys

        self.bar = tqdm(
            total=self.max_steps or self.estimate_steps,
            unit="step",
            dynamic_ncols=True,
            mininterval=0.1 if sys.stderr.isatty() else 30.0,
        )

    def total_steps(self) -> int:
        """Steps the schedule plans for: the cap, or what the budget allows at the rate so far."""
        if self.max_steps is not None:
            return self.max_steps
        if self.step < 20:
            return self.estimate_steps
        per_step = (time.time() - self.start) / self.step
        return max(self.step + 1, int(self.minutes * 60 / per_step))

    def running(self) -> bool:
        if self.max_steps is not None:
            return self.step < self.max_steps
        return time.time() - self.start < self.minutes * 60

    def fraction(self) -> float:
        """How much of the budget (steps, or else time) is spent, in [0, 1]."""
        if self.max_steps is not None:
            return min(1.0, self.step / max(1, self.max_steps))
        return min(1.0, (time.time() - self.start) / (self.minutes * 60))

    def update(self, loss: float, tokens: int):
        self.step += 1
        self.tokens += tokens
        self.history.append((self.step, loss))
        elapsed = time.time() - self.start
        self.bar.total = self.total_steps()
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{self.tokens / max(elapsed, 1e-9):.0f}", refresh=False)
        self.bar.update(1)

    def close(self):
        self.bar.close()

    def summary(self) -> dict:
        """Steps, tokens, minutes, and the mean loss of the first and of the last k steps
        (k = a fifth of the run, at most 50)."""
        k = max(1, min(50, len(self.history) // 5))
        first = [v for _, v in self.history[:k]]
        last = [v for _, v in self.history[-k:]]
        return {
            "steps": self.step,
            "tokens": self.tokens,
            "minutes": round((time.time() - self.start) / 60, 2),
            "first_loss": sum(first) / len(first),
            "last_loss": sum(last) / len(last),
        }


class Trainer:
    """The loop every family shares: AdamW (betas 0.9 / 0.95, weight decay 0.1), a cosine
    schedule with warm-up sized to the time budget, gradient clipping at 1, the progress bar,
    and the held-out loss every 500 steps and at the end."""

    def __init__(self, model, args, device, estimate_steps: int, held_out):
        import torch

        self.model, self.device, self.held_out_fn = model, device, held_out
        self.peak = args.lr or 2e-3
        self.opt = torch.optim.AdamW(model.parameters(), lr=self.peak, betas=(0.9, 0.95), weight_decay=0.1)
        self.prog = Progress(args.minutes, args.max_steps, estimate_steps)

    def running(self) -> bool:
        return self.prog.running()

    def step(self, loss_fn, tokens: int):
        """One optimiser step on `loss_fn()` (computed under autocast) over `tokens` tokens."""
        import torch

        total = self.prog.total_steps()
        for g in self.opt.param_groups:
            g["lr"] = cosine_lr(self.prog.step, total, self.peak, warmup=min(200, total // 10))
        with autocast(self.device):
            loss = loss_fn()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.prog.update(loss.item(), tokens)
        if self.prog.step % 500 == 0:
            self.evaluate()
            self.model.train()

    def evaluate(self) -> float:
        import torch

        self.model.eval()
        with torch.no_grad():
            value = self.held_out_fn()
        self.prog.held_out.append((self.prog.step, value))
        return value

    def finish(self) -> float:
        """Closes the bar; the final held-out loss (the model stays in eval mode)."""
        self.prog.close()
        return self.evaluate()


def plot_loss(progress: Progress, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = zip(*progress.history)
    k = max(1, len(losses) // 200)
    smooth = [sum(losses[max(0, i - k) : i + 1]) / len(losses[max(0, i - k) : i + 1]) for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, alpha=0.25, label="train (per step)")
    ax.plot(steps, smooth, label=f"train (mean of {k + 1})")
    if progress.held_out:
        hs, hl = zip(*progress.held_out)
        ax.plot(hs, hl, "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def unigram_loss(train_ids: list[int], held_ids: list[int], vocab: int) -> float:
    """Cross-entropy (nats/token) of held-out tokens under add-one unigram frequencies of training."""
    counts = [1] * vocab
    for t in train_ids:
        counts[t] += 1
    total = sum(counts)
    return -sum(math.log(counts[t] / total) for t in held_ids) / len(held_ids)


def task_accuracy(answer, n_per_task: int) -> dict[str, float]:
    """Exact-match accuracy per task over the held-out set; `answer(prompt)` is the model's text."""
    correct: dict[str, list[int]] = {}
    for name, prompt, want in eval_set(n_per_task):
        correct.setdefault(name, []).append(int(answer(prompt).strip() == want.strip()))
    return {k: sum(v) / len(v) for k, v in correct.items()}


def greedy(last_logits, prompt: list[int], n: int, stop: int) -> list[int]:
    """Left-to-right greedy decoding by recomputing the whole sequence each token (a monitor
    for the training scripts, not the server): `last_logits(ids)` is the next token's logits."""
    ids = list(prompt)
    for _ in range(n):
        nxt = int(last_logits(ids).argmax())
        if nxt == stop:
            break
        ids.append(nxt)
    return ids[len(prompt) :]


def added_tokens_decoder(tok, specials: list[str]) -> dict:
    """`tokenizer_config.json`'s `added_tokens_decoder` for the special tokens."""
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    return {str(tok.token_to_id(s)): {"content": s, **flags} for s in specials}


def save_checkpoint(
    out: Path,
    tensors: dict,
    config: dict,
    tokenizer,
    extra_files: dict[str, dict] | None = None,
    keep_f32: tuple[str, ...] = (),
):
    """config.json, model.safetensors (bf16 weights; `keep_f32` names stay float32),
    tokenizer.json and any extra JSON files."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            k: v.detach().to("cpu", torch.float32 if k in keep_f32 else torch.bfloat16).contiguous()
            for k, v in tensors.items()
        },
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    for name, content in (extra_files or {}).items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")


def token_stream(tok, docs, end: int, begin: int | None = None) -> list[int]:
    """The documents' token ids end to end, each followed by `end` (and preceded by `begin`)."""
    ids: list[int] = []
    for d in docs:
        if begin is not None:
            ids.append(begin)
        ids.extend(tok.encode(d).ids)
        ids.append(end)
    return ids


def write_report(out: Path, report: dict):
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
