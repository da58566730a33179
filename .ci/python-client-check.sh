#!/usr/bin/env bash
# Generates a Python client from proto/ alone (grpcio-tools) and runs it
# against a live `wavefront serve` on loopback. Needs the debug binary.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TMPDIR:-/tmp}/wavefront-python-client-venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check grpcio==1.76.0 grpcio-tools==1.76.0 grpcio-health-checking==1.76.0
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
