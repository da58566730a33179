"""The prefix cache, measured end to end: `wavefront serve` on one model, started twice (with
`--prefix-cache-entries 64` and `0`), alternating rounds; each round sends `--requests`
completions requests with the same long token-id prompt one after another (each once the one
before has answered, as a client retrying or repeating a prompt does) and reads each one's wall
time and statistics (rows it read from a kept request's pages).

With `--tail N` each request's last N prompt tokens are its own (prompts that only begin
alike: a chat's next turn, few-shot prompts with one preamble), so a request reads the whole
pages of the common prefix.

usage: bench-prefix-cache.py [--model models/refusion-tiny] [--prompt 1024] [--requests 8]
                             [--max-tokens 16] [--rounds 4] [--scheme ar] [--params JSON]
                             [--tail 0]
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
    a.add_argument("--requests", type=int, default=8)
    a.add_argument("--max-tokens", type=int, default=16)
    a.add_argument("--rounds", type=int, default=4)
    a.add_argument("--scheme", default="ar")
    a.add_argument("--params", default="{}", help="the scheme object's fields, as JSON")
    a.add_argument("--tail", type=int, default=0, help="prompt tokens of each request's own")
    args = a.parse_args()
    servers = {e: start(args.wavefront, args.model, ["--prefix-cache-entries", str(e)]) for e in (64, 0)}
    times = {e: [] for e in servers}
    shared = {e: [] for e in servers}
    tokens = {e: [] for e in servers}
    try:
        for rnd in range(args.rounds + 1):
            # A prompt of its own per round, so each round's first request computes it.
            prompt = [(i * 37 + 11 + 7 * rnd) % 400 + 20 for i in range(args.prompt)]
            body = {"model": args.model.rstrip("/").split("/")[-1], "prompt": prompt,
                    "max_tokens": args.max_tokens, "temperature": 0.8,
                    args.scheme: json.loads(args.params)}
            order = list(servers.items()) if rnd % 2 == 0 else list(reversed(servers.items()))
            for entries, (_, addr) in order:
                for i in range(args.requests):
                    own = [(j * 13 + 29 * i + 5) % 400 + 20 for j in range(args.tail)]
                    t, out = ask(addr, {**body, "seed": i, "prompt": prompt[:len(prompt) - args.tail] + own})
                    if rnd == 0:
                        continue  # warm-up
                    times[entries].append(t)
                    c = out["wavefront"]
                    shared[entries].append(c["stats"]["counters"].get("shared_prompt_tokens", 0))
                    tokens[entries].append(c["token_ids"])
    finally:
        for p, _ in servers.values():
            p.terminate()
    same = tokens[64] == tokens[0]
    for entries in servers:
        print(json.dumps({"prefix_cache_entries": entries, "prompt": args.prompt, "tail": args.tail,
                          "requests_per_round": args.requests, "max_tokens": args.max_tokens,
                          "median_s": round(statistics.median(times[entries]), 4),
                          "min_s": round(min(times[entries]), 4),
                          "max_s": round(max(times[entries]), 4),
                          "rows_shared_median": statistics.median(shared[entries]),
                          "requests_that_shared": sum(1 for s in shared[entries] if s > 0),
                          "requests": len(shared[entries]),
                          "same_tokens_both_ways": same}))


if __name__ == "__main__":
    main()
