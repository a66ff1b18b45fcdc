#!/usr/bin/env bash
# On the GPU machine: build a bench (default nibble_kernel_bench) and profile one kernel of it with Nsight
# Compute, leaving the report and a per-SASS-instruction CSV (stall samples, instructions executed) in $OUT for
# tools/bench/ncu_stalls.py to read here.
# Usage (device tool, carry [".deps"]):
#   NIBBLE_NCU="name:kernel-regex:bench-filter[:skip];..." bash scripts/gpu-ncu.sh
#   e.g. NIBBLE_NCU="fc1:stream_fc1:gpt-oss-120b expert fc1 x4 (+SwiGLU) mxfp4:4" (skip: launches of the
#   matching kernel to pass over first, past the bench's warm-up)
#   NIBBLE_NCU_SET (default full), NIBBLE_BUILD_DIR (default build-gpu).
#   NIBBLE_NCU_BENCH (default nibble_kernel_bench) and NIBBLE_NCU_ARGS profile another bench, e.g. flash attention
#   at gpt-oss pp8192 (launches 27.. of `--quick`):
#   NIBBLE_NCU_BENCH=nibble_attention_bench NIBBLE_NCU_ARGS=--quick NIBBLE_NCU="fa64:flash_attention_kernel::26"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nibble-out}
mkdir -p "$OUT"
BENCH=${NIBBLE_NCU_BENCH:-nibble_kernel_bench}
read -r -a bench_args <<<"${NIBBLE_NCU_ARGS:-}"
NIBBLE_TARGETS=$BENCH NIBBLE_SKIP_BENCH=1 NIBBLE_CTEST_FILTER='^$' bash scripts/gpu-check.sh >"$OUT/check.log" 2>&1
tail -5 "$OUT/check.log"
B=${NIBBLE_BUILD_DIR:-build-gpu}
export LD_LIBRARY_PATH=$PWD/.deps/root/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
[ -n "${NIBBLE_NCU:-}" ] || { echo "gpu-ncu.sh: set NIBBLE_NCU" >&2; exit 2; }
IFS=';' read -ra specs <<<"$NIBBLE_NCU"
for spec in "${specs[@]}"; do
  IFS=':' read -r name regex filter skip <<<"$spec"
  t0=$(date +%s)
  NIBBLE_BENCH_FILTER="$filter" timeout 300 ncu --clock-control none --set "${NIBBLE_NCU_SET:-full}" \
    --import-source no -k "regex:$regex" -s "${skip:-4}" -c 1 -f -o "$OUT/$name" "$B/src/$BENCH" "${bench_args[@]}" \
    >"$OUT/$name.log" 2>&1
  echo "$name: rc=$? $(( $(date +%s) - t0 ))s"
  tail -3 "$OUT/$name.log"
  ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass >"$OUT/$name.sass.csv" 2>"$OUT/$name.err"
  ncu --import "$OUT/$name.ncu-rep" --page details --csv >"$OUT/$name.details.csv" 2>>"$OUT/$name.err"
  grep -E '"(Duration|Issue Slots Busy|Eligible Warps Per Scheduler|Active Warps Per Scheduler|Registers Per Thread|DRAM Throughput|Memory Throughput|Executed Ipc Active)"' \
    "$OUT/$name.details.csv" | awk -F'","' '{print "  " $(NF-2) " = " $NF}' | tr -d '"' | head -12
  rm -f "$OUT/$name.ncu-rep" "$OUT/$name.err" "$OUT/$name.log"  # (the device returns only a few files: the CSVs are what is read)
done
rm -f "$OUT"/build.log "$OUT"/ctest.log "$OUT"/check.log
