#!/usr/bin/env bash
# lm-evaluation-harness (lm_eval from PyPI) end to end against `wavefront serve` on the embedded
# trained models: its `local-completions` model (a log-likelihood task and a generate-until
# task, tests/lm_eval/tasks, local data) for huginn, armt and llada, and its
# `local-chat-completions` model (generate-until) for llada; then tests/lm_eval/direct.py sends
# the same requests itself and checks every answer and score against lm-eval's. Needs the debug
# binary.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TMPDIR:-/tmp}/wavefront-lm-eval-venv"
if [ ! -x "$venv/bin/lm_eval" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "lm_eval[api]==0.4.13"
fi
out="$(mktemp -d)"
export HF_HOME="$out/hf" HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
log="$out/serve.log"
target/debug/wavefront serve --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 >"$log" 2>"$out/serve.err" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  grep -q "http listening on" "$log" && break
  kill -0 $pid 2>/dev/null || { cat "$out/serve.err"; exit 1; }
  sleep 0.1
done
http="$(sed -n 's/^wavefront router http listening on //p' "$log" | head -1)"
[ -n "$http" ] || { echo "serve did not report its HTTP address"; exit 1; }
run() { # MODEL KIND ENDPOINT OUT TASKS [EXTRA...]
  local model=$1 kind=$2 endpoint=$3 dir=$4 tasks=$5
  shift 5
  "$venv/bin/lm_eval" --model "$kind" \
    --model_args "model=$model,base_url=http://$http$endpoint,num_concurrent=1,max_retries=1,$TOKENIZER" \
    --tasks "$tasks" --include_path tests/lm_eval/tasks --output_path "$dir" --log_samples \
    --seed 1234 "$@" >"$out/lm-eval-$model-$kind.log" 2>&1 \
    || { tail -40 "$out/lm-eval-$model-$kind.log"; exit 1; }
}
TOKENIZER="tokenizer_backend=remote,tokenized_requests=True"
for model in huginn armt llada; do
  run "$model" local-completions /v1/completions "$out/completions" wf_choice,wf_gen
  python3 tests/lm_eval/direct.py "http://$http" "$out/completions" "$model"
done
TOKENIZER="tokenizer_backend=none"
run llada local-chat-completions /v1/chat/completions "$out/chat" wf_gen --apply_chat_template
python3 tests/lm_eval/direct.py "http://$http" "$out/chat" llada chat
