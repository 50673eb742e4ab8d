"""Mixed data: each row scored by its own reward (`rewards.route_by` / `rewards.routes`, `gspo.rewards.Routes`).

Before, every reward function scored every row: on math + code data the code reward ran (and failed, no tests) on
every math row and the math verifier on every code row, so failures were counted on rows that were never theirs,
`reward/<name>` averaged over rows they could not judge, and one accuracy reward could not say what "solved" means
for both kinds. Here the values are known by construction, so every number is checked against its count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import DEMO, tiny_overrides
from gspo.cli import main
from gspo.config import ConfigError, accuracy_means, load_config
from gspo.data import load_data
from gspo.rewards import RewardRunner, Routes, batched, drop_unscored
from gspo.tracking import read_metrics
from gspo.trainer import train

REWARDS = '''
def flagged(prompt: str, completion: str, **row) -> float:
    """Source a's verifier: 1 on the rows marked solved, whatever the model wrote (fails on a row without the flag)."""
    return float(row["solved"])

def tested(prompt: str, completion: str, **row) -> float:
    """Source b's verifier: needs the row's `tests` (as the code reward does)."""
    return float(row["tests"] == "pass")

def brevity(prompt: str, completion: str, **row) -> float:
    return 0.25
'''


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_each_row_is_scored_by_its_routes_functions_and_by_the_unrouted_ones():
    calls: dict[str, list[str]] = {"fa": [], "fb": []}

    def fa(prompt: str, completion: str, **row) -> float:
        calls["fa"].append(row["data_source"])
        return float(row["solved"])

    @batched
    def fb(prompts: list[str], completions: list[str], **columns) -> list[float]:
        calls["fb"].extend(columns["data_source"])
        return [1.0 if t == "pass" else (None if t == "broken" else 0.0) for t in columns["tests"]]

    def every(prompt: str, completion: str, **row) -> float:
        return 0.5

    rows = [{"prompt": "p", "data_source": "a", "solved": True}, {"prompt": "p", "data_source": "b", "tests": "pass"},
            {"prompt": "p", "data_source": "a", "solved": False},
            {"prompt": "p", "data_source": "b", "tests": "broken"}]
    runner = RewardRunner([(fa, 1.0), (fb, 2.0), (every, 1.0)], on_error="zero",
                          routes=Routes("data_source", {"a": ["fa"], "b": ["fb"]}))
    scores = runner.score(["p"] * 4, ["c"] * 4, rows)
    assert calls == {"fa": ["a", "a"], "fb": ["b", "b"]}  # never called on the other source's rows
    assert scores.total.tolist() == [1.5, 2.5, 0.5, 0.5]  # fa 1/0 + 0.5 on a rows; 2·fb 1/failed + 0.5 on b rows
    assert scores.values["fa"].tolist() == [1.0, 0.0, 0.0, 0.0] and scores.applies["fa"].tolist() == [1, 0, 1, 0]
    assert scores.failed["fb"].tolist() == [False, False, False, True]  # only its own row's None is a failure
    assert runner.failures == {"fa": 0, "fb": 1, "every": 0}
    assert scores.stats["reward/fa"] == 0.5 and scores.stats["reward/fb"] == 0.5  # means over the rows they score
    assert scores.stats["reward/every"] == 0.5 and scores.stats["reward_failures"] == 1
    assert scores.correct(["fa", "fb"]).tolist() == [True, True, False, False]  # each row by its own verifier
    assert scores.correct("fa").tolist() == [True, False, False, False]  # a row fa does not score is not solved
    alone = runner.score(["p"], ["c"], rows[:1]).stats  # no b row: every key is there (processes merge them) ...
    assert alone["reward_rows/fb"] == 0 and alone["reward_rows/fa"] == 1 and scores.stats["reward_rows/fb"] == 2
    assert "reward/fb" not in drop_unscored(alone) and "reward/fa" in drop_unscored(alone)  # ... no mean over nothing


def test_rows_without_a_route_or_without_an_accuracy_reward_are_refused_before_compute():
    def fa(prompt: str, completion: str, **row) -> float:
        return 1.0

    def fb(prompt: str, completion: str, **row) -> float:
        return 1.0

    runner = RewardRunner([(fa, 1.0), (fb, 1.0)], routes=Routes("data_source", {"a": ["fa"], "b": ["fb"]}))
    with pytest.raises(ValueError, match=r"'data_source': training row 1 has no such field"):
        runner.check_rows([{"prompt": "p", "data_source": "a"}, {"prompt": "p"}], where="training row")
    with pytest.raises(ValueError, match=r"row 0 has 'c', which rewards.routes does not list \(routes: \['a', 'b'\]\)"):
        runner.check_rows([{"prompt": "p", "data_source": "c"}])
    with pytest.raises(ValueError, match=r"held-out row 1 \(route 'b'\) is scored by none of the accuracy rewards"):
        runner.check_rows([{"prompt": "p", "data_source": "a"}, {"prompt": "p", "data_source": "b"}], "fa",
                          "held-out row")
    runner.check_rows([{"prompt": "p", "data_source": "a"}, {"prompt": "p", "data_source": "b"}], ["fa", "fb"])
    with pytest.raises(ValueError, match=r"unknown: \['nope'\]"):
        RewardRunner([(fa, 1.0)], routes=Routes("data_source", {"a": ["nope"]}))


def test_a_routed_function_is_checked_against_its_own_routes_rows_only():
    """Before, every function's signature was checked against the first row alone, whatever its route: with a code
    row first, a math verifier that takes `answer` by name was refused ("missing a required argument: 'answer'")
    although it is never called on code rows; a math row lacking `answer` is still refused, by its index."""
    def fa(prompt: str, completion: str, answer: str, **row) -> float:
        return float(completion == answer)

    def fb(prompt: str, completion: str, tests: str, **row) -> float:
        return float(tests == "pass")

    runner = RewardRunner([(fa, 1.0), (fb, 1.0)], routes=Routes("data_source", {"a": ["fa"], "b": ["fb"]}))
    rows = [{"prompt": "p", "data_source": "b", "tests": "pass"}, {"prompt": "q", "data_source": "a", "answer": "1"}]
    runner.check_rows(rows, ["fa", "fb"], "training row")
    with pytest.raises(ValueError, match=r"training row 2: reward 'fa' cannot be called .*'answer'"):
        runner.check_rows([*rows, {"prompt": "r", "data_source": "a"}], ["fa", "fb"], "training row")


def test_routes_are_validated_with_the_config_and_the_verifiers_are_the_default_accuracy():
    with pytest.raises(ConfigError, match="go together"):
        load_config(None, ["rewards.route_by=data_source"])
    with pytest.raises(ConfigError, match=r"unknown: \['code'\]"):
        load_config(None, ["rewards.functions={math: 1.0}", "rewards.route_by=s", "rewards.routes={x: [code]}"])
    with pytest.raises(ConfigError, match="name the one that decides"):  # without routes two verifiers are ambiguous
        load_config(None, ["rewards.functions={math: 1.0, code: 1.0}"])
    cfg = load_config(None, ["rewards.functions={math: 1.0, code: 1.0, conftest:varied_reward: 0.1}",
                             "rewards.route_by=s", "rewards.routes={gsm: [math], apps: [code]}"])
    assert cfg.rewards.accuracy_reward == ["math", "code"]  # the verifiers, not the shaping reward
    assert accuracy_means(cfg.rewards.accuracy_reward, 1.0) == "math | code >= 1"
    with pytest.raises(ConfigError, match="each once"):
        load_config(None, ["rewards.functions={math: 1.0, code: 1.0}", "rewards.accuracy_reward=[math, math]"])


def test_a_run_on_mixed_data_trains_and_measures_each_source_by_its_own_reward(tmp_path, capsys):
    (tmp_path / "rw.py").write_text(REWARDS)
    rw = tmp_path / "rw.py"

    def rows(first: int, count: int, solved: int) -> list[dict]:  # a: the first `solved` flagged; b: tests pass
        return [{"prompt": f"{x}+1=", "answer": str(x + 1), "data_source": "a", "solved": i < solved}
                if i % 2 == 0 else
                {"prompt": f"{x}+1=", "answer": str(x + 1), "data_source": "b", "tests": "pass" if i < solved else "x"}
                for i, x in enumerate(range(first, first + count))]

    train_file = write_jsonl(tmp_path / "train.jsonl", rows(0, 40, 20))
    held = write_jsonl(tmp_path / "held.jsonl", rows(100, 16, 6))  # solved: rows 0-5 (a: 0, 2, 4; b: 1, 3, 5)
    out = tmp_path / "run"
    summary = train(load_config(DEMO, tiny_overrides(
        out, "cold_start=null", f"data.path={train_file}", "data.task=null", f"data.eval_path={held}",
        "data.eval_by=data_source", "rewards.route_by=data_source", "rewards.routes={a: [" + f"{rw}:flagged], b: "
        f"[{rw}:tested]" + "}", f"rewards.functions={{{rw}:flagged: 1.0, {rw}:tested: 1.0, {rw}:brevity: 1.0}}",
        f"rewards.accuracy_reward=[{rw}:flagged, {rw}:tested]", "trainer.steps=2", "trainer.eval_every=2",
        "log.rollouts=16")))
    assert summary["heldout_accuracy_after_rl"] == 6 / 16 and summary["reward_failures"] == {
        f"{rw}:flagged": 0, f"{rw}:tested": 0, f"{rw}:brevity": 0}  # before: every b row failed `flagged`
    assert summary["heldout"]["accuracy"] == f"{rw}:flagged | {rw}:tested >= 1"
    assert {g: e["after_rl"] for g, e in summary["heldout_accuracy_by"].items()} == {"a": 3 / 8, "b": 3 / 8}
    logged = read_metrics(out / "rollouts.jsonl")  # every completion: 4 prompts × 4
    for record in read_metrics(out / "metrics.jsonl"):
        assert record["reward_mean"] == pytest.approx(0.25 + record["accuracy"])  # brevity + the row's verifier
        for verdict in (True, False):  # the mean length of the step's solved / unsolved completions
            tokens = [r["tokens"] for r in logged if r["step"] == record["step"] and r["solved"] == verdict]
            key = f"response_length_{'solved' if verdict else 'unsolved'}"
            assert (record[key] == pytest.approx(sum(tokens) / len(tokens))) if tokens else key not in record
    assert all("response_length_solved" in r and "response_length_unsolved" in r
               for r in read_metrics(out / "metrics.jsonl"))  # train rows 0-19 of 40 solved: both kinds each step
    assert read_metrics(out / "metrics.jsonl")[-1]["time_eval"] > 0  # the last step is evaluated
    assert "time_eval" not in read_metrics(out / "metrics.jsonl")[0]  # step 1 is not (eval_every 2)
    for record in read_metrics(out / "rollouts.jsonl"):
        routed = record["rewards"]
        assert routed[f"{rw}:brevity"] == 0.25
        assert (routed[f"{rw}:flagged"] is None) != (routed[f"{rw}:tested"] is None)  # one verifier per row
        assert record["reward"] == pytest.approx(sum(v for v in routed.values() if v is not None))
        assert record["solved"] == (max(v for v in routed.values() if v is not None) >= 1)

    assert main(["eval", str(out / "final"), "--config", str(out / "config.yaml"), "--samples", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["accuracy"] == pytest.approx(6 / 16) and result["maj@2"] == pytest.approx(6 / 16)
    assert result["reward_failures"] == {f"{rw}:flagged": 0, f"{rw}:tested": 0, f"{rw}:brevity": 0}


def test_several_training_files_are_named_sources_that_routes_and_groups_use(tmp_path):
    """data.path as a list: the files are concatenated and each row without a data_source gets its file's name, so a
    math file and a code file need no extra column to be routed and measured apart."""
    (tmp_path / "rw.py").write_text(REWARDS)
    rw = tmp_path / "rw.py"
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"{x}+1=", "answer": str(x + 1), "solved": x % 3 == 0}
                                           for x in range(60)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"{x}+2=", "answer": str(x + 2), "tests": "pass"}
                                           for x in range(40)])
    kept = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "1+3=", "answer": "4", "tests": "x", "data_source": "b"}])
    cfg = load_config(DEMO, tiny_overrides(
        tmp_path / "run", "cold_start=null", f"data.path=[{a}, {b}, {kept}]", "data.task=null",
        "data.eval_fraction=0.25", "data.train_size=null", "data.eval_size=null", "data.eval_by=data_source",
        "rewards.route_by=data_source",
        "rewards.routes={a: [" + f"{rw}:flagged], b: [{rw}:tested]" + "}",
        f"rewards.functions={{{rw}:flagged: 1.0, {rw}:tested: 1.0}}", f"rewards.accuracy_reward=[{rw}:flagged, "
        f"{rw}:tested]", "trainer.steps=1"))

    data = load_data(cfg.data, seed=0)
    every = data.train + data.heldout
    assert sorted(r["data_source"] for r in every) == ["a"] * 60 + ["b"] * 41  # c.jsonl's row keeps its own
    assert data.train_source["path"] == [str(a), str(b), str(kept)] and data.train_source["of"] == len(data.train)
    held = {g: [r for r in data.heldout if r["data_source"] == g] for g in ("a", "b")}
    summary = train(cfg)
    for group, rows in held.items():
        solved = sum(r["solved"] if group == "a" else r["tests"] == "pass" for r in rows)
        assert summary["heldout_accuracy_by"][group]["after_rl"] == pytest.approx(solved / len(rows))
    assert summary["reward_failures"] == {f"{rw}:flagged": 0, f"{rw}:tested": 0}
    with pytest.raises(ConfigError, match="each once"):
        load_config(None, [f"data.path=[{a}, {a}]", "data.eval_fraction=0.2"])


def test_batches_scored_apart_merge_each_functions_mean_over_the_rows_it_scored():
    """Dynamic sampling's rounds: with routes, a round without `b` rows has reward/b = 0 over 0 rows, which must not
    pull the merged mean down; counts add up; without routes each mean is weighted by its batch's rows."""
    from gspo.rewards import merge_reward_stats

    rounds = [({"reward/a": 0.5, "reward_rows/a": 4.0, "reward/b": 1.0, "reward_rows/b": 4.0, "reward_failures": 1.0},
               8),
              ({"reward/a": 1.0, "reward_rows/a": 8.0, "reward/b": 0.0, "reward_rows/b": 0.0, "reward_failures": 2.0},
               8)]
    merged = merge_reward_stats(rounds)
    assert merged["reward/a"] == pytest.approx((0.5 * 4 + 1.0 * 8) / 12) and merged["reward/b"] == 1.0
    assert merged["reward_rows/a"] == 12 and merged["reward_rows/b"] == 4 and merged["reward_failures"] == 3
    plain = merge_reward_stats([({"reward/f": 0.25}, 4), ({"reward/f": 1.0}, 12)])  # no routes: rows of the batch
    assert plain["reward/f"] == pytest.approx((0.25 * 4 + 12) / 16)
    assert merge_reward_stats([({"reward/b": 0.0, "reward_rows/b": 0.0}, 8)])["reward/b"] == 0.0  # dropped later
