#!/usr/bin/env bash
# Sets up, builds and runs every CPU test: the C++ tests (ctest), a bounded fuzz run of the
# safetensors header parser, and the Python tests (pytest: tokenizer differential, CLI, server).
# GPU tests are built (CUDA sources for every arch in NIBBLE_CUDA_ARCHS) but run on the GPU machine
# (scripts/gpu-check.sh); here they skip themselves.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || { echo "test: setup failed"; exit 1; }

status=0
echo "== ctest"
ctest --test-dir build --output-on-failure -j"$(nproc)" || status=1

if [ -x scripts/fuzz.sh ] || [ -f scripts/fuzz.sh ]; then
  echo "== fuzz (bounded)"
  NIBBLE_FUZZ_SECONDS=${NIBBLE_FUZZ_SECONDS:-60} bash scripts/fuzz.sh || status=1
fi

echo "== pytest"
NIBBLE_BIN="$PWD/build/src/nibble" .venv/bin/python -m pytest -q tests/python
rc=$?
# pytest exits 5 when it collects no test: that is not a failure of the suite.
if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then status=1; fi
exit $status
