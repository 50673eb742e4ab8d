"""Tests for conversation prompts: loading and validating message lists (gspo.data.files), held-out dedup on them
(gspo.data.heldout), rendering them with chat templates (gspo.data.chat), the presets' chat template, the data
config's chat keys, and the GSM8K preparation script that now writes messages."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import datasets
import pytest

from gspo.config import DataConfig
from gspo.data import load_data, load_rows, render_prompts, split_by_fraction
from gspo.data.heldout import holdout_bucket
from gspo.models import VOCAB_CHARS, build_preset, build_tokenizer, load_model, save_model

ROOT = Path(__file__).parent.parent

SYSTEM = {"role": "system", "content": "be brief"}
ROWS = [
    {"prompt": [SYSTEM, {"role": "user", "content": "2+3="}], "answer": "5"},
    {"prompt": [{"role": "user", "content": "4+4="}], "answer": "8", "level": 1},
    {"prompt": "9-4=", "answer": "5"},
]


def _write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---- loading -------------------------------------------------------------------------------------------------------


def test_jsonl_rows_keep_message_lists_as_plain_dicts(tmp_path) -> None:
    rows = load_rows(_write_jsonl(tmp_path / "d.jsonl", ROWS))
    assert rows == ROWS
    assert all(type(m) is dict for row in rows[:2] for m in row["prompt"])


def test_messages_field_is_the_prompt_when_there_is_none(tmp_path) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", [{"messages": ROWS[0]["prompt"], "answer": "5"}])
    assert load_rows(src) == [{"prompt": ROWS[0]["prompt"], "answer": "5"}]
    # a string prompt next to a messages column wins; the column is left as it is
    both = _write_jsonl(tmp_path / "e.jsonl", [{"prompt": "1+1=", "messages": "anything"}])
    assert load_rows(both) == [{"prompt": "1+1=", "messages": "anything"}]


def test_field_mapping_works_for_message_prompts(tmp_path) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", [{"question": r["prompt"], "final": r["answer"]} for r in ROWS])
    rows = load_rows(src, fields={"prompt": "question", "answer": "final"})
    assert [r["prompt"] for r in rows] == [r["prompt"] for r in ROWS]
    assert all("question" not in r for r in rows)
    mapped = _write_jsonl(tmp_path / "m.jsonl", [{"conversation": ROWS[1]["prompt"]}])
    assert load_rows(mapped, fields={"messages": "conversation"}) == [{"prompt": ROWS[1]["prompt"]}]


def test_parquet_and_saved_datasets_give_the_jsonl_rows(tmp_path) -> None:
    # the extra key `name` of one message is filled with null in the others by parquet; those nulls are dropped
    rows = [{"prompt": [SYSTEM, {"role": "user", "content": "2+3=", "name": "ann"}], "answer": "5"},
            {"prompt": [{"role": "user", "content": "4+4="}], "answer": "8"}]
    expected = load_rows(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert expected == rows
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    assert load_rows(str(tmp_path / "d.parquet")) == expected
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "single"))
    assert load_rows(str(tmp_path / "single")) == expected
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:1]),
                          "test": datasets.Dataset.from_list(rows[1:])}).save_to_disk(str(tmp_path / "splits"))
    assert load_rows(str(tmp_path / "splits"), split="test") == expected[1:]


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(("row", "problem"), [
    ({"messages": {"role": "user", "content": "hi"}},
     r"field 'messages' must be a list of messages \(objects with 'role' and 'content'\), got dict"),
    ({"messages": "hi"}, r"field 'messages' must be a list of messages \(.*\), got str 'hi'"),
    ({"prompt": {"role": "user", "content": "hi"}}, r"field 'prompt' must be a string or a list of messages"),
    ({"prompt": [USER, "hi"]}, r"field 'prompt' message 1 is a str, expected an object"),
    ({"prompt": [{"role": "bot", "content": "hi"}]},
     r"field 'prompt' message 0 has role 'bot'; the allowed roles are system, user, assistant, tool"),
    ({"prompt": [{"content": "hi"}]}, r"field 'prompt' message 0 has role None; the allowed roles"),
    ({"prompt": [{"role": "user"}]},
     r"field 'prompt' message 0 \(user\) needs a non-empty string 'content', got nothing"),
    ({"prompt": [{"role": "user", "content": " "}]},
     r"field 'prompt' message 0 \(user\) needs a non-empty string 'content', got str ' '"),
    ({"prompt": [{"role": "user", "content": 3}]},
     r"field 'prompt' message 0 \(user\) needs a non-empty string 'content', got int 3"),
    ({"prompt": []}, r"field 'prompt' is an empty list of messages"),
    ({"messages": [USER, {"role": "assistant", "content": "5"}]},
     r"field 'messages' ends with an assistant message: a prompt must end with a user, system or tool message"),
])
def test_bad_messages_name_the_row_line_and_problem(tmp_path, row: dict, problem: str) -> None:
    src = _write_jsonl(tmp_path / "d.jsonl", [ROWS[0], row])
    with pytest.raises(ValueError, match=r"d\.jsonl: row 1 \(line 2\) " + problem):
        load_rows(src)


def test_bad_messages_in_parquet_name_the_row(tmp_path) -> None:
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"prompt": [USER]}, {"prompt": [USER, {"role": "critic", "content": "x"}]}]) \
        .to_parquet(str(path))
    with pytest.raises(ValueError, match=r"d\.parquet: row 1 field 'prompt' message 1 has role 'critic'"):
        load_rows(str(path))


def test_missing_prompt_mentions_messages(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"row 0 \(line 1\) has no field 'prompt' or 'messages'"):
        load_rows(_write_jsonl(tmp_path / "d.jsonl", [{"question": "q"}]))


# ---- held-out rows -------------------------------------------------------------------------------------------------


def test_string_prompts_keep_their_hash_bucket() -> None:
    for prompt in ("12+34=", "what is 2*3?", "ünïcode"):
        digest = hashlib.sha256(prompt.encode("utf-8")).digest()
        assert holdout_bucket(prompt) == int.from_bytes(digest[:8], "big") / 2**64


def test_message_prompts_split_by_fraction_deterministically() -> None:
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}]} for a in range(200)]
    train, heldout = split_by_fraction(rows, 0.25)
    assert 20 < len(heldout) < 80 and len(train) + len(heldout) == 200
    # the same messages with another key order land on the same side
    swapped = [{"prompt": [{"content": m["content"], "role": m["role"]} for m in r["prompt"]]} for r in rows]
    assert [r["prompt"] for r in split_by_fraction(swapped, 0.25)[1]] == [
        [{"content": m["content"], "role": m["role"]} for m in r["prompt"]] for r in heldout]


def test_heldout_message_prompts_that_are_training_prompts_are_dropped(tmp_path) -> None:
    train = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    repeated = {"prompt": [{"content": "4+4=", "role": "user"}], "answer": "8"}  # row 1 of ROWS, keys reordered
    new = {"prompt": [{"role": "user", "content": "7+1="}], "answer": "8"}
    also_system = {"prompt": [SYSTEM, {"role": "user", "content": "4+4="}], "answer": "8"}  # differs: a system turn
    held = _write_jsonl(tmp_path / "held.jsonl", [repeated, new, also_system])
    splits = load_data(DataConfig(path=train, eval_path=held), seed=0)
    assert splits.heldout == [new, also_system]
    assert splits.heldout_source["dropped_training_prompts"] == 1


# ---- rendering -----------------------------------------------------------------------------------------------------

TOKENIZER = build_tokenizer()


def test_tiny_template_renders_messages_in_the_vocabulary() -> None:
    rows = [dict(r) for r in ROWS]
    before = json.dumps(rows)
    out = render_prompts(rows, TOKENIZER)
    assert [r["prompt"] for r in out] == ["system: be brief; user: 2+3=; assistant:", "user: 4+4=; assistant:",
                                          "9-4="]
    assert out[0]["messages"] == ROWS[0]["prompt"] and out[1]["level"] == 1 and out[1]["answer"] == "8"
    assert "messages" not in out[2]
    assert json.dumps(rows) == before  # the input rows are not mutated
    assert out[0]["messages"] is not rows[0]["prompt"]
    ids = TOKENIZER(out[0]["prompt"], add_special_tokens=False)["input_ids"]
    assert TOKENIZER.unk_token_id not in ids and TOKENIZER.decode(ids) == out[0]["prompt"]


def test_system_prompt_is_added_only_where_there_is_none() -> None:
    out = render_prompts(ROWS[:2], TOKENIZER, system_prompt="add")
    assert out[0]["prompt"] == "system: be brief; user: 2+3=; assistant:"
    assert out[1]["prompt"] == "system: add; user: 4+4=; assistant:"
    assert out[1]["messages"] == ROWS[1]["prompt"]  # the row's own messages, without the configured system prompt


def test_modes(caplog) -> None:
    always = render_prompts(ROWS, TOKENIZER, mode="always", system_prompt="add")
    assert always[2]["prompt"] == "system: add; user: 9-4=; assistant:"
    assert always[2]["messages"] == [{"role": "user", "content": "9-4="}]
    assert not caplog.records
    assert render_prompts(ROWS, TOKENIZER, mode="auto", system_prompt="add")[2]["prompt"] == "9-4="
    assert "1 string prompts are used as they are" in caplog.text  # the system prompt did not reach them: said
    assert render_prompts(ROWS[2:], TOKENIZER, mode="never") == ROWS[2:]
    with pytest.raises(ValueError, match=r"train rows: row 1 has a list of messages .* data\.chat is 'never'"):
        render_prompts([ROWS[2], ROWS[1]], TOKENIZER, mode="never", where="train rows")
    with pytest.raises(ValueError, match=r"chat mode must be one of \['auto', 'always', 'never'\], got 'sometimes'"):
        render_prompts(ROWS, TOKENIZER, mode="sometimes")


def test_custom_template_file_replaces_the_tokenizers(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}")
    out = render_prompts(ROWS[:1], TOKENIZER, chat_template=str(path))
    assert out[0]["prompt"] == "<system>be brief<user>2+3=<assistant>"
    assert TOKENIZER.chat_template.startswith("{% for message in messages %}")  # the tokenizer's own is untouched
    with pytest.raises(FileNotFoundError, match=r"data\.chat_template .*nope\.jinja.* is not a file"):
        render_prompts(ROWS[:1], TOKENIZER, chat_template=str(tmp_path / "nope.jinja"))


def test_template_kwargs_reach_the_template(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[-1].content }}|thinking={{ enable_thinking | default('unset') }}")
    render = lambda **kw: render_prompts(ROWS[1:2], TOKENIZER, chat_template=str(path), **kw)[0]["prompt"]  # noqa: E731
    assert render() == "4+4=|thinking=unset"
    assert render(template_kwargs={"enable_thinking": False}) == "4+4=|thinking=False"
    with pytest.raises(ValueError, match=r"may not set \['add_generation_prompt'\]"):
        render(template_kwargs={"add_generation_prompt": False})


def test_a_tokenizer_without_a_template_is_refused_for_messages_only(tmp_path) -> None:
    bare = build_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match=r"the tokenizer has no chat template.*set data\.chat_template"):
        render_prompts(ROWS, bare)
    assert render_prompts(ROWS[2:], bare) == ROWS[2:]  # string prompts need no template
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert render_prompts(ROWS[1:2], bare, chat_template=str(path))[0]["prompt"] == "4+4="


def test_gspo_sft_and_eval_take_a_chat_template_for_a_model_without_one(tmp_path, capsys) -> None:
    """A model whose tokenizer has no chat template, with conversation rows: `gspo sft` and `gspo eval --data` said
    "set data.chat_template", which neither command had any way to set (no config; eval's overrides need --config).
    `--chat-template FILE` is that setting; the model `gspo sft` saves carries the template it trained with."""
    from gspo.cli import main

    model, tokenizer = build_preset("tiny-dense")
    tokenizer.chat_template = None
    save_model(model, tokenizer, tmp_path / "bare")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    data = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": f"{a}+1="}],
                                                  "answer": str(a + 1), "solution": str(a + 1)} for a in range(4)])
    sft = ["sft", "--model", str(tmp_path / "bare"), "--data", data, "--steps", "1", "--batch-size", "2",
           "--device", "cpu"]
    assert main([*sft, "--out", str(tmp_path / "a")]) == 2
    assert "--chat-template" in capsys.readouterr().err
    assert main([*sft, "--out", str(tmp_path / "a"), "--chat-template", str(tmp_path / "nope.jinja")]) == 2
    assert "--chat-template" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert main([*sft, "--out", str(tmp_path / "a"), "--chat-template", str(template)]) == 0
    assert load_model(str(tmp_path / "a"))[1].chat_template == template.read_text()
    evaluate = ["eval", str(tmp_path / "bare"), "--data", data, "--reward", "addition", "--device", "cpu",
                "--max-new-tokens", "2"]
    assert main(evaluate) == 2
    capsys.readouterr()
    assert main([*evaluate, "--chat-template", str(template)]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 4


def test_a_failing_template_names_the_row_and_its_message(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool turns here') }}"
                    "{% endif %}{{ m.content }}{% endfor %}")
    rows = [ROWS[1], {"prompt": [USER, {"role": "tool", "content": "42"}]}]
    with pytest.raises(ValueError, match=r"eval rows: row 1: the chat template failed: .*no tool turns here"):
        render_prompts(rows, TOKENIZER, chat_template=str(path), where="eval rows")
    empty = tmp_path / "empty.jinja"
    empty.write_text("{% if false %}x{% endif %}")
    with pytest.raises(ValueError, match=r"row 0: the chat template rendered '', not a non-empty prompt"):
        render_prompts(ROWS[1:2], TOKENIZER, chat_template=str(empty))


def test_rendering_checks_rows_that_did_not_come_from_load_rows() -> None:
    with pytest.raises(ValueError, match=r"data: row 0 prompt ends with an assistant message"):
        render_prompts([{"prompt": [USER, {"role": "assistant", "content": "x"}]}], TOKENIZER)


# ---- the presets' template and the config ----------------------------------------------------------------------------


def test_tiny_template_survives_save_and_load_and_leaves_tokenization_alone(tmp_path) -> None:
    model, tokenizer = build_preset("tiny-dense")
    text = VOCAB_CHARS + " 12+34=?"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == [tokenizer.convert_tokens_to_ids(ch) for ch in text]  # one token per character, as before
    save_model(model, tokenizer, tmp_path / "m")
    _, loaded = load_model(str(tmp_path / "m"))
    assert loaded.chat_template == tokenizer.chat_template
    assert loaded(text, add_special_tokens=False)["input_ids"] == ids
    assert render_prompts(ROWS[:1], loaded)[0]["prompt"] == "system: be brief; user: 2+3=; assistant:"


def test_data_config_chat_keys(tmp_path) -> None:
    cfg = DataConfig()
    assert (cfg.chat, cfg.system_prompt, cfg.chat_template, cfg.chat_template_kwargs) == ("auto", None, None, {})
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    cfg = DataConfig(chat="always", system_prompt="be brief", chat_template=str(path),
                     chat_template_kwargs={"enable_thinking": False})
    assert cfg.chat_template == str(path) and cfg.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValueError, match=r"data\.chat_template .*nope\.jinja.* is not a file"):
        DataConfig(chat_template=str(tmp_path / "nope.jinja"))
    with pytest.raises(ValueError, match=r"chat"):
        DataConfig(chat="sometimes")


# ---- GSM8K preparation -----------------------------------------------------------------------------------------------

# The part of Qwen3's chat template that a lone user turn goes through (user turn, generation prompt, thinking switch).
QWEN3_USER_TURN = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def _prepare_gsm8k():
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", ROOT / "scripts" / "prepare_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepared_gsm8k_rows_are_messages_that_render_as_the_old_qwen3_prompt(tmp_path) -> None:
    module = _prepare_gsm8k()
    example = {"question": " Tom has 3 apples and buys 4. How many? ", "answer": "3+4=<<3+4=7>>7\n#### 7"}
    source = datasets.DatasetDict({"train": datasets.Dataset.from_list([example] * 2),
                                   "test": datasets.Dataset.from_list([example])})
    assert module.prepare(source, str(tmp_path / "gsm8k")) == {"train": 2, "test": 1}
    rows = load_rows(str(tmp_path / "gsm8k"), split="test", fields={"prompt": "chat_prompt", "answer": "final_answer"})
    assert rows[0]["answer"] == "7"
    assert rows[0]["prompt"] == [{"role": "user", "content": f"Tom has 3 apples and buys 4. How many?\n"
                                                             f"{module.INSTRUCTION}"}]
    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3_USER_TURN)
    out = render_prompts(rows, TOKENIZER, chat_template=str(template), template_kwargs={"enable_thinking": False})
    # what the script used to write by hand (Qwen3, thinking off)
    assert out[0]["prompt"] == ("<|im_start|>user\nTom has 3 apples and buys 4. How many?\n"
                                f"{module.INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ------------------------------------------------------------------------------------------------ prompt templates


def test_prompt_template_phrases_rows_from_their_fields_before_the_chat_template():
    from gspo.config import DataConfig
    from gspo.data import DataSplits, make_task, render_chat
    from gspo.models import build_tokenizer

    rows = make_task("addition", split="train", size=3, seed=0, digits=2)
    cfg = DataConfig(chat="always", prompt_template="what is {a} + {b}?")
    data = render_chat(DataSplits(train=rows, heldout=[]), cfg, build_tokenizer())
    for raw, done in zip(rows, data.train, strict=True):
        assert done["messages"] == [{"role": "user", "content": f"what is {raw['a']} + {raw['b']}?"}]
        assert done["prompt"].endswith("assistant:") and done["answer"] == raw["answer"]


def test_prompt_template_naming_a_missing_field_is_a_clear_error():
    from gspo.config import ConfigError, DataConfig
    from gspo.data import DataSplits, render_chat
    from gspo.models import build_tokenizer

    cfg = DataConfig(prompt_template="what is {x}?")
    with pytest.raises(ConfigError, match=r"'x'.*row 0.*fields"):
        render_chat(DataSplits(train=[{"prompt": "1+1=", "answer": "2"}], heldout=[]), cfg, build_tokenizer())


def test_render_prompts_reads_a_messages_row_as_load_rows_does_and_names_a_row_without_a_prompt() -> None:
    """A library caller's own rows: `messages` without `prompt` is the conversation (as in a data file), and a row
    with no prompt at all is named, not a bare KeyError: 'prompt'."""
    tokenizer = build_tokenizer()
    conversation = [{"role": "user", "content": "1+2="}]
    (row,) = render_prompts([{"messages": conversation}], tokenizer)
    assert row["prompt"] == render_prompts([{"prompt": conversation}], tokenizer)[0]["prompt"]
    assert row["messages"] == conversation
    for bad, shown in (({"answer": "3"}, "none"), ({"prompt": ""}, "str ''"), ({"prompt": 5}, "int 5")):
        with pytest.raises(ValueError, match=rf"data: row 1 has no prompt .*: {shown}$"):
            render_prompts([{"prompt": "1+1="}, bad], tokenizer)
