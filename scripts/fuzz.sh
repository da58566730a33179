#!/usr/bin/env bash
# Long fuzzing runs of the hostile-input properties (CI runs a bounded budget of each):
# protobuf requests and bytes through the worker's path, chat templates and tokenizer input
# (services/worker/tests/hostile_requests.rs), and model directories with truncated or lying
# files (services/models/tests/hostile_files.rs).
#   scripts/fuzz.sh [CASES]           default 20000 cases per property
set -euo pipefail
cd "$(dirname "$0")/.."
export PROPTEST_CASES="${1:-20000}"
cargo test --release -p wavefront-worker --test hostile_requests
cargo test --release -p wavefront-models --test hostile_files
