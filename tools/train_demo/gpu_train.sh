#!/usr/bin/env bash
# On the GPU machine (device tool): trains both demo models (tools/train_demo/train.py) and leaves
# them in $OUT as demo.tar.gz.part-* (split under the 16 MB per-file limit of the device tool).
# Reassemble here with: cat demo.tar.gz.part-* | tar -xz -C /tmp/demo
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/nibble-out}
mkdir -p "$OUT" /tmp/demo
python3 tools/train_demo/train.py --out /tmp/demo --seconds "${TRAIN_SECONDS:-140}" "$@" 2>&1 |
  grep -v "Writing model shards" | tee "$OUT/train.log"
tar -C /tmp/demo -czf - . | split -b 15M - "$OUT/demo.tar.gz.part-"
ls -la "$OUT"
