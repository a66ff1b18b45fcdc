#!/usr/bin/env bash
# On the GPU machine, in one call: unpack the carried Debian build deps (.deps/debs, no network
# there), build for the local GPU's arch, run every GPU test and the benchmarks, print a short table.
# Usage (device tool, carry [".deps"]): bash scripts/gpu-check.sh [--goldens]
#        bash scripts/gpu-check.sh --tree-hash   prints the source fingerprint it writes to $OUT/tree.txt
#                                                (run it here to tie device numbers to a local commit: the
#                                                device copy's git metadata can be stale)
#   NIBBLE_SKIP_BENCH=1 skips the benchmarks, NIBBLE_BENCHES="kernel tg pp gemm attn" picks them (below);
#   NIBBLE_CTEST_FILTER=regex runs only matching tests;
#   NIBBLE_BUILD_DIR (default build-gpu); NIBBLE_TARGETS="a b" builds only those targets (default all)
#   NIBBLE_ONE_FILE=1 folds every file it left under $OUT into $OUT/all.md at the end (the device tool brings
#   back only a few files; keep the call's own stdout outside $OUT)
# Before/after comparisons of two source trees in one call: scripts/gpu-ab.sh.
#   --goldens  also re-make the committed goldens with HF transformers / tiktoken / tokenizers and
#              leave them in $OUT/goldens.tar.gz
set -uo pipefail
cd "$(dirname "$0")/.."
# Fingerprint of the sources that make the binaries (not git's: the device may hold an old .git).
tree_hash() {
  find CMakeLists.txt src bench tests scripts configs -type f ! -path 'tests/data/*' ! -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z |
    xargs -0 sha1sum | sha1sum | cut -c1-12
}
if [ "${1:-}" = "--tree-hash" ]; then tree_hash; exit 0; fi
OUT=${OUT:-/tmp/nibble-out}
mkdir -p "$OUT"
ROOT=$PWD/.deps/root
if [ -d .deps/debs ]; then
  mkdir -p "$ROOT"
  for f in .deps/debs/*.deb; do dpkg -x "$f" "$ROOT"; done
fi
export CMAKE_PREFIX_PATH=$ROOT/usr
export LD_LIBRARY_PATH=$ROOT/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export CPATH=$ROOT/usr/include:${CPATH:-}
export PKG_CONFIG_PATH=$ROOT/usr/lib/x86_64-linux-gnu/pkgconfig PKG_CONFIG_SYSROOT_DIR=$ROOT

declare -A result
if [ "${1:-}" = "--goldens" ]; then
  t0=$(date +%s)
  mkdir -p /tmp/goldens
  python3 tools/reference/make_goldens.py --out /tmp/goldens/models --device cuda >"$OUT/goldens.log" 2>&1 &&
    python3 tools/reference/make_tokenizer_goldens.py --out /tmp/goldens/tokenizer >>"$OUT/goldens.log" 2>&1
  rc=$?
  tar -C /tmp/goldens -czf "$OUT/goldens.tar.gz" . && result[goldens]="rc=$rc $(( $(date +%s) - t0 ))s"
  tail -20 "$OUT/goldens.log"
fi

arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
t0=$(date +%s)
B=${NIBBLE_BUILD_DIR:-build-gpu}
targets=()
for t in ${NIBBLE_TARGETS:-}; do targets+=(--target "$t"); done
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DNIBBLE_CUDA_ARCHS="${arch}a" >"$OUT/build.log" 2>&1 &&
  cmake --build "$B" -j16 "${targets[@]}" -- -k 0 >>"$OUT/build.log" 2>&1
rc=$?
result[build]="rc=$rc $(( $(date +%s) - t0 ))s sm_${arch}a"
if [ $rc -ne 0 ]; then tail -40 "$OUT/build.log"; fi

t0=$(date +%s)
ctest --test-dir "$B" --output-on-failure -j4 ${NIBBLE_CTEST_FILTER:+-R "$NIBBLE_CTEST_FILTER"} >"$OUT/ctest.log" 2>&1
result[ctest]="rc=$? $(( $(date +%s) - t0 ))s $(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1)"
grep -E "Failed|\*\*\*|Passed|skipping" "$OUT/ctest.log" | tail -30
# The CUDA goldens' measured errors (the test prints them; ctest hides passing output).
if [ -x "$B"/tests/golden_cuda_test ]; then
  "$B"/tests/golden_cuda_test --gtest_filter='*Nll*:*Rounded*' 2>&1 | grep -E "cuda|FAILED" | tail -12
fi

# Benchmarks (bench/), each into $OUT and printed. NIBBLE_BENCHES picks and orders them (default: all):
#   kernel  decode projections (nibble_kernel_bench)
#   kbase   the FP4 rows again without the row-streaming kernels (NIBBLE_FP4_STREAM=0): baseline, same run
#   tg      end-to-end decode tg128 per dense format      pp      end-to-end prefill pp512/2048/8192
#   tgbase  tg128 at dense format mxfp4 without the row-streaming kernels (baseline, same run)
#   tgnofuse  tg128 at dense format mxfp4 without the decode fusions (NIBBLE_DECODE_FUSION=0; baseline)
#   tgdepth tg128 at dense format mxfp4 after 4096- and 16384-token prompts (--depth: long-context decode)
#   tgdbase the same with the key-by-key decode attention kernel (NIBBLE_ATTN_KEYS=0; baseline)
#   tgdgroup the same with the grouped decode attention kernel (NIBBLE_ATTN_GROUP=1; opt-in until measured)
#   khilo   the FP4 rows of the kernel bench with hi + lo activations (NIBBLE_GEMM_ACTIVATIONS=hi-lo; baseline)
#   tghilo  tg128 at dense format mxfp4 with hi + lo activations (--gemm-acts hi-lo; baseline)
#   gemm    prefill GEMMs vs cuBLASLt                      attn    prefill attention
#   models  tg128 and pp512/2048/8192 of the NVFP4 releases' shapes (configs/Llama-3.1-8B-NVFP4,
#           configs/Qwen3-30B-A3B-NVFP4) and prefill of BF16 Qwen3-30B-A3B (its experts through cuBLASLt)
#   portable  the GB10 path on this GPU (NIBBLE_WGMMA=0: the mma.sync tiles): nibble_gemm_bench ${NIBBLE_GEMM_ARGS},
#           pp2048 of both gpt-oss configs, and nibble_gemm_bench --quick at GB10's 2 stages (NIBBLE_WSP_STAGES=2)
#   tgenv   tg128 once per setting in NIBBLE_TG_ENVS (e.g. "- NIBBLE_L2_PREFETCH=0 NIBBLE_L2_PREFETCH=0,NIBBLE_FUSED_HEAD=0":
#           the defaults, one switch, two at once), alternating, NIBBLE_TG_ROUNDS rounds (default 2), dense formats
#           NIBBLE_TG_FORMATS (default mxfp4): a switch's A/B in one build
#   gemmenv nibble_gemm_bench ${NIBBLE_GEMM_ARGS:---quick} once per setting in NIBBLE_GEMM_ENVS, alternating, NIBBLE_TG_ROUNDS
#           rounds: a prefill GEMM switch's A/B in one build (not in the default list)
#   pptrace per-kernel GPU time of nibble_e2e_bench --no-tg --pp ${NIBBLE_PP:-2048} (CUPTI; tools/bench/kernel_sums.py),
#           per model in NIBBLE_PROFILE_MODELS (default both) and setting in NIBBLE_PP_ENVS (not in the default list)
#   ppenv   nibble_e2e_bench --no-tg --pp ${NIBBLE_PP:-512,2048,8192} once per setting in NIBBLE_PP_ENVS, alternating,
#           NIBBLE_TG_ROUNDS rounds (not in the default list)
#   profile kernel timeline of tg128 (tools/bench/kernel_trace.cc, CUPTI) (NIBBLE_PROFILE_MODELS, default gpt-oss-120b; NIBBLE_PROFILE_FORMAT,
#           default mxfp4): per kernel, calls, duration and how far it moves the step's end
#           (tools/bench/decode_timeline.py); NIBBLE_PROFILE_ENVS: one run per setting; not in the default list
build_tracer() {  # /tmp/prof/libkernel_trace.so (tools/bench/kernel_trace.cc: CUPTI kernel records as CSV)
  rm -rf /tmp/prof && mkdir -p /tmp/prof
  local cuda cupti
  cuda=$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")
  cupti=$(dirname "$(find "$cuda"/ -name 'libcupti.so*' 2>/dev/null | head -1)")
  g++ -shared -fPIC -O2 tools/bench/kernel_trace.cc -I"$cuda/include" -I"$cuda/extras/CUPTI/include" \
    -L"$cupti" -lcupti -Wl,-rpath,"$cupti" -o /tmp/prof/libkernel_trace.so
}
bench() {  # name, timeout, command...
  local name=$1 limit=$2
  shift 2
  local t0
  t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.md" 2>&1
  result[$name]="rc=$? $(( $(date +%s) - t0 ))s"
  cat "$OUT/$name.md"
}
if [ "${NIBBLE_SKIP_BENCH:-0}" != 1 ]; then
  git rev-parse --short HEAD >"$OUT/commit.txt" 2>/dev/null
  tree_hash >"$OUT/tree.txt"
  echo "source fingerprint (scripts/gpu-check.sh --tree-hash): $(cat "$OUT/tree.txt")"
  for b in ${NIBBLE_BENCHES:-kernel kbase khilo tg tgbase tghilo pp models gemm portable attn}; do
    case $b in
      kernel) bench kernel_bench 200 "$B"/src/nibble_kernel_bench ;;
      kbase) bench kernel_base 200 env NIBBLE_FP4_STREAM=0 NIBBLE_BENCH_FILTER=fp4 "$B"/src/nibble_kernel_bench ;;
      tg) bench e2e_bench 240 "$B"/src/nibble_e2e_bench --pp '' configs/gpt-oss-20b configs/gpt-oss-120b ;;
      tgbase) bench e2e_base 120 env NIBBLE_FP4_STREAM=0 "$B"/src/nibble_e2e_bench --pp '' --dense-formats mxfp4 \
        configs/gpt-oss-20b configs/gpt-oss-120b ;;
      khilo) bench kernel_hilo 200 env NIBBLE_GEMM_ACTIVATIONS=hi-lo NIBBLE_BENCH_FILTER=fp4 "$B"/src/nibble_kernel_bench ;;
      tghilo) bench e2e_hilo 120 "$B"/src/nibble_e2e_bench --pp '' --gemm-acts hi-lo --dense-formats mxfp4 \
        configs/gpt-oss-20b configs/gpt-oss-120b ;;
      tgdepth | tgdbase | tgdgroup)
        keys=1; [ "$b" = tgdbase ] && keys=0
        group=0; [ "$b" = tgdgroup ] && group=1
        for d in 4096 16384; do
          bench "e2e_${b}_$d" 150 env NIBBLE_ATTN_KEYS=$keys NIBBLE_ATTN_GROUP=$group "$B"/src/nibble_e2e_bench --pp '' \
            --depth $d --dense-formats mxfp4 configs/gpt-oss-20b configs/gpt-oss-120b
        done ;;
      tgnofuse) bench e2e_nofuse 120 env NIBBLE_DECODE_FUSION=0 "$B"/src/nibble_e2e_bench --pp '' --dense-formats mxfp4 \
        configs/gpt-oss-20b configs/gpt-oss-120b ;;
      pp)
        for acts in fp16 hi-lo; do
          bench "e2e_pp_$acts" 150 "$B"/src/nibble_e2e_bench --no-tg --pp 512,2048,8192 --max-seconds 20 \
            --gemm-acts "$acts" configs/gpt-oss-20b configs/gpt-oss-120b
        done ;;
      models)
        bench e2e_models 240 "$B"/src/nibble_e2e_bench --pp 512,2048,8192 --dense-formats keep \
          configs/Llama-3.1-8B-NVFP4 configs/Qwen3-30B-A3B-NVFP4
        bench e2e_qwen3_bf16 150 "$B"/src/nibble_e2e_bench --no-tg --pp 512,2048,8192 --max-seconds 20 \
          configs/Qwen3-30B-A3B ;;
      gemm) bench gemm_bench 300 "$B"/src/nibble_gemm_bench ${NIBBLE_GEMM_ARGS:-} ;;
      attn) bench attention_bench 200 "$B"/src/nibble_attention_bench ;;
      portable)
        bench gemm_portable 300 env NIBBLE_WGMMA=0 "$B"/src/nibble_gemm_bench ${NIBBLE_GEMM_ARGS:-}
        bench e2e_pp_portable 150 env NIBBLE_WGMMA=0 "$B"/src/nibble_e2e_bench --no-tg --pp 2048 \
          configs/gpt-oss-20b configs/gpt-oss-120b
        # GB10's depth of the warp-specialized portable tile (2 stages: its 99 KiB of shared memory per block)
        bench gemm_portable_2stages 200 env NIBBLE_WGMMA=0 NIBBLE_WSP_STAGES=2 "$B"/src/nibble_gemm_bench --quick ;;
      profile)  # kernel timeline of tg128 (CUPTI, graph nodes included): per kernel, duration and critical-path advance
        build_tracer
        for m in ${NIBBLE_PROFILE_MODELS:-gpt-oss-120b}; do
          for e in ${NIBBLE_PROFILE_ENVS:--}; do  # as NIBBLE_TG_ENVS (tgenv below): one run each
            v=${e#-}; tag=$m${v//=/_}; tag=${tag//,/_}
            echo "== profile $m $v"
            env ${v//,/ } NIBBLE_TRACE_CSV=/tmp/prof/$tag.csv LD_PRELOAD=/tmp/prof/libkernel_trace.so "$B"/src/nibble_e2e_bench \
              --pp '' --dense-formats "${NIBBLE_PROFILE_FORMAT:-mxfp4}" "configs/$m" 2>&1 | grep -E "kernel_trace|tok/s|\| configs"
            bench "profile_$tag" 60 python3 tools/bench/decode_timeline.py /tmp/prof/$tag.csv
          done
        done ;;
      pptrace)  # per-kernel GPU time of a prefill (CUPTI): one run per model and NIBBLE_PP_ENVS setting
        build_tracer
        for m in ${NIBBLE_PROFILE_MODELS:-gpt-oss-20b gpt-oss-120b}; do
          for e in ${NIBBLE_PP_ENVS:--}; do
            v=${e#-}; tag=pp$m${v//=/_}; tag=${tag//,/_}
            echo "== pptrace $m $v"
            env ${v//,/ } NIBBLE_TRACE_CSV=/tmp/prof/$tag.csv LD_PRELOAD=/tmp/prof/libkernel_trace.so "$B"/src/nibble_e2e_bench \
              --no-tg --pp "${NIBBLE_PP:-2048}" "configs/$m" 2>&1 | grep -E "kernel_trace|\| configs"
            bench "pptrace_$tag" 60 python3 tools/bench/kernel_sums.py /tmp/prof/$tag.csv --top "${NIBBLE_TRACE_TOP:-12}"
          done
        done ;;
      ppenv)  # pp per NIBBLE_PP_ENVS setting (fp16 activations), alternating as tgenv: a prefill switch's A/B
        for r in $(seq "${NIBBLE_TG_ROUNDS:-2}"); do
          for e in ${NIBBLE_PP_ENVS:--}; do
            v=${e#-}; tag=${v//=/_}; tag=${tag//,/_}
            echo "== round $r $v"
            bench "e2e_ppenv_${tag}_$r" 150 env ${v//,/ } "$B"/src/nibble_e2e_bench --no-tg --pp "${NIBBLE_PP:-512,2048,8192}" \
              --max-seconds 20 configs/gpt-oss-20b configs/gpt-oss-120b >/dev/null
            grep -E "^\| configs" "$OUT/e2e_ppenv_${tag}_$r.md"
          done
        done ;;
      tgenv)  # tg128 per NIBBLE_TG_ENVS setting, alternating for NIBBLE_TG_ROUNDS rounds: an A/B of a switch
        for r in $(seq "${NIBBLE_TG_ROUNDS:-2}"); do
          for e in ${NIBBLE_TG_ENVS:--}; do  # (A=0,B=1: both at once)
            v=${e#-}; tag=${v//=/_}; tag=${tag//,/_}
            echo "== round $r $v"
            bench "e2e_env_${tag}_$r" 150 env ${v//,/ } "$B"/src/nibble_e2e_bench --pp '' \
              --dense-formats "${NIBBLE_TG_FORMATS:-mxfp4}" configs/gpt-oss-20b configs/gpt-oss-120b >/dev/null
            grep -E "^\| configs" "$OUT/e2e_env_${tag}_$r.md"
          done
        done ;;
      gemmenv)  # nibble_gemm_bench ${NIBBLE_GEMM_ARGS:---quick} per NIBBLE_GEMM_ENVS setting, alternating (as tgenv)
        for r in $(seq "${NIBBLE_TG_ROUNDS:-2}"); do
          for e in ${NIBBLE_GEMM_ENVS:--}; do
            v=${e#-}; tag=${v//=/_}; tag=${tag//,/_}
            echo "== round $r $v"
            bench "gemm_env_${tag}_$r" 200 env ${v//,/ } "$B"/src/nibble_gemm_bench ${NIBBLE_GEMM_ARGS:---quick} >/dev/null
            grep -E "^\| (qkv|o|expert|gpt-oss)" "$OUT/gemm_env_${tag}_$r.md"
          done
        done ;;
    esac
  done
fi

echo
echo "| step | result |"
echo "|---|---|"
for k in "${!result[@]}"; do echo "| $k | ${result[$k]} |"; done

if [ "${NIBBLE_ONE_FILE:-0}" = 1 ]; then
  for f in "$OUT"/*; do
    [ -f "$f" ] && [ "${f##*/}" != all.md ] && { echo "=== ${f##*/}"; cat "$f"; echo; }
  done > /tmp/nibble_all.md
  find "$OUT" -mindepth 1 -delete
  mv /tmp/nibble_all.md "$OUT/all.md"
fi
