"""A learned reward: a sequence-classification model with one output, scoring each completion in its conversation.

This is RLHF's reward model (a Bradley–Terry model such as Skywork-Reward or a `trl` RewardTrainer output): what
`rewards.functions` names as `model:PATH` (a local folder or a hub id), weighted and summed with the other rewards.
Each completion is scored as the conversation it ends: the row's messages (or its prompt as one user message), then
the completion as the assistant's reply, rendered with the reward model's own chat template (its tokenizer's, not the
policy's: a reward model was trained on its own format); a tokenizer without a template scores prompt + completion as
one text. The score is the model's output at the last token, as `AutoModelForSequenceClassification` computes it.

What would make its numbers silently wrong is refused when it loads: a folder without a trained score head (a causal
LM folder loads as a classifier with a randomly initialised head, and transformers only warns), and a head with more
than one output (a classifier, whose first logit is not a reward). A conversation longer than `max_length` tokens
(default: the model's position limit) loses its start, not the completion, and is counted (`truncated`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["RewardModel"]

log = logging.getLogger(__name__)


def auto_dtype(device: torch.device) -> str:
    """A reward model's dtype for `dtype: auto` on `device`: bfloat16 on a CUDA GPU that computes in it, float16 on
    one that does not (T4, V100: bf16 there is emulated or refused), float32 on the CPU."""
    if device.type != "cuda":
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"


class RewardModel:
    """A batched reward function (`gspo.rewards.batched`'s protocol) backed by a reward model.

    `name_or_path`: a local folder or hub id holding an `AutoModelForSequenceClassification` with `num_labels == 1`
    and its tokenizer. `device`: "auto" (CUDA when available, else CPU) or a torch device; `dtype`: "auto"
    (`auto_dtype`: bfloat16 on a CUDA GPU that has it, float16 on one without, float32 on CPU) or a dtype name;
    `batch_size`: conversations per forward (sorted by length, so padding is small); `max_length`: tokens per
    conversation (None: the model's `max_position_embeddings`).

    It runs in the calling thread (`inline`), outside the reward deadline: it is a forward pass, not user code that
    can hang. Raises ValueError naming the folder for a model that is not a one-output reward model.
    """

    batched = True  # called once per batch: self(prompts, completions, **columns) -> one score per completion
    inline = True  # runs in the caller's thread, outside `rewards.timeout_s` (see RewardRunner)
    after_thinking = True  # scores the reply after its reasoning block (gspo.rewards.thinking)

    def __init__(self, name_or_path: str, *, device: str | torch.device = "auto", dtype: str = "auto",
                 batch_size: int = 16, max_length: int | None = None, trust_remote_code: bool = False) -> None:
        from transformers import AutoModelForSequenceClassification

        from gspo.models import load_pretrained, resolve_dtype  # transformers: loaded when a reward model is built

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"reward model {name_or_path!r}: batch_size must be an int >= 1, got {batch_size!r}")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                       or max_length < 2):
            raise ValueError(f"reward model {name_or_path!r}: max_length must be an int >= 2 or None, "
                             f"got {max_length!r}")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = process_device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"reward model {name_or_path!r}: device {device!r} asked for, but torch sees no CUDA "
                             "GPU (rewards.reward_model.device: auto follows the trainer's device)")
        torch_dtype = resolve_dtype(auto_dtype(self.device) if dtype == "auto" else dtype)
        self.name = name_or_path
        model, tokenizer, info = load_pretrained(name_or_path, AutoModelForSequenceClassification, dtype=torch_dtype,
                                                 trust_remote_code=trust_remote_code)
        missing = sorted(info.get("missing_keys", ()))
        if missing:
            raise ValueError(
                f"{name_or_path!r} is not a reward model: its checkpoint has no trained weights for {missing} "
                f"(architectures {model.config.architectures}), which transformers would initialise at random. A "
                "reward model is a sequence-classification model with one output (AutoModelForSequenceClassification, "
                "num_labels=1), e.g. one trained with trl's RewardTrainer")
        if model.config.num_labels != 1:
            raise ValueError(
                f"{name_or_path!r} has {model.config.num_labels} outputs (a classifier); a reward model has one "
                "(num_labels=1). To reward with a classifier's probability, write a batched reward function "
                "(gspo.rewards.batched) that computes it")
        # The model reads each row's score at its last token that is not config.pad_token_id, and batches are padded
        # with the tokenizer's pad id: the two must agree, or a padded row is scored at its padding.
        if model.config.pad_token_id not in (None, tokenizer.pad_token_id):
            log.warning("reward model %r: its config's pad_token_id %s differs from its tokenizer's pad token id %s; "
                        "using the tokenizer's (batches are padded with it)", name_or_path,
                        model.config.pad_token_id, tokenizer.pad_token_id)
        model.config.pad_token_id = tokenizer.pad_token_id
        tokenizer.padding_side = "right"
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        limit = getattr(model.config, "max_position_embeddings", None)
        if max_length is not None and limit and max_length > limit:  # positions past it: a silently wrong score
            raise ValueError(f"reward model {name_or_path!r}: max_length {max_length} is beyond the model's "
                             f"position limit ({limit} tokens, max_position_embeddings)")
        self.max_length = max_length or (int(limit) if limit else None)
        self.truncated = 0  # conversations that lost their start to max_length, over the model's life

    def texts(self, prompts: Sequence[str], completions: Sequence[str],
              messages: Sequence[Any] | None = None) -> list[str]:
        """The text each completion is scored as: its conversation (`messages[i]` when given, else the prompt as one
        user message) with the completion as the assistant's reply, in the reward model's chat template; without a
        template, prompt + completion."""
        if not getattr(self.tokenizer, "chat_template", None):
            return [p + c for p, c in zip(prompts, completions, strict=True)]
        out = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            turns = messages[i] if messages is not None and messages[i] else [{"role": "user", "content": prompt}]
            conversation = [*turns, {"role": "assistant", "content": completion}]
            out.append(self.tokenizer.apply_chat_template(conversation, tokenize=False))
        return out

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids per text, the start cut where a text is longer than `max_length` (counted, warned once)."""
        template = bool(getattr(self.tokenizer, "chat_template", None))  # a template writes its own special tokens
        ids = self.tokenizer(texts, add_special_tokens=not template)["input_ids"]
        if self.max_length is not None:
            long = [i for i, row in enumerate(ids) if len(row) > self.max_length]
            if long and not self.truncated:
                log.warning("reward model %r: %d conversation(s) longer than %d tokens lost their start (the "
                            "completion is kept); raise rewards.reward_model.max_length if the model allows it",
                            self.name, len(long), self.max_length)
            self.truncated += len(long)
            for i in long:
                ids[i] = ids[i][-self.max_length:]
        return ids

    @torch.inference_mode()
    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]) -> list[float]:
        """One float32 score per completion, in order. `columns` are the rows' fields (their `messages`, when
        present, give the conversation)."""
        messages = columns.get("messages")
        ids = self._encode(self.texts(prompts, completions, messages if isinstance(messages, Sequence) else None))
        scores = [0.0] * len(ids)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # similar lengths share a batch
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            batch = self.tokenizer.pad({"input_ids": [ids[i] for i in chunk]}, return_tensors="pt").to(self.device)
            try:
                logits = self.model(**batch).logits
            except torch.OutOfMemoryError as exc:
                raise RuntimeError(
                    f"reward model {self.name!r} ran out of memory scoring {len(chunk)} conversations of up to "
                    f"{batch['input_ids'].shape[1]} tokens: lower rewards.reward_model.batch_size "
                    f"(now {self.batch_size}) or rewards.reward_model.max_length") from exc
            for i, value in zip(chunk, logits[:, 0].float().tolist(), strict=True):
                scores[i] = value
        return scores

    def __repr__(self) -> str:
        return f"RewardModel({self.name!r}, device={str(self.device)!r})"


def process_device(device: str | torch.device) -> torch.device:
    """`device`, with a bare "cuda" under torchrun meaning this process's GPU (LOCAL_RANK, modulo the GPUs torch
    sees): the current CUDA device, which is GPU 0 in a process that trains on the CPU, would put every process's
    reward model on GPU 0."""
    device = torch.device(device)
    local_rank = os.environ.get("LOCAL_RANK")
    if device.type == "cuda" and device.index is None and local_rank is not None and torch.cuda.device_count() > 0:
        return torch.device("cuda", int(local_rank) % torch.cuda.device_count())
    return device


def reward_model_options(options: Mapping[str, Any] | None, device: str | torch.device | None) -> dict[str, Any]:
    """`RewardModel` keyword arguments from the config's `rewards.reward_model` section (None: defaults), its
    `device: auto` meaning the trainer's `device` when one is given."""
    opts = dict(options or {})
    if opts.get("device", "auto") == "auto" and device is not None:
        opts["device"] = device
    return opts
