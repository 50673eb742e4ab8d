#!/usr/bin/env bash
# Creates .venv (once) and installs gspo into it. Sourced by scripts/demo.sh and scripts/test.sh.
# torch is installed first, pinned to the CPU wheel, so that resolving gspo's `torch>=2.11` never pulls a CUDA build.
# Override with GSPO_TORCH_SPEC (e.g. GSPO_TORCH_SPEC="torch --index-url <your CUDA index>") on GPU machines.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
extras="${1:-}"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
stamp="$venv/.gspo-installed${extras:+-$extras}"
want="$(cat "$root/pyproject.toml" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  if ! python -c "import torch" 2>/dev/null; then
    # shellcheck disable=SC2086
    pip install -q ${GSPO_TORCH_SPEC:-torch==2.13.0}
  fi
  pip install -q -e "$root${extras:+[$extras]}"
  echo "$want" > "$stamp"
fi
