#!/usr/bin/env bash
# What a session with a lent GPU runs for issue 12 (/work/shared/gpu/README.md: the machine and its .gpu/ wheels).
#
# The budget (2026-11-28): 15 minutes of device time per session, counted from the machine's start (a minute or more)
# to its return, idle time included; at most 10 minutes per call; at most 8 files back from $OUT per call; the machine
# is given back 30 s after a call returns. Issue 12's checks are therefore two calls of about 5-7 minutes, the second
# made as soon as the first returns (read the first one's output after, or the machine is gone and the next call
# pays for a fresh start):
#
#   here, once per session:  bash benchmarks/gpu_session.sh prepare    # .gpu/: the wheels the machine lacks
#   device call 1 (timeout_s 390, carry [".gpu"]):  source .gpu/on_device.sh && bash benchmarks/gpu_session.sh check
#   device call 2 (carry [".gpu"]), its timeout_s T = the budget_left_s that the first call's lease reports, less 30 s,
#     at most 600:  source .gpu/on_device.sh && BUDGET_S=<T - 40> bash benchmarks/gpu_session.sh bench
#
# check (~5 min): a smoke import first (a broken set-up fails in seconds, not after the call), then `gspo demo
#   trainer.device=cuda` beside the fast suite with the GPU visible (-n 12; the suite stops at SUITE_S = 300 s);
#   4 files: env.txt, demo.log, suite.log, unfinished.txt (the tests the time limit cut off:
#   `python3 -m pytest -n 12 $(cat unfinished.txt)` runs them).
# bench (~6-7 min, by the H100 figures of RESULTS.md §5): the A/B against TRL that the JSON line of issue 12 needs,
#   one round of 1 warm-up + 2 measured batches per side: dense (trl, exact, fast), then moe (trl, fast); then, while
#   BUDGET_S (default 420 s from the start) leaves COMPILED_S (default 150 s), dense "exact compiled" (trainer.compile).
#   Each command is stopped at BUDGET_S, and each later one merges the earlier ones' results, so the last JSON line of
#   bench.log holds every side measured, after one line per target; 5 files (env.txt, bench.log, dense.json,
#   moe.json, dense_compiled.json).
#
# Later sessions, with time to spare, one per call: `compiled` (trainer.compile and the released decode caches
# against TRL, the device-level peak), `profile` (each dense gspo side's op tables, and what is live at each side's
# memory peak, TRL's too: 6 files), `sampler` (decode loops against the forward-only bound), `decode` (grouped vs
# repeat_kv decode attention; under autocast, bf16 weight copies vs casts per step), `update` (the update phase,
# layers eager vs compiled), `moe` (the MoE A/B with its exact side).
# `compiled` and the suite's test of rollout.release_decode_cache need torch_memory_saver, which `prepare` adds.
set -uo pipefail
part="${1:?usage: gpu_session.sh prepare|check|bench|compiled|profile|sampler|decode|update|moe}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-gpu-out}"
mkdir -p "$out"
ab=(python3 benchmarks/run.py --device cuda --rounds 1 --threads 8)

env_info() {  # the machine, and whether the carried set-up imports: exit 3 at once when it does not
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    git log -1 --format='commit %h %s' 2>/dev/null
    python3 -c "import torch, transformers, trl, gspo; assert torch.cuda.is_available(), 'no CUDA'; print('torch', \
torch.__version__, 'CUDA', torch.version.cuda, 'transformers', transformers.__version__, 'trl', trl.__version__)"
  } > "$out/env.txt" 2>&1 || { cat "$out/env.txt"; exit 3; }
}

case "$part" in
  prepare)  # on the development machine (package index reachable): .gpu/ = wheels for Python 3.12 + on_device.sh
    shared="$root/../shared/gpu"
    [ -f "$shared/fetch_wheels.sh" ] || { echo "gpu_session.sh prepare: $shared/fetch_wheels.sh not found" >&2; exit 2; }
    grep -qxF /.gpu/ .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude  # never committed
    { bash "$shared/fetch_wheels.sh" .gpu/whl && python3 -m pip download -q --no-deps --only-binary=:all: \
        --platform manylinux2014_x86_64 --python-version 3.12 torch_memory_saver==0.0.9.post1 -d .gpu/whl
    } > /tmp/gpu_prepare.log 2>&1 || { grep -v '^WARNING: Location' /tmp/gpu_prepare.log >&2; exit 2; }
    cp "$shared/on_device.sh" .gpu/
    echo "$(ls .gpu/whl | wc -l) wheels, $(du -sh .gpu | cut -f1) in .gpu/ (a call carries at most 64 MiB)"
    ;;
  check)
    env_info
    start=$(date +%s)
    ( timeout "${DEMO_S:-330}" python3 -m gspo demo --out /tmp/gspo-demo --overwrite trainer.device=cuda \
        > "$out/demo.log" 2>&1
      echo "demo exit $? after $(($(date +%s) - start)) s" >> "$out/demo.log" ) &
    demo=$!
    timeout "${SUITE_S:-300}" python3 -m pytest -v -n "${WORKERS:-12}" -p no:cacheprovider --timeout 240 -rfE \
      > "$out/suite.log" 2>&1
    echo -e "\nsuite exit $? after $(($(date +%s) - start)) s" >> "$out/suite.log"
    wait "$demo"
    # the tests the time limit cut off: collected, never reported
    python3 -m pytest --collect-only -q -p no:cacheprovider 2>/dev/null | grep '::' | sort > /tmp/collected.txt
    sed -nE 's/^\[gw[0-9]+\] \[ *[0-9]+%\] (PASSED|FAILED|SKIPPED|ERROR) (tests\/.*[^ ]) *$/\2/p' "$out/suite.log" \
      | sort -u > /tmp/done.txt  # node ids hold spaces: the whole rest of the line
    comm -23 /tmp/collected.txt /tmp/done.txt > "$out/unfinished.txt"
    tail -n 3 "$out/demo.log"
    grep -E 'FAILED|ERROR' "$out/suite.log" | sort -u
    tail -n 2 "$out/suite.log"
    echo "$(grep -c PASSED "$out/suite.log") passed; $(wc -l < "$out/unfinished.txt") did not finish ($out/unfinished.txt)"
    ;;
  bench)
    env_info
    deadline=$((SECONDS + ${BUDGET_S:-420}))
    log="$out/bench.log"
    : > "$log"
    step() {  # step MIN_S NAME ARGS...: run.py ARGS --save NAME.json, merging the earlier steps' files, if at least
      local need=$1 name=$2 left=$((deadline - SECONDS)) merge  # MIN_S of BUDGET_S is left; stopped at BUDGET_S
      shift 2
      merge=$(ls "$out"/*.json 2>/dev/null | paste -sd, -)
      if (( left < need )); then
        echo "$name: left out, $left s left of BUDGET_S" | tee -a "$log"
        return
      fi
      timeout "$left" "${ab[@]}" "$@" --no-sampler --measured 2 --save "$out/$name.json" ${merge:+--merge "$merge"} \
        2>&1 | tee -a "$log"
    }
    step 60 dense --models dense --sides trl,exact,fast
    step 60 moe --models moe --sides trl,fast
    step "${COMPILED_S:-150}" dense_compiled --models dense --sides exact-compiled
    ;;
  compiled)
    env_info
    "${ab[@]}" --models dense --no-sampler --sides trl,exact-compiled,fast-compiled --release-decode-cache \
      --save "$out/dense_compiled.json" 2>&1 | tee "$out/compiled.log"
    ;;
  profile)  # 2 op tables (gspo exact, fast) + 3 memory tables (TRL, gspo exact, fast) + log
    env_info
    "${ab[@]}" --models dense --sides trl,exact,fast --measured 1 --no-sampler --profile "$out" --memory-peak "$out" \
      2>&1 | tee "$out/profile.log"
    ;;
  sampler)
    env_info
    "${ab[@]}" --models dense --sides fast --measured 2 2>&1 | tee "$out/sampler.log"
    ;;
  decode)
    env_info
    python3 benchmarks/decode_attention.py --device cuda --layers 28 --rows 128 --new-tokens 256 --vocab 151936 \
      --threads 8 2>&1 | tee "$out/decode.log"
    python3 benchmarks/decode_weights.py --device cuda --layers 28 --rows 1,32,128 --new-tokens 256 --vocab 151936 \
      --threads 8 2>&1 | tee "$out/decode_weights.log"
    ;;
  update)
    env_info
    python3 benchmarks/compile_update.py --device cuda --widths 1024 --rows 128 --new-tokens 256 --vocab 151936 \
      --precision autocast --threads 8 2>&1 | tee "$out/update.log"
    ;;
  moe)
    env_info
    "${ab[@]}" --models moe --no-sampler --save "$out/moe.json" 2>&1 | tee "$out/moe.log"
    ;;
  *)
    echo "gpu_session.sh: unknown part $part (prepare, check, bench, compiled, profile, sampler, decode, update, moe)" >&2
    exit 2
    ;;
esac
