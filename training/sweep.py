"""Each paper's schemes on a trained checkpoint, side by side in one run, as served: every
setting of a family's table runs the same held-out prompts through `wavefront run --json`
(`evaluate.measure`), `--rounds` times in alternation, and one markdown table is printed with
accuracy, forward passes, tokens per forward, core iterations (Huginn), the algorithmic FLOPs
ratio (SureLock) and compute time, each against the first row (the baseline scheme).

    python training/sweep.py --family huginn --wavefront target/release/wavefront
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import evaluate  # noqa: E402

HUGINN_AR = ["--scheme", "ar", "--seed", "0", "--max-new-tokens", "16"]
HUGINN_EXIT = HUGINN_AR + ["--num-steps", "32", "--cache-lookup-strategy", "latest-m4"]
HUGINN_DF = ["--scheme", "diffusion-forcing", "--seed", "0", "--max-new-tokens", "16", "--num-steps", "8"]
LLADA = ["--max-new-tokens", "16", "--block-length", "16"]
REFUSION = ["--max-new-tokens", "16"]
# Fast-dLLM's setting scaled to the tiny model: a 64-token canvas in blocks of 16 (Fast-dLLM: 256
# in blocks of 32).
FAST = ["--scheme", "low-confidence", "--max-new-tokens", "64", "--block-length", "16"]

# family: (model directory, tasks, [(setting, run arguments)]); the first row is the baseline.
FAMILIES = {
    "huginn": (
        "models/huginn-tiny",
        "sort,copy",
        [
            ("static ar, r = 8 (mean recurrence)", HUGINN_AR + ["--num-steps", "8"]),
            ("static ar, r = 4", HUGINN_AR + ["--num-steps", "4"]),
            ("static ar, r = 16", HUGINN_AR + ["--num-steps", "16"]),
            ("static ar, r = 32", HUGINN_AR + ["--num-steps", "32"]),
            # A token that exits early leaves no K/V at deeper steps: with the `full` lookup a
            # deeper step of a later token finds none there, so adaptive exit reads `latest-m4`.
            ("adaptive exit 1e-2, r <= 32, full cache", HUGINN_AR + ["--num-steps", "32", "--exit-threshold", "0.01"]),
            ("adaptive exit 1e-3, r <= 32", HUGINN_EXIT + ["--exit-threshold", "0.001"]),
            ("adaptive exit 1e-2, r <= 32", HUGINN_EXIT + ["--exit-threshold", "0.01"]),
            ("adaptive exit 5e-2, r <= 32", HUGINN_EXIT + ["--exit-threshold", "0.05"]),
            ("adaptive exit 1e-1, r <= 32", HUGINN_EXIT + ["--exit-threshold", "0.1"]),
            ("diffusion forcing r' = 1", HUGINN_DF + ["--inner-recurrence", "1"]),
            ("diffusion forcing r' = 2", HUGINN_DF + ["--inner-recurrence", "2"]),
            ("diffusion forcing r' = 4 (paper default)", HUGINN_DF + ["--inner-recurrence", "4"]),
            ("diffusion forcing r' = 4, eps 0.1", HUGINN_DF + ["--inner-recurrence", "4", "--exit-t", "0.1"]),
        ],
    ),
    "llada": (
        "models/llada-tiny",
        "copy,sort",
        [
            ("low-confidence, 16 steps", LLADA + ["--scheme", "low-confidence", "--steps", "16"]),
            ("low-confidence, 8 steps", LLADA + ["--scheme", "low-confidence", "--steps", "8"]),
            ("low-confidence, 4 steps", LLADA + ["--scheme", "low-confidence", "--steps", "4"]),
            ("wino (tau1 0.6, tau2 0.9)", LLADA + ["--scheme", "wino"]),
            ("low-confidence + SureLock eps 5e-4", LLADA + ["--scheme", "low-confidence", "--steps", "16", "--surelock-eps", "0.0005"]),
            ("low-confidence + SureLock eps 5e-3", LLADA + ["--scheme", "low-confidence", "--steps", "16", "--surelock-eps", "0.005"]),
            ("low-confidence + SureLock eps 5e-2", LLADA + ["--scheme", "low-confidence", "--steps", "16", "--surelock-eps", "0.05"]),
            ("wino + SureLock eps 5e-3", LLADA + ["--scheme", "wino", "--surelock-eps", "0.005"]),
        ],
    ),
    # Fast-dLLM (issue 39): its caches and threshold rule against exact low-confidence.
    "fast-dllm": (
        "models/llada-tiny",
        "copy,sort,prose",
        [
            ("low-confidence, one token per step (exact)", FAST + ["--steps", "64"]),
            ("threshold 0.9", FAST + ["--steps", "4", "--threshold", "0.9"]),
            ("threshold 0.7", FAST + ["--steps", "4", "--threshold", "0.7"]),
            ("prefix cache, one token per step", FAST + ["--steps", "64", "--kv-cache", "prefix"]),
            ("dual cache, one token per step", FAST + ["--steps", "64", "--kv-cache", "dual"]),
            ("prefix cache + threshold 0.9", FAST + ["--steps", "4", "--kv-cache", "prefix", "--threshold", "0.9"]),
            ("dual cache + threshold 0.9", FAST + ["--steps", "4", "--kv-cache", "dual", "--threshold", "0.9"]),
            ("prefix cache + threshold 0.7", FAST + ["--steps", "4", "--kv-cache", "prefix", "--threshold", "0.7"]),
            ("dual cache + threshold 0.7", FAST + ["--steps", "4", "--kv-cache", "dual", "--threshold", "0.7"]),
            ("prefix cache + threshold 0.5", FAST + ["--steps", "4", "--kv-cache", "prefix", "--threshold", "0.5"]),
            ("dual cache + threshold 0.5", FAST + ["--steps", "4", "--kv-cache", "dual", "--threshold", "0.5"]),
            ("prefix cache + threshold 0.3", FAST + ["--steps", "4", "--kv-cache", "prefix", "--threshold", "0.3"]),
            ("wino (tau1 0.6, tau2 0.9), blocks of 16", ["--scheme", "wino", "--max-new-tokens", "64", "--block-length", "16"]),
            # The compositions with SureLock (issue 39 item 3): its locked rows leave the forwards
            # alongside the cache's.
            ("SureLock eps 5e-3, one token per step", FAST + ["--steps", "64", "--surelock-eps", "0.005"]),
            ("prefix cache + threshold 0.9 + SureLock eps 5e-3", FAST + ["--steps", "4", "--kv-cache", "prefix", "--threshold", "0.9", "--surelock-eps", "0.005"]),
            ("dual cache + threshold 0.9 + SureLock eps 5e-3", FAST + ["--steps", "4", "--kv-cache", "dual", "--threshold", "0.9", "--surelock-eps", "0.005"]),
            ("wino + SureLock eps 5e-3, blocks of 16", ["--scheme", "wino", "--max-new-tokens", "64", "--block-length", "16", "--surelock-eps", "0.005"]),
        ],
    ),
    "refusion": (
        "models/refusion-tiny",
        "copy,sort",
        [
            ("ar (its own left-to-right decoding)", REFUSION + ["--scheme", "ar"]),
            ("plan-infill, slot 4, thresholds 0.9 / 0.9 (paper)", REFUSION + ["--scheme", "plan-infill", "--slot-size", "4"]),
            ("plan-infill, slot 8", REFUSION + ["--scheme", "plan-infill", "--slot-size", "8"]),
            ("plan-infill, slot 4, thresholds 0.7 / 0.7", REFUSION + ["--scheme", "plan-infill", "--slot-size", "4", "--slot-threshold", "0.7", "--token-threshold", "0.7"]),
        ],
    ),
    "armt": (
        "models/armt-tiny",
        "recall-1,recall",
        [
            ("sequential", ["--scheme", "ar", "--execution", "sequential"]),
            ("diagonal", ["--scheme", "ar", "--execution", "diagonal"]),
        ],
    ),
}


def flops_ratio(wavefront: str, model: str, args: list[str]) -> float | None:
    """SureLock's algorithmic FLOPs over the same sampler's without locking, on one prompt."""
    out = subprocess.run(
        [wavefront, "run", "--model", model, "--json", "--log-filter", "warn", "--prompt", "copy i r q c =", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    c = json.loads(out.stdout)["stats"]["counters"]
    return c["algorithmic_flops"] / c["algorithmic_flops_dense"] if "algorithmic_flops_dense" in c else None


def with_canvas(run_args: list[str], canvas: int) -> list[str]:
    """The run arguments for another canvas length: `--max-new-tokens` becomes `canvas`, and a
    one-token-per-step setting (steps equal to the old length) takes `canvas` steps."""
    out = list(run_args)
    old = out[out.index("--max-new-tokens") + 1]
    out[out.index("--max-new-tokens") + 1] = str(canvas)
    if "--steps" in out and out[out.index("--steps") + 1] == old:
        out[out.index("--steps") + 1] = str(canvas)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=FAMILIES, required=True)
    p.add_argument("--wavefront", default="target/release/wavefront")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the family's)")
    p.add_argument("--per-task", type=int, default=30)
    p.add_argument("--rounds", type=int, default=2, help="alternating passes; times are averaged")
    p.add_argument("--canvas", type=int, default=None,
                   help="fast-dllm: the canvas length (default 64); one-token-per-step rows take as many steps")
    p.add_argument("--only", default=None, help="comma-separated substrings: the settings to run besides the baseline")
    p.add_argument("--scorer", default=None,
                   help="with prose among the tasks: an ARMT checkpoint that scores the continuations (a Gen. PPL column)")
    args = p.parse_args()
    default_model, tasks, settings = FAMILIES[args.family]
    if args.only:
        wanted = args.only.split(",")
        settings = settings[:1] + [s for s in settings[1:] if any(w in s[0] for w in wanted)]
    if args.canvas:
        settings = [(name, with_canvas(run_args, args.canvas)) for name, run_args in settings]
    model = args.model or default_model
    runs: dict[str, list[dict]] = {name: [] for name, _ in settings}
    for _ in range(args.rounds):
        for name, run_args in settings:
            runs[name].append(evaluate.measure(args.wavefront, model, tasks, args.per_task, run_args, args.scorer))
    names = tasks.split(",")
    checked = [t for t in names if t != "prose"]
    prose = "prose" in names
    ppl = prose and args.scorer is not None
    print(f"{model}, {args.per_task} held-out prompts per task, {args.rounds} alternating rounds")
    print()
    print("| setting | " + " | ".join(f"{t} accuracy" for t in checked)
          + (" | prose: known words / seen pairs / distinct pairs" if prose else "")
          + (" | prose Gen. PPL" if ppl else "")
          + " | forwards | tokens / forward | rows | core iterations | FLOPs ratio | compute ms"
          + " | forwards vs baseline | time vs baseline | tokens/s vs baseline"
          + (f" | tokens/s vs baseline per task ({' / '.join(names)})" if len(names) > 1 else "") + " |")
    print("|---|" + "---|" * (len(checked) + int(prose) + int(ppl) + 10 + int(len(names) > 1)))
    base = None
    for name, run_args in settings:
        rs = runs[name]
        first = rs[0]
        fwd = sum(first[t]["forward_passes"] for t in names) / len(names)
        tpf = sum(first[t]["tokens_per_forward"] for t in names) / len(names)
        rows = sum(first[t]["rows"] for t in names) / len(names)
        steps = sum(first[t]["recurrence_steps"] for t in names) / len(names)
        ms = sum(r[t]["compute_ms"] for r in rs for t in names) / (len(rs) * len(names))
        # Throughput: tokens answered per second of engine compute (answers differ in length).
        tps = sum(r[t]["tokens_per_forward"] * r[t]["forward_passes"] for r in rs for t in names) / max(
            sum(r[t]["compute_ms"] for r in rs for t in names), 1e-9
        )
        # The same per task: tasks whose answers differ in length weigh differently in the total.
        per_task = [
            sum(r[t]["tokens_per_forward"] * r[t]["forward_passes"] for r in rs)
            / max(sum(r[t]["compute_ms"] for r in rs), 1e-9)
            for t in names
        ]
        if base is None:
            base = (fwd, ms, tps, per_task)
        flops = flops_ratio(args.wavefront, model, run_args) if "--surelock-eps" in run_args else None
        acc = " | ".join(f"{first[t]['accuracy']:.0%}" for t in checked)
        p = first.get("prose", {})
        quality = f" | {p.get('known_words', 0):.2f} / {p.get('seen_pairs', 0):.2f} / {p.get('distinct_pairs', 0):.2f}" if prose else ""
        if ppl:
            quality += f" | {p['gen_ppl']['ppl']:.2f}"
        print(
            f"| {name} | {acc}{quality} | {fwd:.2f} | {tpf:.2f} | {rows:.0f} | {steps:.1f} | "
            + (f"{flops:.3f}" if flops is not None else "")
            + f" | {ms:.1f} | {fwd / base[0]:.2f}x | {ms / base[1]:.2f}x | {tps / base[2]:.2f}x"
            + (" | " + " / ".join(f"{x / b:.2f}x" for x, b in zip(per_task, base[3])) if len(names) > 1 else "")
            + " |"
        )
    if prose:
        ref = runs[settings[0][0]][0]["prose"]["reference"]
        print()
        own = f"Held-out text's own continuations: {ref['known_words']:.2f} / {ref['seen_pairs']:.2f} / {ref['distinct_pairs']:.2f}"
        if ppl:
            own += f", Gen. PPL {runs[settings[0][0]][0]['prose']['gen_ppl']['reference']:.2f}"
        print(own + ".")


if __name__ == "__main__":
    main()
