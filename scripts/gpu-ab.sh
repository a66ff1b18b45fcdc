#!/usr/bin/env bash
# The same benchmarks from two source trees built side by side on the GPU machine, interleaved, in one call:
# the before/after comparison bench/NOTES.md trusts. (Numbers from different device calls differ by 1-2 %,
# and a knob's "off" path is a baseline only when it compiles to the old code: tenth session, NOTES.md.)
# Here:      bash scripts/gpu-ab.sh --prepare REV   writes ab-base/ (git-ignored) from `git archive REV src bench`
# Device:    bash scripts/gpu-ab.sh [ROUNDS]        (device tool, carry [".deps", "ab-base"]); ROUNDS default 2
#   NIBBLE_AB_KERNEL_FILTER  nibble_kernel_bench rows to compare (NIBBLE_BENCH_FILTER; default mxfp4, "" skips)
#   NIBBLE_AB_E2E_ARGS       nibble_e2e_bench arguments (default: tg128 of both gpt-oss configs, all-MXFP4)
#   NIBBLE_AB_CTEST          a ctest regex to run on this tree first (it is then built with the tests)
#   NIBBLE_AB_VARIANTS       "NAME:CUDA_FLAGS ..." this tree built again per entry with those CMAKE_CUDA_FLAGS
#                            (e.g. "w20:-DNIBBLE_STREAM_WARPS_SM90=20"; commas separate several flags),
#                            benchmarked as a side of its own
#   NIBBLE_AB_SKIP_THIS=1    leave this tree's own build out (when a variant stands for it)
#   NIBBLE_AB_SKIP_BASE=1    no base tree (no ab-base/ needed): this tree and its variants only, e.g. a stamps
#                            build beside the plain one
#   NIBBLE_AB_GEMM_ARGS      also build and run nibble_gemm_bench with these arguments (e.g. --quick)
#   NIBBLE_AB_ATTN_ARGS      also build and run nibble_attention_bench with these arguments (e.g. --quick)
#   NIBBLE_AB_E2E_ARGS=-     no nibble_e2e_bench
# Prints, per round, the base tree's rows then this tree's.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--prepare" ]; then
  rev=${2:?usage: bash scripts/gpu-ab.sh --prepare REV}
  rm -rf ab-base && mkdir ab-base && git archive "$rev" src bench | tar -x -C ab-base &&
    echo "ab-base/ = $rev ($(git rev-parse --short "$rev")); carry it with .deps"
  exit $?
fi
rounds=${1:-2}
skip_base=${NIBBLE_AB_SKIP_BASE:-0}
[ "$skip_base" = 1 ] || [ -d ab-base/src ] || { echo "gpu-ab: no ab-base/ (run --prepare REV here and carry it)"; exit 2; }
OUT=${OUT:-/tmp/nibble-out}
mkdir -p "$OUT"
ROOT=$PWD/.deps/root
mkdir -p "$ROOT"
for f in .deps/debs/*.deb; do dpkg -x "$f" "$ROOT"; done
export CMAKE_PREFIX_PATH=$ROOT/usr LD_LIBRARY_PATH=$ROOT/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export CPATH=$ROOT/usr/include:${CPATH:-} PKG_CONFIG_PATH=$ROOT/usr/lib/x86_64-linux-gnu/pkgconfig PKG_CONFIG_SYSROOT_DIR=$ROOT
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
targets=(--target nibble_e2e_bench --target nibble_kernel_bench)
[ -n "${NIBBLE_AB_GEMM_ARGS+x}" ] && targets+=(--target nibble_gemm_bench)
[ -n "${NIBBLE_AB_ATTN_ARGS+x}" ] && targets+=(--target nibble_attention_bench)
# The base tree: this one with src/ and bench/ replaced.
base=/tmp/ab-base-tree
if [ "$skip_base" = 1 ]; then
  true &  # (a pid for the wait below)
else
  rm -rf "$base" && mkdir -p "$base"
  tar --exclude=./build-gpu --exclude=./ab-base --exclude=./.deps -cf - . | tar -xf - -C "$base"
  rm -rf "$base/src" "$base/bench" && cp -r ab-base/src ab-base/bench "$base/"
  (cd "$base" && cmake -S . -B b -G Ninja -DCMAKE_BUILD_TYPE=Release -DNIBBLE_CUDA_ARCHS="${arch}a" -DNIBBLE_TESTS=OFF &&
     cmake --build b -j8 "${targets[@]}") >"$OUT/ab-base-build.log" 2>&1 &
fi
base_pid=$!
# Variants: this tree again with extra CUDA flags, one build directory each, alongside.
read -r -a variants <<<"${NIBBLE_AB_VARIANTS:-}"
variant_pids=()
for v in "${variants[@]}"; do
  (cmake -S . -B "build-ab-${v%%:*}" -G Ninja -DCMAKE_BUILD_TYPE=Release -DNIBBLE_CUDA_ARCHS="${arch}a" \
     -DNIBBLE_TESTS=OFF -DCMAKE_CUDA_FLAGS="$(tr , ' ' <<<"${v#*:}")" && cmake --build "build-ab-${v%%:*}" -j8 "${targets[@]}") \
    >"$OUT/ab-build-${v%%:*}.log" 2>&1 &
  variant_pids+=($!)
done
tests=OFF
[ -n "${NIBBLE_AB_CTEST:-}" ] && tests=ON
new_rc=0
if [ "${NIBBLE_AB_SKIP_THIS:-0}" != 1 ]; then
  (cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DNIBBLE_CUDA_ARCHS="${arch}a" -DNIBBLE_TESTS=$tests &&
     if [ $tests = ON ]; then cmake --build build-gpu -j8; else cmake --build build-gpu -j8 "${targets[@]}"; fi) \
    >"$OUT/ab-build.log" 2>&1
  new_rc=$?
fi
wait $base_pid
base_rc=$?
var_rc=0
for pid in "${variant_pids[@]}"; do wait "$pid" || var_rc=1; done
echo "build: this tree rc=$new_rc, base rc=$base_rc, variants rc=$var_rc"
[ $new_rc -eq 0 ] && [ $base_rc -eq 0 ] && [ $var_rc -eq 0 ] ||
  { tail -n 20 "$OUT"/ab-build*.log; exit 1; }
if [ -n "${NIBBLE_AB_CTEST:-}" ]; then
  ctest --test-dir build-gpu --output-on-failure -j4 -R "$NIBBLE_AB_CTEST" >"$OUT/ab-ctest.log" 2>&1
  echo "ctest ($NIBBLE_AB_CTEST): rc=$? $(grep -E 'tests passed|tests failed' "$OUT/ab-ctest.log" | tail -1)"
fi
filter=${NIBBLE_AB_KERNEL_FILTER-mxfp4}
if [ -n "${NIBBLE_AB_E2E_ARGS:-}" ]; then
  read -r -a e2e <<<"$NIBBLE_AB_E2E_ARGS"
else
  e2e=(--pp '' --dense-formats mxfp4 configs/gpt-oss-120b configs/gpt-oss-20b)
fi
for r in $(seq "$rounds"); do
  sides=()
  [ "$skip_base" = 1 ] || sides+=(base)
  [ "${NIBBLE_AB_SKIP_THIS:-0}" != 1 ] && sides+=(this)
  for v in "${variants[@]}"; do sides+=("${v%%:*}"); done
  for side in "${sides[@]}"; do
    case $side in
      base) b=$base/b ;;
      this) b=build-gpu ;;
      *) b=build-ab-$side ;;
    esac
    echo "== $side, round $r"
    if [ -n "$filter" ]; then
      NIBBLE_BENCH_FILTER=$filter "$b"/src/nibble_kernel_bench 2>&1 | grep -E "^\| [a-z]|^stamps" | grep -v "^| model"
    fi
    if [ -n "${NIBBLE_AB_GEMM_ARGS+x}" ]; then
      read -r -a gargs <<<"$NIBBLE_AB_GEMM_ARGS"
      "$b"/src/nibble_gemm_bench "${gargs[@]}" 2>&1 | grep -E "^\| [a-z]" | grep -vE "^\| (projection|model|op) "
    fi
    if [ -n "${NIBBLE_AB_ATTN_ARGS+x}" ]; then
      read -r -a aargs <<<"$NIBBLE_AB_ATTN_ARGS"
      "$b"/src/nibble_attention_bench "${aargs[@]}" 2>&1 | grep -E "^\| (pp|[0-9])"
    fi
    [ "${NIBBLE_AB_E2E_ARGS:-}" = - ] || "$b"/src/nibble_e2e_bench "${e2e[@]}" 2>&1 | grep -E "^\| configs|^stamps"
  done
done | tee "$OUT/ab.txt"
