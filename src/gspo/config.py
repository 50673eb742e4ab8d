"""Typed, validated run configuration: YAML file + dotted `key=value` overrides, checked before any compute.

Every section forbids unknown keys, so a typo is an error naming the key rather than a silently ignored setting.
Cross-field rules (an objective's advantage scale, rollout logprobs with truncated sampling, batch divisibility)
are checked here too, so an invalid combination cannot reach the trainer.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gspo.objectives import KL_ESTIMATORS, OBJECTIVES
from gspo.rewards import MODEL_PREFIX
from gspo.rewards.thinking import check_think_tags


def _allows_bool(annotation: Any) -> bool:
    return annotation is bool or annotation is Any or any(_allows_bool(arg) for arg in get_args(annotation))


class _Section(BaseModel):
    # Numbers are accepted for string fields: a YAML file's `out: 2024` is an int (an override keeps a string key's
    # text as given: `_parse_value`). No number may be infinite or NaN (YAML's .inf / .nan): `optim.lr=.inf` used
    # to train a model of NaN weights.
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)
    # Keys a validator filled in from other keys because they were left unset (an objective's eps, ...): saved as
    # null by `config_to_dict`, so that a saved config loaded with other settings derives them again.
    _derived: frozenset[str] = PrivateAttr(default=frozenset())

    def _changed(self, name: str) -> bool:
        """Whether key `name` differs from its default (a setting that must then be able to take effect)."""
        return getattr(self, name) != type(self).model_fields[name].default

    def _derive(self, name: str, value: Any) -> None:
        """Set the unset key `name` to `value`, derived from other keys (see `config_to_dict`)."""
        setattr(self, name, value)
        self._derived = self._derived | {name}

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic would read `true` as 1 for a number field: YAML's yes/no/on/off are booleans, so `eval_every: on`
        would silently mean 1, `betas: [no, 0.999]` (0.0, 0.999). A boolean is only accepted where the field takes
        one, also inside its lists and dicts."""
        found = _misplaced_bool(value, cls.model_fields[info.field_name].annotation)
        if found is not None:
            where, flag = found
            raise ValueError(f"got the boolean {str(flag).lower()}{f' at {where}' if where else ''}, which this key "
                             "does not take (YAML reads yes/no/on/off/true/false as booleans)")
        return value


def _misplaced_bool(value: Any, annotation: Any) -> tuple[str, bool] | None:
    """(where, the boolean) for a boolean in `value` at a place `annotation` takes none: "" for `value` itself,
    "['math']" or "[0]" inside a dict or list / tuple of the annotation's; None when there is none."""
    if isinstance(value, bool):
        return None if _allows_bool(annotation) else ("", value)
    arms = _arms(annotation)
    if Any in arms or not isinstance(value, (dict, list, tuple)):
        return None
    for key, item in value.items() if isinstance(value, dict) else enumerate(value):
        takes = []  # the annotations the arms give this item
        for arm in arms:
            origin, args = get_origin(arm), get_args(arm)
            if isinstance(value, dict) and origin is dict and args:
                takes.append(args[1])
            elif not isinstance(value, dict) and origin is list and args:
                takes.append(args[0])
            elif not isinstance(value, dict) and origin is tuple and args:
                takes.append(args[0] if args[-1] is Ellipsis else args[key] if key < len(args) else Any)
        found = [_misplaced_bool(item, a) for a in takes]
        if found and all(f is not None for f in found):
            return f"[{key!r}]{found[0][0]}", found[0][1]
    return None


class LoraConfig(_Section):
    """LoRA (through peft, `gspo.lora`): train low-rank adapters W + (alpha/r)·B·A on the frozen model instead of all
    its weights. Checkpoints hold the adapter; rollout engines get the merged weights; OUT/final/ is a peft adapter
    folder (plus OUT/final/merged/, a full model, with `merged_final`)."""

    r: int = Field(16, ge=1)  # the adapters' rank
    alpha: float = Field(32.0, gt=0)  # scale alpha/r of the adapter's output
    dropout: float = Field(0.0, ge=0, lt=1)  # dropout on the adapter's input (training forwards only)
    # module names (peft: a name matches if it equals the module's name or ends it after a dot, e.g. q_proj), or
    # "all-linear": every nn.Linear except the output head. MoE experts fused into 3-D weights are not nn.Linear.
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    merged_final: bool = False  # also write the merged full model to OUT/final/merged/ at the end

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and (not value or not all(name.strip() for name in value)):
            raise ValueError(f"must be \"all-linear\" or a non-empty list of module names, got {value!r}")
        return value


class ModelConfig(_Section):
    """The policy: a preset (`tiny-moe`, `tiny-dense`), a local HF model directory, or a hub id."""

    name: str = "tiny-moe"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False
    # the attention kernel of the trainer's forwards and the built-in sampler (transformers' attn_implementation):
    # None = the model's default (sdpa where it supports it); eager, sdpa, flash_attention_2 (the flash-attn package,
    # CUDA, bf16/fp16 compute), flex_attention, ... Checked when the model loads, before any compute.
    attn_implementation: str | None = Field(None, min_length=1)
    lora: LoraConfig | None = None  # train LoRA adapters instead of the full model (see LoraConfig)


SFT_LR = {"preset": 3e-3, "pretrained": 1e-5}
"""Supervised fine-tuning's learning rate for the tiny presets (random weights, a character vocabulary:
`cold_start.lr`'s default) and for a pretrained model (`gspo sft`'s default for any model that is not a preset): the
presets' rate took SmolLM2-135M-Instruct to 0 % accuracy in 3 steps."""


class ColdStartConfig(_Section):
    """Supervised fine-tuning on the data's `solution` field before RL (the paper starts RL from a cold-start model).
    Runs once, at the start of a fresh run, for `steps` or until `target_loss`; its model is saved to
    OUT/cold_start/ with what it did in OUT/cold_start/sft.json."""

    steps: int = Field(200, ge=1)
    target_loss: float | None = Field(None, gt=0)  # stop early once the ~20-step mean SFT loss reaches it
    batch_size: int = Field(64, ge=1)
    lr: float = Field(SFT_LR["preset"], gt=0)  # the presets' rate: a pretrained model needs ~1e-5 (warned)
    warmup_steps: int = Field(10, ge=0)
    # padded tokens per forward/backward: a batch with more runs in pieces whose gradients add up to its own
    micro_batch_tokens: int | None = Field(None, ge=1)


class DataConfig(_Section):
    """Prompts: an embedded task (`task`) or a file / saved dataset / hub dataset (`path`) with a field mapping.

    Held-out rows (evaluation) come from exactly one place, disjoint from the training rows (see
    `gspo.data.heldout`): the task's or dataset's `eval_split`; a separate file or dataset `eval_path`; or
    `eval_fraction` of `path`'s rows, held out by a hash of the prompt. A single jsonl / parquet file has no test
    split, so it needs `eval_path` or `eval_fraction` (or `eval_split: null`: no evaluation); with either of those,
    `eval_split` only picks the split of an `eval_path` dataset that has several. Setting `path` alone means no task
    (`task` defaults to `addition` only when `path` is not set)."""

    task: str | None = "addition"
    task_options: dict[str, Any] = Field(default_factory=dict)
    # a file or dataset, or several (concatenated; each row without a data_source field gets its source's name there)
    path: str | list[str] | None = None
    split: str = "train"
    eval_split: str | None = "test"
    # a held-out file or dataset, or several (each its own evaluation set: accuracy per file, gspo.data.heldout)
    eval_path: str | list[str] | None = None
    eval_fraction: float | None = Field(None, gt=0, lt=1)
    fields: dict[str, str] = Field(default_factory=dict)
    # A field of the held-out rows whose values split the held-out accuracy, e.g. data_source or level (each value
    # gets its accuracy and interval). None: no split, or with several eval_path files, one per file.
    eval_by: str | None = Field(None, min_length=1)
    # At most this many training / held-out rows (None: a file's or dataset's every row; an embedded task draws
    # gspo.data.TASK_ROWS). A cap keeps a sample by prompt hash (gspo.data.subset_rows), never the first rows.
    train_size: int | None = Field(None, ge=1)
    eval_size: int | None = Field(None, ge=1)
    # Prompts longer than this many tokens are skipped at load time (counted, logged, in summary.json). None: the
    # model's max_position_embeddings minus the tokens generated after the prompt (rollout or evaluation).
    max_prompt_tokens: int | None = Field(None, ge=1)
    # A phrasing of every row's prompt from its fields, e.g. "What is {a} + {b}?" (applied before the chat template,
    # gspo.data.chat.apply_prompt_template). None: the rows' own prompts.
    prompt_template: str | None = Field(None, min_length=1)
    # Chat templates (gspo.data.chat.render_prompts): "auto" renders message-list prompts, "always" string ones too.
    chat: Literal["auto", "always", "never"] = "auto"
    # A system message put first in every rendered conversation that has none (None: no system message added).
    system_prompt: str | None = Field(None, min_length=1)
    # A Jinja chat template file that replaces the tokenizer's own (None: the tokenizer's template).
    chat_template: str | None = None
    # Extra variables for the chat template, e.g. {enable_thinking: false} for Qwen3.
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("chat_template")
    @classmethod
    def _template_file(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).expanduser().is_file():
            raise ValueError(f"data.chat_template {value!r} is not a file: it must be the path of a Jinja chat "
                             "template (or null for the tokenizer's own)")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.path is not None and "task" not in self.model_fields_set:
            self.task = None  # `data.path` alone: the default task gives way
        if self.task is None and self.path is None:
            raise ValueError("set one of data.task (embedded task) and data.path (file or dataset)")
        if self.task is not None and self.path is not None:
            raise ValueError(f"set only one of data.task ({self.task!r}) and data.path ({self.path!r}): to train on "
                             "the file, set data.task: null or remove it")
        if self.task is not None and (self.eval_path is not None or self.eval_fraction is not None):
            raise ValueError("data.eval_path / data.eval_fraction are for data.path: an embedded task holds out its "
                             "own test split (data.eval_split)")
        if isinstance(self.path, list) and (not self.path or len(set(self.path)) < len(self.path)):
            raise ValueError(f"data.path: a list of training sources must name at least one, each once; got "
                             f"{self.path}")
        if isinstance(self.eval_path, list) and (not self.eval_path or len(set(self.eval_path)) < len(self.eval_path)):
            raise ValueError(f"data.eval_path: a list of held-out files must name at least one, each once; got "
                             f"{self.eval_path}")
        if self.eval_by is not None and self.eval_split is None and self.eval_path is None \
                and self.eval_fraction is None:
            raise ValueError(f"data.eval_by {self.eval_by!r} splits the held-out accuracy, but nothing is held out "
                             "(data.eval_split is null)")
        if self.eval_path is not None and self.eval_fraction is not None:
            raise ValueError("set at most one of data.eval_path (a held-out file) and data.eval_fraction (hold out a "
                             "fraction of data.path)")
        return self


class RewardModelConfig(_Section):
    """How every `model:PATH` reward in `rewards.functions` runs (gspo.rewards.model.RewardModel)."""

    batch_size: int = Field(16, ge=1)  # conversations per forward
    max_length: int | None = Field(None, ge=2)  # tokens per conversation; None: the model's position limit
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on CUDA (fp16 w/o bf16), fp32 on CPU
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: the trainer's device (each process's own GPU)
    trust_remote_code: bool = False


class CodeRewardConfig(_Section):
    """How the built-in `code` reward in `rewards.functions` runs: `gspo.rewards.code.make_code_reward`'s options (the
    sandbox's limits per call, what a passed case pays, the third-party modules the program and its tests may
    import); the defaults are the plain `code` reward's. Checked when the run starts, before any model is built."""

    timeout_s: float = Field(5.0, gt=0, allow_inf_nan=False)  # one call's wall clock, every stdin/stdout case included
    cpu_s: float = Field(5.0, gt=0, allow_inf_nan=False)  # CPU seconds (per stdin/stdout case)
    memory_mb: int = Field(512, ge=1)  # address space
    max_procs: int = Field(32, ge=1)
    case_timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False)  # None: timeout_s
    case_output_bytes: int = Field(1 << 20, ge=1)
    float_tolerance: float = Field(1e-6, ge=0, allow_inf_nan=False)
    partial_credit: bool = False  # the fraction of stdin/stdout cases passed instead of all-or-nothing
    strict_equality: bool = True  # the always-equal object hack refused (gspo.sandbox.process._HARNESS)
    # top-level modules of the trainer's environment the program and tests may import, e.g. [numpy, pandas]
    packages: list[str] = Field(default_factory=list)
    python: str | None = None  # the sandbox's interpreter (None: the trainer's, else a system python3)

    def options(self) -> dict[str, Any]:
        """The keyword arguments of `make_code_reward` set here (those left at their defaults omitted)."""
        out = self.model_dump(exclude_defaults=True)
        if "packages" in out:
            out["packages"] = tuple(out["packages"])
        return out


class RewardConfig(_Section):
    """Reward functions by registry name or import path, with weights; what to do when one fails.

    `timeout_s`: wall-clock limit of one batch's reward calls together (None: none), so a hanging reward costs a
    step at most that long: a call not finished by then is a failure handled by `on_error`, abandoned in its thread
    (see gspo.rewards.deadline). `workers`: threads running the calls of a batch at once (> 1 only pays for rewards
    that wait, such as `code`; the functions must then be thread-safe).

    `on_error`: `fail` stops the run (RewardFailure); `zero` scores the failed call 0 and trains on it; `mask` leaves
    a completion on which a call failed out of the loss and out of its group's baseline (a judge that timed out says
    nothing of the completion; counted in reward_failed_masked)."""

    functions: dict[str, float] = Field(default_factory=lambda: {"addition": 1.0})
    on_error: Literal["fail", "zero", "mask"] = "fail"
    timeout_s: float | None = Field(30.0, gt=0, allow_inf_nan=False)
    workers: int = Field(1, ge=1)
    # At the start of a run (and of a resume), score the accuracy reward on up to 200 rows' own answers, an empty
    # completion and another row's answer (gspo.rewards.checks): warnings in the log, `reward_check` in
    # summary.json. Off: for a reward whose calls are costly or counted.
    check: bool = True
    # What counts as solved (held-out accuracy, pass/fail counts): the unweighted value of `accuracy_reward` is at
    # least `accuracy_threshold`. None: the only function, or the only built-in verifier among several (with routes:
    # the built-in verifiers); so the weights of the other rewards (format, length, ...) never change what accuracy
    # means. A list (mixed data): each of them that scores a row must say solved.
    accuracy_reward: str | list[str] | None = None
    accuracy_threshold: float = Field(1.0, allow_inf_nan=False)
    # DAPO's soft overlong punishment (Eq. 13): a completion longer than max_new_tokens − overlong_buffer tokens gets
    # −overlong_penalty · (excess / overlong_buffer) added to its reward, −overlong_penalty at the budget.
    overlong_buffer: int | None = Field(None, ge=1)
    overlong_penalty: float = Field(1.0, gt=0, allow_inf_nan=False)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)  # options of `model:PATH` rewards
    code: CodeRewardConfig = Field(default_factory=CodeRewardConfig)  # options of the built-in `code` reward
    # A reasoning model's thinking block [open, close]: the built-in verifiers and reward models judge the text after
    # it, and a completion whose reasoning never ended has no answer (gspo.rewards.thinking); null: whole completions.
    think_tags: list[str] | None = Field(default_factory=lambda: ["<think>", "</think>"])
    # Mixed data (gspo.rewards.Routes): a row field, and for each of its values the functions that score such rows,
    # e.g. route_by: data_source, routes: {gsm8k: [math], apps: [code]}; a function no route lists scores every row.
    route_by: str | None = Field(None, min_length=1)
    routes: dict[str, list[str]] | None = None

    @model_validator(mode="after")
    def _nonempty(self) -> RewardConfig:
        if not self.functions:
            raise ValueError("rewards.functions must name at least one reward function")
        if not any(self.functions.values()):
            raise ValueError(f"rewards.functions: every weight is 0 ({self.functions}), so every reward and advantage "
                             "would be 0 and nothing would train")
        check_think_tags(self.think_tags, "rewards.think_tags")
        for spec in self.functions:
            if spec.startswith(MODEL_PREFIX) and not spec[len(MODEL_PREFIX):].strip():
                raise ValueError(f"rewards.functions: {spec!r} names no reward model; write model:PATH (a folder "
                                 "holding a one-output sequence classifier, or a hub id)")
        if self.overlong_buffer is None and self._changed("overlong_penalty"):
            raise ValueError(f"rewards.overlong_penalty={self.overlong_penalty:g} is the size of the overlong penalty, "
                             "which is off without rewards.overlong_buffer (the tokens before the budget where it "
                             "ramps up): set overlong_buffer, or leave overlong_penalty out")
        if self.code.options() and "code" not in self.functions:
            raise ValueError(f"rewards.code sets {sorted(self.code.options())} for the built-in `code` reward, which "
                             f"rewards.functions {list(self.functions)} does not use: add code there, or leave "
                             "rewards.code out")
        if (self.route_by is None) != (self.routes is None):
            raise ValueError("rewards.route_by (a row field) and rewards.routes (its values → reward functions) go "
                             "together: set both or neither")
        if self.routes is not None:
            listed = {name for route in self.routes.values() for name in route}
            if not self.routes or not all(self.routes.values()) or listed - set(self.functions):
                unknown = sorted(listed - set(self.functions))
                raise ValueError(f"rewards.routes must map each value of {self.route_by!r} to a non-empty list of "
                                 f"rewards.functions {list(self.functions)}" + (f"; unknown: {unknown}" if unknown
                                                                                else ""))
        accuracy = resolve_accuracy_reward(list(self.functions), self.accuracy_reward, key="rewards.accuracy_reward",
                                           routed=self.routes is not None)
        if self.accuracy_reward is None:
            self._derive("accuracy_reward", accuracy)
        else:
            self.accuracy_reward = accuracy
        if "accuracy_threshold" not in self.model_fields_set:
            check_model_threshold(self.accuracy_reward, "rewards.accuracy_threshold")
        return self


# the built-in rewards: 1.0 exactly when the answer is right
VERIFIERS = ("addition", "code", "countdown", "last_number", "math")


def check_model_threshold(accuracy_reward: str | list[str], key: str) -> None:
    """Raise ValueError when accuracy would be decided by a reward model at the default threshold: 1.0 means
    "solved" for a verifier, but is an arbitrary line on a learned score, and the held-out "accuracy" it gave would
    look like a measurement. `key` names the setting that fixes it."""
    for name in [accuracy_reward] if isinstance(accuracy_reward, str) else accuracy_reward:
        if name.startswith(MODEL_PREFIX):
            raise ValueError(f"held-out accuracy would count the completions that the reward model {name!r} "
                             f"scores >= 1.0, an arbitrary line for a learned score: set {key} to the score that "
                             "counts as a success, or name a verifier (e.g. math) as the accuracy reward")


def resolve_accuracy_reward(functions: list[str], chosen: str | list[str] | None, key: str,
                            routed: bool = False) -> str | list[str]:
    """The reward(s) whose value decides correctness: `chosen` (one of `functions`, or a list of them for mixed
    data), else the only function, else the only built-in verifier among them, else with `routed` (rewards.routes:
    each row is scored by its own verifier) the built-in verifiers. Raises ValueError naming `key` when that is
    ambiguous."""
    if isinstance(chosen, list):
        unknown = [name for name in chosen if name not in functions]
        if not chosen or unknown or len(set(chosen)) < len(chosen):
            raise ValueError(f"{key} {chosen} must list reward functions of {functions}, each once"
                             + (f"; unknown: {unknown}" if unknown else ""))
        return chosen[0] if len(chosen) == 1 else list(chosen)
    if chosen is not None:
        if chosen not in functions:
            raise ValueError(f"{key} {chosen!r} is not one of the reward functions {functions}")
        return chosen
    if len(functions) == 1:
        return functions[0]
    verifiers = [f for f in functions if f in VERIFIERS]
    if len(verifiers) == 1 or (routed and verifiers):
        return verifiers[0] if len(verifiers) == 1 else verifiers
    raise ValueError(f"{key}: with several reward functions {functions}, name the one that decides whether an answer "
                     "is correct (accuracy = its unweighted value >= rewards.accuracy_threshold; a list for mixed "
                     "data with rewards.routes)")


def accuracy_means(accuracy_reward: str | list[str], threshold: float) -> str:
    """What "solved" means, for records and reports: "math >= 1", or for mixed data "math | code >= 1"."""
    names = [accuracy_reward] if isinstance(accuracy_reward, str) else accuracy_reward
    return f"{' | '.join(names)} >= {threshold:g}"


class VLLMConfig(_Section):
    """Settings of the vLLM rollout engines (`rollout.engine: vllm | vllm_server`); the hf engine ignores them.

    vllm (colocated): an in-process `vllm.LLM` per training process, sharing its GPU with the trainer, so
    `gpu_memory_utilization` (the fraction of the GPU vLLM may take for weights + KV cache) must leave room for
    training. vllm_server: a separately started `vllm serve` at `server_url`; new weights are written to
    `weight_sync_dir` (a folder the server must see at the same path) and reloaded there after every step.
    """

    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=1)  # None: the model's own limit (sizes the KV cache per sequence)
    enable_prefix_caching: bool = True  # the G samples of a prompt share its prefill
    enforce_eager: bool = False  # True skips CUDA-graph capture / compilation: slower sampling, faster start
    engine_args: dict[str, Any] = Field(default_factory=dict)  # further `vllm.LLM(...)` keyword arguments, as is
    # vllm_server: e.g. http://host:8000; with rollout.mode=async a list, one server per rollout worker
    server_url: str | list[str] | None = None
    weight_sync_dir: str | None = None  # vllm_server: default OUT/weight_sync
    request_timeout: float = Field(600.0, gt=0)  # vllm_server: seconds per HTTP request
    max_concurrent_requests: int = Field(64, ge=1)  # vllm_server: completion requests in flight per process

    @property
    def server_urls(self) -> list[str]:
        """`server_url` as a list (empty when unset)."""
        if self.server_url is None:
            return []
        return [self.server_url] if isinstance(self.server_url, str) else list(self.server_url)


class RolloutConfig(_Section):
    """The rollout engine and how it samples. `dtype` other than the model's makes it a separate engine copy."""

    engine: Literal["hf", "vllm", "vllm_server"] = "hf"
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    prompts_per_step: int = Field(8, ge=1)
    group_size: int = Field(8, ge=2)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(16, ge=1)
    stop: list[str] = Field(default_factory=list)
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    # The built-in engine's decode loop (gspo.rollout.sampler.DECODE_MODES): auto = compiled (static KV cache, CUDA
    # graphs) on CUDA for models that support it, dynamic (growing cache, finished rows dropped) elsewhere.
    decode: Literal["auto", "dynamic", "static", "compiled"] = "auto"
    # The built-in engine samples at most this many rows (completions) at once: a step's P × G rows run as batches of
    # whole groups (KV-cache memory follows this, not the rollout batch). None: all at once. vLLM schedules its own.
    max_batch_rows: int | None = Field(None, ge=1)
    # The compiled decode loop (rollout.decode: compiled, or auto on CUDA) keeps its static KV caches between rollouts,
    # since its CUDA graphs replay their addresses: 28 layers × 128 rows × 384 slots of the Qwen3-0.6B shape hold 5.6 GB
    # of bf16 K and V (11.3 GB in float32) through the updates. true: give that memory back after
    # each rollout (gspo.rollout.cache_memory; on CUDA the caches are unmapped and mapped again at the same addresses,
    # with torch_memory_saver: pip install torch_memory_saver). The other loops free their caches after every call.
    release_decode_cache: bool = False
    # sync: generate, then train on it, alternately (deterministic). async: rollout worker processes generate while
    # the learner trains (gspo.rollout.workers): a batch may have been sampled by a policy up to `max_staleness`
    # versions older than the one it trains; with `partial`, a generation in flight takes new weights as they come.
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = Field(1, ge=0)
    workers: int = Field(1, ge=1)
    worker_threads: int = Field(1, ge=1)
    partial: bool = True
    # DAPO's dynamic sampling: groups whose G rewards are all equal carry no signal (advantage 0); sample more prompts,
    # at most `dynamic_max_rounds` rounds per step, and train on P groups with varied rewards (gspo.rollout.dynamic;
    # with rollout.mode=async each worker fills its batch so).
    dynamic_sampling: bool = False
    dynamic_max_rounds: int = Field(4, ge=2)
    # Leave completions cut at max_new_tokens out of the loss (TRL's mask_truncated_completions, DAPO's overlong
    # filtering): their reward judges an unfinished answer. They still count in their group's advantages.
    overlong_filter: bool = False

    @field_validator("stop")
    @classmethod
    def _stops_nonempty(cls, stop: list[str]) -> list[str]:
        if any(not s for s in stop):
            raise ValueError(f"an empty stop string would end every completion before its first token: {stop}")
        return stop

    @model_validator(mode="after")
    def _decode_is_for_the_built_in_engine(self) -> RolloutConfig:
        if self.engine != "hf" and self.decode != "auto":
            raise ValueError(f"rollout.decode={self.decode} sets the built-in engine's decode loop; rollout.engine="
                             f"{self.engine} decodes on its own (leave rollout.decode at auto)")
        if self.engine != "hf" and self.max_batch_rows is not None:
            raise ValueError(f"rollout.max_batch_rows caps the built-in engine's batch; rollout.engine={self.engine} "
                             "schedules its own (vLLM: rollout.vllm.engine_args.max_num_seqs)")
        if self.release_decode_cache and (self.engine != "hf" or self.decode in ("dynamic", "static")
                                          or self.mode == "async"):
            raise ValueError("rollout.release_decode_cache gives back the memory of the built-in engine's compiled "
                             "decode loop between the rollouts and the updates of a sync run; with rollout.engine="
                             f"{self.engine}, rollout.decode={self.decode}, rollout.mode={self.mode} there is none to "
                             "give back: leave it out")
        if self.max_batch_rows is not None and self.max_batch_rows < self.group_size:
            raise ValueError(f"rollout.max_batch_rows={self.max_batch_rows} is less than one group "
                             f"(rollout.group_size={self.group_size}): a batch holds whole groups")
        if not self.dynamic_sampling and self._changed("dynamic_max_rounds"):
            raise ValueError(f"rollout.dynamic_max_rounds={self.dynamic_max_rounds} bounds the rounds of dynamic "
                             "sampling, which is off: set rollout.dynamic_sampling=true, or leave it out")
        async_only = {"max_staleness": 1, "workers": 1, "worker_threads": 1, "partial": True}  # their defaults
        changed = [k for k, default in async_only.items() if getattr(self, k) != default]
        if self.mode == "sync" and changed:
            raise ValueError(f"rollout.{', rollout.'.join(changed)} only apply to rollout.mode=async (this run is "
                             "sync): set rollout.mode=async, or leave them out")
        urls = self.vllm.server_urls
        if self.engine == "vllm_server" and self.mode == "async" and len(urls) not in (0, self.workers):
            raise ValueError(f"rollout.mode=async with rollout.engine=vllm_server gives each of the rollout.workers="
                             f"{self.workers} workers its own server: rollout.vllm.server_url lists {len(urls)} "
                             "(list one URL per worker)")
        if len(set(urls)) < len(urls):
            raise ValueError(f"rollout.vllm.server_url lists a server twice ({urls}): each rollout worker reloads its "
                             "own server with the weights it takes, so workers cannot share one")
        if self.mode == "async" and self.engine == "vllm_server" and self.partial:
            raise ValueError("rollout.partial (new weights taken between decode steps) needs an engine in the worker "
                             "process (hf or vllm); a vllm_server worker takes new weights between batches: set "
                             "rollout.partial=false")
        if self.mode == "sync" and len(urls) > 1:
            raise ValueError(f"rollout.vllm.server_url lists {len(urls)} servers; a list is for rollout.mode=async "
                             "(one server per rollout worker): give one URL")
        return self


class EnvConfig(_Section):
    """Multi-turn episodes (`gspo.agent`): the policy acts turn by turn in an environment, e.g. calling tools, and is
    trained on its own tokens only (observation tokens have loss mask 0). `name: tools` is tool use (`ToolEnv`) with
    `tools` (built-in names or `package.module:function`) whose calls are found by `parser`; any other name is an
    import path `package.module:factory` of your own environment, called with `options`. `rollout.max_new_tokens` is
    then the budget of one policy turn; `max_tokens` bounds a whole episode's response (policy and observation
    tokens). The run's reward functions score the final reply; the environment may add per-turn rewards, which
    objectives that take per-token advantages (gspo_token, grpo, ...) credit per turn (`turn_credit`,
    gspo.advantages.turn_advantages)."""

    name: str = "tools"
    tools: list[str] = Field(default_factory=lambda: ["calc"])
    parser: Literal["hermes", "call"] = "hermes"
    options: dict[str, Any] = Field(default_factory=dict)
    max_turns: int = Field(4, ge=1)
    max_tokens: int = Field(256, ge=2)
    max_calls_per_turn: int = Field(4, ge=1)
    max_observation_chars: int = Field(2000, ge=1)  # a tool's output beyond this is cut (with a note)
    tool_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)  # one turn's tool calls of an episode together
    step_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)  # one environment step or reset (workers at once)
    workers: int = Field(4, ge=1)  # environment steps run at once (each step's tool calls run at once too)
    invalid_call_reward: float = Field(0.0, allow_inf_nan=False)  # a turn whose call is malformed
    tool_error_reward: float = Field(0.0, allow_inf_nan=False)  # per call that raised, timed out or returned non-text
    turn_credit: bool = True  # per-token (reward-to-go) advantages for objectives that take them; False: Eq. 6's Â_i
    # An episode its environment failed (a step that raised, timed out or returned no usable Step; an observation the
    # chat template cannot render; a reset that failed: an episode of no tokens, unless every reset of the batch
    # failed): `mask` leaves it out of the loss and out of its group's baseline (the policy is not blamed for the
    # environment's fault; counted in env_failed_masked); `train` scores and trains it as it ended (a failed reset
    # stops the run there).
    on_failure: Literal["mask", "train"] = "mask"

    @model_validator(mode="after")
    def _known(self) -> EnvConfig:
        if self.name != "tools" and ":" not in self.name and "." not in self.name:
            raise ValueError(f"env.name must be 'tools' or an import path 'package.module:factory', got {self.name!r}")
        if self.name == "tools" and not self.tools:
            raise ValueError("env.tools must name at least one tool for env.name=tools")
        if self.name == "tools" and self.options:
            raise ValueError(f"env.options ({sorted(self.options)}) are for a custom environment (env.name: "
                             "package.module:factory); the tools environment takes the env.* settings")
        # a saved config (OUT/config.yaml) holds every key, the defaults of tools and parser included: only values
        # other than the defaults are a custom environment's mistake, so that a run's own config loads back
        defaults = {k: type(self).model_fields[k].get_default(call_default_factory=True) for k in ("tools", "parser")}
        if self.name != "tools" and (given := [k for k, v in defaults.items() if getattr(self, k) != v]):
            raise ValueError(f"env.{' and env.'.join(given)} are for env.name=tools; a custom environment takes its "
                             "settings from env.options")
        return self


class AlgorithmConfig(_Section):
    """The objective and how the rollout batch is used. eps_* default to the objective's paper values."""

    loss: str = "gspo"
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    minibatches: int = Field(4, ge=1)
    # Passes over each rollout batch (PPO's epochs: TRL's num_iterations, verl's ppo_epochs), each reshuffled into
    # `minibatches` updates against the same π_old. The paper makes one pass; every update after the first is
    # off-policy, so more passes clip more (watch clip_frac_tokens).
    epochs: int = Field(1, ge=1)
    eps_low: float | None = Field(None, ge=0, le=1)
    eps_high: float | None = Field(None, ge=0)
    advantage_scale: Literal["group", "batch", "none"] | None = None
    kl_beta: float = Field(0.0, ge=0)
    # The per-token KL estimator behind kl_beta (gspo.objectives.KL_ESTIMATORS): k3 (GRPO's; as a loss its expected
    # gradient is the forward KL's) or k2 (½ log² r; its expected gradient is the reverse KL's, KL(π_θ‖π_ref)).
    kl_estimator: Literal[tuple(KL_ESTIMATORS)] = "k3"  # type: ignore[valid-type]
    # MoE Routing Replay (§5.3): r2 replays the π_old forward's routing in the π_θ forwards; r3 replays the rollout
    # engine's routing (arXiv 2510.11370) in every training forward. Both need an MoE model with a router adapter.
    routing_replay: Literal["none", "r2", "r3"] = "none"
    # Train–inference mismatch correction (gspo.correction) by ρ = π_old/μ, μ the engine that sampled the tokens, at
    # the objective's ratio level (per token; per sequence for gspo/gspo_token, ρ's geometric mean): tis weights each
    # term by min(ρ, tis_cap), mask drops those with ρ outside mask_bounds (None: the level's default,
    # correction.DEFAULT_MASK_BOUNDS: [0.5, 2] at both levels, IcePop/MIS's; measured: [0.95, 1.05] on the geometric
    # mean dropped 32% of GSPO's tokens at staleness 2 in `gspo async-study`). auto: tis+mask when π_old is
    # recomputed and rollout.mode is async (μ is then an older policy), else off. Needs old_logprobs=recompute (with
    # rollout, π_old is μ); explicit tis/mask also apply in sync mode (e.g. against a bf16 engine's numerics).
    # tis_cap / mask_bounds that the resolved mode does not use (no TIS / no mask) are refused (`_check_correction`).
    mismatch: Literal["auto", "off", "tis", "mask", "tis+mask"] = "auto"
    tis_cap: float = Field(2.0, gt=1, allow_inf_nan=False)
    mask_bounds: tuple[float, float] | None = None

    @field_validator("mismatch", mode="before")
    @classmethod
    def _off_is_not_false(cls, value: Any) -> Any:
        """YAML reads an unquoted `off` as the boolean false: `mismatch: off` means "off"."""
        return "off" if value is False else value

    @model_validator(mode="after")
    def _check_mismatch(self) -> AlgorithmConfig:
        if self.old_logprobs == "rollout" and self.mismatch not in ("auto", "off"):
            raise ValueError(f"algorithm.mismatch={self.mismatch} corrects a recomputed π_old towards the rollout "
                             "engine's μ, but algorithm.old_logprobs=rollout takes π_old from the engine (π_old is μ, "
                             "ρ ≡ 1): use algorithm.old_logprobs=recompute, or algorithm.mismatch=off")
        if self.mask_bounds is not None:
            low, high = self.mask_bounds
            if not (0 < low < 1 < high < float("inf")):  # ρ = 1 (no mismatch) is always kept
                raise ValueError(f"algorithm.mask_bounds must satisfy 0 < low < 1 < high (finite), got [{low}, {high}]")
        spec = OBJECTIVES.get(self.loss)
        if spec is not None and "tis" in self.mismatch and spec.ratio_level == "token" and not spec.token_advantages:
            raise ValueError(f"algorithm.mismatch={self.mismatch}: token-level TIS scales the advantages per token, "
                             f"which algorithm.loss {self.loss} does not accept: use mismatch=mask")
        return self

    @model_validator(mode="after")
    def _resolve_defaults(self) -> AlgorithmConfig:
        # Everything objective-specific comes from its registry entry (gspo.objectives.Objective): no name here.
        spec = OBJECTIVES.get(self.loss)
        if spec is None:
            raise ValueError(f"algorithm.loss {self.loss!r} is not one of: {', '.join(OBJECTIVES)}")
        for name in ("eps_low", "eps_high", "advantage_scale"):
            if getattr(self, name) is None:
                self._derive(name, getattr(spec, name))
        if self.advantage_scale not in spec.allowed_scales:
            allowed = " or ".join(repr(s) for s in spec.allowed_scales)
            raise ValueError(f"algorithm.loss {self.loss} requires algorithm.advantage_scale {allowed}, got "
                             f"{self.advantage_scale!r} ({spec.summary})")
        return self


class OptimConfig(_Section):
    """AdamW with grad-norm clipping and linear warm-up then cosine decay (per optimizer step)."""

    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    # AdamW's moment decays, each in [0, 1) (torch refuses others only when the optimizer is built, after a cold start)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    grad_clip: float | None = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class LogConfig(_Section):
    tensorboard: bool = True
    wandb: dict[str, Any] | None = None
    mlflow: dict[str, Any] | None = None
    progress: bool = True
    # When stdout/stderr is not a terminal (a log file, a job scheduler) the bar is off and a one-line summary is
    # printed every `progress_every` steps instead (None: about 20 lines per run).
    progress_every: int | None = Field(None, ge=1)
    samples: int = Field(4, ge=0)  # held-out completions with their rewards logged at each evaluation (samples.jsonl)
    # Training completions logged at every step (rollouts.jsonl, TensorBoard text): the step's first groups, whole,
    # with each completion's reward and advantage, to see what the policy writes and what it is paid for. 0: off.
    rollouts: int = Field(0, ge=0)


class GuardConfig(_Section):
    """The collapse guard (gspo.guard): each step's reward, entropy, clip fraction, ratio extremes and finiteness
    against the median ± robust spread of the last `window` healthy steps; `patience` anomalous steps in a row are a
    collapse. action rollback: back to the last checkpoint before the collapse began, learning rate × `lr_factor`,
    at most `max_rollbacks` times, then stop; stop: status "collapsed" in summary.json; warn: log it and go on."""

    enabled: bool = True
    action: Literal["rollback", "stop", "warn"] = "rollback"
    window: int = Field(20, ge=3)
    warmup: int = Field(10, ge=3)  # healthy steps in the window before the relative rules apply
    patience: int = Field(3, ge=1)
    z: float = Field(3.0, gt=0)
    reward_drop: float = Field(0.5, gt=0, le=1)  # fraction of the best baseline reward the mean must lose
    entropy_factor: float = Field(2.0, gt=1)  # entropy below M / f or above M · f
    # ... and at least this many nats per token from M: a near-deterministic policy's entropy (0.013 → 0.041 nats on
    # a multi-turn run at 100 % accuracy) doubles without anything going wrong
    entropy_floor: float = Field(0.05, ge=0, allow_inf_nan=False)
    clip_jump: float = Field(0.25, gt=0, le=1)  # absolute rise of the clipped-token fraction
    ratio_jump: float = Field(10.0, gt=1)  # factor on the baseline |log ratio_max| (and |log ratio_min|)
    # a ratio_max below this (ratio_min above its inverse), or inside the objective's clip range, is never anomalous:
    # GSPO's sequence ratio reached 1.15 on healthy off-policy steps (async calculator runs, 10x its 1.005 median)
    ratio_floor: float = Field(1.25, gt=1)
    lr_factor: float = Field(0.5, gt=0, lt=1)
    max_rollbacks: int = Field(2, ge=0)

    @model_validator(mode="after")
    def _warmup_fits(self) -> GuardConfig:
        if self.warmup > self.window:
            raise ValueError(f"trainer.guard.warmup={self.warmup} cannot exceed trainer.guard.window={self.window}")
        return self


class TrainerConfig(_Section):
    steps: int | None = Field(None, ge=1)  # RL steps (None: 100, or as many as `epochs` takes)
    # Passes over the training rows instead of a step count: ceil(epochs × rows / rollout.prompts_per_step) steps,
    # counted once the rows are loaded (prompts too long skipped). Set at most one of steps and epochs.
    epochs: float | None = Field(None, gt=0, allow_inf_nan=False)
    seed: int = Field(0, ge=0, lt=2**32)  # the range `set_seed` accepts: checked here, before any compute
    out: str = "runs/gspo"
    eval_every: int = Field(10, ge=0)
    eval_max_new_tokens: int | None = Field(None, ge=1)
    # Held-out pass@k: sample this many completions per row at eval_temperature and log pass@k (unbiased estimator)
    # and maj@k for k = 1, 2, 4, ..., eval_samples besides `heldout_accuracy` (then the mean per-sample accuracy).
    # 1: greedy decoding, as before.
    eval_samples: int = Field(1, ge=1)
    eval_temperature: float = Field(1.0, gt=0)
    checkpoint_every: int = Field(50, ge=0)
    # Keep the policy of the evaluation with the highest held-out accuracy as OUT/best (a model folder like
    # OUT/final; summary.json's `best` says its step). Its accuracy on those rows is optimistic: it was chosen on them.
    save_best: bool = False
    keep_checkpoints: int = Field(2, ge=1)
    threads: int | None = Field(None, ge=1)
    # Multi-process training (`torchrun --nproc_per_node=N -m gspo train ...`): ddp replicates the model on every
    # process; fsdp shards parameters, gradients and optimizer state over them (FSDP2), for models that do not fit.
    parallel: Literal["ddp", "fsdp"] = "ddp"
    # bf16 compute over float32 weights (model.dtype float32): the policy's forwards and backwards run in bfloat16
    # (torch.autocast; under fsdp, FSDP2's MixedPrecisionPolicy with float32 gradient reduction), while weights,
    # gradients and AdamW stay float32 and the LM head's log-softmax runs in float32. The built-in sampler sharing the
    # weights (rollout.dtype unset or float32) samples under the same autocast: the policy it samples is the one
    # trained, on bf16 tensor cores with bf16 KV caches. float16: the same in float16 (GPUs without bf16: T4, V100),
    # with a dynamic loss scale (`gspo.optim.loss_scaler`; overflowed updates skipped and counted, not failures).
    mixed_precision: Literal["bfloat16", "float16"] | None = None
    # auto: this process's GPU (LOCAL_RANK) when every process on the machine has one, else the CPU (warned);
    # cuda: the same, but too few GPUs is an error (gspo.parallel.resolve_device)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Recompute each decoder layer's activations in the backward instead of keeping them (transformers' gradient
    # checkpointing, non-reentrant): less activation memory for ~1/3 more training compute. Sampling is unaffected (it
    # runs the model in eval mode, with its KV cache). Not with MoE routing replay (the recompute would not replay).
    gradient_checkpointing: bool = False
    # Compile each decoder layer with torch.compile for the training forwards and backwards (the cold start, π_old and
    # the updates; `gspo.models.compiled_layers`): a layer's ~740 eager ops become a few fused kernels, for GPUs where
    # a small model's update waits on the host dispatching ops. The first forwards compile (seconds per graph); the
    # values are those of eager mode within float rounding. Also the chunked head's float32 passes over each chunk of
    # logits, fused (`gspo.logprobs.fused_head`). Dense models only (MoE expert dispatch is refused); prompt sharing's
    # forwards (given a KV cache), sampling, evaluation and saving run the layers eager.
    compile: bool = False
    # Padded tokens (rows × their longest prompt + completion) one RL training forward/backward may hold (the cold
    # start has its own, cold_start.micro_batch_tokens): a minibatch share with more runs as micro-batches whose
    # gradients add up to its own (one optimizer step either way, the same update up to float rounding), so activation
    # memory is bounded by the budget, not by the rollout batch. None: a minibatch share in one forward. A row longer
    # than the budget runs alone.
    micro_batch_tokens: int | None = Field(None, ge=1)
    # Turn the model's dropout off for RL (after the cold start, which keeps it): with dropout π_θ is random, and the
    # on-policy minibatch's ratios π_θ/π_old are dropout noise instead of 1 — larger than GSPO's clip range (3e-4).
    disable_dropout: bool = True
    # Stop (TrainingError, summary.json with status "failed") after this many consecutive RL steps whose optimizer
    # updates were all skipped for a non-finite loss or gradient norm. None: never stop.
    max_bad_steps: int | None = Field(5, ge=1)
    guard: GuardConfig = Field(default_factory=GuardConfig)

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainerConfig:
        if self.steps is not None and self.epochs is not None:
            raise ValueError(f"set one of trainer.steps ({self.steps}) and trainer.epochs ({self.epochs:g}): the "
                             "other follows from the number of training rows")
        if self.epochs is None and self.steps is None:
            self._derive("steps", 100)
        if self.eval_samples == 1 and self._changed("eval_temperature"):
            raise ValueError(f"trainer.eval_temperature={self.eval_temperature:g} samples the held-out completions "
                             "when trainer.eval_samples > 1; with eval_samples=1 the evaluation decodes greedily: set "
                             "trainer.eval_samples=N, or leave eval_temperature out")
        return self


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    cold_start: ColdStartConfig | None = None
    data: DataConfig = Field(default_factory=DataConfig)
    rewards: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    env: EnvConfig | None = None  # multi-turn episodes (None: one completion per prompt)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        d = self.data
        if self.trainer.save_best and d.eval_split is None and d.eval_path is None and d.eval_fraction is None:
            raise ValueError("trainer.save_best keeps the policy with the best held-out accuracy, but nothing is held "
                             "out (data.eval_split is null): hold rows out (data.eval_path / data.eval_fraction)")
        rows = self.rollout.prompts_per_step * self.rollout.group_size
        if rows % self.algorithm.minibatches:
            raise ValueError(
                f"rollout batch of {rows} completions (prompts_per_step {self.rollout.prompts_per_step} × group_size "
                f"{self.rollout.group_size}) does not split into algorithm.minibatches={self.algorithm.minibatches}"
            )
        if self.algorithm.old_logprobs == "rollout" and (self.rollout.top_p < 1 or self.rollout.top_k > 0):
            raise ValueError(
                "algorithm.old_logprobs=rollout takes π_old from the sampler, whose top-p/top-k truncated distribution "
                "is not the policy π_θ is trained as: use top_p=1 and top_k=0, or old_logprobs=recompute"
            )
        cap = self.rollout.max_batch_rows
        if cap is not None and self.trainer.eval_samples > cap:
            raise ValueError(f"trainer.eval_samples={self.trainer.eval_samples} completions of one held-out prompt "
                             f"are one group, more than rollout.max_batch_rows={cap}: a batch holds whole groups. "
                             "Raise rollout.max_batch_rows or lower trainer.eval_samples")
        replay = self.algorithm.routing_replay
        if replay == "r2" and self.algorithm.old_logprobs != "recompute":
            raise ValueError("algorithm.routing_replay=r2 replays the routing of the trainer's π_old forward, which "
                             "old_logprobs=rollout skips: use old_logprobs=recompute, or routing_replay=r3 (the "
                             "rollout engine's routing)")
        if replay == "r3" and self.env is not None:
            raise ValueError("algorithm.routing_replay=r3 replays the routing the engine recorded for each completion; "
                             "a multi-turn episode (env) is laid out from several generations and keeps none of it, "
                             "so nothing would be replayed: use routing_replay=r2 (the trainer's π_old routing)")
        if replay != "none" and self.trainer.gradient_checkpointing:
            raise ValueError(f"algorithm.routing_replay={replay} replays the routing inside each forward, which "
                             "trainer.gradient_checkpointing would recompute in the backward without it: turn one off")
        if self.model.lora is not None and self.model.lora.dropout > 0 and self.trainer.disable_dropout:
            raise ValueError(f"model.lora.dropout={self.model.lora.dropout:g} with trainer.disable_dropout=true: the "
                             "adapters' dropout would be turned off. Set model.lora.dropout=0 (dropout makes π_θ "
                             "random: the on-policy ratios become noise larger than GSPO's clip range), or "
                             "trainer.disable_dropout=false to train with it anyway")
        _check_correction(self)
        _check_scaling(self)
        # Whether the model supports routing replay is not checked here (validation builds no model): the trainer's
        # start checks call gspo.moe.replay_support_error, before anything is written or loaded.
        return self


def _check_correction(cfg: Config) -> None:
    """Refuse algorithm.mask_bounds / tis_cap (other than its default) when the run's mismatch correction, as the
    trainer resolves it (`gspo.correction.resolve_correction`), has no mask / no TIS to use them in: "auto" is off
    in a sync run and with π_old from the engine."""
    from gspo.correction import resolve_correction

    algo, mode = cfg.algorithm, cfg.rollout.mode
    correction = resolve_correction(algo.mismatch, OBJECTIVES[algo.loss], recompute=algo.old_logprobs == "recompute",
                                    asynchronous=mode == "async", tis_cap=algo.tis_cap, mask_bounds=algo.mask_bounds)
    why = f"algorithm.mismatch={algo.mismatch}"
    if algo.mismatch == "auto":
        why += (" (a correction only with algorithm.old_logprobs=recompute and rollout.mode=async; this run: "
                f"{algo.old_logprobs}, {mode}{'' if correction is None else f': {_correction_words(correction)}'})")
    if algo.mask_bounds is not None and (correction is None or correction.bounds is None):
        raise ValueError(f"algorithm.mask_bounds is set but {why} masks nothing: use mismatch=mask or tis+mask, or "
                         "remove mask_bounds")
    if algo._changed("tis_cap") and (correction is None or correction.tis_cap is None):
        raise ValueError(f"algorithm.tis_cap={algo.tis_cap:g} is set but {why} weights nothing (no TIS): use "
                         "mismatch=tis or tis+mask, or remove tis_cap")


def _correction_words(correction: Any) -> str:
    """A resolved `gspo.correction.Correction` as its mismatch mode: tis, mask or tis+mask."""
    return "+".join(kind for kind, on in (("tis", correction.tis_cap), ("mask", correction.bounds)) if on is not None)


def _check_scaling(cfg: Config) -> None:
    """Cross-field rules of the rollout engine and the parallel training settings."""
    ro, tr = cfg.rollout, cfg.trainer
    urls = ro.vllm.server_urls
    if ro.engine == "vllm_server" and not urls:
        raise ValueError("rollout.engine=vllm_server needs rollout.vllm.server_url (e.g. http://host:8000)")
    if ro.engine != "vllm_server" and (urls or ro.vllm.weight_sync_dir):
        raise ValueError("rollout.vllm.server_url and weight_sync_dir are for rollout.engine=vllm_server, not "
                         f"{ro.engine}")
    for url in urls:
        if not re.match(r"^https?://[^/\s]+", url):
            raise ValueError(f"rollout.vllm.server_url must look like http://host:port, got {url!r}")
    if ro.engine == "vllm" and ro.vllm.max_model_len is not None:
        # an episode's later turns are prompted with the prompt plus everything before them: up to env.max_tokens
        key = "env.max_tokens" if cfg.env else "rollout.max_new_tokens / trainer.eval_max_new_tokens"
        longest = cfg.env.max_tokens if cfg.env else max(ro.max_new_tokens, tr.eval_max_new_tokens or 0)
        prompt, room = cfg.data.max_prompt_tokens, ro.vllm.max_model_len - longest
        if prompt is None or prompt > room:
            fix = (f"set data.max_prompt_tokens to at most {room} (longer prompts are then skipped at load time)"
                   if room >= 1 else f"lower {key}")
            raise ValueError(f"rollout.vllm.max_model_len={ro.vllm.max_model_len} must hold the longest prompt plus "
                             f"{longest} new tokens ({key}): {fix}")
    if cfg.rewards.overlong_buffer is not None and cfg.rewards.overlong_buffer > ro.max_new_tokens:
        raise ValueError(f"rewards.overlong_buffer={cfg.rewards.overlong_buffer} is longer than rollout.max_new_tokens="
                         f"{ro.max_new_tokens}: the penalty starts max_new_tokens − overlong_buffer tokens in")
    if cfg.env is not None:
        if cfg.rewards.overlong_buffer is not None:
            raise ValueError("rewards.overlong_buffer shapes single-turn completions; with env, limit episodes with "
                             "env.max_tokens / env.max_turns (rollout.overlong_filter drops truncated episodes)")
        if ro.max_new_tokens > cfg.env.max_tokens:
            raise ValueError(f"rollout.max_new_tokens={ro.max_new_tokens} (one policy turn) exceeds env.max_tokens="
                             f"{cfg.env.max_tokens} (a whole episode's response)")
    if tr.mixed_precision is not None and cfg.model.dtype != "float32":
        raise ValueError(f"trainer.mixed_precision={tr.mixed_precision} computes in low precision over float32 "
                         f"weights: it needs model.dtype=float32, not {cfg.model.dtype}")


class ConfigError(ValueError):
    """A configuration problem, with the offending key in the message."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """" (did you mean 'x'?)" for the choices closest to a mistyped `name` (difflib), else "" ."""
    close = difflib.get_close_matches(name, list(choices), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            msg, value = "unknown key" + _known_keys(e["loc"]), ""
        elif e["type"] == "value_error":  # our validators' messages name the keys; the input is a whole section
            msg, value = str(e.get("ctx", {}).get("error", e["msg"])), ""
        else:
            msg, value = e["msg"], f" (got {e.get('input')!r})"
            msg += _missing_space_hint(e["loc"], e.get("input"))
        lines.append(f"  {key}: {msg}{value}")
    return "invalid configuration:\n" + "\n".join(lines)


def _missing_space_hint(loc: tuple[int | str, ...], value: Any) -> str:
    """For a null value under a key holding a colon (`{last_number:1.0}`: YAML reads one key "last_number:1.0" with
    no value, since a flow mapping's colon needs a space after it), how to write what was meant."""
    last = str(loc[-1]) if loc else ""
    if value is not None or ":" not in last:
        return ""
    name, _, rest = last.rpartition(":")
    return f"; YAML reads {last!r} as one key with no value: write '{name}: {rest}', a space after the colon"


def _known_keys(loc: tuple[int | str, ...]) -> str:
    """For an unknown key at `loc`: its section's closest keys, " (did you mean 'group_size'?)", or when none is
    close, the keys the section takes."""
    parent = _annotation_at([str(p) for p in loc[:-1]])
    section = next((a for a in _arms(parent) if isinstance(a, type) and issubclass(a, _Section)), None)
    if section is None:
        return ""
    keys = list(section.model_fields)
    where = ".".join(str(p) for p in loc[:-1]) or "a config"
    return did_you_mean(str(loc[-1]), keys) or f" ({where} takes: {', '.join(keys)})"


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader (YAML 1.1), except that `1e-3` / `3E4` (exponent, no dot) are floats as in YAML 1.2 and
    Python, not strings: otherwise an override `optim.lr=1e-3` or a `task_options` value would be read as text."""


def _construct_unique_mapping(loader: _YamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    """A mapping whose keys are unique: YAML would let a repeated section silently replace the first one. Merge keys
    (`<<: *defaults`) are left to SafeConstructor, which merges them under the mapping's own keys."""
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key].start_mark.line + 1}): a repeated key "
                "would silently replace the first; merge them", key_node.start_mark)
        seen[key] = key_node
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_YamlLoader)  # a SafeLoader subclass: no arbitrary objects


def _arms(annotation: Any) -> tuple[Any, ...]:
    """The types of a union annotation (`str | None` → str, NoneType), or the annotation alone."""
    return get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)


def _annotation_at(parts: list[str]) -> Any:
    """The type of the dotted key `parts` in `Config` (through sections and dict values, e.g. data.fields.prompt →
    str); None for a key it does not have."""
    annotation: Any = Config
    for part in parts:
        section = next((a for a in _arms(annotation) if isinstance(a, type) and issubclass(a, _Section)), None)
        if section is not None:
            if part not in section.model_fields:
                return None
            annotation = section.model_fields[part].annotation
            continue
        mapping = next((a for a in _arms(annotation) if get_origin(a) is dict), None)
        if mapping is None:
            return None
        annotation = get_args(mapping)[1]
    return annotation


def _parse_value(text: str, annotation: Any = None) -> Any:
    """An override's value: parsed as YAML (numbers, booleans, null, lists, dicts; text that is not YAML stays a
    string), except for a key that takes a string (`annotation`): its text as given, since YAML would change or
    drop it (`007` → 7, `12:30` → 750, `runs/exp #2` → 'runs/exp', `#1 rule` → null, `Solve: {q}` → a dict). There,
    YAML still reads null / ~ (a key that takes none), a quoted string, and a list (a key that takes one)."""
    try:
        parsed = _yaml_load(text)
    except yaml.YAMLError:
        return text
    arms = _arms(annotation)
    if str not in arms or not text.strip() or (isinstance(parsed, str) and text.lstrip()[:1] in "'\""):
        return parsed
    if text.strip() in ("null", "Null", "NULL", "~") and type(None) in arms:
        return None
    if isinstance(parsed, list) and any(get_origin(a) is list for a in arms):
        return parsed
    return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides to a nested dict (in place); the value is parsed as YAML, but for a key that
    takes a string (`_parse_value`)."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if child is None:  # an empty section in the YAML file (`wandb:`) or one turned off (`cold_start=null`)
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(value, _annotation_at(parts))
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (or the defaults), apply overrides, validate. Raises ConfigError naming bad keys."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            hint = f" (a run's config is {path / 'config.yaml'})" if (path / "config.yaml").is_file() else ""
            raise ConfigError(f"config file {path} is a folder, not a YAML file{hint}")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = _yaml_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        except UnicodeDecodeError as e:
            line = path.read_bytes()[:e.start].count(b"\n") + 1
            raise ConfigError(f"config file {path}: line {line} is not UTF-8 text ({e.reason}); save it as UTF-8") \
                from None
        if data is None:  # an empty file (or comments only) would train the defaults, as if no config were named
            raise ConfigError(f"config file {path} is empty: it sets nothing, and the run would train the built-in "
                              "defaults (the tiny addition demo). Write your settings in it, or run `gspo demo` for "
                              "the defaults")
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    apply_overrides(data, overrides or [])
    return validate_config(data)


def validate_config(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def config_to_dict(cfg: Config, resolved: bool = False) -> dict[str, Any]:
    """Plain dict (JSON/YAML-safe) of a validated config, as OUT/config.yaml holds it: every key, with the defaults;
    but the keys that validation derives from other keys when they are left unset (an objective's eps_low, eps_high
    and advantage_scale, the accuracy reward, trainer.steps) are null, as given, so that the dict loaded again with
    other settings (another algorithm.loss) derives them again instead of keeping values that look set by the user.
    `resolved`: their derived values instead, what the run uses (to compare two configs: `config_diff`)."""
    data = cfg.model_dump(mode="json")
    if not resolved:
        _underive(cfg, data)
    return data


def _underive(section: _Section, data: dict[str, Any]) -> None:
    """Null the derived keys (`_Section._derive`) of `section` and its sub-sections in its dump `data`."""
    for name in section._derived:
        data[name] = None
    for name in type(section).model_fields:
        value = getattr(section, name)
        if isinstance(value, _Section):
            _underive(value, data[name])


def config_diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dicts."""
    keys = sorted(set(a) | set(b))
    diff = []
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            diff += config_diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            diff.append(f"{prefix}{k}")
    return diff
