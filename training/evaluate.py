"""Held-out task accuracy of a checkpoint *as served*: every prompt of the fixed held-out set
(`common.eval_set`) goes through `wavefront run --json` with the given scheme arguments; prints
per-task exact-match accuracy, mean forward passes, tokens per forward, core iterations and
compute time per answer. `--tasks recall,recall-1` asks an ARMT checkpoint the held-out
key-value recall questions (`armt.recall_sequence` on held-out prose: facts in the first
segments, the question in the last; `recall` has 2 to 4 facts, so the answer depends on the
key asked, `recall-1` one fact, `recall-2` exactly two), as token ids; each is also reported
by how many segments back the asked fact is (`recall, 2 back`). `--tasks prose` continues the
first words of held-out sentences (books never trained on) and scores the continuations with
numbers a reader can check (`prose_scores`): the share of words the training prose contains,
the share of adjacent word pairs it contains (word order), and the share of distinct pairs
within each continuation (loops score low), next to the same figures for the held-out text's
own continuations.

    python training/evaluate.py --model models/llada-tiny --wavefront target/release/wavefront \\
        -- --scheme low-confidence --max-new-tokens 16 --steps 16 --block-length 16
    python training/evaluate.py --model models/armt-tiny --tasks recall-1,recall -- --execution diagonal
    python training/evaluate.py --model models/llada-tiny --tasks prose --per-task 40 \\
        -- --scheme low-confidence --max-new-tokens 32 --steps 32 --block-length 8
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def measure(wavefront: str, model: str, tasks: str, per_task: int, extra: list[str], scorer: str | None = None) -> dict:
    """{task: {accuracy, forward_passes, compute_ms, tokens_per_forward, recurrence_steps, n}}
    of `wavefront run --model MODEL EXTRA` over the held-out prompts of `tasks` (comma separated
    names of `common.TASKS`, or `recall`)."""

    def run(prompt_args: list[str]) -> dict:
        out = subprocess.run(
            [wavefront, "run", "--model", model, "--json", "--log-filter", "warn", *prompt_args, *extra],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout)

    def row(right: bool, r: dict) -> tuple:
        s = r["stats"]
        # Rows the forwards computed (masked diffusion records them per forward).
        rows = sum(s.get("series", {}).get("active_rows", []))
        return (right, s["forward_passes"], s["compute_time_ms"], s["generated_tokens"], s["recurrence_steps"], rows)

    results: dict[str, list] = {}
    prose: dict = {}
    recall = {"recall": (2, 4), "recall-1": (1, 1), "recall-2": (2, 2)}
    for name in tasks.split(","):
        if name in recall:
            for ids, answer, back in recall_set(Path(model), per_task, recall[name]):
                r = run(["--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", str(len(answer))])
                outcome = row(r["token_ids"][: len(answer)] == answer, r)
                results.setdefault(name, []).append(outcome)
                results.setdefault(f"{name}, {back} back", []).append(outcome)
    if "prose" in tasks.split(","):
        rows, texts, prompts = [], [], []
        for prompt, truth in prose_prompts(per_task):
            prompts.append(prompt)
            r = run(["--prompt", prompt])
            texts.append((r["text"], truth))
            rows.append(row(True, r))
        ppl = {"gen_ppl": gen_ppl(prompts, texts, Path(scorer))} if scorer else {}
        samples = {"samples": [p + cut(t, 24) for p, (t, _) in zip(prompts[:3], texts)]}
        prose = {"prose": {**prose_scores(texts), **ppl, **summarise(rows), **samples}}
    chosen = {k: common.TASKS[k] for k in tasks.split(",") if k not in recall and k != "prose"}
    for name, prompt, answer in common.eval_set(per_task, tasks=chosen) if chosen else []:
        r = run(["--prompt", prompt])
        text = r["text"].split("<|")[0]
        results.setdefault(name, []).append(row(text.strip() == answer.strip(), r))
    return {**{name: {"accuracy": sum(x[0] for x in rs) / len(rs), **summarise(rs)} for name, rs in results.items()}, **prose}


def summarise(rs: list[tuple]) -> dict:
    return {
        "forward_passes": sum(x[1] for x in rs) / len(rs),
        "compute_ms": sum(x[2] for x in rs) / len(rs),
        "tokens_per_forward": sum(x[3] for x in rs) / max(sum(x[1] for x in rs), 1),
        "recurrence_steps": sum(x[4] for x in rs) / len(rs),
        "rows": sum(x[5] for x in rs) / len(rs),
        "n": len(rs),
    }


def words(text: str) -> list[str]:
    """Lower-cased words, punctuation dropped (apostrophes kept)."""
    return re.findall(r"[a-z']+", text.lower())


def prose_prompts(n: int, prompt_words: int = 6, seed: int = 5) -> list[tuple[str, str]]:
    """n (prompt, true continuation) pairs: the first `prompt_words` words of held-out sentences
    of at least twice that length, and the rest of each sentence with the next one."""
    rng = random.Random(seed)
    sentences = []
    for doc in common.corpus(None)["held_out"]:
        parts = re.split(r"(?<=[.!?])\s+", doc)
        for i, sentence in enumerate(parts):
            if len(sentence.split()) >= 2 * prompt_words:
                sentences.append((sentence, " ".join(parts[i + 1 : i + 2])))
    out = []
    for sentence, after in rng.sample(sentences, n):
        w = sentence.split()
        out.append((" ".join(w[:prompt_words]), " " + " ".join(w[prompt_words:]) + " " + after))
    return out


def cut(text: str, max_words: int) -> str:
    """`text` up to its first special token and its first `max_words` words."""
    text = text.split("<|")[0].split("</s>")[0]
    ends = [m.end() for m in re.finditer(r"[a-z']+", text, re.IGNORECASE)]
    return text[: ends[max_words - 1]] if len(ends) >= max_words else text


def gen_ppl(prompts: list[str], texts: list[tuple[str, str]], scorer: Path, max_words: int = 24) -> dict:
    """Generative perplexity, the diffusion papers' prose measure (SureLock's Gen.-PPL): the
    perplexity a separate autoregressive model (here an ARMT checkpoint of `training/armt.py`,
    read from its upstream tensors) gives each continuation (cut as `prose_scores` cuts it) after
    its prompt, over all their tokens; `reference` scores the held-out text's own."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    import armt

    tok = Tokenizer.from_file(str(scorer / "tokenizer.json"))
    model = armt.Armt(armt.Config())
    names = {"memory_cell.memory": "memory", "memory_cell.model.lm_head.weight": "lm_head.weight"}
    state = {}
    for k, v in load_file(str(scorer / "model.safetensors")).items():
        if k in names:
            k = names[k]
        elif k.startswith("memory_cell.model.model."):
            k = k[len("memory_cell.model.model.") :]
        else:
            k = k[len("memory_cell.") :]
        state[k] = v.float()
    model.load_state_dict(state)
    model.eval()

    def ppl(pairs) -> float:
        total = count = 0.0
        with torch.no_grad():
            for prompt, text in pairs:
                head, tail = tok.encode(prompt).ids, tok.encode(cut(text, max_words)).ids
                if not tail:
                    continue
                ids = torch.tensor([head + tail])
                logits = model(ids[:, :-1])[0, len(head) - 1 :]
                total += F.cross_entropy(logits, ids[0, len(head) :], reduction="sum").item()
                count += len(tail)
        return round(math.exp(total / max(count, 1)), 2)

    return {"ppl": ppl(zip(prompts, (t for t, _ in texts))), "reference": ppl(zip(prompts, (r for _, r in texts)))}


def prose_scores(texts: list[tuple[str, str]], max_words: int = 24, train_docs: list[str] | None = None) -> dict:
    """Means over continuations (their first `max_words` words, up to a special token) of:
    `known_words`, the share of words the training prose contains; `seen_pairs`, the share of
    adjacent word pairs it contains; `distinct_pairs`, the share of a continuation's pairs that
    are distinct. `reference` holds the same for the held-out text's own continuations.
    `train_docs`: the training prose (default: the corpus' training split)."""
    vocab, pairs = set(), set()
    for doc in common.corpus(None)["train"] if train_docs is None else train_docs:
        w = words(doc)
        vocab.update(w)
        pairs.update(zip(w, w[1:]))

    def score(text: str) -> tuple[float, float, float] | None:
        w = words(text.split("<|")[0].split("</s>")[0])[:max_words]
        if len(w) < 2:
            return None
        p = list(zip(w, w[1:]))
        return (sum(x in vocab for x in w) / len(w), sum(x in pairs for x in p) / len(p), len(set(p)) / len(p))

    def mean(scores) -> dict:
        scores = [s for s in scores if s is not None]
        keys = ("known_words", "seen_pairs", "distinct_pairs")
        return {k: round(sum(s[i] for s in scores) / max(len(scores), 1), 3) for i, k in enumerate(keys)} | {
            "scored": len(scores)
        }

    return {**mean(score(t) for t, _ in texts), "reference": mean(score(truth) for _, truth in texts)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--wavefront", default="target/release/wavefront")
    p.add_argument("--per-task", type=int, default=100)
    p.add_argument("--tasks", default=",".join(common.TASKS))
    p.add_argument("--scorer", default=None, help="with --tasks prose: an ARMT checkpoint that scores the continuations (gen_ppl)")
    p.add_argument("run_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    extra = [a for a in args.run_args if a != "--"]
    summary = measure(args.wavefront, args.model, args.tasks, args.per_task, extra, args.scorer)
    print(json.dumps({"model": args.model, "run_args": extra, "tasks": summary}, indent=1))


def recall_set(model: Path, n: int, facts=(2, 4)) -> list[tuple[list[int], list[int], int]]:
    """n held-out recall prompts (token ids up to a question) with `facts` facts each, their
    answers' ids, and how many segments before the question the asked fact is."""

    import armt
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    c = armt.Config()
    c.segment = json.loads((model / "armt_config.json").read_text())["segment_size"]
    eos = tok.token_to_id("</s>")
    held = common.token_stream(tok, common.corpus(None)["held_out"], eos)
    rng = random.Random(99)
    out = []
    for _ in range(n):
        back: list[int] = []
        ids, answers = armt.recall_sequence(tok, held, c, rng, facts=facts, back=back)
        start, answer = answers[0]
        out.append((ids[:start], answer, back[0]))
    return out


if __name__ == "__main__":
    main()
