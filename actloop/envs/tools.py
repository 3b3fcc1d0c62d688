"""`ToolEnv`: a multi-turn environment whose tools are plain typed Python functions.

    class Calculator(ToolEnv):
        def prompt(self, row):
            return [Message("user", row["question"])]

        @tool
        def calculator(self, expression: str) -> str:
            \"\"\"Evaluate an arithmetic expression.

            Args:
                expression: e.g. 23 * 17 + 4
            \"\"\"
            return str(eval_arithmetic(expression))

A tool is a method marked `@tool`, or a plain function listed in the class attribute `tools`.
Its OpenAI schema (what `reset` returns, what the renderer shows the model) comes from its type
hints and its docstring: the first paragraph is the description, each ``Args:`` line a
parameter's description (`transformers.utils.get_json_schema`, the same reader the chat
templates' tool support uses; a tool without a described argument is refused when the class is
first used).

Never write a tool-call spelling into the prompt: the chat format declares the tools from their
schemas (Qwen3's and gpt-oss's templates their own way), and worked examples are assistant
`Message`s with `tool_calls=(ToolCall(name, arguments),)` followed by `tool` messages, which each
format spells its own way. For a chat template that cannot declare tools (SmolLM2's), the
renderer writes a tool prompt into the system message; `tool_prompt` words it (see below).

`step` runs every call of the assistant message in order and answers each with a `tool` message.
What goes wrong is answered to the model as an ``Error: ...`` tool message and counted in
`info["tool_errors"]`, never raised: an unknown tool, arguments that do not fit the signature or
the schema's JSON types, a tool that raises (`ToolError("text")` shows just the text; any other
exception its type and text; `report_exceptions` narrows which). A tool that raised anything but
a `ToolError` is also reported to you: `info["tool_raised"]` (a line each, with your file and line)
and `info["tool_traceback"]` (the first one's) become `tool` failures in `failures.jsonl`, and a
step in which a tool raised in at least half of the episodes prints a line saying so. A reply
without a tool call ends the episode (override `finish` to do more). `max_tool_calls` limits
calls per episode: the call past it is refused and the episode ends. `close()` is called whenever an episode ends, however it ends.
"""

from __future__ import annotations

import functools
import inspect
import json
import typing
from typing import Any, Callable, ClassVar, Sequence

from transformers.utils import get_json_schema

from actloop.envs.base import StepResult
from actloop.types import Message, ToolCall, example_arguments, user_error

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, (list, tuple)),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


class ToolError(Exception):
    """Raise from a tool to answer the model with ``Error: <text>`` (counted as a tool error)."""


def tool(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a method of a `ToolEnv` subclass as a tool."""
    fn.__actloop_tool__ = True  # type: ignore[attr-defined]
    return fn


@functools.lru_cache(maxsize=None)
def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI function schema of `fn` from its type hints and docstring (``Args:`` section).
    A method's `self` is not a parameter."""
    try:
        schema = get_json_schema(_without_receiver(fn))
    except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
        raise TypeError(f"tool `{getattr(fn, '__name__', fn)}`: {e} (every argument needs a type hint and a line "
                        "in the docstring's Args: section)") from None
    schema["function"].pop("return", None)
    return schema


def _without_receiver(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as get_json_schema should see it: a method's `self` dropped (older transformers
    releases require a type hint on every parameter), type hints already resolved."""
    params = list(inspect.signature(fn).parameters.values())
    if not params or params[0].name not in ("self", "cls"):
        return fn

    def stub(*args: Any, **kwargs: Any) -> Any: ...

    hints = typing.get_type_hints(fn)
    stub.__name__, stub.__doc__ = fn.__name__, fn.__doc__
    stub.__signature__ = inspect.signature(fn).replace(parameters=params[1:])  # type: ignore[attr-defined]
    stub.__annotations__ = {k: v for k, v in hints.items() if k != params[0].name}
    return stub


def _type_problem(value: Any, schema: dict[str, Any]) -> str | None:
    kinds = schema.get("type")
    if kinds is None:
        return None
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if any(_JSON_TYPES.get(k, lambda v: True)(value) for k in kinds):
        return None
    return f"must be {' or '.join(kinds)}, got {type(value).__name__}"


class ToolEnv:
    """Base class for tool environments; write `prompt(row)` and the tools (see the module doc)."""

    tools: ClassVar[Sequence[Callable[..., Any]]] = ()  # plain functions, besides the @tool methods
    # the wording of the tool prompt that the renderer writes for a chat template that cannot
    # declare tools (SmolLM2's): a template with `{system}` (the prompt's system message), and
    # optionally `{tools}` (a line per tool) and `{call}` (a call of the first tool, spelled in the
    # format's syntax), e.g. "You have a calculator. Call it as {call}. {system}". Empty = the
    # format's default; `rollout.tool_prompt` overrides it; formats that declare tools ignore it.
    tool_prompt: ClassVar[str] = ""
    max_tool_calls: int | None = None  # tool calls per episode; None = only the rollout's turn limit
    # exceptions of a tool answered to the model; any other one fails the episode (recorded, masked):
    # narrow it to (ToolError,) when a tool's own exceptions mean broken infrastructure, not a bad call
    report_exceptions: ClassVar[tuple[type[Exception], ...]] = (Exception,)

    def prompt(self, row: dict[str, Any]) -> list[Message]:
        """The opening messages for `row` (system prompt, examples, the question)."""
        raise NotImplementedError("a ToolEnv subclass writes prompt(row)")

    # -------------------------------------------------------------------------------- episode

    def reset(self, row: dict[str, Any]) -> tuple[list[Message], list[dict[str, Any]]]:
        self.row = row
        self.tool_calls_run = self.tool_errors = 0
        self.tool_raised: list[str] = []  # a line per exception a tool raised (ToolError aside), first 5
        self.tool_traceback: str | None = None  # the first one's
        return self.prompt(row), self.tool_schemas()

    def step(self, message: Message) -> StepResult:
        if not message.tool_calls:
            return self.finish(message)
        out, done = [], False
        for call in message.tool_calls:
            if self.max_tool_calls is not None and self.tool_calls_run >= self.max_tool_calls:
                self.tool_errors += 1
                out.append(Message("tool", f"Error: no more than {self.max_tool_calls} tool calls; the episode ends.",
                                   name=call.name))
                done = True
                break
            out.append(self.call_tool(call))
        return StepResult(out, done, self.info())

    def finish(self, message: Message) -> StepResult:
        """A reply without a tool call: the final answer. Ends the episode."""
        return StepResult([], True, self.info())

    def info(self) -> dict[str, Any]:
        """Merged into the trajectory's `info` after every step."""
        out: dict[str, Any] = {"tools_run": self.tool_calls_run, "tool_errors": self.tool_errors}
        if getattr(self, "tool_raised", None):
            out.update(tool_raised=list(self.tool_raised), tool_traceback=self.tool_traceback)
        return out

    def close(self) -> None:
        """Release what the episode holds (override for sessions, containers, files)."""

    # ---------------------------------------------------------------------------------- tools

    def tool_functions(self) -> dict[str, Callable[..., Any]]:
        """name -> callable: the class's `tools` and its `@tool` methods (bound)."""
        found = {f.__name__: f for f in type(self).tools}
        for cls in reversed(type(self).__mro__):
            for name, value in vars(cls).items():
                if getattr(value, "__actloop_tool__", False):
                    found[name] = getattr(self, name)
        return found

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [self._schema(f) for f in self.tool_functions().values()]

    def call_tool(self, call: ToolCall) -> Message:
        """Run one call; whatever goes wrong becomes an ``Error: ...`` message."""
        self.tool_calls_run += 1
        tools = self.tool_functions()
        fn = tools.get(call.name)
        if fn is None:
            self.tool_errors += 1
            names = sorted(tools)
            known = f"the only tool is {names[0]}" if len(names) == 1 else f"the tools are {', '.join(names)}"
            return Message("tool", f"Error: unknown tool {call.name!r}; {known}.", name=call.name)
        problem = self._argument_problem(fn, call.arguments)
        if problem:
            self.tool_errors += 1
            example = json.dumps(example_arguments(self._schema(fn)["function"]["parameters"]))
            return Message("tool", f"Error: the {call.name} tool needs {example} ({problem}).", name=call.name)
        try:
            result = fn(**call.arguments)
        except ToolError as e:
            self.tool_errors += 1
            return Message("tool", f"Error: {e}", name=call.name)
        except self.report_exceptions as e:
            self.tool_errors += 1
            line, tb = user_error(f"tool `{call.name}`")
            raised = self.__dict__.setdefault("tool_raised", [])  # (a subclass's reset may not call ours)
            if len(raised) < 5:
                raised.append(line)
            self.tool_traceback = getattr(self, "tool_traceback", None) or tb
            return Message("tool", f"Error: {type(e).__name__}: {e}", name=call.name)
        return Message("tool", _as_text(result), name=call.name)

    def _schema(self, fn: Callable[..., Any]) -> dict[str, Any]:
        return _method_schema(fn) if inspect.ismethod(fn) else tool_schema(fn)

    def _argument_problem(self, fn: Callable[..., Any], args: dict[str, Any]) -> str | None:
        if not isinstance(args, dict):
            return "arguments must be a JSON object"
        try:
            inspect.signature(fn).bind(**args)
        except TypeError as e:
            return str(e)
        props = self._schema(fn)["function"]["parameters"].get("properties", {})
        for name, value in args.items():
            problem = _type_problem(value, props.get(name, {}))
            if problem:
                return f"`{name}` {problem}"
        return None


def _method_schema(method: Callable[..., Any]) -> dict[str, Any]:
    return tool_schema(method.__func__)  # type: ignore[attr-defined]


def _as_text(result: Any) -> str:
    if result is None:
        return ""
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list, tuple, bool)):
        return json.dumps(result)
    return str(result)
