"""Multi-turn episodes: environments (`gspo.agent.env`), tools and their call formats (`gspo.agent.tools`), and the
episode driver over the rollout-engine protocol (`gspo.agent.episodes`). The trainer uses `build_env` and
`make_episode_runner` when a config has an `env` section."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from gspo.agent.env import Environment, Step, ToolEnv, make_env_factory
from gspo.agent.episodes import (
    ChatFormat,
    EpisodeLimits,
    EpisodeRunner,
    encode_demonstration,
    episode_metrics,
    failed_episodes,
)
from gspo.agent.tools import PARSERS, TOOLS, Tool, ToolCall, calc, resolve_tool, run_calls

if TYPE_CHECKING:
    from gspo.config import Config

__all__ = [
    "PARSERS",
    "TOOLS",
    "ChatFormat",
    "Environment",
    "EpisodeLimits",
    "EpisodeRunner",
    "Step",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "build_env",
    "calc",
    "encode_demonstration",
    "episode_metrics",
    "failed_episodes",
    "make_env_factory",
    "make_episode_runner",
    "resolve_tool",
    "run_calls",
    "run_chat_format",
]


def build_env(cfg: Config) -> tuple[Callable[[], Environment] | None, list[dict] | None]:
    """(a factory of one environment per episode, the tools' JSON schemas for the chat template) as the config's
    `env` section says; (None, None) without one. One environment is built here, before any compute: a constructor
    that raises (or does not take `env.options`), or an object without callable `reset` and `step`, is a
    ConfigError naming env.* now rather than a traceback after the model is built."""
    from gspo.config import ConfigError

    if cfg.env is None:
        return None, None
    try:
        make_env, schemas = make_env_factory(cfg.env, cfg.rewards.think_tags)
    except ValueError as exc:
        raise ConfigError(f"env: {exc}") from None
    try:
        env = make_env()
    except Exception as exc:
        raise ConfigError(f"env.name={cfg.env.name}: building an environment failed ({type(exc).__name__}: {exc}); "
                          "its settings come from env.options") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ConfigError(f"env.name={cfg.env.name}: {type(env).__name__} has no {' or '.join(missing)} method; an "
                          "environment has reset(row) -> prompt and step(reply) -> gspo.agent.Step")
    return make_env, schemas


def run_chat_format(cfg: Config, tokenizer, eos_ids: Sequence[int] | None = None) -> ChatFormat:
    """How the run renders observations (and multi-turn demonstrations): the data section's chat template (or the
    tokenizer's) with its `chat_template_kwargs`; `eos_ids`, the ids that end a turn (the engine's, or
    `gspo.rollout.assemble.eos_ids` of the model's generation_config: the tokenizer's EOS when None)."""
    from pathlib import Path

    d = cfg.data
    template = Path(d.chat_template).expanduser().read_text(encoding="utf-8") if d.chat_template else None
    return ChatFormat(tokenizer, template, d.chat_template_kwargs, eos_ids)


def make_episode_runner(cfg: Config, engine, tokenizer, make_env: Callable[[], Environment]) -> EpisodeRunner:
    """The run's episode driver on `engine`, with the config's limits and the run's chat format."""
    e = cfg.env
    return EpisodeRunner(engine, tokenizer, make_env,
                         EpisodeLimits(max_turns=e.max_turns, max_tokens=e.max_tokens,
                                       step_timeout_s=e.step_timeout_s, workers=e.workers,
                                       isolate_resets=e.on_failure == "mask"),
                         run_chat_format(cfg, tokenizer, getattr(engine, "eos_ids", None)))
