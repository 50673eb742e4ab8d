"""Bad and awkward data inputs get a clear error naming what and where, or load as meant: files that are not UTF-8
(or start with a byte order mark), local paths that do not exist (never looked up on the Hub), integral float
answers, data.prompt_template misuse, errors naming the user's own columns, and held-out files without the columns
only training needs (gspo.data.files, gspo.data.chat, gspo.data.heldout)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pandas as pd
import pytest

from gspo.config import ConfigError, DataConfig
from gspo.data import DataSplits, load_data, load_rows, render_chat
from gspo.data.chat import apply_prompt_template
from gspo.models import build_tokenizer

FIELDS = {"prompt": "question", "answer": "result"}


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any call of `datasets.load_dataset` fail the test: what must be a local path is never looked up."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"datasets.load_dataset was called with {args} {kwargs}")

    monkeypatch.setattr(datasets, "load_dataset", refuse)


# ---- 1. encodings ---------------------------------------------------------------------------------------------------


def test_a_jsonl_that_is_not_utf8_is_named_by_path_and_line(tmp_path) -> None:
    path = tmp_path / "latin1.jsonl"
    lines = [json.dumps({"question": "1+1=", "result": "2"}), "", '{"question": "café?", "result": "3"}']
    path.write_bytes("\n".join(lines).encode("latin-1") + b"\n")
    with pytest.raises(ValueError, match=r"latin1\.jsonl: line 3 is not UTF-8 text: its byte 18 is 0xe9") as info:
        load_rows(str(path), fields=FIELDS)
    assert "position" not in str(info.value)  # not the offset into a read buffer


def test_a_utf8_byte_order_mark_is_skipped(tmp_path) -> None:
    rows = [{"question": "café=", "result": "1"}, {"question": "2+2=", "result": "4"}]
    plain = _write_jsonl(tmp_path / "plain.jsonl", rows)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + Path(plain).read_bytes())
    assert load_rows(str(bom), fields=FIELDS) == load_rows(plain, fields=FIELDS)
    assert load_rows(str(bom), fields=FIELDS)[0]["prompt"] == "café="


# ---- 2. local paths that do not exist ------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["missing.csv", "missing.json", "missing.jsonl", "missing.parquet", "dir/x.arrow",
                                    "./train", "../nowhere/train", "a/b/c", "data/train", "folder/"])
def test_a_missing_local_file_or_folder_is_an_immediate_error_not_a_hub_lookup(tmp_path, monkeypatch,
                                                                               source: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()  # `data/train` beside an existing data/ folder is a path, not the Hub id data/train
    _no_hub(monkeypatch)
    with pytest.raises(FileNotFoundError, match=rf"data file or folder '{source}' does not exist"):
        load_rows(source)


def test_a_hub_shaped_source_taken_for_a_path_says_why_and_how_to_reach_the_hub(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "openai").mkdir()
    _no_hub(monkeypatch)
    with pytest.raises(FileNotFoundError, match=r"'openai/gsm8k' does not exist.*for the Hub dataset 'openai/gsm8k', "
                                                r"run from a folder without a 'openai/' subfolder"):
        load_rows("openai/gsm8k")


def test_a_missing_absolute_or_home_path_is_an_immediate_error(tmp_path, monkeypatch) -> None:
    _no_hub(monkeypatch)
    with pytest.raises(FileNotFoundError, match=rf"nothing at {tmp_path}/train"):
        load_rows(str(tmp_path / "train"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=rf"'~/gone' does not exist \(there is nothing at {tmp_path}/gone\)"):
        load_rows("~/gone")


@pytest.mark.parametrize("hub_id", ["openai/gsm8k", "gsm8k", "HuggingFaceH4/MATH-500", "org/name.v2", "org/data"])
def test_hub_ids_still_go_to_the_hub(tmp_path, monkeypatch, hub_id: str) -> None:
    monkeypatch.chdir(tmp_path)  # no local folder named like the id's org
    calls = []

    def fake_load_dataset(source, split=None):
        calls.append((source, split))
        return datasets.Dataset.from_list([{"prompt": "1+1=", "answer": "2"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_rows(hub_id) == [{"prompt": "1+1=", "answer": "2"}]
    assert calls == [(hub_id, "train")]


def test_an_existing_folder_of_data_files_still_loads(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "train").mkdir(parents=True)
    _write_jsonl(tmp_path / "data" / "train" / "train.jsonl", [{"question": "1+1=", "result": "2"}])
    assert load_rows("data/train", fields=FIELDS) == [{"prompt": "1+1=", "answer": "2"}]


# ---- 3. integral float answers --------------------------------------------------------------------------------------


ANSWERS = [37.0, 2.5, -4.0, 0.0, 1e20]
ANSWER_TEXT = ["37", "2.5", "-4", "0", "1e+20"]  # 1e20 is past the exact integers of a float: kept as Python writes it


def test_integral_float_answers_from_parquet_are_integers(tmp_path) -> None:
    path = tmp_path / "floats.parquet"
    pd.DataFrame({"question": [f"q{i}" for i in range(len(ANSWERS))], "result": ANSWERS}).to_parquet(path)
    assert [r["answer"] for r in load_rows(str(path), fields=FIELDS)] == ANSWER_TEXT


def test_csv_answers_are_the_text_as_written_in_a_file_or_a_folder(tmp_path) -> None:
    """A CSV cell is text: what the file says is what a reward compares with. A type guess made "007" 7 (and, in a
    column that turned to text after 10,000 rows, a pyarrow error); pandas' own float text stays as it wrote it."""
    folder = tmp_path / "csv"
    folder.mkdir()
    answers = ["007", "5.00", "1e3", "NA", "true", "37.0", "1,000", 'say "hi"']
    pd.DataFrame({"question": [f"q{i}" for i in range(len(answers))], "result": answers}).to_csv(
        folder / "train.csv", index=False)
    assert [r["answer"] for r in load_rows(str(folder), fields=FIELDS)] == answers
    assert [r["answer"] for r in load_rows(str(folder / "train.csv"), fields=FIELDS)] == answers


def test_integral_float_answers_from_jsonl_are_integers(tmp_path) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": a} for i, a in enumerate(ANSWERS)])
    assert [r["answer"] for r in load_rows(src)] == ANSWER_TEXT


def test_small_float_answers_are_decimals_not_scientific_notation(tmp_path) -> None:
    """JSON `0.00005` was read as "5e-05" (Python's repr of the float), which neither the file nor a model writes:
    an exact-match reward judged the answer as written ("0.00005") wrong, and the start-of-run check, which scores
    the converted text, had nothing to warn about."""
    answers, text = [0.00005, -1.5e-07, 0.0001, 0.000123], ["0.00005", "-0.00000015", "0.0001", "0.000123"]
    src = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": a} for i, a in enumerate(answers)])
    assert [r["answer"] for r in load_rows(str(src))] == text
    path = tmp_path / "d.parquet"
    pd.DataFrame({"question": [f"q{i}" for i in range(len(answers))], "result": answers}).to_parquet(path)
    assert [r["answer"] for r in load_rows(str(path), fields=FIELDS)] == text
    assert [float(t) for t in text] == answers  # the same numbers


# ---- 3b. CSV and TSV files: text as written, records as the header names them -------------------------------------


def test_tsv_quotes_are_ordinary_characters_so_no_rows_merge(tmp_path) -> None:
    path = tmp_path / "q.tsv"
    path.write_text('question\tresult\n"quote opens here. 1+1=\t2\n2+2=\t4\n"Hi," she said. 3+3=\t6\n')
    rows = load_rows(str(path), fields=FIELDS)
    assert [r["prompt"] for r in rows] == ['"quote opens here. 1+1=', "2+2=", '"Hi," she said. 3+3=']
    assert [r["answer"] for r in rows] == ["2", "4", "6"]


def test_a_csv_record_spanning_lines_and_blank_lines_keep_their_line_numbers(tmp_path) -> None:
    path = tmp_path / "d.csv"
    path.write_text('question,result\n"two\nlines",1\n\nq2,\n')
    with pytest.raises(ValueError, match=r"d\.csv: row 1 \(line 5\) field 'result' \(mapped to 'answer'\) is null"):
        load_rows(str(path), fields=FIELDS)  # an empty cell is a missing value
    assert load_rows(str(path), fields=FIELDS, limit=1) == [{"prompt": "two\nlines", "answer": "1"}]


@pytest.mark.parametrize(("text", "message"), [
    ("question,result\n1+1=,2,\n", r"line 2 has 3 values where the header \(line 1\) names 2 columns"),
    ("question,result\n1+1=\n", r"line 2 has 1 values where the header \(line 1\) names 2"),
    ("question,question\n1+1=,2\n", r"the header \(line 1\) names the column 'question' twice"),
    ('question,result\n"1+1="x,2\n', r"line 2 is not valid CSV"),
    ('question,result\n"1+1=,2\n', r"line 2 is not valid CSV: unexpected end of data"),
])
def test_malformed_csv_is_an_error_naming_the_line(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"bad\.csv: {message}"):
        load_rows(str(path), fields=FIELDS)


def test_a_csv_with_an_index_column_or_trailing_commas_loads(tmp_path) -> None:
    frame = pd.DataFrame({"question": ["1+1=", "2+2="], "result": ["2", "4"]})
    frame.to_csv(tmp_path / "indexed.csv")  # pandas' default: an unnamed index column first
    assert [r["Unnamed: 0"] for r in load_rows(str(tmp_path / "indexed.csv"), fields=FIELDS)] == ["0", "1"]
    (tmp_path / "trailing.csv").write_text("question,result,\n1+1=,2,\n")
    assert load_rows(str(tmp_path / "trailing.csv"), fields=FIELDS) == [{"prompt": "1+1=", "answer": "2",
                                                                          "Unnamed: 2": None}]


def test_a_csv_that_is_not_utf8_is_named_by_its_line(tmp_path) -> None:
    path = tmp_path / "latin1.csv"
    path.write_bytes("question,result\n1+1=,2\ncafé?,3\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.csv: line 3 is not UTF-8 text: its byte 4 is 0xe9"):
        load_rows(str(path), fields=FIELDS)


def test_a_folder_of_csv_files_reads_each_split_as_text(tmp_path) -> None:
    data = tmp_path / "ds" / "data"
    data.mkdir(parents=True)
    for name, rows in (("train-00000-of-00002", [("a", "007")]), ("train-00001-of-00002", [("b", "008")]),
                       ("test-00000-of-00001", [("c", "009")])):
        (data / f"{name}.csv").write_text("question,result\n" + "".join(f"{q},{a}\n" for q, a in rows))
    assert load_rows(str(tmp_path / "ds"), fields=FIELDS) == [{"prompt": "a", "answer": "007"},
                                                               {"prompt": "b", "answer": "008"}]
    assert load_rows(str(tmp_path / "ds"), split="test", fields=FIELDS) == [{"prompt": "c", "answer": "009"}]
    assert load_rows(str(tmp_path / "ds"), fields=FIELDS, limit=1) == [{"prompt": "a", "answer": "007"}]
    with pytest.raises(ValueError, match=r"has no split 'validation'; its splits are \['test', 'train'\]"):
        load_rows(str(tmp_path / "ds"), split="validation", fields=FIELDS)


def test_upper_case_suffixes_load_like_lower_case_ones(tmp_path) -> None:
    rows = [{"prompt": "1+1=", "answer": "2"}]
    _write_jsonl(tmp_path / "D.JSONL", rows)
    pd.DataFrame(rows).to_parquet(tmp_path / "D.PARQUET")
    (tmp_path / "D.TSV").write_text("prompt\tanswer\n1+1=\t2\n")
    for name in ("D.JSONL", "D.PARQUET", "D.TSV"):
        assert load_rows(str(tmp_path / name)) == rows, name


def test_numeric_solutions_become_text_and_a_field_mapped_from_one_of_ours_keeps_it(tmp_path) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": 2}])
    # {"solution": "answer"}: the cold start trains on the answer, and the reward still reads `answer`
    assert load_rows(src, fields={"solution": "answer"}) == [{"prompt": "1+1=", "answer": "2", "solution": "2"}]
    assert load_rows(src, fields={"prompt": "prompt", "solution": "answer"})[0]["answer"] == "2"
    # a column mapped to one of ours is still renamed when it is not one of ours itself
    src = _write_jsonl(tmp_path / "e.jsonl", [{"question": "1+1=", "result": 2}])
    assert load_rows(src, fields=FIELDS) == [{"prompt": "1+1=", "answer": "2"}]


# ---- 4. data.prompt_template ----------------------------------------------------------------------------------------


def test_a_template_that_reaches_into_a_string_is_a_clear_error() -> None:
    rows = [{"prompt": "1+1=", "answer": "2"}]
    with pytest.raises(ValueError, match=r"training rows: data\.prompt_template 'Q: \{prompt\.x\}' cannot fill in "
                                         r"\{prompt\.x\} from row 0's 'prompt' \(str\): AttributeError"):
        apply_prompt_template(rows, "Q: {prompt.x}", "training rows")
    with pytest.raises(ValueError, match=r"cannot fill in \{answer\[x\]\} from row 0.*TypeError"):
        apply_prompt_template(rows, "{answer[x]}")


def test_a_template_on_conversation_prompts_is_refused() -> None:
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"}]
    with pytest.raises(ValueError, match=r"row 1 is a conversation.*applies to string prompts"):
        apply_prompt_template(rows, "Q: {prompt}")
    # one message's text is text: that is fine
    assert apply_prompt_template(rows[1:], "Q: {prompt[0][content]}")[0]["prompt"] == "Q: 2+2="


@pytest.mark.parametrize(("template", "reason"), [("Answer briefly.", "names no field"),
                                                  ("{{prompt}}", "names no field"),
                                                  ("Q: {0}", "positional field"),
                                                  ("Q: {}", "positional field")])
def test_a_template_that_names_no_row_field_is_refused(template: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        apply_prompt_template([{"prompt": "a"}, {"prompt": "b"}], template)


def test_a_template_still_phrases_rows_from_nested_and_plain_fields() -> None:
    rows = [{"prompt": "1+1=", "meta": {"level": 3}}]
    assert apply_prompt_template(rows, "[{meta[level]}] {prompt} {{ok}}")[0]["prompt"] == "[3] 1+1= {ok}"


def test_a_template_naming_a_renamed_column_says_which_field_to_write() -> None:
    with pytest.raises(ValueError, match=r"names the field 'question', which row 0 does not have.*data\.fields "
                                         r"renames the column 'question' to 'prompt': write \{prompt\}"):
        apply_prompt_template([{"prompt": "1+1=", "answer": "2"}], "Q: {question}", "training rows", FIELDS)


def test_render_chat_reports_a_bad_template_as_a_config_error() -> None:
    cfg = DataConfig(prompt_template="{prompt.x}")
    with pytest.raises(ConfigError, match=r"data: training rows: .*row 0.*AttributeError"):
        render_chat(DataSplits(train=[{"prompt": "1+1=", "answer": "2"}], heldout=[]), cfg, build_tokenizer())


@pytest.mark.parametrize(("template", "reason"), [("{prompt.x}", "cannot fill in"), ("hello", "names no field"),
                                                  ("{question}", "write \\{prompt\\}")])
def test_load_data_checks_the_template_before_any_model_is_loaded(tmp_path, template: str, reason: str) -> None:
    train = _write_jsonl(tmp_path / "train.jsonl", [{"question": f"{i}+1=", "result": str(i + 1)} for i in range(4)])
    held = _write_jsonl(tmp_path / "held.jsonl", [{"question": "9+9=", "result": "18"}])
    cfg = DataConfig(path=train, eval_path=held, fields=FIELDS, prompt_template=template)
    with pytest.raises(ValueError, match=reason):
        load_data(cfg, seed=0)
    good = load_data(DataConfig(path=train, eval_path=held, fields=FIELDS, prompt_template="Q: {prompt}"), seed=0)
    assert good.train[0]["prompt"].endswith("+1=")  # checked only: the template is applied with the chat template


def _passage_rows(n: int, questions: list[str], start: int = 0) -> list[dict]:
    """Rows whose `prompt` field is one of a few questions and whose `passage` holds the problem: only a template
    "{passage} {prompt}" makes each row its own prompt."""
    return [{"prompt": questions[i % len(questions)], "passage": f"a is {i} and b is {i + 1}", "answer": str(2 * i + 1)}
            for i in range(start, start + n)]


def test_held_out_rows_are_compared_by_the_prompt_the_template_makes(tmp_path) -> None:
    train = _write_jsonl(tmp_path / "train.jsonl", _passage_rows(100, ["what is the sum?", "what is the total?"]))
    held = _write_jsonl(tmp_path / "held.jsonl", _passage_rows(40, ["what is the sum?"], start=100))
    template = "{passage}. {prompt}"
    # every held-out `prompt` field is a training one, but no templated prompt is: all 40 are held out, once each
    splits = load_data(DataConfig(path=train, eval_path=held, prompt_template=template), seed=0)
    assert len(splits.heldout) == 40
    assert splits.heldout_source["dropped_training_prompts"] == 0 and splits.heldout_source["repeated_prompts"] == 0
    # a held-out row whose templated prompt is a training one (up to case) is still dropped
    copied = _write_jsonl(tmp_path / "copied.jsonl", [{**_passage_rows(1, ["What is the SUM?"])[0]},
                                                      *_passage_rows(3, ["what is the sum?"], start=200)])
    splits = load_data(DataConfig(path=train, eval_path=copied, prompt_template=template), seed=0)
    assert [r["passage"] for r in splits.heldout] == [f"a is {i} and b is {i + 1}" for i in (200, 201, 202)]
    assert splits.heldout_source["dropped_training_prompts"] == 1
    # a fraction of one file splits by templated prompt: both sides non-empty, disjoint in templated prompts
    cfg = DataConfig(path=train, eval_fraction=0.2, prompt_template=template)
    splits = load_data(cfg, seed=0)
    made = {side: {template.format_map(r) for r in getattr(splits, side)} for side in ("train", "heldout")}
    assert 0 < len(splits.heldout) < 100 and len(splits.train) + len(splits.heldout) == 100
    assert not made["train"] & made["heldout"]


def test_a_capped_sample_under_a_template_is_not_the_first_rows_of_one_prompt_field(tmp_path) -> None:
    # sorted by question: a sample by the `prompt` field would take the first rows of one question, in file order
    rows = sorted(_passage_rows(200, ["what is the sum?", "what is the total?"]), key=lambda r: r["prompt"])
    train = _write_jsonl(tmp_path / "train.jsonl", rows)
    held = _write_jsonl(tmp_path / "held.jsonl", _passage_rows(5, ["q?"], start=500))
    splits = load_data(DataConfig(path=train, eval_path=held, train_size=20, prompt_template="{passage}. {prompt}"),
                       seed=0)
    chosen = [rows.index(r) for r in splits.train]
    assert len(chosen) == 20 and chosen != list(range(20))
    assert {r["prompt"] for r in splits.train} == {"what is the sum?", "what is the total?"}


# ---- 5. errors name the user's columns ------------------------------------------------------------------------------


@pytest.mark.parametrize(("row", "message"), [
    ({"question": " ", "result": "2"}, r"field 'question' \(mapped to 'prompt'\) is empty"),
    ({"question": 5, "result": "2"}, r"field 'question' \(mapped to 'prompt'\) must be a string"),
    ({"question": "1+1=", "result": ["2"]}, r"field 'result' \(mapped to 'answer'\) must be a non-empty string"),
    ({"question": [], "result": "2"}, r"field 'question' \(mapped to 'prompt'\) is an empty list of messages"),
])
def test_row_errors_name_the_mapped_column(tmp_path, row: dict, message: str) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", [{"question": "ok", "result": "1"}, row])
    with pytest.raises(ValueError, match=rf"d\.jsonl: row 1 \(line 2\) {message}"):
        load_rows(src, fields=FIELDS)


def test_a_mapped_solution_column_is_named_in_its_error(tmp_path) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "worked": [2]}])
    with pytest.raises(ValueError, match=r"row 0 \(line 1\) field 'worked' \(mapped to 'solution'\) must be"):
        load_rows(src, fields={"solution": "worked"})


# ---- 6. held-out rows need no solution ------------------------------------------------------------------------------


def test_held_out_files_need_not_have_the_mapped_solution_column(tmp_path) -> None:
    train = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1), "worked": str(i + 1)}
                                                    for i in range(4)])
    held = _write_jsonl(tmp_path / "held.jsonl", [{"prompt": "9+1=", "answer": "10"}])
    held_sol = _write_jsonl(tmp_path / "held_sol.jsonl", [{"prompt": "9+1=", "answer": "10", "worked": "10"}])
    fields = {"solution": "worked"}
    data = load_data(DataConfig(path=train, eval_path=held, fields=fields), seed=0)
    assert data.heldout == [{"prompt": "9+1=", "answer": "10"}]
    assert all(r["solution"] == r["answer"] for r in data.train)
    data = load_data(DataConfig(path=train, eval_path=[held, held_sol], fields=fields), seed=0)
    assert [r.get("solution") for r in data.heldout] == [None, "10"]  # renamed where a file has it
    # training rows still need it: the cold start trains on it
    with pytest.raises(ValueError, match=r"train2\.jsonl: row 0 \(line 1\) has no field 'worked'"):
        load_data(DataConfig(path=_write_jsonl(tmp_path / "train2.jsonl", [{"prompt": "1+1=", "answer": "2"}]),
                             eval_path=held_sol, fields=fields), seed=0)


def test_a_held_out_split_need_not_have_the_mapped_solution_column(tmp_path) -> None:
    saved = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"prompt": f"{i}+1=", "answer": str(i + 1), "worked": str(i + 1)}
                                             for i in range(4)]),
        "test": datasets.Dataset.from_list([{"prompt": "9+1=", "answer": "10"}]),
    }).save_to_disk(str(saved))
    data = load_data(DataConfig(path=str(saved), fields={"solution": "worked"}), seed=0)
    assert data.heldout == [{"prompt": "9+1=", "answer": "10"}]
    assert [r["solution"] for r in data.train] == [r["answer"] for r in data.train]


def test_single_csv_tsv_and_json_files_load_as_the_same_rows_as_jsonl(tmp_path):
    """One .csv / .tsv / .json file was refused as an unsupported file type (only a folder of them loaded)."""
    rows = [{"prompt": f"{a}+1=", "answer": a + 1} for a in range(5)]
    expected = load_rows(_write_jsonl(tmp_path / "d.jsonl", rows))
    (tmp_path / "d.csv").write_text("prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in rows))
    (tmp_path / "d.tsv").write_text("prompt\tanswer\n" + "".join(f"{r['prompt']}\t{r['answer']}\n" for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    for name in ("d.csv", "d.tsv", "d.json"):
        assert load_rows(str(tmp_path / name)) == expected, name
    with pytest.raises(ValueError, match=r"a single \.csv file has no splits, so no split 'test'"):
        load_rows(str(tmp_path / "d.csv"), split="test")


# ---- 7. field mapping, limits, splits and headers -------------------------------------------------------------------


def test_a_column_whose_name_has_a_dot_wins_over_the_nested_path(tmp_path) -> None:
    """A dotted name is a nested path only when no column has that exact name: a flat column "ans.x" is read as
    written, not the value inside an `ans` object."""
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "ans.x": "1", "ans": {"x": "2"}}])
    assert load_rows(path, fields={"answer": "ans.x"})[0]["answer"] == "1"


def test_an_optional_mapped_field_that_is_null_is_left_out(tmp_path) -> None:
    """An optional field (held-out rows need no solution) that a row has as null is left out, like a missing one,
    rather than failing the load as a null required field."""
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "worked": None}, {"prompt": "q", "worked": "7"}])
    assert load_rows(path, fields={"solution": "worked"}, optional=("solution",)) == [
        {"prompt": "p"}, {"prompt": "q", "solution": "7"}]


def test_a_csv_limit_reads_no_record_after_the_limit(tmp_path) -> None:
    """`limit` rows are read and checked, no more: a malformed record after them is never reached, in one file or
    in the later file of a folder's split."""
    (tmp_path / "d.csv").write_text("prompt,answer\n1+1=,2\n3+3=,6,extra\n")
    assert load_rows(str(tmp_path / "d.csv"), limit=1) == [{"prompt": "1+1=", "answer": "2"}]
    data = tmp_path / "ds" / "data"
    data.mkdir(parents=True)
    (data / "train-00000-of-00002.csv").write_text("prompt,answer\na,1\n")
    (data / "train-00001-of-00002.csv").write_text("prompt,answer\nb,2\nc,3,extra\n")
    assert load_rows(str(tmp_path / "ds"), limit=2) == [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]


def test_a_tests_list_of_only_blank_strings_is_refused(tmp_path) -> None:
    """A `tests` list with no non-blank test would let code rewards pass every completion: it is a row error."""
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "tests": ["", "  "]}])
    with pytest.raises(ValueError, match=r"row 0 \(line 1\) field 'tests' must be a non-empty string or list"):
        load_rows(path)


def test_a_source_with_several_splits_and_no_split_named_is_refused(tmp_path) -> None:
    """split=None means "the only split": with train and test it is an error, never silently the first split."""
    (tmp_path / "train.csv").write_text("prompt,answer\na,1\n")
    (tmp_path / "test.csv").write_text("prompt,answer\nb,2\n")
    with pytest.raises(ValueError, match=r"has the splits \['test', 'train'\]; name one"):
        load_rows(str(tmp_path), split=None)


def test_csv_header_names_are_stripped_of_spaces(tmp_path) -> None:
    """A header written "prompt, answer" names the column `answer` (a space after the comma is not part of it), and
    a blank name is pandas' `Unnamed: i`, so a hand-written CSV reaches the reward with its answer."""
    (tmp_path / "d.csv").write_text("prompt, answer , \n1+1=,2,\n")
    assert load_rows(str(tmp_path / "d.csv")) == [{"prompt": "1+1=", "answer": "2", "Unnamed: 2": None}]


# ---- 8. chat rendering ----------------------------------------------------------------------------------------------


def test_template_kwargs_may_not_replace_the_chat_template() -> None:
    """`chat_template` is set by data.chat_template: giving it in data.chat_template_kwargs is refused by name, not
    reported as a failing template."""
    from gspo.data import render_prompts

    with pytest.raises(ValueError, match=r"may not set \['chat_template'\]"):
        render_prompts([{"prompt": "1+1="}], build_tokenizer(), template_kwargs={"chat_template": "x"})


def test_a_template_that_renders_only_whitespace_is_refused(tmp_path) -> None:
    """A chat template that renders nothing but whitespace would give the model an empty prompt: it is an error."""
    from gspo.data import render_prompts

    template = tmp_path / "blank.jinja"
    template.write_text("  \n")
    with pytest.raises(ValueError, match=r"row 0: the chat template rendered"):
        render_prompts([{"prompt": "1+1="}], build_tokenizer(), mode="always", chat_template=str(template))


def test_render_chat_renders_held_out_rows_and_passes_tools_to_the_template(tmp_path) -> None:
    """Held-out rows are rendered as training rows are (evaluation must see the prompt training saw), and the tools
    reach the template as `tools`, so that it can describe them."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }};{% endfor %}tools={{ tools | length if tools "
                        "else 0 }}")
    cfg = DataConfig(chat="always", chat_template=str(template))
    data = render_chat(DataSplits(train=[{"prompt": "a"}], heldout=[{"prompt": "b"}]), cfg, build_tokenizer(),
                       tools=[{"type": "function", "function": {"name": "calc"}}])
    assert [r["prompt"] for r in data.train] == ["a;tools=1"]
    assert [r["prompt"] for r in data.heldout] == ["b;tools=1"]
