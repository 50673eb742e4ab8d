#!/usr/bin/env bash
# Creates .venv-bench (once): gspo (editable) plus TRL, the benchmark-only baseline of benchmarks/run.py.
# torch is installed first, pinned to the CPU wheel (the version the project venv uses), so that resolving TRL's and
# gspo's `torch>=...` never pulls a multi-GB CUDA build. transformers is pinned to the project venv's version so both
# sides of the comparison run the same model code. Override the pins with GSPO_TORCH_SPEC / BENCH_TRL_SPEC /
# BENCH_TRANSFORMERS_SPEC. Usage: `bash benchmarks/setup.sh`, then `.venv-bench/bin/python benchmarks/run.py`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-bench"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
pip="$venv/bin/python -m pip"
stamp="$venv/.bench-installed"
want="$(cat "$root/pyproject.toml" "$root/benchmarks/setup.sh" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  # shellcheck disable=SC2086
  $pip install -q ${GSPO_TORCH_SPEC:-torch==2.13.0}
  # shellcheck disable=SC2086
  $pip install -q ${BENCH_TRANSFORMERS_SPEC:-transformers==5.23.0} ${BENCH_TRL_SPEC:-trl==1.16.0}
  $pip install -q -e "$root"
  echo "$want" > "$stamp"
fi
"$venv/bin/python" -c "import torch, transformers, trl; print('bench venv: torch', torch.__version__, \
'transformers', transformers.__version__, 'trl', trl.__version__)"
