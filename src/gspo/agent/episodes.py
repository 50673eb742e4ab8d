"""The episode driver: multi-turn rollouts over the engine protocol, laid out as one `Trajectory` row per episode.

Turn by turn, every unfinished episode of the batch is continued in one `engine.generate` call (its context passed
as token ids, so the policy sees exactly the tokens it will be trained on, never a re-tokenised transcript):

    prompt ─ policy turn (loss 1, engine log-probs, version) ─ observation (loss 0) ─ policy turn ─ ... ─ final answer

The response of row i is everything after the prompt: policy tokens (`loss_mask` 1) and observation tokens
(`loss_mask` 0: attended to, never trained on; log-prob 0, version NO_VERSION). Each turn's environment reward sits on
that turn's last policy token in `token_rewards`; the trainer adds the final answer's reward (the run's reward
functions, on `completions[i]` = the final reply's text) at the episode's last policy token, so an episode's return is
`token_rewards[i].sum()`.

Limits, all recorded: `max_turns` policy turns (an episode still going then is cut: `turn_limit`); `max_tokens`
response tokens in all, policy and observation (`token_limit`: a turn is cut to what is left, an observation that
does not fit ends the episode). A policy turn cut at `max_new_tokens` without EOS ends its episode too (the model did
not finish its message); every such episode is `truncated`. Per-episode counts are in `extras["episode"]` [N, K]
(names in `extras["episode_keys"]`): turns, the limits hit, environment failures and the environment's own counts.

Observations given as chat messages are rendered with the tokenizer's chat template (`ChatFormat`): the text the
template puts after an assistant message (e.g. "<|im_end|>\\n", less the EOS the policy's turn ended with), then the
new messages and the generation prompt, exactly as `apply_chat_template` renders them after an assistant turn. The
EOS ids are the engine's (`eos_ids`: the tokenizer's and `generation_config`'s, e.g. Gemma's <end_of_turn>), so that
a turn ended by any token the engine stops at is recognised as ended, and that token's text is what the turn end
loses: the template's marker is never added a second time.
"""

from __future__ import annotations

import copy
import logging
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from gspo.agent.env import STEP_COUNTS, Environment, Step
from gspo.rewards.deadline import DeadlinePool
from gspo.rollout.base import SamplingParams
from gspo.schedule import derive_seed
from gspo.trajectory import NO_VERSION, Trajectory, pad_left, pad_right

__all__ = ["EPISODE_COUNTS", "ChatFormat", "EpisodeLimits", "EpisodeRunner", "count_metrics", "encode_demonstration",
           "episode_metrics", "failed_episodes"]

log = logging.getLogger(__name__)

EPISODE_COUNTS = ("turns", "turn_limit", "token_limit", "unfinished_turn", "env_failures", "env_timeouts")
"""Counts the driver keeps per episode (`env_timeouts`: the environment failures that were a step past
`step_timeout_s`); then `env.STEP_COUNTS` (tool use) and the names an environment class lists in its `counts`
attribute, summed from `Step.info`. The columns are fixed per runner, so batches concatenate."""

_DUMMY = "\x00gspo-content\x00"  # stands for an assistant message's content when locating the template's turn end


class ChatFormat:
    """How observation messages become tokens after a policy turn, from the tokenizer's chat template
    (`template`: a Jinja string replacing the tokenizer's; `template_kwargs`: extra template variables).

    `eos_ids`: the ids that end a policy turn (the engine's `eos_ids`; default the tokenizer's EOS). `turn_eos` is the
    one a demonstration's assistant turns end with (`encode_demonstration`): the EOS the template's turn end begins
    with (after any whitespace: Llama-2's " </s>"), e.g. Gemma's <end_of_turn> rather than its tokenizer's <eos>, so
    that cold-start SFT teaches the turn end the template (and the model's own chat training) uses; the tokenizer's
    EOS when the turn end begins with none (the driver then appends the whole turn end after it, as here)."""

    def __init__(self, tokenizer, template: str | None = None, template_kwargs: dict | None = None,
                 eos_ids: Sequence[int] | None = None) -> None:
        self.tokenizer, self.template, self.kwargs = tokenizer, template, dict(template_kwargs or {})
        self.base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _DUMMY}]
        rendered = self._render(self.base, False)
        self.turn_end = rendered[rendered.rindex(_DUMMY) + len(_DUMMY):]  # after an assistant message's content
        default = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        self.eos_ids = [int(i) for i in eos_ids] if eos_ids else default
        self.turn_eos = next((i for i in self.eos_ids if self._begins_turn_end(i)),
                             self.eos_ids[0] if self.eos_ids else None)

    def _begins_turn_end(self, token: int | None) -> bool:
        """Whether the template's turn end begins with `token`'s text, after any whitespace."""
        text = None if token is None else self.tokenizer.decode([token])
        return bool(text) and self.turn_end.lstrip().startswith(text)

    def end_after(self, ended: int | None) -> str:
        """The template's turn end after a policy turn whose last token is `ended` (None: the turn ended without
        one): less that token's text where the turn end begins with it (and the whitespace before it: the policy
        wrote its reply and that token with nothing between them); else the whole turn end."""
        if not self._begins_turn_end(ended):
            return self.turn_end
        return self.turn_end.lstrip()[len(self.tokenizer.decode([ended])):]

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.template,
                                                      add_generation_prompt=generation_prompt, **self.kwargs)
        except Exception as exc:
            raise ValueError(f"the chat template cannot render an episode's messages ({type(exc).__name__}: {exc})") \
                from None

    def observation_text(self, messages: list[dict], ended: int | None) -> str:
        """The text that follows a policy turn whose last token is the EOS `ended` (None: it ended without one): the
        template's end of the assistant turn (`end_after`: less that EOS's text), the `messages`, then the generation
        prompt."""
        rendered = self._render([*self.base, *messages], True)
        start = rendered.rindex(_DUMMY) + len(_DUMMY)
        if not rendered.startswith(self.turn_end, start):
            raise ValueError("the chat template renders an assistant turn's end differently when messages follow it; "
                             "gspo cannot place observation tokens after a policy turn with it")
        return self.end_after(ended) + rendered[start + len(self.turn_end):]

    def encode(self, observation: str | list[dict], ended: int | None) -> list[int]:
        """Token ids of an observation after a turn ended by EOS `ended` (or None): messages through
        `observation_text`, a string as it is."""
        text = observation if isinstance(observation, str) else self.observation_text(observation, ended)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_demonstration(fmt: ChatFormat, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
    """A multi-turn demonstration (the messages after the prompt: assistant turns, and tool / user messages between
    them) in the episode layout: (token ids, loss mask), assistant turns + `fmt.turn_eos` with mask 1, the rest 0.
    What the cold-start SFT trains on, so the policy learns exactly the layout the driver produces for a turn ended by
    that EOS: the template's own end of turn (the driver lays out a turn ended by another EOS just as well)."""
    tok, eos = fmt.tokenizer, fmt.turn_eos
    ids: list[int] = []
    mask: list[int] = []
    pending: list[dict] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            raise ValueError(f"demonstration message {i} must be {{'role': str, 'content': str}}, got {m!r}")
        if m["role"] == "assistant":
            if pending:
                obs = fmt.encode(pending, eos)
                ids += obs
                mask += [0] * len(obs)
                pending = []
            turn = tok(m["content"], add_special_tokens=False)["input_ids"] + [eos]
            ids += turn
            mask += [1] * len(turn)
        else:
            if not ids:
                raise ValueError("a demonstration starts with an assistant message (the prompt holds what is before)")
            pending.append(m)
    if pending:
        raise ValueError("a demonstration ends with an assistant message (its final answer)")
    if not ids:  # nothing to train on: a batch of only such rows was a loss of 0/0 (NaN from then on)
        raise ValueError("a demonstration has at least one assistant message, got none")
    return ids, mask


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 4  # policy turns per episode
    max_tokens: int = 256  # response tokens per episode, policy and observation
    step_timeout_s: float | None = 60.0  # one environment step or reset (they run `workers` at a time)
    workers: int = 4  # environment steps (and resets) run at once
    # a reset that fails ends only its own episode (no tokens; counted in env_failures) instead of the run, unless
    # every reset of the batch fails (`env.on_failure: mask`, whose episodes leave the loss)
    isolate_resets: bool = False


@dataclass
class _Episode:
    env: Environment
    prompt: list[int]
    seed: int
    ids: list[int] = field(default_factory=list)
    loss: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    final: str = ""
    done: bool = False
    truncated: bool = False
    counts: dict[str, float] = field(default_factory=dict)

    def add(self, ids: list[int], logprobs: list[float] | None = None, versions: list[int] | None = None) -> None:
        """Append tokens: the policy's (with their engine log-probs and the policy version each was sampled with,
        which a partial rollout may change mid-turn) or, without log-probs, an observation's."""
        policy = logprobs is not None
        self.ids += ids
        self.loss += [int(policy)] * len(ids)
        self.logprobs += logprobs if policy else [0.0] * len(ids)
        self.versions += versions if policy else [NO_VERSION] * len(ids)
        self.rewards += [0.0] * len(ids)

    def stop(self, reason: str | None = None, truncated: bool = True) -> None:
        self.done, self.truncated = True, self.truncated or truncated
        if reason:
            self.counts[reason] = self.counts.get(reason, 0.0) + 1


class EpisodeRunner:
    """Runs batches of episodes on `engine` (any `RolloutEngine`); `make_env()` gives a fresh environment per
    episode; `fmt` renders message observations. `run` has the engine's `generate` contract, with rows instead of
    prompts: rows g·G .. g·G+G−1 are the G episodes of rows[g], each a function of `seeds[g]` and its index."""

    def __init__(self, engine, tokenizer, make_env: Callable[[], Environment], limits: EpisodeLimits,
                 fmt: ChatFormat | None = None) -> None:
        self.engine, self.tokenizer, self.make_env, self.limits = engine, tokenizer, make_env, limits
        eos = list(getattr(engine, "eos_ids", None) or [tokenizer.eos_token_id])  # the ids the engine stops at
        self.fmt = fmt or ChatFormat(tokenizer, eos_ids=eos)
        self.fmt.observation_text([{"role": "tool", "content": "x"}], self.fmt.turn_eos)  # a template that cannot: now
        self.pool = DeadlinePool(workers=limits.workers, timeout_s=limits.step_timeout_s)
        self.eos = set(eos)
        declared = env_counts(make_env())
        self.keys = (*EPISODE_COUNTS, *STEP_COUNTS, *(k for k in declared if k not in EPISODE_COUNTS + STEP_COUNTS))
        self._ignored: set[str] = set()
        self._failures_told: set[str] = set()  # kinds of environment failure already logged (each once)

    def run(self, rows: list[dict], group_size: int, seeds: list[int],
            params: SamplingParams | None = None) -> Trajectory:
        params = params or self.engine.params
        episodes = []
        for g, j, env, prompt, problem in self._reset(rows, group_size):
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            self._check_fits(ids, g, rows[g])
            episodes.append(_Episode(env, ids, derive_seed(seeds[g], "episode", j)))
            if problem is not None:  # isolated (`isolate_resets`): an episode of no tokens, its env failed
                episodes[-1].stop("env_failures", truncated=False)
                if "reset" not in self._failures_told:
                    self._failures_told.add("reset")
                    log.warning("%s; its episodes end before they start, counted in episode_env_failures (further "
                                "failed resets are counted, not logged)", problem)
        lim = self.limits
        for turn in range(lim.max_turns):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            self._policy_turn(active, turn, params)
            self._env_turn([e for e in active if not e.done], last=turn == lim.max_turns - 1)
        failed = sum(e.counts.get("env_failures", 0) > 0 for e in episodes)
        if failed == len(episodes) and "all" not in self._failures_told:
            self._failures_told.add("all")
            log.warning("every one of the %d episodes of a batch ended in an environment failure (counted in "
                        "episode_env_failures; the reasons are logged once each)", len(episodes))
        return self._layout(episodes, group_size)

    def _reset(self, rows: list[dict], group_size: int) -> list[tuple[int, int, Environment, str, str | None]]:
        """A fresh environment per episode and its reset prompt, as (row g, episode j, env, prompt, problem). The
        resets run in the steps' pool (`workers` at a time, each given `step_timeout_s`, as `_env_turn`'s steps): a
        reset that waits on a service does not hold the others up, nor the run forever. A reset that raises, hangs
        or returns no prompt string is a ValueError naming the row (without a prompt there is no episode), unless
        `isolate_resets`: then its episode gets the row's own prompt and the problem (None for the others), and
        only a batch whose every reset failed is the ValueError (a broken environment, not a flaky one)."""
        envs = [(g, j, self.make_env()) for g in range(len(rows)) for j in range(group_size)]
        rounds = max(1, math.ceil(len(envs) / self.limits.workers))
        # an environment that edits its row edits a copy
        outcomes = self.pool.map([(env.reset, (copy.deepcopy(rows[g]),), {}) for g, _, env in envs], rounds=rounds)
        problems = [self._reset_problem(g, outcome) for (g, _, _), outcome in zip(envs, outcomes, strict=True)]
        first = next((p for p in problems if p is not None), None)
        if first is not None and (not self.limits.isolate_resets or all(p is not None for p in problems)):
            error = next(o.error for o, p in zip(outcomes, problems, strict=True) if p is first)
            every = " (and every other reset of the batch failed)" if self.limits.isolate_resets else ""
            raise ValueError(first + every) from error
        return [(g, j, env, str(rows[g].get("prompt", "")) if p else o.value, p)
                for (g, j, env), o, p in zip(envs, outcomes, problems, strict=True)]

    def _reset_problem(self, g: int, outcome) -> str | None:
        """Why a reset's outcome gives no episode (it timed out, raised or returned no prompt string); None when it
        gives one."""
        if outcome.timed_out:
            return (f"the environment's reset on row {g} took longer than env.step_timeout_s="
                    f"{self.limits.step_timeout_s:g} s (resets run env.workers={self.limits.workers} at a time)")
        if outcome.error is not None:
            return f"the environment's reset failed on row {g} ({type(outcome.error).__name__}: {outcome.error})"
        if not isinstance(outcome.value, str) or not outcome.value:
            return f"the environment's reset returned {outcome.value!r} for row {g}, not a prompt string"
        return None

    def _check_fits(self, ids: list[int], g: int, row: dict) -> None:
        """Raise ValueError, naming the row and what to change, if a reset prompt of `ids` and the episode's token
        budget (env.max_tokens) cannot fit the engine's context together (its `max_context`, where it has one)."""
        limit = getattr(self.engine, "max_context", None)
        if limit is not None and len(ids) + self.limits.max_tokens > limit:
            raise ValueError(
                f"the environment's reset prompt for row {g} (prompt {str(row.get('prompt', ''))!r:.80}) has "
                f"{len(ids)} tokens; with env.max_tokens={self.limits.max_tokens} an episode needs "
                f"{len(ids) + self.limits.max_tokens} positions, more than the engine's {limit}: shorten what the "
                "environment's reset adds, lower env.max_tokens or data.max_prompt_tokens (`gspo train --check` "
                "measures the reset prompts)")

    def _calls(self, active: list[_Episode], left: list[int], max_new: int) -> list[tuple[list[int], int]]:
        """The generate calls of a policy turn, as (episodes, new tokens): usually one, with the largest budget any
        episode has left. An episode whose context would then pass the engine's `max_context` (it is near the limit
        and has little budget left, while another has much) waits for a later call with a smaller cap; the episode
        with the most budget left always fits its call (its reset prompt and whole budget fit: `_check_fits`)."""
        limit = getattr(self.engine, "max_context", None)
        todo, calls = list(range(len(active))), []
        while todo:
            cap = min(max_new, max(left[i] for i in todo))
            fits = [i for i in todo if limit is None or len(active[i].prompt) + len(active[i].ids) + cap <= limit]
            calls.append((fits, cap))
            todo = [i for i in todo if i not in fits]
        return calls

    def _policy_turn(self, active: list[_Episode], turn: int, params: SamplingParams) -> None:
        """The generate calls (`_calls`) of every active episode; each appends its reply (cut to its token budget)."""
        left = [self.limits.max_tokens - len(e.ids) for e in active]
        for members, cap in self._calls(active, left, params.max_new_tokens):
            traj = self.engine.generate([active[i].prompt + active[i].ids for i in members], 1,
                                        [derive_seed(active[i].seed, "turn", turn) for i in members],
                                        params=replace(params, max_new_tokens=cap)).to("cpu")  # one copy, then rows
            for row, i in enumerate(members):
                self._take_reply(active[i], traj, row, left[i])

    def _take_reply(self, e: _Episode, traj: Trajectory, i: int, left: int) -> None:
        """Episode `e` appends row `i` of `traj`, its reply, cut to the `left` tokens of its budget."""
        n = int(traj.completion_mask[i].sum())
        ids = traj.completion_ids[i, :n].tolist()
        e.counts["turns"] = e.counts.get("turns", 0.0) + 1
        if n > left:  # the episode's token budget ends inside this reply
            ids = ids[:left]
            e.add(ids, traj.logprobs[i, :left].tolist(), traj.versions[i, :left].tolist())
            e.final = self.tokenizer.decode([t for t in ids if t not in self.eos], skip_special_tokens=True)
            e.stop("token_limit")
            return
        e.add(ids, traj.logprobs[i, :n].tolist(), traj.versions[i, :n].tolist())
        e.final = traj.completions[i]
        if bool(traj.truncated[i]):
            e.stop("token_limit" if n == left else "unfinished_turn")

    def _env_turn(self, stepping: list[_Episode], last: bool) -> None:
        """Every stepping episode's environment takes its reply (`workers` at a time; each step given `step_timeout_s`
        from its start, each round of steps that much of the whole: a hung step frees its worker for the steps queued
        behind it after its own limit, `DeadlinePool`); observations that fit are appended; a failing environment
        ends only its own episode, not as a truncation (the policy did not run out of tokens), and the first failure
        of each kind is logged."""
        rounds = max(1, math.ceil(len(stepping) / self.limits.workers))
        outcomes = self.pool.map([(e.env.step, (e.final,), {}) for e in stepping], rounds=rounds)
        for e, outcome in zip(stepping, outcomes, strict=True):
            step = outcome.value
            why = self._step_problem(outcome)
            if why is not None:
                kind, reason = why
                if outcome.timed_out:
                    e.counts["env_timeouts"] = e.counts.get("env_timeouts", 0.0) + 1
                e.stop("env_failures", truncated=False)
                if kind not in self._failures_told:
                    self._failures_told.add(kind)
                    log.warning("an environment step failed: %s; its episode ends, counted in episode_env_failures "
                                "(further failures of this kind are counted, not logged)", reason)
                continue
            e.rewards[-1] += float(step.reward)
            for key, value in step.info.items():
                if key in self.keys:
                    e.counts[key] = e.counts.get(key, 0.0) + float(value)
                elif key not in self._ignored:
                    self._ignored.add(key)
                    log.warning("Step.info key %r is not counted: list it in the environment's `counts` attribute", key)
            if step.done:
                e.stop(truncated=False)
                continue
            if last:
                e.stop("turn_limit")
                continue
            try:
                ended = e.ids[-1] if e.ids and e.ids[-1] in self.eos else None  # the EOS the turn ended with
                obs = self.fmt.encode(step.observation or "", ended)
            except (ValueError, TypeError, KeyError) as exc:  # messages this template cannot render: this episode's
                e.stop("env_failures", truncated=False)
                if "observation" not in self._failures_told:
                    self._failures_told.add("observation")
                    log.warning("an environment's observation %.80r cannot be encoded (%s: %s); its episode ends, "
                                "counted in episode_env_failures", step.observation, type(exc).__name__, exc)
                continue
            if len(e.ids) + len(obs) >= self.limits.max_tokens:  # no room for the observation and a reply
                e.stop("token_limit")
                continue
            e.add(obs)

    def _step_problem(self, outcome) -> tuple[str, str] | None:
        """(kind, reason) when a step's outcome cannot be used: it timed out, raised, or returned something other than
        a `Step` whose reward is a finite number, `done` a bool and `info` values finite numbers. None when it can."""
        if outcome.timed_out:
            return "timeout", (f"a step took longer than env.step_timeout_s={self.limits.step_timeout_s:g} s (the "
                               f"steps of a turn run env.workers={self.limits.workers} at a time)")
        if outcome.error is not None:
            exc = outcome.error
            return f"raised {type(exc).__name__}", f"step() raised {type(exc).__name__}: {exc}"
        step = outcome.value
        if not isinstance(step, Step):
            return "not a Step", f"step() returned {type(step).__name__} {step!r:.80}, not a gspo.agent.Step"

        def number(x) -> bool:
            return isinstance(x, numbers.Real) and math.isfinite(float(x))

        if not number(step.reward):
            return "reward", f"Step.reward is {step.reward!r:.80}, not a finite number"
        if not isinstance(step.done, bool):
            return "done", f"Step.done is {step.done!r:.80}, not True or False"
        if not isinstance(step.info, dict) or not all(number(v) for v in step.info.values()):
            return "info", f"Step.info is {step.info!r:.80}, not a dict of finite numbers"
        return None

    def _layout(self, episodes: list[_Episode], group_size: int) -> Trajectory:
        prompt_ids, prompt_mask = pad_left([e.prompt for e in episodes], self.engine.pad_id)
        ids, mask = pad_right([e.ids for e in episodes], self.engine.pad_id)

        def right(values: list[list], fill: float, dtype: torch.dtype) -> torch.Tensor:
            out = torch.full(ids.shape, fill, dtype=dtype)
            for i, v in enumerate(values):
                out[i, :len(v)] = torch.tensor(v, dtype=dtype)
            return out

        keys = self.keys
        return Trajectory(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=ids, completion_mask=mask,
            logprobs=right([e.logprobs for e in episodes], 0.0, torch.float32),
            truncated=torch.tensor([e.truncated for e in episodes], dtype=torch.bool),
            completions=[e.final for e in episodes],
            prompt_index=torch.arange(len(episodes) // group_size).repeat_interleave(group_size),
            loss_mask=right([e.loss for e in episodes], 0, torch.long),
            versions=right([e.versions for e in episodes], NO_VERSION, torch.long),
            token_rewards=right([e.rewards for e in episodes], 0.0, torch.float32),
            extras={"episode": torch.tensor([[e.counts.get(k, 0.0) for k in keys] for e in episodes]),
                    "episode_keys": tuple(keys)},
        )


def episode_metrics(traj: Trajectory) -> dict[str, float]:
    """`count_metrics` of a batch's episodes; empty for single-turn trajectories."""
    if "episode" not in traj.extras:
        return {}
    return count_metrics(traj.extras["episode"], traj.extras["episode_keys"])


def failed_episodes(traj: Trajectory) -> torch.Tensor | None:
    """[N] bool: the episodes their environment failed (`env_failures` counted); None for single-turn
    trajectories."""
    if "episode" not in traj.extras:
        return None
    column = traj.extras["episode_keys"].index("env_failures")
    return traj.extras["episode"][:, column] > 0


def env_counts(env: Environment) -> tuple[str, ...]:
    """The names an environment lists in its `counts` attribute (a string is one name, not its characters)."""
    declared = getattr(env, "counts", ())
    return (declared,) if isinstance(declared, str) else tuple(declared)


def count_metrics(counts: torch.Tensor, keys: Sequence[str]) -> dict[str, float]:
    """Means over episodes from their counts [N, K] (`extras["episode"]`): `episode_turns`, the rate of each limit
    and failure (`episode_turn_limit`, ...); with tools, `tool_calls` per episode, `tool_call_rate` (episodes with at
    least one call attempt), `tool_call_validity` (well-formed calls among the attempts; NaN without any) and
    `tool_failures` (calls that raised, timed out or returned non-text, among the well-formed); an environment's own
    counts (its `counts` attribute) as `env/<name>`, their mean per episode."""
    counts = counts.float().cpu()
    col = {k: counts[:, i] for i, k in enumerate(keys)}
    out = {"episode_turns": float(col["turns"].mean())}
    out.update({f"episode_{k}": float((col[k] > 0).float().mean()) for k in EPISODE_COUNTS[1:] if k in col})
    out.update({f"env/{k}": float(col[k].mean()) for k in keys if k not in EPISODE_COUNTS + STEP_COUNTS})
    if "tool_calls" in col:
        calls, zero = col["tool_calls"], torch.zeros_like(col["tool_calls"])
        invalid, failed = col.get("invalid_calls", zero).sum(), col.get("tool_failures", zero).sum()
        out.update(tool_calls=float(calls.mean()), tool_call_rate=float((calls > 0).float().mean()),
                   tool_call_validity=float(1 - invalid / calls.sum()) if calls.sum() else float("nan"),
                   tool_failures=float(failed / (calls.sum() - invalid)) if calls.sum() > invalid else 0.0)
    return out
