#!/usr/bin/env bash
# The full soak (10,000 requests over every family and scheme, 64 connections) and the
# overload and hostile-client tests with the issue's 2x bounds, on a release build, nothing
# else running.
# Loopback only; each test stops by itself (count and time bounded).
#   scripts/soak.sh [REQUESTS]        default 10000
# Reports: target/soak-report.json, and the two JSON lines printed (soak: / overload:).
set -euo pipefail
cd "$(dirname "$0")/.."
export WAVEFRONT_SOAK_REQUESTS="${1:-10000}"
export WAVEFRONT_SOAK_SECONDS="${WAVEFRONT_SOAK_SECONDS:-1200}"
export WAVEFRONT_SOAK_REPORT="$PWD/target/soak-report.json"
export WAVEFRONT_OVERLOAD_MAX_RATIO="${WAVEFRONT_OVERLOAD_MAX_RATIO:-2}"
export WAVEFRONT_FLOOD_MAX_RATIO="${WAVEFRONT_FLOOD_MAX_RATIO:-2}"
cargo test --release -p wavefront --test e2e -- soak:: hostile:: --test-threads 1 --nocapture 2>&1 \
  | grep -E '^(soak|overload): |oversized chats refused|^test |test result' 
