"""Render conversation prompts with the model's chat template, once, right after the tokenizer is loaded.

Rows may carry `prompt` as a string (fed to the model as it is) or as a list of messages (see
`gspo.data.files.check_messages`). Everything downstream (rollout, evaluation, cold start, length filtering) works on
prompt strings, so `render_prompts` turns each conversation into the exact text a chat model expects:
`tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`. The messages stay on the row
under `messages`, so a reward function can read the conversation it scores.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from string import Formatter
from typing import Any, Literal

from gspo.data.files import check_messages

__all__ = ["CHAT_MODES", "apply_prompt_template", "check_prompt_template", "render_chat", "render_prompts"]

log = logging.getLogger(__name__)

CHAT_MODES = ("auto", "always", "never")
# Arguments of `apply_chat_template` that `render_prompts` sets itself, so template_kwargs may not.
_RESERVED_KWARGS = frozenset({"conversation", "tokenize", "add_generation_prompt", "chat_template"})


def _read_template(chat_template: str | None, tokenizer: Any, where: str) -> str | None:
    """The template to render with: the file `chat_template` when given (None: the tokenizer's own). Raises when
    neither exists, since a conversation cannot become model text without one."""
    if chat_template is not None:
        path = Path(chat_template).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{where}: data.chat_template {chat_template!r} is not a file (a Jinja template)")
        return path.read_text(encoding="utf-8")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: the tokenizer has no chat template, so message prompts cannot be rendered; set "
                         "data.chat_template (gspo sft, gspo eval --data: --chat-template) to a Jinja template file, "
                         "or give the rows string prompts")
    return None


def render_prompts(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    mode: Literal["auto", "always", "never"] = "auto",
    system_prompt: str | None = None,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    where: str = "data",
) -> list[dict]:
    """New rows whose `prompt` is a string, rendering conversations with the chat template; `rows` are not mutated.

    `mode`: "auto" renders the rows whose prompt is a list of messages and leaves string prompts as they are;
    "always" also wraps a string prompt as one user message and renders it (how an embedded task is phrased to a
    chat model); "never" leaves strings alone and refuses conversations. A rendered row keeps its messages (as they
    were, without `system_prompt`) under `messages`. `system_prompt` is prepended as a system message to a
    conversation that has none. `chat_template` is a Jinja file that replaces the tokenizer's template (None: the
    tokenizer's). `template_kwargs` (e.g. `{"enable_thinking": False}`) are passed to the template. `where` names the
    rows in errors (e.g. "data.path train rows").

    Raises ValueError naming the row for a conversation under mode "never", a malformed message list, or a template
    that fails or renders nothing; ValueError naming `data.chat_template` when there is no template to render with.
    """
    if mode not in CHAT_MODES:
        raise ValueError(f"{where}: chat mode must be one of {list(CHAT_MODES)}, got {mode!r}")
    if system_prompt is not None and not (isinstance(system_prompt, str) and system_prompt.strip()):
        raise ValueError(f"{where}: data.system_prompt must be a non-empty string or null, got {system_prompt!r}")
    kwargs = dict(template_kwargs or {})
    if _RESERVED_KWARGS & set(kwargs):
        raise ValueError(f"{where}: data.chat_template_kwargs may not set {sorted(_RESERVED_KWARGS & set(kwargs))}: "
                         "render_prompts sets them itself")

    prompts = [row["prompt"] if "prompt" in row else row.get("messages") for row in rows]  # as `load_rows` reads
    for index, prompt in enumerate(prompts):
        if not (isinstance(prompt, list) or (isinstance(prompt, str) and prompt)):
            shown = "none" if prompt is None else f"{type(prompt).__name__} {prompt!r:.60}"
            raise ValueError(f"{where}: row {index} has no prompt (a non-empty string or a list of messages under "
                             f"'prompt', or messages under 'messages'): {shown}")
    is_chat = [isinstance(prompt, list) or mode == "always" for prompt in prompts]
    if mode == "never" and any(is_chat):
        index = is_chat.index(True)
        raise ValueError(f"{where}: row {index} has a list of messages as its prompt, but data.chat is 'never'; set "
                         "data.chat: auto to render conversations with the chat template")
    template = _read_template(chat_template, tokenizer, where) if any(is_chat) else None
    if system_prompt is not None and mode == "auto" and not all(is_chat):
        log.warning("%s: data.system_prompt is only added to conversations; %d string prompts are used as they are "
                    "(data.chat: always renders them as user messages too)", where, is_chat.count(False))

    rendered = []
    for index, (row, prompt, chat) in enumerate(zip(rows, prompts, is_chat, strict=True)):
        new = dict(row)
        if chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            messages = check_messages(messages, f"{where}: row {index} prompt")  # copies: the row keeps its own
            shown = messages
            if system_prompt is not None and not any(m["role"] == "system" for m in messages):
                shown = [{"role": "system", "content": system_prompt}, *messages]
            new["prompt"] = _render(tokenizer, shown, template, kwargs, f"{where}: row {index}")
            new["messages"] = messages
        rendered.append(new)
    return rendered


def _render(tokenizer: Any, messages: list[dict], template: str | None, kwargs: dict[str, Any], where: str) -> str:
    """One conversation as prompt text, ending with the template's generation prompt (the assistant turn opens)."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             chat_template=template, **kwargs)
    except Exception as exc:
        raise ValueError(f"{where}: the chat template failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: the chat template rendered {text!r}, not a non-empty prompt string")
    return text


def render_chat(data: Any, data_cfg: Any, tokenizer: Any, tools: list[dict] | None = None) -> Any:
    """`data` (a `DataSplits`) with its training and held-out rows rendered by `render_prompts` as the config's data
    section says (`data.prompt_template` first, then `chat`, `system_prompt`, `chat_template`,
    `chat_template_kwargs`), with `tools` (JSON schemas, `gspo.agent`) passed to the template as `tools` so that it
    describes them to the model. A render error (a row, a template) is a ConfigError naming the key. Called once the
    tokenizer is loaded, before prompts are measured."""
    from dataclasses import replace

    from gspo.config import ConfigError

    kwargs = dict(mode=data_cfg.chat, system_prompt=data_cfg.system_prompt, chat_template=data_cfg.chat_template,
                  template_kwargs={**data_cfg.chat_template_kwargs, **({"tools": tools} if tools else {})})
    template, fields = getattr(data_cfg, "prompt_template", None), getattr(data_cfg, "fields", None)
    if tools and data_cfg.chat == "auto" and not all(isinstance(r["prompt"], list) for r in data.train):
        log.warning("the tools are described to the model by the chat template, which renders only conversation rows "
                    "under data.chat: auto; string prompts are used as they are (data.chat: always renders them too)")
    try:
        train, heldout = (apply_prompt_template(rows, template, where, fields) if template else rows
                          for rows, where in ((data.train, "training rows"), (data.heldout, "held-out rows")))
        return replace(data, train=render_prompts(train, tokenizer, where="training rows", **kwargs),
                       heldout=render_prompts(heldout, tokenizer, where="held-out rows", **kwargs))
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"data: {e}") from None


def apply_prompt_template(rows: Sequence[Mapping[str, Any]], template: str, where: str = "data",
                          fields: Mapping[str, str] | None = None) -> list[dict]:
    """New rows whose `prompt` is `template` filled in with the row's fields (`str.format`), e.g. "What is {a} + {b}?
    Answer with just the number." for the addition task's rows: a phrasing for chat models without a new dataset.

    The template is checked first (`check_prompt_template`), then each row: a field the template names that a row
    lacks, one it cannot reach into (`{prompt.x}` on a string), or a conversation (a list of messages, which
    `str.format` would paste in as Python text) is a ValueError naming the row, the field and the template.
    `fields` (data.fields) lets the error for a column that data.fields renamed name the field to write instead."""
    names = check_prompt_template(template)
    return [{**row, "prompt": _fill(template, names, row, i, where, fields or {})} for i, row in enumerate(rows)]


def check_prompt_template(template: str) -> list[str]:
    """The fields `template` names (`{a}` gives "a", `{meta[level]}` gives "meta[level]"), after checking that it is
    a valid format string that names at least one field, each by name. A template that names none would make every
    prompt the same text; a positional `{}` / `{0}` has nothing to fill it. Raises ValueError saying which."""
    shown = f"data.prompt_template {template!r}"
    try:
        names = [name for _, name, _, _ in Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ValueError(f"{shown} is not a valid format string: {e}") from None
    if not names:
        raise ValueError(f"{shown} names no field, so every prompt would be this same text: name the rows' fields in "
                         "braces, e.g. 'Q: {prompt}' (a literal brace is written {{ or }})")
    positional = next((name for name in names if not _root(name) or _root(name).isdigit()), None)
    if positional is not None:
        raise ValueError(f"{shown} has the positional field {{{positional}}}: name a field of the rows instead, e.g. "
                         "{prompt}")
    return names


def _root(name: str) -> str:
    """The row field a format field starts from: "meta" for "meta[level]" or "meta.level"."""
    return re.split(r"[.\[]", name, maxsplit=1)[0]


def _fill(template: str, names: list[str], row: Mapping[str, Any], index: int, where: str,
          fields: Mapping[str, str]) -> str:
    """`template` filled in from `row` (row `index` of `where`), every field it names first checked to be there and to
    be text (not a conversation). Raises ValueError naming the rows, the row and the field."""
    shown = f"data.prompt_template {template!r}"
    for name in names:
        root = _root(name)
        if root not in row:
            renamed = {theirs: ours for ours, theirs in fields.items()}.get(root)
            hint = f"; data.fields renames the column {root!r} to {renamed!r}: write {{{renamed}}}" if renamed else ""
            raise ValueError(f"{where}: data.prompt_template names the field {root!r}, which row {index} does not have "
                             f"(its fields: {sorted(row)}){hint}")
        try:
            value, _ = Formatter().get_field(name, (), row)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: {shown} cannot fill in {{{name}}} from row {index}'s {root!r} "
                             f"({type(row[root]).__name__}): {type(e).__name__}: {e}") from None
        if _is_conversation(value):
            raise ValueError(f"{where}: {shown} fills in {{{name}}}, which in row {index} is a conversation (a list "
                             "of messages), not text: data.prompt_template applies to string prompts (a conversation "
                             "is rendered by the chat template; data.system_prompt adds a system message)")
    try:
        return template.format_map(row)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: {shown} cannot be filled in from row {index}: {type(e).__name__}: {e}") from None


def _is_conversation(value: Any) -> bool:
    """Whether `value` is a list of chat messages (objects with a role), as a conversation prompt is."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, Mapping) and "role" in m for m in value)
