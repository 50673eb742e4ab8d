"""Tools: Python callables with an OpenAI-style JSON schema, the parsers that find their calls in a model's reply, and
running the calls so that no tool can crash or hang an episode.

A tool is a plain function with type hints and a Google-style docstring; `Tool.from_function` takes its schema from
them with transformers' `get_json_schema` (the schema a chat template renders for the model through
`apply_chat_template(tools=...)`). A reply's calls are found by a parser for the format the model was taught:

    hermes   `<tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>` (Qwen2.5/Qwen3, Hermes): JSON
             in tags, any number per reply
    call     `calc(2*3)`: the whole reply is one call, its text between the parentheses (which must balance) the tool's
             first parameter (for small vocabularies such as the embedded tiny tokenizer's, which has no quotes or
             braces). It can express one text argument only: a tool for it takes a string first parameter and
             requires no other (`call_format_problem`, checked when the run's tools are resolved)

A reply with no call is the model's answer. A malformed call (bad JSON, or JSON past the interpreter's limits such as
an integer of thousands of digits or arrays nested thousands deep, an unknown tool, missing or unexpected arguments, an
argument of the wrong JSON type, unbalanced parentheses or text after a `call`) is not an error of the run:
`ParsedCalls.error` says what was wrong, and the environment shows the model that text as the tool's observation.
`run_calls` runs calls in a `DeadlinePool`: a tool that raises, outlives its timeout or returns something other than
text gives an "error: ..." observation and is counted; training goes on.
Untrusted code belongs in the sandbox: the built-in `python` tool runs the model's program there.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gspo.rewards.deadline import DeadlinePool

__all__ = ["PARSERS", "TOOLS", "ParsedCalls", "Tool", "ToolCall", "ToolResult", "calc", "call_format_problem",
           "make_python_tool", "parse_call", "parse_hermes", "python", "resolve_tool", "run_calls"]


@dataclass(frozen=True)
class Tool:
    """A callable the model may call by `name`, described to it by `schema` (OpenAI function-calling format)."""

    name: str
    fn: Callable[..., Any]
    schema: dict

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> Tool:
        """A tool from a function with type hints and a Google-style docstring (an `Args:` section describing every
        parameter), its schema built by `transformers.utils.get_json_schema`. Raises ValueError naming the function
        when the schema cannot be built."""
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as exc:
            raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: cannot build its JSON schema from its signature "
                             f"and docstring ({type(exc).__name__}: {exc}); it needs type hints and a Google-style "
                             "docstring with an Args: section") from None
        return cls(schema["function"]["name"], fn, schema)

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters", {})


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedCalls:
    """What a reply asks for: `calls` to run, or `error` (a malformed attempt, shown to the model), or neither (an
    answer)."""

    calls: tuple[ToolCall, ...] = ()
    error: str | None = None


_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                            "boolean": (bool,), "array": (list,), "object": (dict,),
                                            "null": (type(None),)}
_JSON_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
               dict: "an object", type(None): "null"}


def _type_fits(value: Any, spec: Mapping[str, Any]) -> bool:
    """Whether `value` (as JSON decoded it) is of a type parameter schema `spec` allows: its `type` (a name or a list
    of names; unknown names and no type allow anything), `nullable`; no boolean for a number, no NaN or infinity."""
    types = spec.get("type")
    if types is None:
        return True
    names = [types] if isinstance(types, str) else list(types)
    names += ["null"] if spec.get("nullable") else []
    if any(n not in _JSON_TYPES for n in names):
        return True
    if isinstance(value, bool) and "boolean" not in names:
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return any(isinstance(value, _JSON_TYPES[n]) for n in names)


def _check_arguments(call: ToolCall, tools: Mapping[str, Tool]) -> str | None:
    """Why `call` cannot be made (unknown tool, missing or unexpected arguments, an argument whose JSON type or value
    its parameter's schema does not allow), or None."""
    if call.name not in tools:
        return f"unknown tool {call.name!r}; the tools are {', '.join(sorted(tools))}"
    params = tools[call.name].parameters
    properties = params.get("properties", {})
    known, required = set(properties), set(params.get("required", []))
    if missing := sorted(required - set(call.arguments)):
        return f"tool {call.name!r} needs the argument(s) {', '.join(missing)}"
    if extra := sorted(set(call.arguments) - known):
        return f"tool {call.name!r} has no argument(s) {', '.join(extra)}; its arguments are {', '.join(sorted(known))}"
    for arg, value in call.arguments.items():
        spec = properties[arg]
        if not _type_fits(value, spec):
            got = "not a finite number" if isinstance(value, float) and not math.isfinite(value) else \
                _JSON_NAMES.get(type(value), type(value).__name__)
            return f"tool {call.name!r}: argument {arg} must be of type {spec['type']}, got {got}"
        if "enum" in spec and value not in spec["enum"]:
            return f"tool {call.name!r}: argument {arg} must be one of {spec['enum']}, got {value!r}"
    return None


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str, tools: Mapping[str, Tool]) -> ParsedCalls:
    """Calls in Hermes / Qwen format: each `<tool_call>` tag holds `{"name": ..., "arguments": {...}}` (arguments may
    also be a JSON string of that object). The first malformed call makes the reply's `error`."""
    calls = []
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            return ParsedCalls(error=f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
        except (ValueError, RecursionError) as exc:  # past the interpreter's limits: an integer of more digits than
            why = "it nests too deeply" if isinstance(exc, RecursionError) else str(exc).split(";")[0]  # int() takes
            return ParsedCalls(error=f"the tool call cannot be read ({why})")
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return ParsedCalls(error='a tool call must be {"name": <tool>, "arguments": {<argument>: <value>}}')
        call = ToolCall(obj["name"], args)
        if problem := _check_arguments(call, tools):
            return ParsedCalls(error=problem)
        calls.append(call)
    return ParsedCalls(tuple(calls))


_OPENED = re.compile(r"([^\W\d]\w*)\(")  # a Python identifier and an opening parenthesis


def _closing(text: str, start: int) -> int:
    """The index of the `)` that closes the parenthesis opened just before `start`, or -1 if none does."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return -1


def parse_call(text: str, tools: Mapping[str, Tool]) -> ParsedCalls:
    """One call written `name(argument)`: the whole reply (stripped) is the call, and the text between its outer
    parentheses, whose parentheses balance, is the tool's first parameter. A reply starting `name(` for a known tool
    but not of that form (a parenthesis never closed, text after the closing one: a second call, `calc(1)(2)`,
    `calc(2*3))`) is malformed; anything else (an unknown name included) is an answer."""
    text = text.strip()
    opened = _OPENED.match(text)
    if opened is None or opened.group(1) not in tools:
        return ParsedCalls()
    name = opened.group(1)
    close = _closing(text, opened.end())
    if close != len(text) - 1:
        return ParsedCalls(error=f"a call is written {name}(<argument>) and nothing else, its parentheses balanced")
    argument = text[opened.end():close]
    names = list(tools[name].parameters.get("properties", {}))
    if not names:
        return ParsedCalls(error=f"tool {name!r} takes no argument; call it as {name}()") if argument else \
            ParsedCalls((ToolCall(name, {}),))
    call = ToolCall(name, {names[0]: argument})
    problem = _check_arguments(call, tools)
    return ParsedCalls(error=problem) if problem else ParsedCalls((call,))


def call_format_problem(tool: Tool) -> str | None:
    """Why the `call` format (`parse_call`) can never make a call of `tool` that could succeed, or None: the format
    names the tool by a Python identifier and passes one text argument, as the tool's first parameter, so the other
    parameters must have defaults and the first must take a string."""
    if not tool.name.isidentifier():
        return f"tool {tool.name!r}: the call format names a tool by a Python identifier"
    properties = tool.parameters.get("properties", {})
    first = next(iter(properties), None)
    if others := sorted(set(tool.parameters.get("required", [])) - {first}):
        return (f"tool {tool.name!r} requires the argument(s) {', '.join(others)} besides its first; the call format "
                f"passes one text argument, as the first parameter ({tool.name}(<text>)): give the others defaults, "
                "or use env.parser=hermes")
    if first is not None and not _type_fits("text", {"type": properties[first].get("type")}):
        return (f"tool {tool.name!r}: its first parameter {first} takes {properties[first]['type']}, but the call "
                f"format passes it as text ({tool.name}(<text>)): annotate it str and convert it in the tool, or use "
                "env.parser=hermes")
    return None


PARSERS: dict[str, Callable[[str, Mapping[str, Tool]], ParsedCalls]] = {"hermes": parse_hermes, "call": parse_call}


@dataclass(frozen=True)
class ToolResult:
    """A call's observation text and how it went: "ok", "error" (raised), "timeout", "bad_return" (not a str)."""

    content: str
    status: str = "ok"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_calls(calls: Sequence[ToolCall], tools: Mapping[str, Tool], pool: DeadlinePool,
              max_chars: int = 2000) -> list[ToolResult]:
    """Run `calls` in `pool` (one deadline for them all: `pool.timeout_s`) and return one result per call, in order;
    never raises for what a tool does. Output beyond `max_chars` characters is cut, with a note saying so."""
    outcomes = pool.map([(tools[c.name].fn, (), dict(c.arguments)) for c in calls])
    results = []
    for call, outcome in zip(calls, outcomes, strict=True):
        if outcome.timed_out:
            results.append(ToolResult(f"error: {call.name} timed out after {pool.timeout_s:g} s", "timeout"))
        elif outcome.error is not None:
            message = str(outcome.error).splitlines()[0] if str(outcome.error) else ""
            results.append(ToolResult(f"error: {type(outcome.error).__name__}: {message}"[:max_chars], "error"))
        elif not isinstance(outcome.value, str):
            results.append(ToolResult(f"error: {call.name} returned {type(outcome.value).__name__}, not text",
                                      "bad_return"))
        else:
            text = outcome.value
            results.append(ToolResult(text if len(text) <= max_chars else
                                      text[:max_chars] + f" [cut at {max_chars} of {len(text)} characters]"))
    return results


# ---- built-in tools --------------------------------------------------------------------------------------------------

_OPS: dict[type, Callable[[int, int], int]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_MAX_DIGITS = 40  # operands and results beyond this many digits are refused (no exponent blow-ups to evaluate)


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.FloorDiv)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if right == 0:
            raise ZeroDivisionError("division by zero")
        if left % right:
            raise ValueError(f"{left}/{right} is not a whole number")
        value = left // right
    else:
        raise ValueError("only integers, + - * / and parentheses are allowed")
    if len(str(abs(value))) > _MAX_DIGITS:
        raise ValueError(f"the result has more than {_MAX_DIGITS} digits")
    return value


def calc(expression: str) -> str:
    """Evaluate an integer arithmetic expression exactly.

    Args:
        expression: integers with + - * / and parentheses, e.g. 482*37 or (12+3)*4
    """
    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    return str(_evaluate(tree.body))


def make_python_tool(packages: Sequence[str] = (), timeout_s: float = 5.0, memory_mb: int = 512,
                     max_output_bytes: int = 16 << 10) -> Callable[[str], str]:
    """The `python` tool with its own limits: `packages` are top-level modules of the trainer's environment the model's
    programs may import besides the standard library (e.g. ("numpy", "sympy"); `gspo.sandbox.package_dirs`, a name that
    is not installed is a ValueError now, not an error at the first call), `timeout_s` the wall-clock and CPU seconds
    of a program, `memory_mb` its address space, `max_output_bytes` what it may print. Use it from your own module, as
    `env.tools: ["my_tools.py:python"]` with `python = make_python_tool(packages=("numpy",))` in my_tools.py: the
    model sees the same tool, named `python`, whose description names the packages."""
    from gspo.sandbox import check_limits, package_dirs

    check_limits(timeout_s, timeout_s, memory_mb, 32, max_output_bytes)
    package_dirs(packages)  # before the tuple: a string ("numpy") is refused as such, not read as letters
    packages = tuple(packages)
    may_import = f"the standard library and {', '.join(packages)}" if packages else "standard library only"

    def python(code: str) -> str:
        from gspo.sandbox import run_sandboxed

        result = run_sandboxed(code, timeout_s=timeout_s, cpu_s=timeout_s, memory_mb=memory_mb,
                               max_output_bytes=max_output_bytes, packages=packages)
        if result.reason == "passed":
            return result.stdout
        tail = result.stderr.strip().splitlines()[-1:] or [""]
        return f"error: {result.reason}" + (f": {tail[0]}" if tail[0] else "")

    # the schema the model is shown comes from this docstring (`Tool.from_function`)
    python.__doc__ = (f"Run a Python program in a sandbox ({may_import}, no network, {timeout_s:g} s; it can read the "
                      "machine's\n    world-readable files but write only in its own temporary folder) and return "
                      "what it printed.\n\n    Args:\n        code: the program; print the values you need\n    ")
    return python


python = make_python_tool()
"""The built-in `python` tool: the model's program in the sandbox, standard library only, 5 s, 512 MB."""


TOOLS: dict[str, Callable[..., Any]] = {"calc": calc, "python": python}
"""The built-in tools by name (`env.tools` in a config may also name `package.module:function`)."""


def resolve_tool(spec: str) -> Tool:
    """The tool `spec` names: a `TOOLS` name or an import path `package.module:function` (or a .py file path before
    the colon), imported by the rules reward functions use. Raises ValueError naming the spec."""
    from gspo.rewards import resolve_reward

    builtin = f"(built-in tools: {sorted(TOOLS)})"
    if spec in TOOLS:
        return Tool.from_function(TOOLS[spec])
    if ":" not in spec and "." not in spec:
        raise ValueError(f"unknown tool {spec!r}: not a built-in tool {sorted(TOOLS)} nor an import path "
                         "'package.module:function'")
    try:
        fn = resolve_reward(spec)
    except ValueError as exc:
        raise ValueError(import_error(exc, spec, "tool", builtin)) from None
    return Tool.from_function(fn)


def import_error(exc: ValueError, spec: str, what: str, listing: str = "") -> str:
    """`resolve_reward`'s message for `spec` as one about `what` (a tool, env.name): "reward" renamed, and its list of
    registered rewards, which says nothing about a tool or an environment, replaced by `listing`."""
    from gspo.rewards import REWARDS

    message = str(exc).replace(f"reward spec {spec!r}", f"{what} {spec!r}", 1).replace(f"reward {spec!r}",
                                                                                        f"{what} {spec!r}", 1)
    suffix = f"(registered rewards: {sorted(REWARDS)})"
    return message.replace(f" {suffix}", f" {listing}" if listing else "", 1)
