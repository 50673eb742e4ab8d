"""The `env` section and its tools as a user sets them up: a custom environment's saved config loads back, tools the
`call` format could never call are refused before any compute, malformed `call` replies and hermes arguments of the
wrong type are invalid calls (not tool failures), and the messages name what is relevant (import errors, the token
budget that binds with an env, vLLM's max_model_len with episodes, an environment error inside an async worker)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from conftest import DEMO, numpy_for_the_sandbox, tiny_overrides
from gspo.agent import Tool, ToolCall, ToolEnv, build_env, calc, make_env_factory
from gspo.agent.tools import TOOLS, make_python_tool, parse_call, parse_hermes, python, resolve_tool
from gspo.cli import main
from gspo.config import ConfigError, config_to_dict, load_config
from gspo.rewards.deadline import DeadlinePool
from gspo.schedule import prompt_token_limit

CALC = {"calc": Tool.from_function(calc)}

ENVS = '''
from gspo.agent import Step

class Good:
    def reset(self, row):
        return row["prompt"]
    def step(self, action):
        return Step(done=True)

class ResetRaises(Good):
    def reset(self, row):
        raise KeyError("no such field")
'''

TOOLS_PY = '''
def getWeather(city: str) -> str:
    """The weather.

    Args:
        city: the city
    """
    return "sunny in " + city

def two(a: str, b: str) -> str:
    """Two required arguments.

    Args:
        a: first
        b: second
    """
    return a + b

def intarg(n: int) -> str:
    """An int argument.

    Args:
        n: a number
    """
    return str(n + 1)

def optional_rest(text: str, times: int = 1) -> str:
    """A text argument and an optional one.

    Args:
        text: the text
        times: how often
    """
    return text * times
'''


def env_config(tmp_path, *extra: str):
    return load_config(DEMO, tiny_overrides(tmp_path / "run", "algorithm.loss=gspo_token", "data.chat=always",
                                            "env.max_tokens=16", *extra))


def round_trip(cfg, path):
    """The config as the trainer saves it (OUT/config.yaml), loaded back."""
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return load_config(path)


# ---- B1: a run's saved config loads back -----------------------------------------------------------------------------


@pytest.mark.parametrize("env", [["env.name=my_envs:Good", "env.options={size: 3}"],
                                 ["env.name=tools", "env.tools=[calc, python]", "env.parser=call"],
                                 ["env.name=tools"]])
def test_a_saved_env_config_loads_back_equal(tmp_path, env):
    """A custom environment's saved config holds the defaults `tools: [calc]` and `parser: hermes`; it was refused
    ("env.tools are for env.name=tools"), so `gspo eval RUN` and `--resume` failed on every custom-env run."""
    cfg = env_config(tmp_path, *env)
    assert round_trip(cfg, tmp_path / "config.yaml") == cfg


def test_a_custom_env_still_refuses_tool_settings_it_would_ignore(tmp_path):
    for setting, key in [("env.tools=[python]", "env.tools"), ("env.parser=call", "env.parser")]:
        with pytest.raises(ConfigError, match=rf"{key} are for env.name=tools"):
            env_config(tmp_path, "env.name=my_envs:Good", setting)


# ---- A4: tools the call format can never call ---------------------------------------------------------------------


@pytest.mark.parametrize(("name", "message"), [
    ("two", r"'two' requires the argument\(s\) b besides its first; the call format passes one text argument"),
    ("intarg", r"'intarg': its first parameter n takes integer, but the call format passes it as text"),
])
def test_tools_the_call_format_cannot_call_are_refused_before_the_model(tmp_path, name, message):
    """`two(a, b)` became {'a': 'a, b'} and `intarg(5)` passed '5': every call a tool failure, accepted silently."""
    module = tmp_path / "my_tools.py"
    module.write_text(TOOLS_PY)
    cfg = env_config(tmp_path, f"env.tools=[{module}:{name}]", "env.parser=call")
    with pytest.raises(ConfigError, match=rf"env\.tools \({module}:{name}\) with env\.parser=call: tool {message}"):
        build_env(cfg)
    make_env_factory(env_config(tmp_path, f"env.tools=[{module}:{name}]", "env.parser=hermes").env)  # hermes can


def test_the_call_format_calls_any_identifier_and_a_tool_with_optional_extras(tmp_path):
    """`getWeather(paris)` was read as a final answer (the name pattern was lowercase only): never called."""
    module = tmp_path / "my_tools.py"
    module.write_text(TOOLS_PY)
    make, _ = make_env_factory(env_config(tmp_path, f"env.tools=[{module}:getWeather, {module}:optional_rest]",
                                                "env.parser=call").env)
    env = make()
    env.reset({"prompt": "weather?"})
    step = env.step("getWeather(paris)")
    assert step.info == {"tool_calls": 1.0, "tool_failures": 0.0}
    assert step.observation[0]["content"] == "sunny in paris"
    assert env.step("optional_rest(ab)").observation[0]["content"] == "ab"


# ---- A5: malformed call replies are invalid calls --------------------------------------------------------------------


@pytest.mark.parametrize("reply", ["calc(2*3) calc(4*5)", "calc(2*3))", "calc(1)(2)", "calc(2*3)\ncalc(4)",
                                   "calc(2*(3)", "calc(2*3"])
def test_a_malformed_call_reply_is_an_invalid_call(reply):
    """The greedy pattern took `calc(2*3) calc(4*5)` as one call of `2*3) calc(4*5`: a tool failure
    (tool_error_reward) where the reply was malformed (invalid_call_reward), and tool_call_validity read too high."""
    parsed = parse_call(reply, CALC)
    assert parsed.calls == () and "calc(<argument>) and nothing else" in parsed.error
    env = ToolEnv(CALC, parse_call, DeadlinePool(workers=1, timeout_s=1.0), invalid_call_reward=-0.5,
                  tool_error_reward=-0.25, think_tags=None)
    env.reset({"prompt": "q"})
    step = env.step(reply)
    assert step.info == {"tool_calls": 1.0, "invalid_calls": 1.0} and step.reward == -0.5


def test_well_formed_calls_with_nested_parentheses_still_run():
    assert parse_call(" calc((12+3)*(4-1)) ", CALC).calls == (ToolCall("calc", {"expression": "(12+3)*(4-1)"}),)
    assert parse_call("calc(2*3) is it", CALC).error  # text after the call
    assert parse_call("17834", CALC) == parse_call("foo(1) bar", CALC) == parse_call("(1)", CALC)  # answers


# ---- D3: hermes arguments of the wrong JSON type ---------------------------------------------------------------------


@pytest.mark.parametrize(("arguments", "got"), [('{"expression": 5}', "an integer"),
                                                ('{"expression": NaN}', "not a finite number"),
                                                ('{"expression": 1e400}', "not a finite number"),
                                                ('{"expression": ["1"]}', "an array")])
def test_a_hermes_argument_of_the_wrong_type_is_an_invalid_call(arguments, got):
    parsed = parse_hermes(f'<tool_call>{{"name": "calc", "arguments": {arguments}}}</tool_call>', CALC)
    assert parsed.calls == () and parsed.error == f"tool 'calc': argument expression must be of type string, got {got}"


def test_hermes_arguments_of_the_schema_types_pass():
    def scale(x: float, n: int, flag: bool = False, note: str | None = None) -> str:
        """Scale.

        Args:
            x: a number
            n: a count
            flag: a switch
            note: a note
        """
        return ""

    tools = {"scale": Tool.from_function(scale)}
    ok = parse_hermes('<tool_call>{"name": "scale", "arguments": {"x": 2, "n": 3, "flag": true, "note": null}}'
                      '</tool_call>', tools)
    assert ok.error is None and ok.calls[0].arguments["n"] == 3
    assert "argument n must be of type integer, got a boolean" in parse_hermes(
        '<tool_call>{"name": "scale", "arguments": {"x": 2.5, "n": true}}</tool_call>', tools).error
    assert "argument x must be of type number, got a string" in parse_hermes(
        '<tool_call>{"name": "scale", "arguments": {"x": "2", "n": 1}}</tool_call>', tools).error


# ---- C5: import errors say what is relevant --------------------------------------------------------------------------


def test_import_errors_of_env_name_and_tools_do_not_list_the_rewards(tmp_path):
    with pytest.raises(ConfigError, match=r"env\.name 'nosuchmod:Good': cannot import module 'nosuchmod'") as err:
        build_env(env_config(tmp_path, "env.name=nosuchmod:Good"))
    assert "registered rewards" not in str(err.value)
    with pytest.raises(ValueError, match=r"tool 'nomod:x': cannot import module 'nomod'.*No module named") as err:
        resolve_tool("nomod:x")
    assert "registered rewards" not in str(err.value) and f"(built-in tools: {sorted(TOOLS)})" in str(err.value)


# ---- C4, B5: the token budget that binds with an env -----------------------------------------------------------------


def test_the_prompt_limit_names_env_max_tokens_when_an_env_is_set(tmp_path):
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=256))
    cfg = env_config(tmp_path)
    with pytest.raises(ConfigError, match=r"leaves no room for a prompt .*: lower env\.max_tokens$"):
        prompt_token_limit(cfg, model, 1000)
    assert "lower env.max_tokens," in prompt_token_limit(cfg, model, 200)[1]
    plain = load_config(DEMO, tiny_overrides(tmp_path / "plain"))
    with pytest.raises(ConfigError, match=r"lower rollout\.max_new_tokens / trainer\.eval_max_new_tokens$"):
        prompt_token_limit(plain, model, 1000)


def test_vllm_max_model_len_must_hold_a_whole_episode(tmp_path):
    """With an env an episode's last turn is prompted with the prompt plus up to env.max_tokens tokens: 100 + 48 >
    110 was accepted (only one turn's 8 tokens were counted) and failed mid-run in the engine."""
    vllm = ["rollout.engine=vllm", "rollout.vllm.max_model_len=110", "data.max_prompt_tokens=100",
            "rollout.max_new_tokens=8", "trainer.eval_max_new_tokens=8"]
    with pytest.raises(ConfigError, match=r"plus 48 new tokens \(env\.max_tokens\): set data\.max_prompt_tokens to "
                                          r"at most 62"):
        env_config(tmp_path, *vllm, "env.max_tokens=48")
    with pytest.raises(ConfigError, match=r"plus 120 new tokens \(env\.max_tokens\): lower env\.max_tokens"):
        env_config(tmp_path, *vllm, "env.max_tokens=120")
    assert load_config(DEMO, tiny_overrides(tmp_path / "plain", *vllm)).rollout.vllm.max_model_len == 110


# ---- B4: an environment error inside an async rollout worker ---------------------------------------------------------


def test_an_env_error_in_an_async_worker_is_the_same_one_line_error_as_in_sync(tmp_path, capsys):
    """It was a 48-line `WorkerError` traceback (rc 1) where a sync run says one clean line (rc 2)."""
    module = tmp_path / "my_envs.py"
    module.write_text(ENVS)
    args = ["train", str(DEMO), *tiny_overrides(tmp_path / "run", "algorithm.loss=gspo_token", "data.chat=always",
                                                "env.max_tokens=16", f"env.name={module}:ResetRaises",
                                                "data.eval_split=null", "cold_start=null", "trainer.steps=1")]
    lines = {}
    for mode in ("sync", "async"):
        capsys.readouterr()
        assert main([*args, f"rollout.mode={mode}", "--overwrite"]) == 2
        lines[mode] = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert lines["sync"] == lines["async"] and len(lines["async"]) == 1
    assert "gspo train: error: the environment's reset failed on row 0 (KeyError: 'no such field')" in \
        lines["async"][0]


# ---- D4: the python tool says what its sandbox allows ----------------------------------------------------------------


def test_the_python_tool_does_not_claim_files_are_out_of_reach():
    description = Tool.from_function(python).schema["function"]["description"]
    assert "no files outside" not in description and "write only in its own temporary folder" in description


def test_the_python_tool_returns_what_the_program_printed_or_the_exceptions_last_line():
    """The model sees its program's output, or, when it fails, the traceback's last line (the exception and its
    message: what it can act on), not the traceback's first line ("Traceback (most recent call last):")."""
    assert python("print(6 * 7)") == "42\n"
    failed = python("print('partial')\nraise ValueError('no such thing')")
    assert failed.startswith("error: ") and failed.endswith("ValueError: no such thing")


def test_a_python_tool_of_ones_own_imports_its_packages_and_says_so_to_the_model(tmp_path):
    """The built-in `python` tool runs the standard library only; `make_python_tool(packages=...)` in a user's module,
    named in `env.tools`, lets the model's programs import the trainer's numpy, and its description (what the chat
    template shows the model) says which packages it has. A package that is not installed, or a limit out of range,
    is refused when the tool is made."""
    numpy_for_the_sandbox()
    (tmp_path / "my_tools.py").write_text("from gspo.agent.tools import make_python_tool\n"
                                          "python = make_python_tool(packages=('numpy',), timeout_s=10)\n")
    tool = resolve_tool(f"{tmp_path / 'my_tools.py'}:python")
    assert tool.name == "python" and "the standard library and numpy" in tool.schema["function"]["description"]
    assert "10 s" in tool.schema["function"]["description"]
    assert tool.fn("import numpy as np\nprint(int(np.arange(5).sum()))") == "10\n"
    assert python("import numpy").endswith("No module named 'numpy'")  # the built-in one: standard library only
    assert "standard library only" in Tool.from_function(python).schema["function"]["description"]
    with pytest.raises(ValueError, match="no module 'no_such_package' is installed"):
        make_python_tool(packages=("no_such_package",))
    with pytest.raises(TypeError, match=r"packages must be a list of top-level module names.*got 'numpy'"):
        make_python_tool(packages="numpy")  # was read as the letters n, u, m, ...
    with pytest.raises(ValueError, match="timeout_s"):
        make_python_tool(timeout_s=0)
