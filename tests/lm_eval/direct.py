"""Scores the local lm-eval tasks (tests/lm_eval/tasks) by sending their requests straight to
wavefront's HTTP API, then checks that lm-evaluation-harness's results (its `--output_path`)
are the same numbers.

The requests are the ones lm-eval's `local-completions` and `local-chat-completions` models
make, built here from the task data without lm-eval:
- log-likelihood (`wf_choice`): the context and each choice tokenized together and apart
  through `/tokenize` (no special tokens; a context's trailing spaces move to the continuation),
  one completion per choice with `echo`, `logprobs: 1`, `max_tokens: 1`; a choice's
  log-likelihood is the sum of its tokens' entries (the prompt's, after the context); the
  document counts as right when its gold choice has the highest;
- generate-until (`wf_gen`): the prompt's ids (or, for chat, one user message), greedy, at most
  `max_gen_toks` tokens, stopping at `until` (and the tokenizer's end-of-text token for
  completions); right when the text equals the answer.

Every request's answer is compared with lm-eval's logged one (each choice's log-likelihood,
each generated text), then the scores.

Usage: python direct.py BASE_URL RESULTS_DIR MODEL [chat]
Exits non-zero on any difference.
"""
import glob
import json
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEED = 1234


def post(base, path, body):
    req = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def get(base, path):
    with urllib.request.urlopen(f"{base}{path}", timeout=60) as r:
        return json.loads(r.read())


def rows(name):
    return [json.loads(line) for line in open(ROOT / "tests/lm_eval/data" / name)]


def tokenize(base, model, text):
    return post(base, "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})["tokens"]


def loglikelihood(base, model, context, continuation):
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation = context[-spaces:] + continuation
        context = context[:-spaces]
    whole = tokenize(base, model, context + continuation)
    ctx = tokenize(base, model, context)
    ids = ctx + whole[len(ctx):]
    r = post(base, "/v1/completions", {"model": model, "prompt": ids, "temperature": 0,
                                        "max_tokens": 1, "logprobs": 1, "seed": SEED, "echo": True})
    return sum(r["choices"][0]["logprobs"]["token_logprobs"][len(ctx):-1])


def samples(results_dir, model, task):
    """lm-eval's logged samples of `task`, by document index."""
    files = sorted(glob.glob(f"{results_dir}/{model}/samples_{task}_*.jsonl"))
    if not files:
        raise SystemExit(f"no lm-eval samples of {task} for {model} under {results_dir}")
    return {int(d["doc_id"]): d for d in map(json.loads, open(files[-1]))}


def choice_acc(base, model, logged):
    right = []
    for i, d in enumerate(rows("choice.jsonl")):
        lls = [loglikelihood(base, model, d["prompt"], c) for c in d["choices"]]
        theirs = [float(r[0]) for r in logged[i]["filtered_resps"]]
        if theirs != lls:
            raise SystemExit(f"{model} document {i}: lm-eval's log-likelihoods {theirs}, direct {lls}")
        right.append(max(range(len(lls)), key=lambda i: (lls[i], -i)) == d["gold"])
    return sum(right) / len(right)


def gen_exact(base, model, chat, logged):
    eos = get(base, f"/tokenizer_info?model={model}").get("eos_token")
    right = []
    for i, d in enumerate(rows("gen.jsonl")):
        if chat:
            r = post(base, "/v1/chat/completions", {
                "model": model, "messages": [{"role": "user", "content": d["prompt"]}],
                "max_tokens": 12, "temperature": 0, "stop": ["\n"], "seed": SEED})
            text = r["choices"][0]["message"]["content"]
        else:
            stop = ["\n"] + ([eos] if eos else [])
            r = post(base, "/v1/completions", {
                "model": model, "prompt": tokenize(base, model, d["prompt"]), "max_tokens": 12,
                "temperature": 0, "stop": stop, "seed": SEED})
            text = r["choices"][0]["text"]
        if logged[i]["filtered_resps"] != [text]:
            raise SystemExit(f"{model} document {i}: lm-eval got {logged[i]['filtered_resps']}, direct {text!r}")
        right.append(text == d["answer"])
    return sum(right) / len(right)


def harness(results_dir, model):
    files = sorted(glob.glob(f"{results_dir}/{model}/results_*.json"))
    if not files:
        raise SystemExit(f"no lm-eval results for {model} under {results_dir}")
    return json.load(open(files[-1]))["results"]


def main():
    base, results_dir, model = sys.argv[1:4]
    chat = len(sys.argv) > 4 and sys.argv[4] == "chat"
    got = harness(results_dir, model)
    checks = [("wf_gen", "exact_match,none",
               gen_exact(base, model, chat, samples(results_dir, model, "wf_gen")))]
    if not chat:
        checks.insert(0, ("wf_choice", "acc,none",
                          choice_acc(base, model, samples(results_dir, model, "wf_choice"))))
    for task, metric, direct in checks:
        lm = got[task][metric]
        print(f"{model}{' chat' if chat else ''} {task} {metric}: lm-eval {lm}, direct {direct}")
        if lm != direct:
            raise SystemExit(f"{model} {task}: lm-eval's {lm} is not the direct script's {direct}")


if __name__ == "__main__":
    main()
