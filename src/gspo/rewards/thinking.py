"""What a reward judges when a model thinks before it answers: the text after its reasoning block.

Reasoning models (Qwen3, DeepSeek-R1 and its distillations, SmolLM3, QwQ) write `<think> … </think>` and then the
answer. A verifier run on the whole completion reads numbers out of the reasoning: a completion cut off by
`max_new_tokens` in the middle of its thought ("12 × 3 = 36. So the answer is 36. But wait,") is scored correct by
Math-Verify and by a last-number check, so RL would pay for thoughts that never finish and held-out accuracy would
count them as solved. A reward marked `after_thinking` (every built-in verifier, every reward model) therefore sees
`final_answer(prompt, completion)`: the text after the last close tag, the completion as it is when there is no
reasoning, and "" (no answer) when the reasoning never ended. Other reward functions (e.g. a format reward that
checks the tags) see the completion as generated, as in TRL.

Whether the completion starts inside a thought is read from the prompt: DeepSeek-R1-style templates end the
generation prompt with the open tag, so the completion holds only the close tag; Qwen3's template with
`enable_thinking: false` ends it with an empty, closed block, so the completion starts after it; a prompt that only
mentions the tags in its instructions opens nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["THINK_TAGS", "after_thinking", "check_think_tags", "final_answer", "judges_final_answer"]

THINK_TAGS = ("<think>", "</think>")

F = TypeVar("F", bound=Callable[..., Any])


def after_thinking(fn: F) -> F:
    """Mark a reward function (per-row or `batched`) as judging the answer only: the runner gives it
    `final_answer(prompt, completion)` in place of the completion, so that a thought cut off mid-way scores as an
    empty answer rather than by the numbers inside it::

        @after_thinking
        def exact_match(prompt, completion, **row):
            return float(completion.strip() == row["answer"])
    """
    fn.after_thinking = True  # type: ignore[attr-defined]
    return fn


def judges_final_answer(fn: Any) -> bool:
    """Whether reward `fn` is marked `after_thinking` (the built-in verifiers and reward models are)."""
    return getattr(fn, "after_thinking", False) is True


def check_think_tags(tags: Sequence[str] | None, where: str = "think_tags") -> tuple[str, str] | None:
    """`tags` as an (open, close) pair, or None (reasoning is not split off). Raises ValueError naming `where` unless
    they are two non-empty strings, neither inside the other (a close tag holding the open tag would read as both)."""
    if tags is None:
        return None
    if isinstance(tags, str) or len(tags) != 2 or not all(isinstance(t, str) and t.strip() for t in tags):
        raise ValueError(f"{where} must be two non-empty strings [open, close] (e.g. ['<think>', '</think>']) or "
                         f"null, got {tags!r}")
    opening, closing = tags
    if opening != opening.strip() or closing != closing.strip():
        raise ValueError(f"{where}: tags are matched exactly, so they may not start or end with whitespace, got "
                         f"{list(tags)!r}")
    if opening in closing or closing in opening:
        raise ValueError(f"{where}: neither tag may contain the other, got {list(tags)!r}")
    return opening, closing


def _opens_thought(prompt: str, tags: tuple[str, str]) -> bool:
    """Whether the generation prompt opens a reasoning block for the completion: it ends with the open tag (but for
    whitespace), as DeepSeek-R1-style templates do. A prompt that only mentions the tags ("think inside <think> tags,
    then answer") does not."""
    return prompt.rstrip().endswith(tags[0])


def final_answer(prompt: str, completion: str, tags: tuple[str, str] = THINK_TAGS) -> str | None:
    """The part of `completion` that answers: the text after its last close tag; the whole completion when it holds
    no tag and `prompt` does not open a reasoning block; None when the reasoning never ended (a tag opened in the
    completion, or by the end of the prompt, and not closed after). `tags` is (open, close)."""
    opening, closing = tags
    close = completion.rfind(closing)
    if close > completion.rfind(opening):
        return completion[close + len(closing):]
    if opening in completion or _opens_thought(prompt, tags):
        return None
    return completion
