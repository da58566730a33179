"""Prompt sharing, measured end to end: `wavefront serve` on one model, started twice (with
`--prompt-sharing true` and `false`, the prefix cache off on both, so a round's choices share
with each other only; `bench-prefix-cache.py` measures the cache), alternating rounds; each
round sends one completions request with `n` choices of a long token-id prompt and reads its
wall time and the choices' statistics (rows each computed, rows it read from another choice's
pages).

usage: bench-prompt-sharing.py [--model models/refusion-tiny] [--prompt 1024] [--n 8]
                               [--max-tokens 16] [--rounds 4] [--scheme ar] [--params JSON]
"""

import argparse
import json
import statistics

from serve_http import ask, start


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--wavefront", default="target/release/wavefront")
    a.add_argument("--model", default="models/refusion-tiny")
    a.add_argument("--prompt", type=int, default=1024)
    a.add_argument("--n", type=int, default=8)
    a.add_argument("--max-tokens", type=int, default=16)
    a.add_argument("--rounds", type=int, default=4)
    a.add_argument("--scheme", default="ar")
    a.add_argument("--params", default="{}", help="the scheme object's fields, as JSON")
    args = a.parse_args()
    servers = {s: start(args.wavefront, args.model, ["--prompt-sharing", s, "--prefix-cache-entries", "0"]) for s in ("true", "false")}
    prompt = [(i * 37 + 11) % 400 + 20 for i in range(args.prompt)]
    body = {"model": args.model.rstrip("/").split("/")[-1], "prompt": prompt,
            "max_tokens": args.max_tokens, "temperature": 0.8, "seed": 1, "n": args.n,
            args.scheme: json.loads(args.params)}
    times = {"true": [], "false": []}
    rows = {}
    try:
        for s in servers.values():
            ask(s[1], body)  # warm-up
        for _ in range(args.rounds):
            for sharing, (_, addr) in servers.items():
                t, out = ask(addr, body)
                times[sharing].append(t)
                stats = [c["wavefront"]["stats"] for c in out["choices"]]
                rows[sharing] = (
                    sum(sum(s["series"].get("rows_per_call", [])) for s in stats),
                    sum(s["counters"].get("shared_prompt_tokens", 0) for s in stats),
                    [c["wavefront"]["token_ids"] for c in out["choices"]],
                )
    finally:
        for p, _ in servers.values():
            p.terminate()
    same = rows["true"][2] == rows["false"][2]
    for sharing in ("true", "false"):
        computed, shared, _ = rows[sharing]
        print(json.dumps({"prompt_sharing": sharing, "prompt": args.prompt, "n": args.n,
                          "max_tokens": args.max_tokens, "rounds_s": [round(x, 3) for x in times[sharing]],
                          "median_s": round(statistics.median(times[sharing]), 3),
                          "rows_computed": computed, "rows_shared": shared,
                          "same_tokens_both_ways": same}))


if __name__ == "__main__":
    main()
