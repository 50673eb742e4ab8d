"""What the sandbox's strict equality costs: the same programs and tests with `strict_equality` on and off.

    .venv/bin/python benchmarks/sandbox_equality.py [--repeats 3]

The code reward's tests count a value whose equality the program defines as unequal to a plain one
(`gspo.sandbox.process._HARNESS`): every `==` / `!=` of the tests first looks at the types on both sides (through
dicts, lists, tuples and sets). This runs `run_sandboxed` on three kinds of tests, alternating the two settings,
`--repeats` times each, and prints the median wall seconds per call (interpreter start, isolation and the program
included: what a reward call costs) with their ratio, and one JSON line. Every call must pass: the check changes the
cost, not the verdict, of honest programs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

CASES = {
    # a typical code-contest row: a handful of asserts on small values
    "5 scalar asserts": ("def add(a, b):\n    return a + b\n",
                         "\n".join(f"assert add({i}, {i + 1}) == {2 * i + 1}" for i in range(5))),
    # a list of a million ints, compared 20 times (each side's types are checked at C speed)
    "20 x list of 1e6 ints": ("def f(n):\n    return list(range(n))\n",
                              "big = list(range(10**6))\nfor _ in range(20):\n    assert f(10**6) == big\n"),
    # 100,000 small nested rows, compared 5 times (the walk stops after 100,000 items per side)
    "5 x 1e5 nested rows": ("def rows(n):\n    return [[i, str(i), (i, 2.0)] for i in range(n)]\n",
                            "expected = [[i, str(i), (i, 2.0)] for i in range(10**5)]\n"
                            "for _ in range(5):\n    assert rows(10**5) == expected\n"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats}: at least 1")
    from gspo.sandbox import run_sandboxed

    limits = {"timeout_s": 120.0, "cpu_s": 120.0, "memory_mb": 2048}
    results = {}
    print(f"{'tests':<24} {'plain s':>9} {'strict s':>9} {'ratio':>7}")
    for name, (code, tests) in CASES.items():
        seconds: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(a.repeats):
            for strict in (False, True):
                t0 = time.perf_counter()
                result = run_sandboxed(code, tests, strict_equality=strict, **limits)
                seconds[strict].append(time.perf_counter() - t0)
                if result.reason != "passed":
                    raise SystemExit(f"{name} (strict_equality={strict}): {result.reason}\n{result.stderr}")
        plain, strict_s = statistics.median(seconds[False]), statistics.median(seconds[True])
        results[name] = {"plain_s": round(plain, 3), "strict_s": round(strict_s, 3),
                         "ratio": round(strict_s / plain, 3)}
        print(f"{name:<24} {plain:>9.3f} {strict_s:>9.3f} {strict_s / plain:>6.2f}x")
    print(json.dumps({"sandbox_strict_equality": results}))


if __name__ == "__main__":
    main()
