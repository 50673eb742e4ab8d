"""Does gspo's code reward agree with real pytest? KodCode's published verification runs as the reference.

    git clone https://github.com/KodCode-AI/kodcode           # its demo/ folder: ~300 programs pytest has judged
    .venv/bin/python benchmarks/code_reward_agreement.py kodcode/demo [--packages numpy] [--timeout 20]

KodCode's demo folder has, for each question, three generated trials: a program, a pytest test file of its own and
the verdict of running that file with pytest ("Pass", "Fail", "Fail - Timed Out"), in
`Complete_Verified_*/*_Complete.json`. This scores every trial's program against its test file with
`make_code_reward` (the sandbox, its harness and its pytest: `gspo.sandbox.pytest_shim`) and prints a table of
pytest's verdict against gspo's (1.0, 0.0, or "refused": tests gspo will not run, e.g. not valid Python), then every
disagreement with its reason and one JSON line. A timed-out trial counts as failed. The data is KodCode's (CC BY-NC
4.0): read from the clone, never copied into this repository.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

VERDICTS = {"Pass": 1.0, "Fail": 0.0, "Fail - Timed Out": 0.0}


def trials(demo: Path):
    """(file, question id, trial name, program, tests, pytest's verdict) for every trial of the verified files."""
    files = sorted(demo.glob("Complete_Verified_*/*_Complete.json"))
    if not files:
        raise SystemExit(f"{demo}: no Complete_Verified_*/*_Complete.json (the demo/ folder of KodCode's repository)")
    for path in files:
        for row in json.loads(path.read_text()):
            for name, trial in sorted(row["trials"].items()):
                yield (path.stem, row["metadata"]["prompt_id"], name, trial["solution_code"], trial["test_code"],
                       VERDICTS[trial["test_result"]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("demo", type=Path, help="the demo/ folder of a clone of github.com/KodCode-AI/kodcode")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds per call (wall and CPU; default 20)")
    p.add_argument("--memory-mb", type=int, default=1024)
    p.add_argument("--packages", nargs="*", default=[], help="third-party modules the sandbox may import")
    a = p.parse_args()
    from gspo.rewards.code import make_code_reward

    options = {"packages": tuple(a.packages)} if a.packages else {}
    reward = make_code_reward(timeout_s=a.timeout, cpu_s=a.timeout, memory_mb=a.memory_mb, **options)
    table: collections.Counter = collections.Counter()
    disagree = []
    t0, calls = time.perf_counter(), 0
    for source, question, name, program, tests, truth in trials(a.demo):
        try:
            got: float | str = reward("", f"```python\n{program}\n```", tests=tests)
        except ValueError as e:
            got = f"refused: {str(e)[:160]}"
        calls += 1
        table[(truth, got if isinstance(got, float) else "refused")] += 1
        if isinstance(got, float) and got != truth:
            disagree.append((source, question, name, truth, got))
    seconds = time.perf_counter() - t0
    print("| pytest | gspo | trials |\n|---|---|---:|")
    for (truth, got), n in sorted(table.items(), key=str):
        print(f"| {'pass' if truth else 'fail'} | {got} | {n} |")
    for d in disagree:
        print("disagrees:", *d)
    scored = sum(n for (_, got), n in table.items() if got != "refused")
    agreed = sum(n for (truth, got), n in table.items() if got == truth)
    print(json.dumps({"trials": calls, "scored": scored, "agreed": agreed, "refused": calls - scored,
                      "agreement": agreed / scored if scored else None, "seconds_per_call": seconds / calls}))


if __name__ == "__main__":
    main()
