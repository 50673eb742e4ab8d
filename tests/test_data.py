"""Tests for gspo.data: procedural tasks (determinism, disjoint splits, correct answers) and file loading."""

from __future__ import annotations

import ast
import json
from collections import Counter
from fractions import Fraction

import datasets
import pytest

from gspo.data import TASKS, load_rows, make_task, split_of
from gspo.models import VOCAB_CHARS

# ---- an independent, safe evaluator for countdown solutions ----------------------------------------------------------

_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def _evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """Exact value of an expression of non-negative integers and + - * / ( ), and the integers it uses."""
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise AssertionError(f"disallowed syntax {ast.dump(node)} in {expr!r}")

    return walk(ast.parse(expr, mode="eval").body), used


# ---- tasks -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.parametrize("split", ["train", "test"])
def test_task_is_deterministic_from_seed(name: str, split: str) -> None:
    a = make_task(name, split, size=200, seed=7)
    assert a == make_task(name, split, size=200, seed=7)
    assert a != make_task(name, split, size=200, seed=8)
    assert len(a) == 200
    # a smaller draw is a prefix of a larger one from the same seed
    assert make_task(name, split, size=50, seed=7) == a[:50]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_train_and_test_are_disjoint_for_any_seeds(name: str) -> None:
    """Disjoint as problems, not only as prompts: a test problem's commuted (`b+a=`) or reordered (countdown's numbers)
    twin is never a training row (`Task.key`)."""
    key = TASKS[name].key
    train = [r for seed in (0, 1, 2) for r in make_task(name, "train", size=500, seed=seed)]
    test = [r for seed in (0, 1, 2) for r in make_task(name, "test", size=500, seed=seed)]
    assert train and test
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in test)
    assert {key(r) for r in train}.isdisjoint(key(r) for r in test)
    assert all(split_of(key(r)) == "train" for r in train)
    assert all(split_of(key(r)) == "test" for r in test)


def test_a_problem_posed_in_another_order_is_in_the_same_split() -> None:
    """The audit that found this: 66 of 200 distinct countdown test problems had a training row with the same numbers
    in another order; 244 of 300 two-digit addition test problems had their commuted twin in training."""
    for name, options, twin in [
        ("addition", {"digits": 2}, lambda r: f"{r['b']}+{r['a']}="),
        ("countdown", {}, lambda r: ",".join(map(str, sorted(r["numbers"]))) + f":{r['answer']}="),
    ]:
        test = make_task(name, "test", size=200, distinct=True, **options)
        train_prompts = {r["prompt"] for r in make_task(name, "train", size=20_000, **options)}
        assert not {twin(r) for r in test} & train_prompts
        assert len({TASKS[name].key(r) for r in test}) == 200  # distinct problems, not only distinct prompts


def test_split_of_holds_out_about_a_tenth() -> None:
    prompts = [f"{a}+{b}=" for a in range(100) for b in range(100)]
    share = sum(split_of(p) == "test" for p in prompts) / len(prompts)
    assert 0.08 < share < 0.12


@pytest.mark.parametrize("name", sorted(TASKS))
def test_rows_have_the_common_fields_in_the_tokenizer_vocab(name: str) -> None:
    for row in make_task(name, size=100):
        assert row["task"] == name
        solution = row["solution"]  # a string, or a multi-turn demonstration (multiply: a tool-use episode)
        texts = [m["content"] for m in solution] if isinstance(solution, list) else [solution]
        for key, value in [("prompt", row["prompt"]), ("answer", row["answer"])] + [("solution", t) for t in texts]:
            assert isinstance(value, str) and value
            assert set(value) <= set(VOCAB_CHARS), (key, value)


def test_multiply_rows_demonstrate_the_tool_on_their_share_and_are_correct() -> None:
    rows = make_task("multiply", size=400, seed=2)
    with_tool = [r for r in rows if isinstance(r["solution"], list)]
    assert 0.4 < len(with_tool) / len(rows) < 0.6  # tool_share 50 by default
    for r in rows:
        assert r["answer"] == str(r["a"] * r["b"]) and r["prompt"] == f"{r['a']}*{r['b']}="
    for r in with_tool:
        assert [m["content"] for m in r["solution"]] == [f"calc({r['a']}*{r['b']})", r["answer"], r["answer"]]
    assert all(isinstance(r["solution"], str) for r in make_task("multiply", size=50, tool_share=0))


@pytest.mark.parametrize("digits", [1, 3, 6])
def test_addition_answers_are_correct(digits: int) -> None:
    rows = make_task("addition", size=300, seed=1, digits=digits)
    for row in rows:
        left, right = row["prompt"].removesuffix("=").split("+")
        assert row["prompt"] == f"{int(left)}+{int(right)}="
        assert 0 <= int(left) < 10**digits and 0 <= int(right) < 10**digits
        assert row["answer"] == row["solution"] == str(int(left) + int(right))
    if digits >= 3:  # operands really span the range
        assert max(int(r["prompt"].split("+")[0]) for r in rows) >= 10 ** (digits - 1)


def test_addition_default_is_three_digits() -> None:
    assert make_task("addition", size=50) == make_task("addition", size=50, digits=3)


def test_countdown_solutions_reach_the_target_with_the_given_numbers() -> None:
    rows = make_task("countdown", size=400, seed=3)
    ops_seen: Counter[str] = Counter()
    for row in rows:
        numbers_text, target_text = row["prompt"].removesuffix("=").split(":")
        numbers = [int(n) for n in numbers_text.split(",")]
        assert row["numbers"] == numbers
        assert 3 <= len(numbers) <= 4 and all(1 <= n <= 20 for n in numbers)
        assert row["answer"] == target_text and 1 <= int(target_text) <= 100
        value, used = _evaluate(row["solution"])
        assert value == int(target_text), row
        assert not Counter(used) - Counter(numbers), row  # each given number used at most once
        ops_seen.update(c for c in row["solution"] if c in "+-*/")
    assert set(ops_seen) == set("+-*/")


def test_countdown_options() -> None:
    rows = make_task("countdown", size=100, min_count=2, max_count=2, max_number=9, max_target=50)
    for row in rows:
        assert len(row["numbers"]) == 2 and max(row["numbers"]) <= 9
        assert _evaluate(row["solution"])[0] == int(row["answer"]) <= 50


def test_make_task_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'sudoku'.*addition.*countdown"):
        make_task("sudoku")
    with pytest.raises(ValueError, match=r"unknown split 'validation'"):
        make_task("addition", "validation")
    for size in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="size"):
            make_task("addition", size=size)
    with pytest.raises(ValueError, match=r"no option\(s\) \['digit'\]"):
        make_task("addition", digit=4)
    with pytest.raises(ValueError, match="digits must be >= 1"):
        make_task("addition", digits=0)
    with pytest.raises(ValueError, match="digits must be an int"):
        make_task("addition", digits="3")
    with pytest.raises(ValueError, match="min_count"):
        make_task("countdown", min_count=5, max_count=4)


def test_make_task_reports_a_too_small_problem_space() -> None:
    # two numbers in 1..1 with a target <= 1 admit one problem only, 1*1=1, and it is a train problem
    space = {"min_count": 2, "max_count": 2, "max_number": 1, "max_target": 1}
    assert split_of(TASKS["countdown"].key({"numbers": [1, 1], "answer": "1"})) == "train"
    assert {r["prompt"] for r in make_task("countdown", "train", size=5, **space)} == {"1,1:1="}
    with pytest.raises(ValueError, match=r"only 0 of 5 problems.*too small"):
        make_task("countdown", "test", size=5, **space)


# ---- files -----------------------------------------------------------------------------------------------------------

SOURCE_ROWS = [
    {"question": "what is 1+1?", "final": "2", "level": 1},
    {"question": "what is 2*3?", "final": "6", "level": 2},
    {"question": "what is 9-4?", "final": "5", "level": 1},
]
FIELDS = {"prompt": "question", "answer": "final"}
EXPECTED = [{"prompt": r["question"], "answer": r["final"], "level": r["level"]} for r in SOURCE_ROWS]


def _write_jsonl(path, rows, extra_lines=()) -> str:
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_jsonl_round_trip_with_field_mapping(tmp_path) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", SOURCE_ROWS)
    assert load_rows(src, fields=FIELDS) == EXPECTED
    assert load_rows(src, fields=FIELDS, limit=2) == EXPECTED[:2]


def test_jsonl_without_mapping_keeps_rows_and_skips_blank_lines(tmp_path) -> None:
    rows = make_task("addition", size=5)
    path = tmp_path / "t.jsonl"
    path.write_text(
        "\n".join(json.dumps(r) for r in rows[:2]) + "\n\n   \n" + "\n".join(json.dumps(r) for r in rows[2:])
    )
    assert load_rows(str(path)) == rows


def test_parquet_round_trip_with_field_mapping(tmp_path) -> None:
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(SOURCE_ROWS).to_parquet(str(path))
    assert load_rows(str(path), fields=FIELDS) == EXPECTED
    assert load_rows(str(path), fields=FIELDS, limit=1) == EXPECTED[:1]


def test_save_to_disk_dataset_and_dataset_dict(tmp_path) -> None:
    single = tmp_path / "single"
    datasets.Dataset.from_list(SOURCE_ROWS).save_to_disk(str(single))
    assert load_rows(str(single), fields=FIELDS) == EXPECTED

    splits = tmp_path / "splits"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(SOURCE_ROWS[:2]), "test": datasets.Dataset.from_list(SOURCE_ROWS[2:])}
    ).save_to_disk(str(splits))
    assert load_rows(str(splits), fields=FIELDS) == EXPECTED[:2]
    assert load_rows(str(splits), split="test", fields=FIELDS) == EXPECTED[2:]
    with pytest.raises(ValueError, match=r"no split 'validation'.*\['test', 'train'\]"):
        load_rows(str(splits), split="validation")


def test_missing_mapped_field_names_row_line_and_field(tmp_path) -> None:
    rows = [*SOURCE_ROWS[:2], {"question": "what is 3+3?", "level": 3}]
    src = _write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match=r"d\.jsonl: row 2 \(line 3\) has no field 'final' \(mapped to 'answer'\)"):
        load_rows(src, fields=FIELDS)


def test_missing_prompt_names_row_and_field(tmp_path) -> None:
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(SOURCE_ROWS).to_parquet(str(path))
    with pytest.raises(ValueError, match=r"d\.parquet: row 0 has no field 'prompt'"):
        load_rows(str(path))


@pytest.mark.parametrize(("bad", "reason"), [("", "empty"), ("  \n", "empty"), (5, "must be a string")])
def test_bad_prompt_names_row_and_field(tmp_path, bad, reason: str) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"prompt": bad}])
    with pytest.raises(ValueError, match=rf"row 1 \(line 2\) field 'prompt' .*{reason}"):
        load_rows(src)


def test_null_mapped_field(tmp_path) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "final": None}])
    with pytest.raises(ValueError, match=r"row 0 \(line 1\) field 'final' \(mapped to 'answer'\) is null"):
        load_rows(src, fields=FIELDS)


def test_malformed_json_line_is_named(tmp_path) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", SOURCE_ROWS, extra_lines=['{"question": "oops",'])
    with pytest.raises(ValueError, match=r"d\.jsonl: line 4 is not valid JSON"):
        load_rows(src, fields=FIELDS)
    # a line that is JSON but not an object
    src = _write_jsonl(tmp_path / "e.jsonl", SOURCE_ROWS[:1], extra_lines=["[1, 2]"])
    with pytest.raises(ValueError, match=r"row 1 \(line 2\) is a list"):
        load_rows(src, fields=FIELDS)


def test_load_rows_rejects_bad_arguments(tmp_path) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", SOURCE_ROWS)
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl.*does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "d.xml").write_text("<prompt>hi</prompt>\n")
    with pytest.raises(ValueError, match=r"unsupported file type '\.xml'"):
        load_rows(str(tmp_path / "d.xml"))
    for limit in (0, -1, 1.5):
        with pytest.raises(ValueError, match="limit"):
            load_rows(src, fields=FIELDS, limit=limit)
    with pytest.raises(ValueError, match="fields"):
        load_rows(src, fields={"prompt": ""})
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        load_rows(str(tmp_path / "empty.jsonl"))


@pytest.mark.parametrize(
    ("field", "bad", "reason"),
    [
        ("answer", ["4"], "'answer' must be a non-empty string or a number, got list"),
        ("answer", {"value": 4}, "'answer' must be a non-empty string or a number, got dict"),
        ("answer", True, "'answer' must be a non-empty string or a number, got bool"),
        ("answer", None, "'answer' must be a non-empty string or a number, got NoneType"),
        ("answer", " ", "'answer' must be a non-empty string or a number, got str"),
        ("answer", float("nan"), "'answer' must be a non-empty string or a number, got float nan"),
        ("solution", ["12"], "'solution' must be a non-empty string or a number, got list"),
        ("solution", True, "'solution' must be a non-empty string or a number, got bool"),
        ("solution", "", "'solution' must be a non-empty string or a number, got str"),
        ("tests", ["assert f(1) == 1", 2], "'tests' must be a non-empty string or list of strings, or stdin/stdout "
         "cases .*, got list"),
        ("tests", [], "'tests' must be a non-empty string or list of strings, or stdin/stdout cases .*, got list"),
        ("tests", {"inputs": ["1"], "outputs": []}, "'tests' as stdin/stdout test cases need 'outputs', a non-empty "
         "list, got \\[\\]"),
        ("tests", '{"inputs": ["1", "2"], "outputs": ["1"]}', "'tests' as stdin/stdout test cases: 'inputs' has 2 "
         "items but 'outputs' has 1"),
        ("tests", {"inputs": ["1"], "outputs": [1], "fn_name": "f"}, "'tests' as call-based test cases: 'inputs' item "
         "0 must be the list of the function's arguments \\(or its JSON text\\), got str '1'"),
        ("tests", [{"input": "1", "output": "1", "testtype": "functional"}], "'tests' as LiveCodeBench test cases: "
         "functional cases call a function the cases do not name; give the row an 'fn_name' field"),
        ("tests", '[{"input": "1", "output": "1", "testtype": "stdin"}, "x"]', "'tests' as LiveCodeBench test cases: "
         "item 1 must be a dict with the keys"),
    ],
)
def test_wrong_typed_known_fields_name_row_and_field(tmp_path, field: str, bad, reason: str) -> None:
    good = {"prompt": "1+1=", "answer": "2", "solution": "2", "tests": "assert True"}
    src = _write_jsonl(tmp_path / "d.jsonl", [good, {**good, field: bad}])
    with pytest.raises(ValueError, match=rf"d\.jsonl: row 1 \(line 2\) field {reason}"):
        load_rows(src)


def test_stdin_stdout_cases_load_as_they_are(tmp_path) -> None:
    """`tests` as stdin/stdout cases, a dict or APPS's `input_output` JSON text, pass the load-time check unchanged
    (the code reward parses them); a JSON object with other keys is refused by name."""
    cases = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    rows = [{"prompt": "add", "tests": cases}, {"prompt": "add", "tests": json.dumps({**cases, "fn_name": None})}]
    assert load_rows(_write_jsonl(tmp_path / "d.jsonl", rows)) == rows
    src = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "add", "tests": json.dumps({"input": ["1"]})}])
    with pytest.raises(ValueError, match=r"row 0 \(line 1\) field 'tests' as stdin/stdout test cases take the keys "
                                         r".*got unknown \['input'\]"):
        load_rows(src)


def test_call_based_and_livecodebench_cases_load_as_they_are(tmp_path) -> None:
    """APPS's call-based `input_output` (a `fn_name`) and LiveCodeBench's test cases (stdin ones; functional ones
    with the function named by the row's `fn_name` or LiveCodeBench's `metadata` JSON) pass the load-time check
    unchanged; functional ones whose function nothing names are refused at their row."""
    functional = json.dumps([{"input": "[1, 2]\n3", "output": "6", "testtype": "functional"}])
    rows = [{"prompt": "add", "tests": {"inputs": [[1, 2]], "outputs": [[3]], "fn_name": "add"}},
            {"prompt": "add", "tests": [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]},
            {"prompt": "add", "tests": functional, "metadata": json.dumps({"func_name": "total"})},
            {"prompt": "add", "tests": functional, "fn_name": "total"}]
    assert load_rows(_write_jsonl(tmp_path / "d.jsonl", rows)) == rows
    src = _write_jsonl(tmp_path / "bad.jsonl", [rows[2], {"prompt": "add", "tests": functional, "metadata": "{}"}])
    with pytest.raises(ValueError, match=r"row 1 \(line 2\) field 'tests' as LiveCodeBench test cases: functional "
                                         r"cases call a function the cases do not name"):
        load_rows(src)


def test_numeric_answers_become_strings(tmp_path) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": 2}, {"prompt": "half?", "answer": 0.5}])
    assert [r["answer"] for r in load_rows(src)] == ["2", "0.5"]


def test_a_verl_parquet_loads_as_is_with_a_dotted_field_for_its_nested_ground_truth(tmp_path):
    """verl's RL data format (data_source, prompt as messages, reward_model.ground_truth nested in a struct column):
    `fields={"answer": "reward_model.ground_truth"}` reads it without a conversion script, and its data_source is the
    field that rewards.routes and data.eval_by use."""
    from gspo.rewards import RewardRunner, Routes

    verl = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": f"What is {a} + 3? Put the answer in \\\\boxed{{}}."}],
             "reward_model": {"style": "rule", "ground_truth": str(a + 3)},
             "extra_info": {"split": "train", "index": a}} for a in range(3)]
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(verl).to_parquet(str(path))
    rows = load_rows(str(path), fields={"answer": "reward_model.ground_truth"})
    assert [r["answer"] for r in rows] == ["3", "4", "5"] and rows[0]["data_source"] == "openai/gsm8k"
    assert rows[1]["prompt"] == [{"role": "user", "content": "What is 1 + 3? Put the answer in \\\\boxed{}."}]
    assert rows[2]["reward_model"] == {"style": "rule", "ground_truth": "5"}  # the struct column is kept whole
    runner = RewardRunner({"math": 1.0}, routes=Routes("data_source", {"openai/gsm8k": ["math"]}))
    runner.check_rows(rows, "math")
    assert runner.score(["p"] * 3, ["\\boxed{3}", "\\boxed{5}", "5"], rows).total.tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match=r"row 0 has no field 'reward_model\.answer' \(mapped to 'answer'\)"):
        load_rows(str(path), fields={"answer": "reward_model.answer"})


def test_a_capped_sample_keeps_the_sources_order_and_is_chosen_by_the_salted_hash():
    """`subset_rows` keeps the `size` rows whose prompt has the smallest bucket under SUBSET_SALT (independent of the
    held-out side, which uses the unsalted bucket), listed in the source's order."""
    from gspo.data.heldout import SUBSET_SALT, holdout_bucket, subset_rows
    rows = [{"prompt": f"{a}+{a}="} for a in range(60)]
    picked = subset_rows(rows, 10)
    positions = [rows.index(r) for r in picked]
    assert positions == sorted(positions) and len(set(positions)) == 10
    salted = sorted(range(60), key=lambda i: holdout_bucket(rows[i]["prompt"], SUBSET_SALT))[:10]
    assert positions == sorted(salted)
    plain = sorted(range(60), key=lambda i: holdout_bucket(rows[i]["prompt"]))[:10]
    assert sorted(salted) != sorted(plain)  # the two hashes pick different rows here


def test_a_held_out_split_loses_every_training_prompt_even_when_the_training_rows_are_capped(tmp_path):
    """The held-out split of a dataset loses the prompts of every training row, not only of the capped sample
    that trains (data.train_size): the rows left out of the sample are still training data of that dataset."""
    from gspo.config import DataConfig
    from gspo.data import load_data
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.csv").write_text("prompt,answer\n" + "".join(f"{a}+1=,{a + 1}\n" for a in range(20)))
    (folder / "test.csv").write_text("prompt,answer\n" + "".join(f"{a}+1=,{a + 1}\n" for a in range(15, 30)))
    data = load_data(DataConfig(path=str(folder), eval_split="test", train_size=5), seed=0)
    assert len(data.train) == 5
    assert data.heldout_source["dropped_training_prompts"] == 5  # 15+1= .. 19+1=, whether sampled or not
    assert sorted(r["prompt"] for r in data.heldout) == [f"{a}+1=" for a in range(20, 30)]


def test_the_split_of_a_problem_never_changes_across_versions() -> None:
    """A problem's split is fixed (SHA-256 buckets): a run resumed or compared under another version of gspo must
    hold out the same problems, or it would train on problems an earlier run tested on. Pinned on a few keys."""
    keys = [f"{a}+{a + 1}" for a in range(30)]
    assert [k for k in keys if split_of(k) == "test"] == ["3+4", "5+6", "22+23"]


def test_countdown_intermediate_values_are_positive_and_multiply_operands_have_their_digits() -> None:
    """Every operator a countdown solution may use keeps the intermediate value a positive integer (no 5-5=0), and
    multiply's operands have exactly digits_a / digits_b digits (the product is beyond the tiny models' heads)."""
    from gspo.data.tasks import _valid_ops

    for left in range(1, 13):
        for right in range(1, 13):
            for op in _valid_ops(left, right):
                value = _BINOPS[{"+": ast.Add, "-": ast.Sub, "*": ast.Mult, "/": ast.Div}[op]](Fraction(left), right)
                assert value > 0 and value.denominator == 1, (left, op, right)
    for row in make_task("multiply", size=200, digits_a=3, digits_b=2):
        assert len(str(row["a"])) == 3 and len(str(row["b"])) == 2, row


def test_make_task_refuses_bools_and_too_many_countdown_numbers() -> None:
    """A bool is not an int option or seed (True would silently be 1), and countdown takes at most 8 numbers."""
    with pytest.raises(ValueError, match="digits must be an int"):
        make_task("addition", digits=True)
    with pytest.raises(ValueError, match="seed"):
        make_task("addition", seed=True)
    with pytest.raises(ValueError, match="max_count <= 8"):
        make_task("countdown", max_count=9)
