#!/usr/bin/env bash
# Generates a Python client from proto/ alone (grpcio-tools) and runs it
# against a live `wavefront serve` on loopback. Needs the debug binary.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TMPDIR:-/tmp}/wavefront-python-client-venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import grpc_tools, grpc_health, grpc_reflection, openai" 2>/dev/null; then
  "$venv/bin/pip" install -q --disable-pip-version-check grpcio==1.76.0 grpcio-tools==1.76.0 \
    grpcio-health-checking==1.76.0 grpcio-reflection==1.76.0 openai==3.51.0
fi
out="$(mktemp -d)"
"$venv/bin/python" -m grpc_tools.protoc -Iproto --python_out="$out" --grpc_python_out="$out" \
  proto/wavefront/v1/generate.proto
log="$out/serve.log"
target/debug/wavefront serve --listen 127.0.0.1:0 >"$log" 2>"$out/serve.err" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  grep -q "listening on" "$log" && break
  kill -0 $pid 2>/dev/null || { cat "$out/serve.err"; exit 1; }
  sleep 0.1
done
addr="$(sed -n 's/.*listening on //p' "$log" | head -1)"
[ -n "$addr" ] || { echo "serve did not report its address"; exit 1; }
"$venv/bin/python" tests/python/client_check.py "$out" "$addr"

# The OpenAI-compatible HTTP front with the official `openai` package, and reflection v1alpha,
# on the LLaDA fixture (a chat template, masked diffusion).
kill $pid 2>/dev/null || true
mport="$("$venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
log2="$out/serve-llada.log"
target/debug/wavefront --metrics-listen "127.0.0.1:$mport" serve --model tests/fixtures/llada \
  --served-name llada --listen 127.0.0.1:0 --http-listen 127.0.0.1:0 >"$log2" 2>"$out/serve-llada.err" &
pid=$!
for _ in $(seq 1 600); do
  grep -q "http listening on" "$log2" && break
  kill -0 $pid 2>/dev/null || { cat "$out/serve-llada.err"; exit 1; }
  sleep 0.1
done
grpc_addr="$(sed -n 's/^wavefront router listening on //p' "$log2" | head -1)"
http_addr="$(sed -n 's/^wavefront router http listening on //p' "$log2" | head -1)"
[ -n "$http_addr" ] || { echo "serve did not report its HTTP address"; exit 1; }
"$venv/bin/python" tests/python/openai_check.py "$http_addr" "$grpc_addr" "127.0.0.1:$mport"
