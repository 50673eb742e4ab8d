"""Prompt data: procedural tasks with verifiable answers (`make_task`) and rows loaded from files or the hub
(`load_rows`). Rows are plain dicts with at least a `prompt`: a non-empty string, or a list of chat messages that
`render_prompts` turns into a string with the model's chat template once the tokenizer is loaded."""

from gspo.data.chat import render_chat, render_prompts
from gspo.data.files import load_rows
from gspo.data.heldout import (
    TASK_ROWS,
    DataSplits,
    eval_group_field,
    eval_groups,
    load_data,
    near_key,
    repeated_prompts,
    split_by_fraction,
    subset_rows,
)
from gspo.data.tasks import SPLITS, TASKS, Task, make_task, split_of

__all__ = [
    "SPLITS", "TASKS", "TASK_ROWS", "DataSplits", "Task", "eval_group_field", "eval_groups", "load_data", "load_rows",
    "make_task", "near_key", "render_chat", "render_prompts", "repeated_prompts", "split_by_fraction", "split_of",
    "subset_rows",
]
