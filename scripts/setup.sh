#!/usr/bin/env bash
# Sets nibble up on a Debian 12 machine: Debian packages for the engine, a Python venv for the tests
# and reference tools (.venv), then a Release build in build/ (CUDA backend too when nvcc is found).
# Idempotent: packages already present are not reinstalled, an up-to-date build is a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_PACKAGES=(build-essential cmake ninja-build pkg-config git
  nlohmann-json3-dev libcpp-httplib-dev libcli11-dev libpcre2-dev libgtest-dev
  clang libclang-rt-14-dev python3 python3-venv python3-pip)

missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ "${NIBBLE_SKIP_VENV:-0}" != 1 ]; then
  if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    python3 -m venv .venv
  fi
  if ! cmp -s requirements-test.txt .venv/.requirements-installed 2>/dev/null; then
    echo "setup: installing Python test requirements"
    .venv/bin/pip install -q --disable-pip-version-check -r requirements-test.txt
    cp requirements-test.txt .venv/.requirements-installed
  fi
fi

BUILD_DIR=${NIBBLE_BUILD_DIR:-build}
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${NIBBLE_CMAKE_ARGS:-} >/dev/null
fi
echo "setup: building in $BUILD_DIR"
cmake --build "$BUILD_DIR" -j"$(nproc)"
