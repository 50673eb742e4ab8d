"""Prepare GSM8K for the Qwen3 recipes (configs/qwen3-*.yaml): a saved DatasetDict with train/test splits.

    python scripts/prepare_gsm8k.py --out data/gsm8k            # downloads openai/gsm8k (config "main")
    python scripts/prepare_gsm8k.py --source DIR --out data/gsm8k   # from a DatasetDict saved with save_to_disk

Why a preparation step: `openai/gsm8k` has two configs (`main`, `socratic`), which `datasets.load_dataset` cannot
choose without a name; and its `answer` column is a worked solution ending in `#### 72`, while the `math` reward
wants the final answer alone. Columns written: `question` (original), `chat_prompt` (the conversation to prompt
with: one user message, the question and the instruction to box the answer), `final_answer` (the number after ####,
thousands separators removed) and `rationale` (the worked solution, calculator annotations <<...>> removed; usable as
`solution` for cold-start SFT). The recipes map them with `data.fields: {prompt: chat_prompt, answer: final_answer}`.

The chat template is not applied here: training renders the messages with the model's own template
(`gspo.data.render_prompts`, `data.chat`), so the data fits any chat model. For Qwen3 with thinking off, as the
recipes prompt it, set `data.chat_template_kwargs: {enable_thinking: false}`.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)
_CALCULATOR = re.compile(r"<<[^>]*>>")


def gsm8k_row(example: dict[str, Any]) -> dict[str, Any]:
    """One GSM8K example (`question`, `answer` = solution + '#### N') as the recipe's columns; `chat_prompt` is a
    list of messages, rendered at training time with the model's chat template."""
    match = _FINAL.search(example["answer"])
    if match is None:
        raise ValueError(f"GSM8K answer without a '#### N' final answer: {example['answer'][-80:]!r}")
    final = match.group(1).replace(",", "").strip()
    rationale = _CALCULATOR.sub("", example["answer"][:match.start()]).strip()
    question = example["question"].strip()
    return {
        "question": question,
        "chat_prompt": [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}],
        "final_answer": final,
        "rationale": f"{rationale}\nThe final answer is \\boxed{{{final}}}.",
    }


def prepare(source, out: str) -> dict[str, int]:
    """Map every split of `source` (a DatasetDict with GSM8K's columns) with `gsm8k_row` and save it to `out`;
    returns the number of rows per split."""
    columns = {split: ds.column_names for split, ds in source.items()}
    prepared = source.map(gsm8k_row, remove_columns=next(iter(columns.values())))
    prepared.save_to_disk(out)
    return {split: len(ds) for split, ds in prepared.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/gsm8k", help="output folder (datasets save_to_disk format)")
    parser.add_argument("--source", default=None, help="a saved DatasetDict instead of the hub's openai/gsm8k")
    args = parser.parse_args(argv)
    import datasets

    source = datasets.load_from_disk(args.source) if args.source else datasets.load_dataset("openai/gsm8k", "main")
    print(prepare(source, args.out))


if __name__ == "__main__":
    main()
