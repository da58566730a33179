"""CI's check of the training pipeline (CI does not train): each family's script runs a few
steps on the committed slice of the corpus, its loss must fall, and `wavefront` must load the
checkpoint it writes and generate from it.

    python training/smoke_test.py --wavefront target/debug/wavefront
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# family script -> (steps, a `wavefront run` invocation's extra arguments)
FAMILIES = {
    "llada": (40, ["--scheme", "low-confidence", "--prompt", "12+34=", "--max-new-tokens", "8"]),
    "huginn": (30, ["--scheme", "ar", "--prompt", "12+34=", "--max-new-tokens", "4"]),
    "refusion": (20, ["--scheme", "plan-infill", "--prompt", "12+34=", "--max-new-tokens", "16"]),
    "armt": (15, ["--prompt", "The key q is 5. The key q is", "--max-new-tokens", "4"]),
}


def check(family: str, steps: int, run_args: list[str], wavefront: str, tmp: Path) -> str | None:
    out = tmp / family
    train = subprocess.run(
        [sys.executable, str(HERE / f"{family}.py"), "--smoke", "--max-steps", str(steps), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    if train.returncode != 0:
        return f"training failed:\n{train.stderr[-3000:]}"
    report = json.loads((out / "training.json").read_text())
    if not report["last_loss"] < report["first_loss"]:
        return f"loss did not fall: {report['first_loss']:.3f} -> {report['last_loss']:.3f}"
    if not (out / "loss.png").stat().st_size > 0:
        return "no loss curve written"
    if family == "armt":
        # the scorer of `evaluate.py --tasks prose` reads this checkpoint back (strict names)
        import math

        import evaluate

        ppl = evaluate.gen_ppl(["In the beginning"], [(" God created the heavens", " God created the heavens")], out)
        if not (math.isfinite(ppl["ppl"]) and ppl["ppl"] == ppl["reference"] and ppl["ppl"] > 1):
            return f"gen_ppl on the written checkpoint: {ppl}"
    run = subprocess.run(
        [wavefront, "run", "--model", str(out), "--json", "--log-filter", "warn", *run_args],
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        return f"wavefront run failed:\n{run.stderr[-3000:]}"
    result = json.loads(run.stdout)
    if not result["token_ids"]:
        return "wavefront generated no token"
    print(
        f"  {family}: loss {report['first_loss']:.3f} -> {report['last_loss']:.3f} in {steps} steps; "
        f"wavefront run: {result['text']!r}",
        flush=True,
    )
    return None


def check_llada_fine_tune(wavefront: str, tmp: Path) -> str | None:
    """`llada.py --init` on the smoke checkpoint `check` wrote, with answers padded to 16- and
    32-token canvases and half the task lines as chat turns: it starts from those weights (its
    first loss is below the from-scratch run's), reports the new options, and what it writes
    loads and answers a chat turn."""
    base, out = tmp / "llada", tmp / "llada-fine-tuned"
    train = subprocess.run(
        [sys.executable, str(HERE / "llada.py"), "--smoke", "--max-steps", "4", "--out", str(out), "--init", str(base),
         "--task-canvases", "16,32", "--chat-share", "0.5", "--lr", "5e-4"],
        capture_output=True,
        text=True,
    )
    if train.returncode != 0:
        return f"fine-tuning failed:\n{train.stderr[-3000:]}"
    before = json.loads((base / "training.json").read_text())
    report = json.loads((out / "training.json").read_text())
    if not report["first_loss"] < before["first_loss"]:
        return f"--init did not start from the checkpoint: first loss {report['first_loss']:.3f}, from scratch {before['first_loss']:.3f}"
    if (report["init"], report["task_canvases"], report["chat_share"]) != (str(base), [16, 32], 0.5):
        return f"the report does not name the options: {report}"
    if "held_out_accuracy_python_low_confidence_canvas_32" not in report or "held_out_accuracy_python_low_confidence_chat" not in report:
        return f"no accuracy at the trained canvas or as chat turns: {sorted(report)}"
    run = subprocess.run(
        [wavefront, "run", "--model", str(out), "--json", "--log-filter", "warn", "--chat", "--prompt", "copy a b c =",
         "--scheme", "low-confidence", "--max-new-tokens", "16", "--steps", "16", "--block-length", "16"],
        capture_output=True,
        text=True,
    )
    if run.returncode != 0 or not json.loads(run.stdout)["token_ids"]:
        return f"wavefront run --chat on the fine-tuned checkpoint failed:\n{run.stderr[-3000:]}"
    print(f"  llada fine-tuned: loss {report['first_loss']:.3f} (from scratch {before['first_loss']:.3f})", flush=True)
    return None


def check_prose_scores() -> str | None:
    """`evaluate.prose_scores` on the committed slice: a trained-on sentence scores 1 on every
    measure, a loop scores low on distinct pairs, and fragments score low on known words."""
    import common
    import evaluate

    docs = common.slice_corpus()["train"]
    sentence = " ".join(docs[0].split()[:8])
    s = evaluate.prose_scores([(sentence, sentence), (" and, and, and, and, and, and", ""), (" thevoid zzq kx", "")], train_docs=docs)
    got = (s["known_words"], s["seen_pairs"], s["distinct_pairs"], s["scored"], s["reference"]["seen_pairs"])
    # per text: (1, 1, 1), (1, 0, 0.2), (0, 0, 1); the reference is the first text alone
    want = (round(2 / 3, 3), round(1 / 3, 3), round(2.2 / 3, 3), 3, 1.0)
    return None if got == want else f"prose_scores: got {got}, want {want}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wavefront", required=True, help="the wavefront binary")
    p.add_argument("families", nargs="*", default=list(FAMILIES))
    args = p.parse_args()
    outcomes: list[bool] = []

    def run_check(name: str, check_fn) -> None:
        """Runs one check, prints its status, time and error, and records whether it passed."""
        start = time.time()
        error = check_fn()
        print(f"{name}: {'ok' if error is None else 'FAILED'} ({time.time() - start:.0f} s)", flush=True)
        if error is not None:
            print(error, flush=True)
        outcomes.append(error is None)

    run_check("prose scores", check_prose_scores)
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            steps, run_args = FAMILIES[family]
            run_check(f"training smoke {family}", lambda: check(family, steps, run_args, args.wavefront, Path(tmp)))
        if "llada" in args.families and (Path(tmp) / "llada" / "training.json").exists():
            run_check("training smoke llada --init", lambda: check_llada_fine_tune(args.wavefront, Path(tmp)))
    failed = outcomes.count(False)
    print(f"{len(outcomes) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
