#!/usr/bin/env bash
# The main job: set up, build, and generate text with the bundled default model (GPU if present and
# supported by this build, else CPU). Extra arguments go to `nibble run`.
set -euo pipefail
cd "$(dirname "$0")/.."
NIBBLE_SKIP_VENV=1 bash scripts/setup.sh >&2
MODEL=${NIBBLE_MODEL:-models/default}
exec build/src/nibble run -m "$MODEL" --device auto -p "${NIBBLE_PROMPT:-ROMEO:}" -n "${NIBBLE_N:-64}" \
  --temperature 0.8 --seed 1 "$@"
