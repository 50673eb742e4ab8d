"""Multi-turn episodes (gspo.agent): tool-call parsing and running, the chat-template observation layout, the episode
driver on the real built-in engine (layout, limits, failures), per-token advantages, that observation tokens never get
gradient, multi-turn cold-start demonstrations, and the trainer end to end with tools."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest
import torch

from conftest import DEMO, tiny_overrides, varied_reward
from gspo.advantages import group_advantages, turn_advantages
from gspo.agent import (
    ChatFormat,
    EpisodeLimits,
    EpisodeRunner,
    Step,
    Tool,
    ToolCall,
    ToolEnv,
    calc,
    encode_demonstration,
    episode_metrics,
)
from gspo.agent.env import make_env_factory
from gspo.agent.tools import TOOLS as BUILTIN_TOOLS
from gspo.agent.tools import parse_call, parse_hermes, resolve_tool, run_calls
from gspo.cli import main
from gspo.config import ConfigError, EnvConfig, load_config
from gspo.logprobs import completion_logprobs
from gspo.models import VOCAB_CHARS, build_preset, build_tokenizer
from gspo.objectives import OBJECTIVES
from gspo.rewards import REWARDS
from gspo.rewards.deadline import DeadlinePool
from gspo.rollout import HFSampler, SamplingParams, policy_weights
from gspo.sft import encode_pairs, sft
from gspo.trainer import train
from gspo.trajectory import NO_VERSION, Trajectory, pad_left, pad_right

TOOLS = {"calc": Tool.from_function(calc)}


# ---- tools -----------------------------------------------------------------------------------------------------------


def test_tool_schema_comes_from_the_signature_and_docstring():
    schema = TOOLS["calc"].schema["function"]
    assert schema["name"] == "calc"
    assert schema["parameters"]["required"] == ["expression"]
    with pytest.raises(ValueError, match="Args"):
        Tool.from_function(lambda x: x)


def test_calc_is_exact_and_refuses_what_is_not_arithmetic():
    assert calc("482*37") == "17834"
    assert calc("(12+3)*4-10/5") == "58"
    for bad, match in [("2**10", "only integers"), ("__import__('os')", "only integers"), ("7/2", "whole"),
                       ("1/0", "division by zero"), ("2*(3", "cannot parse")]:
        with pytest.raises((ValueError, ZeroDivisionError), match=match):
            calc(bad)


def test_hermes_parser_finds_calls_and_names_what_is_malformed():
    ok = parse_hermes('let me compute <tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>'
                      '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"4\\"}"}</tool_call>', TOOLS)
    assert ok.error is None
    assert ok.calls == (ToolCall("calc", {"expression": "2*3"}), ToolCall("calc", {"expression": "4"}))
    assert parse_hermes("the answer is 6", TOOLS).calls == () and parse_hermes("6", TOOLS).error is None
    assert "not valid JSON" in parse_hermes("<tool_call>{name: calc}</tool_call>", TOOLS).error
    assert "unknown tool 'sum'" in parse_hermes('<tool_call>{"name": "sum", "arguments": {}}</tool_call>', TOOLS).error
    assert "needs the argument" in parse_hermes('<tool_call>{"name": "calc", "arguments": {}}</tool_call>', TOOLS).error
    assert "has no argument(s) x" in parse_hermes(
        '<tool_call>{"name": "calc", "arguments": {"expression": "1", "x": 2}}</tool_call>', TOOLS).error
    assert parse_hermes('<tool_call>{"name": "calc", "arguments": {"expression": "1"}}', TOOLS).calls  # cut: ok


def test_hermes_parser_counts_json_past_the_interpreters_limits_as_malformed():
    """JSON that json.loads refuses with ValueError (an integer of more digits than int() takes) or RecursionError
    (arrays nested past the recursion limit) is a malformed call the model is shown, not an error of the episode."""
    digits = '<tool_call>{"name": "calc", "arguments": {"expression": ' + "1" * 5000 + "}}</tool_call>"
    nested = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    in_string = '<tool_call>{"name": "calc", "arguments": "' + "[" * 100_000 + '"}</tool_call>'
    assert "digits" in parse_hermes(digits, TOOLS).error
    assert "nests too deeply" in parse_hermes(nested, TOOLS).error
    assert "must be {" in parse_hermes(in_string, TOOLS).error  # arguments given as a JSON string that cannot be read
    env = ToolEnv(TOOLS, parse_hermes, DeadlinePool(1, 5.0), invalid_call_reward=-0.5, think_tags=None)
    env.reset({"prompt": "x"})
    step = env.step(nested)
    assert not step.done and step.reward == -0.5 and step.info["invalid_calls"] == 1


def test_call_parser():
    assert parse_call(" calc(482*37) ", TOOLS).calls == (ToolCall("calc", {"expression": "482*37"}),)
    assert parse_call("17834", TOOLS).calls == () and parse_call("17834", TOOLS).error is None
    assert parse_call("foo(1)", TOOLS).calls == ()  # not a tool: an answer
    assert "calc(<argument>)" in parse_call("calc(482*37) = 17834", TOOLS).error


def _raises(expression: str) -> str:
    """Fails.

    Args:
        expression: anything
    """
    raise RuntimeError("tool broke")


def _hangs(expression: str) -> str:
    """Hangs.

    Args:
        expression: anything
    """
    time.sleep(5)
    return "late"


def _number(expression: str) -> str:
    """Returns a number, not text.

    Args:
        expression: anything
    """
    return 42


def _long(expression: str) -> str:
    """Returns a lot.

    Args:
        expression: anything
    """
    return "x" * 60


def test_run_calls_isolates_a_tool_that_raises_hangs_or_returns_non_text():
    tools = {t.name: t for t in map(Tool.from_function, (calc, _raises, _hangs, _number, _long))}
    pool = DeadlinePool(workers=4, timeout_s=0.5)
    t0 = time.monotonic()
    results = run_calls([ToolCall(n, {"expression": "6*7"}) for n in ("calc", "_raises", "_hangs", "_number", "_long")],
                        tools, pool, max_chars=40)
    assert time.monotonic() - t0 < 3  # the hanging call costs the deadline, not its 5 s
    assert [r.status for r in results] == ["ok", "error", "timeout", "bad_return", "ok"]
    assert results[0].content == "42"
    assert results[1].content == "error: RuntimeError: tool broke"
    assert results[2].content.startswith("error: _hangs timed out")
    assert "returned int, not text" in results[3].content
    assert results[4].content == "x" * 40 + " [cut at 40 of 60 characters]"


def _echo(expression: str) -> str:
    """Returns its argument.

    Args:
        expression: anything
    """
    return expression


def _refuses(expression: str) -> str:
    """Raises with its argument as the message.

    Args:
        expression: anything
    """
    raise ValueError(expression)


def test_an_observation_of_exactly_max_chars_is_kept_whole_and_an_error_is_cut_to_it():
    """env.max_observation_chars bounds what the model is shown: output of exactly that many characters is shown as
    it is (no cut note, which would make it longer), one more character is cut, and a tool's exception message is
    held to the same bound; of a message of several lines, the first is shown."""
    tools = {t.name: t for t in map(Tool.from_function, (_echo, _refuses))}
    calls = [ToolCall("_echo", {"expression": "x" * 10}), ToolCall("_echo", {"expression": "x" * 11}),
             ToolCall("_refuses", {"expression": "y" * 50})]
    whole, cut, error = run_calls(calls, tools, DeadlinePool(workers=2, timeout_s=5.0), max_chars=10)
    assert whole.content == "x" * 10 and whole.ok
    assert cut.content == "x" * 10 + " [cut at 10 of 11 characters]"
    assert error.status == "error" and error.content == "error: ValueError: yyyyyyyyyy"[:10]
    (lines,) = run_calls([ToolCall("_refuses", {"expression": "what went wrong\n  details"})], tools,
                         DeadlinePool(workers=1, timeout_s=5.0))
    assert lines.content == "error: ValueError: what went wrong"  # a message's first line


def test_calc_keeps_signs_and_refuses_booleans_and_results_past_forty_digits():
    """A negated number stays negative; True is no integer; a result of 40 digits is given, one of 41 refused (the
    bound that keeps exponent blow-ups out); an expression of 201 characters is refused, one of 200 is not."""
    assert calc("-3*4") == "-12" and calc("2-(-3)") == "5"
    with pytest.raises(ValueError, match="only integers"):
        calc("True+1")
    forty = "9" * 40
    assert calc(f"{forty}*1") == forty
    with pytest.raises(ValueError, match="more than 40 digits"):
        calc(f"{forty}+1")
    assert calc("+".join(["1"] * 100) + "0") == "109"  # 200 characters
    with pytest.raises(ValueError, match="longer than 200 characters"):
        calc("+".join(["1"] * 100) + "+0")  # 201


def _sleeps(expression: str) -> str:
    """Outlives any short deadline.

    Args:
        expression: anything
    """
    time.sleep(2)
    return "late"


def _hermes(name: str, expression: str = "1") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def test_tool_env_allows_exactly_max_calls_and_charges_every_failed_call():
    """env.max_calls_per_turn calls in one reply are made (one more is a malformed turn, counted as one call); each
    call that raised or timed out is a failure and costs tool_error_reward, so two failures cost it twice."""
    tools = {t.name: t for t in map(Tool.from_function, (calc, _raises, _sleeps))}
    env = ToolEnv(tools, parse_hermes, DeadlinePool(workers=3, timeout_s=0.3), invalid_call_reward=-0.5,
                  tool_error_reward=-0.25, max_calls_per_turn=3, think_tags=None)
    env.reset({"prompt": "q"})
    step = env.step(_hermes("calc", "6*7") + _hermes("_raises") + _hermes("_sleeps"))
    assert [m["content"][:6] for m in step.observation] == ["42", "error:", "error:"] and not step.done
    assert step.info == {"tool_calls": 3.0, "tool_failures": 2.0} and step.reward == -0.5
    over = env.step(_hermes("calc") * 4)
    assert over.info == {"tool_calls": 1.0, "invalid_calls": 1.0} and over.reward == -0.5
    assert "at most 3 tool calls per turn" in over.observation[0]["content"]


def test_the_env_factory_passes_the_configs_rewards_bound_and_think_tags_to_every_environment():
    """env.invalid_call_reward, env.tool_error_reward and env.max_observation_chars reach each environment the
    factory makes; think_tags None parses whole replies (a call after a thought is then not a call)."""
    make, schemas = make_env_factory(EnvConfig(tools=["calc"], parser="call", max_observation_chars=5,
                                               invalid_call_reward=-0.5, tool_error_reward=-0.25), think_tags=None)
    assert [s["function"]["name"] for s in schemas] == ["calc"]
    env = make()
    env.reset({"prompt": "q"})
    assert env.step("calc(6*7").reward == -0.5
    assert env.step("calc(1/0)").reward == -0.25
    assert env.step("calc(123456*10)").observation[0]["content"] == "12345 [cut at 5 of 7 characters]"
    assert env.step("<think>x</think>calc(6*7)").done
    tagged, _ = make_env_factory(EnvConfig(tools=["calc"], parser="call"))
    thinking = tagged()
    thinking.reset({"prompt": "q"})
    assert not thinking.step("<think>x</think>calc(6*7)").done


def test_two_tools_of_one_name_are_refused():
    """A second tool of a name would replace the first without a word (the schema list would still show both)."""
    with pytest.raises(ValueError, match=r"env\.tools names two tools called 'calc'"):
        make_env_factory(EnvConfig(tools=["calc", "calc"]))


def test_the_tool_calls_of_every_step_running_at_once_start_at_once(monkeypatch):
    """env.tool_timeout_s is one episode's turn's calls' own time, so the tool pool all episodes share has a thread
    for every call that env.workers steps running at once can make: no call waits behind another episode's (with
    env.workers threads, 8 episodes' 0.4 s calls under a 1 s limit failed 42 %). Each call here waits for all the
    others: a thread short, the barrier breaks and calls fail."""
    workers, per_turn = 3, 2
    barrier = threading.Barrier(workers * per_turn)

    def meet(expression: str) -> str:
        """Waits for every other call.

        Args:
            expression: anything
        """
        barrier.wait(timeout=10)
        return "met"

    monkeypatch.setitem(BUILTIN_TOOLS, "meet", meet)
    make, _ = make_env_factory(EnvConfig(tools=["meet"], workers=workers, max_calls_per_turn=per_turn,
                                         tool_timeout_s=60), think_tags=None)
    reply = '<tool_call>{"name": "meet", "arguments": {"expression": "1"}}</tool_call>' * per_turn
    envs = [make() for _ in range(workers)]
    for env in envs:
        env.reset({"prompt": "x"})
    steps = [o.value for o in DeadlinePool(workers).map([(env.step, (reply,), {}) for env in envs])]  # as the driver
    assert [s.info["tool_failures"] for s in steps] == [0.0] * workers
    assert all(m["content"] == "met" for s in steps for m in s.observation)


def test_resolve_tool_errors_name_the_spec():
    assert resolve_tool("calc").name == "calc"
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        resolve_tool("nope")
    with pytest.raises(ValueError, match="tool 'no_such_module:f'"):
        resolve_tool("no_such_module:f")


# ---- the chat-template layout ----------------------------------------------------------------------------------------


def test_observation_text_follows_the_template_after_a_policy_turn():
    tok = build_tokenizer()
    fmt = ChatFormat(tok)  # the tiny template: "role: content; " and the generation prompt "assistant:"
    eos = tok.eos_token_id
    assert fmt.observation_text([{"role": "tool", "content": "6"}], eos) == "; tool: 6; assistant:"
    chatml = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}<eos>\n{% endfor %}"
              "{% if add_generation_prompt %}[assistant]{% endif %}")
    fmt = ChatFormat(tok, chatml)
    # the policy's EOS stands for the template's end-of-turn marker; without it the marker is added
    assert fmt.observation_text([{"role": "tool", "content": "6"}], eos) == "\n[tool]6<eos>\n[assistant]"
    assert fmt.observation_text([{"role": "tool", "content": "6"}], None) == "<eos>\n[tool]6<eos>\n[assistant]"
    # Llama-2-chat: an assistant turn is " " + content + " " + eos_token; the space before the EOS goes with it
    llama2 = ("{% for m in messages %}{% if m.role == 'user' %}{{ '[inst] ' + m.content + ' [/inst]' }}"
              "{% elif m.role == 'assistant' %}{{ ' ' + m.content + ' ' + eos_token }}{% endif %}{% endfor %}")
    fmt = ChatFormat(tok, llama2)
    assert fmt.observation_text([{"role": "user", "content": "again"}], eos) == "[inst] again [/inst]"  # not " <eos>…"
    assert fmt.turn_eos == eos


def test_a_turn_ended_by_a_generation_config_eos_gets_the_templates_turn_end_once():
    """Gemma ships tokenizer EOS <eos> and generation_config.eos_token_id [<eos>, <end_of_turn>], its template ending
    a turn "<end_of_turn>\\n". The engine stopped at <end_of_turn> but the driver knew only the tokenizer's EOS and
    added the whole turn end again: '<eot><eot>;' trained where the template renders '<eot>;'. Cold-start
    demonstrations ended turns with <eos>, a layout the template never renders. Both now follow the template, and
    the driver's layout of an episode is its demonstration's layout, token for token."""
    torch.manual_seed(0)
    model, tok = build_preset("tiny-dense", seed=0)
    tok.add_special_tokens({"additional_special_tokens": ["<sot>", "<eot>"]})
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    eot = tok.convert_tokens_to_ids("<eot>")
    model.generation_config.eos_token_id = [tok.eos_token_id, eot]
    tok.chat_template = ("{% for m in messages %}<sot>{{ m.role }}:{{ m.content }}<eot>;{% endfor %}"
                         "{% if add_generation_prompt %}<sot>assistant:{% endif %}")

    def end_turn(module, args, out):  # the policy ends every turn with <eot> at once, as a chat model would
        out[..., eot] = 1e9
        return out

    model.get_output_embeddings().register_forward_hook(end_turn)

    class Again:
        def reset(self, row):
            self.k = 0
            return row["prompt"]

        def step(self, action):
            self.k += 1
            return Step([{"role": "user", "content": "again"}], done=self.k == 2)

    engine = HFSampler(model.eval(), tok, SamplingParams(max_new_tokens=4, top_k=1))
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False, add_generation_prompt=True)
    traj = EpisodeRunner(engine, tok, Again, EpisodeLimits(max_turns=3, max_tokens=60)).run([{"prompt": prompt}], 1,
                                                                                            [0])
    n = int(traj.completion_mask[0].sum())
    ids, loss = traj.completion_ids[0, :n].tolist(), traj.loss_mask[0, :n].tolist()
    turns = [{"role": "assistant", "content": ""}, {"role": "user", "content": "again"},
             {"role": "assistant", "content": ""}]
    rendered = tok.apply_chat_template([{"role": "user", "content": "1+1="}, *turns], tokenize=False)
    assert prompt + tok.decode(ids) + ";" == rendered  # the last turn's ";" comes after the episode
    fmt = ChatFormat(tok, eos_ids=engine.eos_ids)
    assert fmt.turn_eos == eot
    assert encode_demonstration(fmt, turns) == (ids, loss)


def test_demonstration_layout_is_the_episode_layout():
    tok = build_tokenizer()
    fmt = ChatFormat(tok)  # a turn end without an EOS in it: the tokenizer's EOS ends a turn, then the turn end
    ids, mask = encode_demonstration(fmt, [{"role": "assistant", "content": "calc(2*3)"},
                                           {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"}])
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tok.eos_token_id
    assert ids == [*enc("calc(2*3)"), eos, *enc("; tool: 6; assistant:"), *enc("6"), eos]
    assert mask == [1] * 10 + [0] * len(enc("; tool: 6; assistant:")) + [1, 1]
    with pytest.raises(ValueError, match="ends with an assistant"):
        encode_demonstration(fmt, [{"role": "assistant", "content": "calc(2*3)"}, {"role": "tool", "content": "6"}])
    with pytest.raises(ValueError, match="starts with an assistant"):
        encode_demonstration(fmt, [{"role": "tool", "content": "6"}])
    with pytest.raises(ValueError, match="at least one assistant message"):  # nothing to train: SFT's loss was 0/0
        encode_demonstration(fmt, [])


# ---- the episode driver, on the real built-in engine -----------------------------------------------------------------


class Echo:
    """An environment that answers every reply with a fixed observation for `turns` turns, rewarding turn k with k."""

    counts = ("echoes",)

    def __init__(self, turns: int = 3, observation: str | list | None = None) -> None:
        self.turns, self.k = turns, 0
        self.observation = observation or [{"role": "tool", "content": "ok"}]

    def reset(self, row):
        return row["prompt"]

    def step(self, action):
        self.k += 1
        return Step(None if self.k >= self.turns else self.observation, reward=float(self.k),
                    done=self.k >= self.turns, info={"echoes": 1.0})


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    model, tok = build_preset("tiny-moe", seed=0)
    return model.eval(), tok


ROWS = [{"prompt": "12*34="}, {"prompt": "5*6="}]


def runner(policy, make_env, **limits) -> EpisodeRunner:
    """Episodes of the untrained tiny model, whose turns end at their first character (every character is a stop
    string): an untrained model rarely samples EOS, and a turn cut at max_new_tokens would end its episode."""
    model, tok = policy
    engine = HFSampler(model, tok, SamplingParams(max_new_tokens=5, stop=tuple(VOCAB_CHARS)))
    return EpisodeRunner(engine, tok, make_env, EpisodeLimits(**{"max_turns": 4, "max_tokens": 60, **limits}))


def test_episode_layout_masks_logprobs_versions_and_turn_rewards(policy):
    model, tok = policy
    run = runner(policy, lambda: Echo(3))
    run.engine.version = 7
    traj = run.run(ROWS, 2, [1, 2])
    obs = tok("; tool: ok; assistant:", add_special_tokens=False)["input_ids"]
    assert len(traj) == 4 and traj.prompt_index.tolist() == [0, 0, 1, 1]
    loss, real = traj.loss_mask.bool(), traj.completion_mask.bool()
    assert (loss <= real).all()
    for i in range(4):
        ids, lm = traj.completion_ids[i][real[i]].tolist(), traj.loss_mask[i][real[i]].tolist()
        # three policy turns separated by two observations, each exactly the template's tokens
        segments = [list(run) for _, run in itertools.groupby(lm)]
        assert [s[0] for s in segments] == [1, 0, 1, 0, 1]
        pos = 0
        for seg in segments:
            if seg[0] == 0:
                assert ids[pos:pos + len(seg)] == obs
            pos += len(seg)
        # turn rewards 1, 2, 3 on each turn's last policy token
        last_of_turn = [j for j in range(len(lm)) if lm[j] == 1 and (j + 1 == len(lm) or lm[j + 1] == 0)]
        assert traj.token_rewards[i].nonzero().flatten().tolist() == last_of_turn
        assert traj.token_rewards[i][last_of_turn].tolist() == [1.0, 2.0, 3.0]
    assert (traj.versions[loss] == 7).all() and (traj.versions[~loss] == NO_VERSION).all()
    assert (traj.logprobs[~loss] == 0).all()
    # every policy token's engine log-prob is the model's, given everything before it in this very layout
    with torch.no_grad():
        recomputed, _ = completion_logprobs(model, *traj.rows(torch.arange(4)))
    torch.testing.assert_close(recomputed[loss], traj.logprobs[loss], atol=2e-5, rtol=0)
    m = episode_metrics(traj)
    assert m["episode_turns"] == 3 and m["episode_turn_limit"] == 0 and not traj.truncated.any()
    assert traj.extras["episode"][:, traj.extras["episode_keys"].index("echoes")].tolist() == [3.0] * 4


def test_a_partial_rollout_inside_an_episode_keeps_each_tokens_version(policy):
    """Weights that arrive in the middle of a policy turn (rollout.partial): the episode keeps the version of every
    policy token as the engine reports it, not the turn's first; observation tokens have none."""
    model, tok = policy
    engine = HFSampler(model, tok, SamplingParams(max_new_tokens=6), own_copy=True)
    calls = []

    def arrive() -> None:  # after the 3rd token of the first turn, version 1 (the same weights: only the label)
        calls.append(1)
        if len(calls) == 3:
            engine.update_weights(policy_weights(model), 1)

    engine.between_tokens = arrive
    traj = EpisodeRunner(engine, tok, lambda: Echo(3), EpisodeLimits(max_turns=3, max_tokens=60)).run(ROWS, 2, [1, 2])
    loss = traj.loss_mask.bool()
    for i in range(len(traj)):
        versions = traj.versions[i][loss[i]].tolist()
        assert versions[:3] == [0, 0, 0] and set(versions[3:]) == {1}  # the first turn has both
    assert (traj.versions[~loss] == NO_VERSION).all()


def test_episodes_are_reproducible_and_independent_of_the_batch(policy):
    run = runner(policy, lambda: Echo(2))
    both = run.run(ROWS, 2, [1, 2])
    alone = run.run(ROWS[1:], 2, [2])
    assert both.completions[2:] == alone.completions
    assert torch.equal(both.completion_ids[2:, :alone.completion_ids.shape[1]], alone.completion_ids)
    assert run.run(ROWS, 2, [1, 2]).completions == both.completions


def test_episode_limits_are_recorded(policy):
    never = runner(policy, lambda: Echo(100), max_turns=3).run(ROWS, 2, [1, 2])
    m = episode_metrics(never)
    assert m["episode_turn_limit"] == 1.0 and never.truncated.all() and m["episode_turns"] == 3
    short = runner(policy, lambda: Echo(100), max_tokens=12).run(ROWS, 2, [1, 2])
    assert episode_metrics(short)["episode_token_limit"] == 1.0 and short.truncated.all()
    assert int(short.completion_mask.sum(-1).max()) <= 12


class Faulty:
    """Row-dependent failures: raise, hang, return a non-Step, or behave."""

    def reset(self, row):
        self.kind = row["kind"]
        return row["prompt"]

    def step(self, action):
        if self.kind == "raise":
            raise RuntimeError("env broke")
        if self.kind == "hang":
            time.sleep(3)
        if self.kind == "junk":
            return "not a step"
        return Step(done=True, reward=1.0)


def test_a_failing_environment_ends_only_its_own_episode(policy):
    rows = [{"prompt": "1=", "kind": k} for k in ("raise", "hang", "junk", "fine")]
    t0 = time.monotonic()
    traj = runner(policy, Faulty, step_timeout_s=0.5).run(rows, 2, [1, 2, 3, 4])
    assert time.monotonic() - t0 < 3
    failed = traj.extras["episode"][:, traj.extras["episode_keys"].index("env_failures")].tolist()
    assert failed == [1.0] * 6 + [0.0] * 2
    assert traj.token_rewards.sum(-1).tolist() == [0.0] * 6 + [1.0] * 2


def test_tool_env_turns_calls_into_observations_and_counts_failures():
    pool = DeadlinePool(workers=2, timeout_s=0.5)
    tools = {t.name: t for t in map(Tool.from_function, (calc, _raises))}
    env = ToolEnv(tools, parse_call, pool, invalid_call_reward=-0.5, tool_error_reward=-0.25)
    assert env.step("calc(6*7)").observation == [{"role": "tool", "name": "calc", "content": "42"}]
    bad = env.step("calc(6*7")
    assert bad.observation[0]["content"].startswith("error:") and bad.reward == -0.5
    assert bad.info == {"tool_calls": 1.0, "invalid_calls": 1.0}
    broke = env.step("_raises(1)")
    assert broke.reward == -0.25 and broke.info["tool_failures"] == 1.0
    assert env.step("42").done


# ---- advantages and gradients ----------------------------------------------------------------------------------------


def test_turn_advantages_by_hand():
    # two episodes of one group; rewards at turn ends: episode 0 gets -0.5 (turn 1) and 1 (turn 2); episode 1 gets 0
    r = torch.tensor([[0, -0.5, 0, 0, 1.0], [0, 0, 0, 0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]])
    adv = turn_advantages(r, mask, 2)
    returns = torch.tensor([0.5, 0.0])
    mean, std = returns.mean(), returns.std()
    expected = torch.tensor([[0.5, 0.5, 0, 1.0, 1.0], [0, 0, 0, 0, 0.0]]) - mean
    torch.testing.assert_close(adv, expected / std * mask)
    assert adv[0, 0] == group_advantages(returns, 2)[0]  # the first turn: Eq. 6's advantage


def test_turn_advantages_equal_the_episode_advantage_when_only_the_answer_is_rewarded():
    torch.manual_seed(0)
    mask = (torch.rand(8, 12) > 0.3).long()
    r = torch.zeros(8, 12)
    last = 11 - mask.flip(-1).argmax(-1)
    r[torch.arange(8), last] = torch.rand(8)
    for scale in ("group", "batch", "none"):
        torch.testing.assert_close(turn_advantages(r, mask, 4, scale),
                                   group_advantages(r.sum(-1), 4, scale)[:, None] * mask)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_turn_advantages_of_the_valid_episodes_are_those_of_a_group_without_the_others(scale):
    """`valid` (env.on_failure=mask): an episode its environment failed leaves its group's returns statistics and gets
    0 on every token."""
    torch.manual_seed(0)
    mask = (torch.rand(8, 6) > 0.3).long()
    r = torch.rand(8, 6) * mask
    valid = torch.tensor([True, True, False, True, False, True, True, True])  # 3 valid episodes per group of 4
    adv = turn_advantages(r, mask, 4, scale, valid=valid)
    torch.testing.assert_close(adv[valid], turn_advantages(r[valid], mask[valid], 3, scale))
    assert adv[~valid].abs().sum() == 0


@pytest.mark.parametrize("loss", ["gspo", "gspo_token", "grpo"])
def test_observation_tokens_never_get_gradient(loss):
    torch.manual_seed(0)
    loss_mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 0]])
    old = torch.randn(2, 6) * 0.01 - 1
    new = (old + torch.randn(2, 6) * 1e-4).requires_grad_(True)
    objective = OBJECTIVES[loss]
    adv = torch.tensor([1.0, -1.0]) if not objective.token_advantages else torch.randn(2, 6) * loss_mask
    value, _ = objective(new, old, adv, loss_mask)
    (grad,) = torch.autograd.grad(value, new)
    assert (grad[loss_mask == 0] == 0).all() and (grad[loss_mask == 1] != 0).any()
    # changing an observation token's log-probs (π_θ and π_old) changes neither the loss nor any gradient
    obs = loss_mask == 0
    new2 = torch.where(obs, new.detach() - 3.0, new.detach()).requires_grad_(True)
    value2, _ = objective(new2, torch.where(obs, old + 5.0, old), adv, loss_mask)
    (grad2,) = torch.autograd.grad(value2, new2)
    assert torch.equal(value, value2) and torch.equal(grad, grad2)


def test_observation_tokens_change_no_model_gradient(policy):
    """End to end through the model: the engine log-prob of an observation token (π_old from the engine) does not
    reach any parameter's gradient."""
    model, _ = policy
    traj = runner(policy, lambda: Echo(2)).run(ROWS, 2, [1, 2])
    obs = (traj.completion_mask.bool() & ~traj.loss_mask.bool())
    assert obs.any()
    adv = turn_advantages(traj.token_rewards, traj.loss_mask, 2)

    def grads(old):
        model.zero_grad()
        logprobs, _ = completion_logprobs(model, *traj.rows(torch.arange(len(traj))))
        value, _ = OBJECTIVES["gspo_token"](logprobs, old, adv, traj.loss_mask)
        value.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    a = grads(traj.logprobs)
    b = grads(torch.where(obs, torch.full_like(traj.logprobs, -7.0), traj.logprobs))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    model.zero_grad()


# ---- cold start and the trainer --------------------------------------------------------------------------------------


def test_sft_trains_only_the_assistant_turns_of_a_demonstration():
    tok = build_tokenizer()
    demo = [{"role": "assistant", "content": "calc(2*3)"}, {"role": "tool", "content": "6"},
            {"role": "assistant", "content": "6"}]
    *_, c_mask, loss_mask = encode_pairs(tok, ["2*3=", "1+1="], [demo, "2"])
    assert loss_mask[1].tolist()[:2] == [1, 1] and loss_mask[1].sum() == 2
    assert loss_mask[0].sum() == 12 and c_mask[0].sum() > 12
    model, tok = build_preset("tiny-moe", seed=0)
    losses = sft(model, tok, [{"prompt": "2*3=", "solution": demo}] * 8, steps=30, batch_size=4, lr=3e-3,
                 warmup_steps=2, progress=False)
    assert losses[-1] < 0.5 * losses[0]
    with pytest.raises(ValueError, match=r"row 1's 'solution'.*ends with an assistant"):
        sft(model, tok, [{"prompt": "1=", "solution": "1"}, {"prompt": "2*3=", "solution": demo[:2]}], steps=1,
            batch_size=1, lr=1e-3, progress=False)


def test_engine_prompts_may_be_token_ids(policy):
    model, tok = policy
    engine = HFSampler(model, tok, SamplingParams(max_new_tokens=3, top_k=1))
    ids = tok("12+3=", add_special_tokens=False)["input_ids"]
    assert engine.generate([ids], 1, [0]).completions == engine.generate(["12+3="], 1, [0]).completions
    with pytest.raises(ValueError, match="token ids"):
        engine.generate([[10 ** 6]], 1, [0])


CALC = ["data.task=multiply", "data.chat=always", "rewards.functions={addition: 1.0}", "env.parser=call",
        "env.max_turns=3", "env.max_tokens=48", "rollout.max_new_tokens=12", "cold_start.steps=40",
        "data.task_options={digits_a: 2, digits_b: 1}"]


def calc_config(out, *extra):
    return load_config(DEMO, [*tiny_overrides(out, *CALC), *extra])


def test_env_settings_are_checked_before_any_compute(tmp_path):
    with pytest.raises(ConfigError, match=r"env\.name"):
        calc_config(tmp_path / "a", "env.name=nothing")
    with pytest.raises(ConfigError, match=r"exceeds env\.max_tokens"):
        calc_config(tmp_path / "c", "rollout.max_new_tokens=64")
    with pytest.raises(ConfigError, match=r"env\.options \(\['x'\]\) are for a custom environment"):
        calc_config(tmp_path / "e", "env.options={x: 1}")
    # episodes keep no engine routing: r3 trained as routing_replay=none, saying r3
    with pytest.raises(ConfigError, match=r"routing_replay=r3 .*multi-turn episode.*use routing_replay=r2"):
        calc_config(tmp_path / "r", "algorithm.routing_replay=r3")
    assert calc_config(tmp_path / "r", "algorithm.routing_replay=r2").algorithm.routing_replay == "r2"
    with pytest.raises(ConfigError, match="unknown tool 'abacus'"):
        train(calc_config(tmp_path / "d", "env.tools=[abacus]"))
    assert not (tmp_path / "d" / "config.yaml").exists()  # nothing written: the start checks failed first


@pytest.mark.parametrize("loss", ["gspo", "gspo_token", "grpo"])
def test_training_with_tools_runs_and_reports_tool_use(tmp_path, loss):
    summary = train(calc_config(tmp_path, f"algorithm.loss={loss}", "log.rollouts=8"))
    assert summary["status"] == "completed"
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for key in ("tool_call_rate", "tool_call_validity", "episode_turns", "episode_turn_limit"):
        assert key in metrics[-1]
    assert all(0 <= m["tool_call_rate"] <= 1 and 1 <= m["episode_turns"] <= 3 for m in metrics)
    evals = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert "heldout_tool_call_rate" in evals[0]
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert all("transcript" in s for s in samples)
    # training episodes are logged whole: the final reply ends the transcript of policy turns and tool results
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert rollouts and all(r["transcript"].endswith(r["completion"]) for r in rollouts)
    assert any("tool:" in r["transcript"] for r in rollouts)  # the tiny chat template's tool turn


def test_episodes_combine_with_dynamic_sampling_and_the_overlong_filter(tmp_path, monkeypatch):
    """Dynamic sampling (which concatenates rounds of episodes: their count columns are fixed per runner) and the
    overlong filter (truncated episodes out of the loss) run on episodes."""
    monkeypatch.setitem(REWARDS, "varied", varied_reward)
    summary = train(calc_config(tmp_path, "trainer.steps=2", "rollout.dynamic_sampling=true",
                                "rollout.overlong_filter=true", "rewards.functions={varied: 1.0}",
                                "rewards.accuracy_reward=varied", "rewards.accuracy_threshold=0.5"))
    assert summary["status"] == "completed"
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("dynamic_rounds" in m and "overlong_filtered" in m and "tool_call_rate" in m for m in metrics)


def test_asynchronous_workers_play_episodes(tmp_path, monkeypatch):
    """rollout.mode=async with an env: the rollout workers play the episodes (tools and all) while the learner
    trains; the steps carry the episode metrics and the staleness bookkeeping of the async path. A reward registered
    in this process reaches the worker processes; one that cannot be sent to them is refused with its name."""
    monkeypatch.setitem(REWARDS, "varied", varied_reward)
    summary = train(calc_config(tmp_path, "rollout.mode=async", "trainer.steps=3", "cold_start.steps=10",
                                "rewards.functions={varied: 1.0}", "rewards.accuracy_reward=varied",
                                "rewards.accuracy_threshold=0.5"))
    assert summary["status"] == "completed"
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert 1 <= m["episode_turns"] <= 3 and 0 <= m["tool_call_rate"] <= 1
        assert 0 <= m["staleness_max"] <= 1 and m["grad_norm"] > 0
    monkeypatch.setitem(REWARDS, "varied", lambda prompt, completion, **_: varied_reward(prompt, completion))
    with pytest.raises(ConfigError, match=r"reward 'varied' .* cannot be sent to the rollout worker processes"):
        train(calc_config(tmp_path / "lambda", "rollout.mode=async", "rewards.functions={varied: 1.0}"))
    assert not (tmp_path / "lambda" / "config.yaml").exists()  # refused before anything was built or written


def test_tools_with_string_prompts_not_rendered_are_warned_about(tmp_path, caplog):
    """Under data.chat: auto, string prompts are not rendered, so the template never describes the tools: said."""
    train(calc_config(tmp_path, "data.chat=auto", "trainer.steps=1", "cold_start.steps=2"))
    assert "renders only conversation rows" in caplog.text


def test_gspo_eval_with_a_multi_turn_config_evaluates_episodes(tmp_path, capsys):
    """`gspo eval` of a tool-use run evaluates episodes, as the run's own evaluation did (same held-out accuracy)."""
    train(calc_config(tmp_path, "trainer.steps=1", "trainer.eval_every=1"))
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "final"), "--config", str(tmp_path / "config.yaml")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    last = json.loads((tmp_path / "eval.jsonl").read_text().splitlines()[-1])
    assert result["tool_call_rate"] == last["heldout_tool_call_rate"]
    assert result["accuracy"] == last["heldout_accuracy"] and result["episode_turns"] == last["heldout_episode_turns"]


def test_tool_calls_are_read_after_the_thinking_block():
    """As vLLM's reasoning parser splits the reasoning off before the tool parser: a call drafted in the thought is not
    made, a call after it is, and a reply whose reasoning never ended makes none and ends the episode (R1-style
    templates open the thought in the prompt). With think_tags None the whole reply is parsed, as before."""
    pool = DeadlinePool(workers=1, timeout_s=1.0)
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call>'
    env = ToolEnv(TOOLS, parse_hermes, pool)
    env.reset({"prompt": "q"})
    assert env.step(f"<think>maybe {call}</think>It is 42.").done  # drafted, not made: an answer
    made = env.step(f"<think>I will compute it.</think>{call}")
    assert made.observation == [{"role": "tool", "name": "calc", "content": "42"}] and not made.done
    assert env.step(f"<think>first {call}").done  # cut off mid-thought: no call
    env.reset({"prompt": "<｜User｜>6*7?<｜Assistant｜><think>\n"})  # the template opened the thought
    assert env.step(f"draft {call}").done and not env.step(f"ok</think>{call}").done
    whole = ToolEnv(TOOLS, parse_hermes, pool, think_tags=None)
    whole.reset({"prompt": "q"})
    assert whole.step(f"<think>maybe {call}</think>It is 42.").observation[0]["content"] == "42"


class Scripted:
    """An engine replying by script: an episode is known by its prompt's first token; its t-th policy turn gets the
    t-th reply of its script (text, "$" ends it with EOS), cut at the call's max_new_tokens."""

    def __init__(self, tok, script: dict[str, list[str]]) -> None:
        self.tok, self.eos_ids, self.pad_id = tok, [tok.eos_token_id], tok.pad_token_id
        self.params = SamplingParams(max_new_tokens=8)
        self.script = {tok(p, add_special_tokens=False)["input_ids"][0]: r for p, r in script.items()}
        self.turn: dict[int, int] = {}

    def encode(self, reply: str) -> list[int]:
        ids = self.tok(reply.rstrip("$"), add_special_tokens=False)["input_ids"]
        return ids + [self.tok.eos_token_id] * reply.endswith("$")

    def generate(self, prompts, n, seeds, params=None) -> Trajectory:
        cap = params.max_new_tokens
        replies = []
        for p in prompts:
            t = self.turn[p[0]] = self.turn.get(p[0], -1) + 1
            replies.append(self.encode(self.script[p[0]][t])[:cap])
        prompt_ids, prompt_mask = pad_left(prompts, self.pad_id)
        ids, mask = pad_right(replies, self.pad_id, width=max(1, max(map(len, replies))))
        return Trajectory(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=ids, completion_mask=mask,
                          logprobs=-0.5 * mask.float(),
                          truncated=torch.tensor([not r or r[-1] != self.tok.eos_token_id for r in replies]),
                          completions=[self.tok.decode([t for t in r if t != self.tok.eos_token_id]) for r in replies],
                          prompt_index=torch.arange(len(prompts)))


class Says:
    """Every step answers with the same text observation, never done."""

    def __init__(self, text: str) -> None:
        self.text = text

    def reset(self, row):
        return row["prompt"]

    def step(self, action):
        return Step(self.text)


def _count(traj: Trajectory, key: str) -> list[float]:
    return traj.extras["episode"][:, traj.extras["episode_keys"].index(key)].tolist()


def test_a_reply_the_budget_ends_inside_is_cut_to_exactly_the_budget():
    """Two episodes share a generate call whose cap is the larger budget left; the one with less left is cut to its
    own budget (max_tokens in all), its log-probs with it."""
    tok = build_tokenizer()
    engine = Scripted(tok, {"1=": ["1$", "1$"], "2=": ["123456$", "1234567"]})
    traj = EpisodeRunner(engine, tok, lambda: Says(";k"), EpisodeLimits(max_turns=2, max_tokens=12)).run(
        [{"prompt": "1="}, {"prompt": "2="}], 1, [0, 1])
    # episode 2: 7 policy + 2 observation tokens, then 3 of its 7-token reply: 12 in all
    assert traj.completion_mask.sum(-1).tolist() == [6, 12]
    assert traj.loss_mask[1].tolist() == [1] * 7 + [0] * 2 + [1] * 3
    assert (traj.logprobs[1] == -0.5 * traj.loss_mask[1]).all()  # every policy token has its log-prob
    assert traj.completions[1] == "123" and _count(traj, "token_limit") == [0.0, 1.0]
    assert traj.truncated.tolist() == [True, True]  # turn limit, token limit


def test_an_observation_that_leaves_no_room_for_a_reply_ends_the_episode():
    """An observation that would fill the budget exactly (no token left for a reply) is not appended: the episode
    ends at its policy turn, counted as a token limit."""
    tok = build_tokenizer()
    engine = Scripted(tok, {"1=": ["1234567$", "9$"]})
    traj = EpisodeRunner(engine, tok, lambda: Says(";ab;"), EpisodeLimits(max_turns=3, max_tokens=12)).run(
        [{"prompt": "1="}], 1, [0])
    assert traj.completion_mask.sum(-1).tolist() == [8]  # 8 + 4 = 12 = max_tokens: no room
    assert traj.loss_mask[0].tolist() == [1] * 8
    assert _count(traj, "turns") == [1.0] and _count(traj, "token_limit") == [1.0] and traj.truncated.all()


def _repeat(times: int) -> str:
    """Repeat something.

    Args:
        times: how many times
    """
    return "x" * times


def test_call_parser_balances_nested_parentheses():
    tools = {"calc": Tool.from_function(calc)}
    assert parse_call("calc((12+3)*4)", tools).calls == (ToolCall("calc", {"expression": "(12+3)*4"}),)
    assert parse_call("calc(((1)))", tools).calls == (ToolCall("calc", {"expression": "((1))"}),)
    assert parse_call("calc((1)", tools).error is not None  # never closed
    assert parse_call("calc((1)))", tools).error is not None  # text after the closing parenthesis


def test_a_json_boolean_is_not_an_integer_argument():
    """JSON true is a Python bool, an int subclass: it must not pass for an integer parameter."""
    tools = {"_repeat": Tool.from_function(_repeat)}
    ok = parse_hermes('<tool_call>{"name": "_repeat", "arguments": {"times": 3}}</tool_call>', tools)
    assert ok.error is None and ok.calls == (ToolCall("_repeat", {"times": 3}),)
    bad = parse_hermes('<tool_call>{"name": "_repeat", "arguments": {"times": true}}</tool_call>', tools)
    assert bad.calls == () and "must be of type integer, got a boolean" in bad.error
