#!/usr/bin/env bash
# The training pipeline's smoke test (CI does not train; the checkpoints are committed): each
# family's script trains a few steps on the committed slice, its loss must fall, and the debug
# `wavefront` binary must load what it wrote. The venv is kept between runs, keyed by the
# requirements file (torch is large).
set -euo pipefail
cd "$(dirname "$0")/.."
key="$(sha256sum training/requirements.txt | cut -c1-16)"
venv="${WAVEFRONT_TRAIN_VENV:-$HOME/.cache/wavefront/train-venv-$key}"
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r training/requirements.txt
  touch "$venv/.complete"
fi
"$venv/bin/python" training/smoke_test.py --wavefront target/debug/wavefront
