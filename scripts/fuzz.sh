#!/usr/bin/env bash
# Fuzzes the parsers of untrusted input (tests/fuzz/*_fuzz.cc) with clang's libFuzzer under ASan and
# UBSan, in its own build dir (build-fuzz), each target for NIBBLE_FUZZ_SECONDS (default 60) seconds,
# starting from generated seed files. Exits non-zero on any crash, sanitizer report or leak. Where
# libFuzzer cannot link, a standalone random-mutation driver (tests/fuzz/standalone_main.cc) runs instead.
#
#   scripts/fuzz.sh                       # all targets, 60 s each
#   NIBBLE_FUZZ_SECONDS=30 scripts/fuzz.sh safetensors_fuzz
# Environment: NIBBLE_FUZZ_SECONDS, NIBBLE_FUZZ_BUILD (default build-fuzz), NIBBLE_FUZZ_JOBS (default 2),
# NIBBLE_FUZZ_STANDALONE=1 (force the fallback driver), CC/CXX are set to clang/clang++.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${NIBBLE_FUZZ_BUILD:-$root/build-fuzz}
seconds=${NIBBLE_FUZZ_SECONDS:-60}
jobs=${NIBBLE_FUZZ_JOBS:-2}
export CC=clang CXX=clang++

targets=()
if [ $# -gt 0 ]; then
  targets=("$@")
else
  for f in "$root"/tests/fuzz/*_fuzz.cc; do targets+=("$(basename "$f" .cc)"); done
fi

# Does this clang link libFuzzer (clang + libclang-rt-*-dev)?
mode=libfuzzer
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' >"$probe/p.cc"
if [ "${NIBBLE_FUZZ_STANDALONE:-0}" = 1 ] ||
   ! "$CXX" -fsanitize=fuzzer,address,undefined "$probe/p.cc" -o "$probe/p" >/dev/null 2>&1; then
  mode=standalone
  echo "fuzz.sh: libFuzzer unavailable (or NIBBLE_FUZZ_STANDALONE=1): using the standalone ASan driver" >&2
fi

if [ "$mode" = libfuzzer ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DNIBBLE_FUZZ=ON -DNIBBLE_CUDA=OFF -DNIBBLE_TESTS=ON >/dev/null
  cmake --build "$build" -j"$jobs" --target "${targets[@]}"
else
  # Same sanitizers, no coverage instrumentation: the library plus driver + target, linked by hand.
  sanitize="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
  cmake -S "$root" -B "$build-standalone" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DNIBBLE_FUZZ=OFF -DNIBBLE_CUDA=OFF -DNIBBLE_TESTS=OFF \
    -DCMAKE_CXX_FLAGS="$sanitize" -DCMAKE_EXE_LINKER_FLAGS="$sanitize" >/dev/null
  cmake --build "$build-standalone" -j"$jobs" --target nibble_lib
  pcre_libs=$(pkg-config --libs libpcre2-8 2>/dev/null || echo -lpcre2-8)
  mkdir -p "$build/tests"
  for t in "${targets[@]}"; do
    # shellcheck disable=SC2086
    "$CXX" -std=c++20 -O1 -g $sanitize -I"$root/src" "$root/tests/fuzz/$t.cc" \
      "$root/tests/fuzz/standalone_main.cc" "$build-standalone/src/libnibble_lib.a" $pcre_libs -pthread \
      -o "$build/tests/$t"
  done
fi

# Seed inputs per target: small valid files, so mutations start from deep inside the format.
make_seeds() {
  local t=$1 dir=$2
  mkdir -p "$dir"
  case $t in
    safetensors_fuzz)
      python3 - "$dir" <<'PY'
import json, os, struct, sys
out = sys.argv[1]
def write(name, tensors, metadata=None, pad=True):
    header, data = {}, b""
    for tname, dtype, shape, nbytes in tensors:
        header[tname] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + nbytes]}
        data += bytes((i * 37 + 11) & 0xFF for i in range(nbytes))
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(os.path.join(out, name), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
write("empty", [])
write("one_f32", [("w", "F32", [2, 2], 16)])
write("scalar_and_empty", [("s", "F32", [], 4), ("e", "BF16", [0, 3], 0), ("z", "U8", [0], 0)], pad=False)
write("mxfp4", [("model.layers.0.mlp.experts.down_proj_blocks", "U8", [2, 3, 1, 16], 96),
                ("model.layers.0.mlp.experts.down_proj_scales", "U8", [2, 3, 1], 6),
                ("model.layers.0.mlp.experts.down_proj_bias", "BF16", [2, 3], 12)],
      metadata={"format": "pt"})
write("nvfp4", [("q_proj.weight", "U8", [4, 8], 32), ("q_proj.weight_scale", "F8_E4M3", [4, 1], 4),
                ("q_proj.weight_scale_2", "F32", [], 4), ("q_proj.input_scale", "F32", [1], 4)])
write("subbyte", [("a", "F4", [2, 3], 3), ("b", "F6_E2M3", [4], 3), ("c", "F8_E8M0", [5], 5),
                  ("d", "I64", [1], 8), ("e", "C64", [1], 8), ("f", "BOOL", [3], 3)])
PY
      ;;
  esac
}

dict_for() {
  local t=$1 file=$2
  case $t in
    safetensors_fuzz)
      {
        for w in dtype shape data_offsets __metadata__ BOOL U8 I8 I16 U16 F16 BF16 I32 U32 F32 F64 I64 U64 C64 \
                 F8_E4M3 F8_E5M2 F8_E4M3FNUZ F8_E5M2FNUZ F8_E8M0 F4 F6_E2M3 F6_E3M2; do
          printf '"\\"%s\\""\n' "$w"
        done
        printf '"[]"\n"{}"\n"[0,0]"\n"18446744073709551615"\n"9223372036854775807"\n"-1"\n"1e9"\n'
      } >"$file"
      ;;
    *) : >"$file" ;;
  esac
}

status=0
for t in "${targets[@]}"; do
  bin=$build/tests/$t
  seeds=$build/seeds/$t
  corpus=$build/corpus/$t
  artifacts=$build/artifacts/$t
  rm -rf "$seeds"
  make_seeds "$t" "$seeds"
  mkdir -p "$corpus" "$artifacts"
  echo "fuzz.sh: $t for ${seconds}s ($mode)" >&2
  if [ "$mode" = libfuzzer ]; then
    dict=$build/$t.dict
    dict_for "$t" "$dict"
    dict_arg=()
    [ -s "$dict" ] && dict_arg=(-dict="$dict")
    if ! "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="$artifacts/" "${dict_arg[@]}" "$corpus" "$seeds"; then
      echo "fuzz.sh: $t FAILED; reproducer in $artifacts/" >&2
      status=1
    fi
  else
    if ! "$bin" -max_total_time="$seconds" -artifact_prefix="$artifacts/" "$seeds"; then
      echo "fuzz.sh: $t FAILED; reproducer in $artifacts/" >&2
      status=1
    fi
  fi
done
exit $status
