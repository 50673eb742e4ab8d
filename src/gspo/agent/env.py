"""The environment interface of multi-turn episodes, and the tool environment built on it.

An environment is one episode's world: `reset(row)` gives the first observation (the prompt the policy starts from),
`step(action_text)` takes the policy's reply and returns a `Step`: the observation the policy sees next, a reward
for this turn, and whether the episode is over. The episode driver (`gspo.agent.episodes`) calls them turn by turn
and owns the token layout, limits and failures; an environment only deals in text and messages.

    class Guess:                                   # a custom environment: env.name: my_envs:Guess
        def reset(self, row):
            self.secret = int(row["answer"]); return row["prompt"]
        def step(self, action):
            if action.strip() == str(self.secret):
                return Step(reward=1.0, done=True)
            return Step([{"role": "user", "content": "higher" if int(action) < self.secret else "lower"}])

An observation is a list of chat messages (rendered with the tokenizer's chat template as the turn after the
policy's reply) or a plain string (appended as it is). A step that raises, hangs past `env.step_timeout_s` or returns
something other than a `Step` ends that episode, counted (`env_failures`); the others go on. A reset that raises, hangs
past `env.step_timeout_s` or returns no prompt string stops the run, naming the row (there is no episode without it).

`ToolEnv` is the environment of tool use: each reply is parsed for tool calls (`gspo.agent.tools`); calls are run
and their results become `tool` messages; a reply without a call is the final answer and ends the episode, and the
run's reward functions score it. Turn rewards (`invalid_call_reward`, `tool_error_reward`, default 0) are optional
shaping, credited per turn by GSPO-token's advantages (`gspo.advantages.turn_advantages`). A reasoning model's calls
are read after its thinking block (`rewards.think_tags`, `gspo.rewards.thinking`), as vLLM's reasoning parser splits
the reasoning off before its tool parser runs: a call drafted inside the thought is not made, and a reply whose
reasoning never ended makes no call (it is an empty answer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gspo.agent.tools import PARSERS, ParsedCalls, Tool, run_calls
from gspo.rewards.deadline import DeadlinePool
from gspo.rewards.thinking import THINK_TAGS, final_answer

__all__ = ["STEP_COUNTS", "Environment", "Step", "ToolEnv", "make_env_factory"]

STEP_COUNTS = ("tool_calls", "invalid_calls", "tool_failures")
"""The per-turn counts `ToolEnv` reports in `Step.info` (an episode's are their sums over its turns)."""


@dataclass
class Step:
    """What an environment returns for one policy turn."""

    observation: str | list[dict] | None = None  # next input: chat messages or raw text; None (with done) for none
    reward: float = 0.0  # this turn's reward (the final answer's reward comes from the run's reward functions)
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)  # counts summed per episode into the metrics


class Environment(Protocol):
    def reset(self, row: dict) -> str:
        """The episode's first observation: the prompt text the policy starts from."""
        ...

    def step(self, action: str) -> Step:
        """The policy's reply (decoded, without EOS) → what happens next."""
        ...


class ToolEnv:
    """Tool use as an environment: replies with calls get the tools' results, a reply without one ends the episode."""

    def __init__(self, tools: Mapping[str, Tool], parse: Callable[[str, Mapping[str, Tool]], ParsedCalls],
                 pool: DeadlinePool, *, invalid_call_reward: float = 0.0, tool_error_reward: float = 0.0,
                 max_calls_per_turn: int = 4, max_chars: int = 2000,
                 think_tags: tuple[str, str] | None = THINK_TAGS) -> None:
        self.tools, self.parse, self.pool = tools, parse, pool
        self.invalid_call_reward, self.tool_error_reward = invalid_call_reward, tool_error_reward
        self.max_calls_per_turn, self.max_chars = max_calls_per_turn, max_chars
        self.think_tags, self.prompt = think_tags, ""

    def reset(self, row: dict) -> str:
        self.prompt = row["prompt"]  # whether its template leaves a thought open (R1-style), as each turn's does
        return row["prompt"]

    def step(self, action: str) -> Step:
        if self.think_tags is not None:
            action = final_answer(self.prompt, action, self.think_tags)
            if action is None:  # the reasoning never ended: no call, no answer
                return Step(done=True)
        parsed = self.parse(action, self.tools)
        if parsed.error is None and len(parsed.calls) > self.max_calls_per_turn:
            parsed = ParsedCalls(error=f"at most {self.max_calls_per_turn} tool calls per turn")
        if parsed.error is not None:
            return Step([{"role": "tool", "content": f"error: {parsed.error}"}], reward=self.invalid_call_reward,
                        info={"tool_calls": 1.0, "invalid_calls": 1.0})
        if not parsed.calls:
            return Step(done=True)
        results = run_calls(parsed.calls, self.tools, self.pool, self.max_chars)
        failed = sum(not r.ok for r in results)
        return Step([{"role": "tool", "name": c.name, "content": r.content}
                     for c, r in zip(parsed.calls, results, strict=True)],
                    reward=self.tool_error_reward * failed,
                    info={"tool_calls": float(len(results)), "tool_failures": float(failed)})


def make_env_factory(env_cfg: Any, think_tags: Any = THINK_TAGS
                     ) -> tuple[Callable[[], Environment], list[dict] | None]:
    """(a function making one fresh environment per episode, the tools' JSON schemas) as the config's `env` section
    says: `name: tools` builds a `ToolEnv` over `env.tools` with `env.parser`, reading calls after `think_tags` (the
    config's `rewards.think_tags`; None: whole replies), and returns their schemas, for the chat template; any other
    name is an import path `package.module:factory` called with `env.options` as keyword
    arguments (a class works; no schemas). Raises ValueError naming the setting that is wrong, e.g. a tool the
    `call` parser could never call successfully (`call_format_problem`)."""
    from gspo.agent.tools import call_format_problem, import_error, resolve_tool
    from gspo.rewards import resolve_reward

    if env_cfg.name == "tools":
        tools = {}
        for spec in env_cfg.tools:
            tool = resolve_tool(spec)
            if tool.name in tools:
                raise ValueError(f"env.tools names two tools called {tool.name!r}")
            if env_cfg.parser == "call" and (problem := call_format_problem(tool)):
                raise ValueError(f"env.tools ({spec}) with env.parser=call: {problem}")
            tools[tool.name] = tool
        # one pool for every episode's calls, a thread for each call that can run at once (env.workers steps of up
        # to max_calls_per_turn calls): a call starts when its step makes it, so tool_timeout_s is one turn's calls'
        # own time; with env.workers threads, calls queued behind other episodes' calls timed out
        pool = DeadlinePool(workers=env_cfg.workers * env_cfg.max_calls_per_turn, timeout_s=env_cfg.tool_timeout_s)
        parse, tags = PARSERS[env_cfg.parser], None if think_tags is None else tuple(think_tags)

        def make() -> ToolEnv:
            return ToolEnv(tools, parse, pool, invalid_call_reward=env_cfg.invalid_call_reward,
                           tool_error_reward=env_cfg.tool_error_reward, max_calls_per_turn=env_cfg.max_calls_per_turn,
                           max_chars=env_cfg.max_observation_chars, think_tags=tags)

        return make, [t.schema for t in tools.values()]
    try:
        factory = resolve_reward(env_cfg.name)  # the same import rules as rewards and tools
    except ValueError as exc:
        raise ValueError(import_error(exc, env_cfg.name, "env.name")) from None
    options = dict(env_cfg.options)
    return (lambda: factory(**options)), None
