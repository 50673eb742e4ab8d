#!/usr/bin/env bash
# Quick start, main job: set up .venv, then cold-start SFT + GSPO on the embedded tiny MoE (offline, CPU).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$root/scripts/setup.sh" ""  # an explicit (empty) extras argument: a sourced script otherwise sees this one's
cd "$root"
exec gspo demo --out "${GSPO_DEMO_OUT:-runs/demo}" "$@"
