#!/usr/bin/env bash
# Quick start, tests: set up .venv with the dev extra, lint, then the fast suite. `--slow` runs the slow tests only.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/setup.sh" dev
cd "$root"
ruff check .
if [ "${1:-}" = "--slow" ]; then
  shift
  exec python -m pytest -m slow "$@"
fi
exec python -m pytest "$@"
