#!/usr/bin/env bash
# On the GPU machine (device tool, carry [".deps"]): builds nibble with CUDA, then
#  1. the HF cross-check (tools/reference/check_quantized.py) of every `nibble quantize` layout made
#     from the demo models, against nibble's CPU backend and its CUDA backend;
#  2. the GPU rows of docs/quality.md (tools/train_demo/quality_table.py --set gpu).
# Results land in $OUT (check_*.json, quality_gpu.json, logs).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/nibble-out}
mkdir -p "$OUT"
ROOT=$PWD/.deps/root
if [ -d .deps/debs ]; then
  mkdir -p "$ROOT"
  for f in .deps/debs/*.deb; do dpkg -x "$f" "$ROOT"; done
fi
export CMAKE_PREFIX_PATH=$ROOT/usr LD_LIBRARY_PATH=$ROOT/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export CPATH=$ROOT/usr/include:${CPATH:-} PKG_CONFIG_PATH=$ROOT/usr/lib/x86_64-linux-gnu/pkgconfig PKG_CONFIG_SYSROOT_DIR=$ROOT
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
t0=$(date +%s)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DNIBBLE_CUDA_ARCHS="${arch}a" >"$OUT/build.log" 2>&1 &&
  cmake --build build-gpu -j16 --target nibble >>"$OUT/build.log" 2>&1
rc=$?
echo "build rc=$rc $(( $(date +%s) - t0 ))s"
if [ $rc -ne 0 ]; then grep -E "error|FAILED" -A3 "$OUT/build.log" | head -40; exit 1; fi
NB=build-gpu/src/nibble
HELD=/tmp/heldout.txt
tail -c +1003857 data/tinyshakespeare.txt >"$HELD"
Q=/tmp/quantized
$NB quantize -m models/qwen3-demo-bf16 -o $Q/qwen3-demo-fp8 --format fp8 >/dev/null
for m in models/gpt-oss-demo-mxfp4 models/qwen3-demo-nvfp4 $Q/qwen3-demo-fp8 models/gpt-oss-demo-bf16 models/qwen3-demo-bf16; do
  n=$(basename "$m")
  for dev in cpu cuda; do
    timeout 120 python3 tools/reference/check_quantized.py -m "$m" --text-file "$HELD" --max-tokens 4096 \
      --nibble "$NB" --nibble-args "--device $dev" --device cuda --out "$OUT/check_${n}_nibble-$dev.json" 2>>"$OUT/check.log" |
      tail -1
  done
done
timeout 300 python3 tools/train_demo/quality_table.py --nibble "$NB" --set gpu --device cuda --out "$OUT/quality_gpu.json"
echo "quality rc=$?"
