"""Held-out task accuracy of a checkpoint *as served*: every prompt of the fixed held-out set
(`common.eval_set`) goes through `wavefront run --json` with the given scheme arguments; prints
per-task exact-match accuracy, mean forward passes and wall time per answer.

    python training/evaluate.py --model models/llada-tiny --wavefront target/release/wavefront \\
        -- --scheme low-confidence --max-new-tokens 16 --steps 16 --block-length 16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--wavefront", default="target/release/wavefront")
    p.add_argument("--per-task", type=int, default=100)
    p.add_argument("--tasks", default=",".join(common.TASKS))
    p.add_argument("run_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    extra = [a for a in args.run_args if a != "--"]
    tasks = {k: common.TASKS[k] for k in args.tasks.split(",")}
    results: dict[str, list] = {}
    for name, prompt, answer in common.eval_set(args.per_task, tasks=tasks):
        start = time.time()
        out = subprocess.run(
            [args.wavefront, "run", "--model", args.model, "--json", "--log-filter", "warn", "--prompt", prompt, *extra],
            capture_output=True,
            text=True,
            check=True,
        )
        r = json.loads(out.stdout)
        text = r["text"].split("<|")[0]
        results.setdefault(name, []).append(
            (text.strip() == answer.strip(), r["stats"]["forward_passes"], r["stats"]["compute_time_ms"], time.time() - start)
        )
    summary = {
        name: {
            "accuracy": sum(x[0] for x in rs) / len(rs),
            "forward_passes": sum(x[1] for x in rs) / len(rs),
            "compute_ms": sum(x[2] for x in rs) / len(rs),
            "n": len(rs),
        }
        for name, rs in results.items()
    }
    print(json.dumps({"model": args.model, "run_args": extra, "tasks": summary}, indent=1))


if __name__ == "__main__":
    main()
