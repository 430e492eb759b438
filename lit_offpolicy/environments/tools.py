"""``ToolEnvironment``: plain Python functions as tools, called in the Qwen/Hermes format.

A turn calls a tool by writing ``<tool_call>{"name": "calculator", "arguments": {"expression":
"3+4*5"}}</tool_call>`` (several calls may follow each other); each call runs in a forked process
under a time limit, and its result, or an error message, is the observation. A turn without a tool
call is the episode's final answer. Nothing the policy writes can stop the run: a malformed call,
an unknown tool, a tool that raises or one that runs past its limit all answer with an error text.
"""

from __future__ import annotations

import json
import multiprocessing
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lit_offpolicy.core.checks import check_range
from lit_offpolicy.core.registry import Registry
from lit_offpolicy.environments.base import ENVIRONMENTS, Environment, EpisodeState, Observation
from lit_offpolicy.environments.calculator import calculator

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL)

TOOLS: Registry[Callable[..., str]] = Registry("tools")
"""Short names of the built-in tools (functions taking keyword arguments, returning text)."""
TOOLS.register("calculator")(calculator)


@dataclass(frozen=True)
class ToolCall:
    """One parsed ``<tool_call>``: a tool's name and arguments, or why it is unusable."""

    name: str = ""
    """The tool's name ("" where ``error`` is set)."""
    arguments: dict | None = None
    """Its keyword arguments (None where ``error`` is set)."""
    error: str | None = None
    """What made the call unusable (malformed); None: a usable call."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` of ``text`` in order (an unclosed last one included)."""
    calls = []
    for match in _CALL.finditer(text):
        body, closed = match.group(1).strip(), match.group(0).endswith(TOOL_CALL_CLOSE)
        if not closed:
            calls.append(ToolCall(error=f"malformed tool call: no {TOOL_CALL_CLOSE} after {TOOL_CALL_OPEN}"))
            continue
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append(ToolCall(error=f"malformed tool call: invalid JSON ({error.msg})"))
            continue
        name = call.get("name") if isinstance(call, dict) else None
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            calls.append(
                ToolCall(error='malformed tool call: expected {"name": <string>, "arguments": <object>}')
            )
            continue
        calls.append(ToolCall(name, arguments))
    return calls


def call_with_timeout(fn: Callable[..., object], arguments: dict, timeout: float) -> tuple[bool, str]:
    """(True, str(result)) of ``fn(**arguments)`` run in a forked process, or (False, why) where it
    raised, exited without an answer, or ran past ``timeout`` seconds (then it is killed)."""
    receiver, sender = multiprocessing.Pipe(duplex=False)
    process = multiprocessing.get_context("fork").Process(
        target=_call, args=(sender, fn, arguments), daemon=True
    )
    process.start()
    sender.close()
    try:
        if not receiver.poll(timeout):
            return False, f"timed out after {timeout:g} s"
        return receiver.recv()
    except EOFError:
        return False, "exited without a result"
    finally:
        receiver.close()
        if process.is_alive():
            process.kill()
        process.join()


def _call(sender, fn: Callable[..., object], arguments: dict) -> None:
    try:
        sender.send((True, str(fn(**arguments))))
    except Exception as error:  # the tool's own failure, reported to the policy
        sender.send((False, f"raised {type(error).__name__}: {error}"))


@ENVIRONMENTS.register("tools")
class ToolEnvironment(Environment):
    """Runs the tool calls of each turn; a turn without one ends the episode (its final answer).

    Args:
        tools: short names of built-in tools ("calculator"), import paths "pkg.module:fn", or the
            functions themselves; a tool is called with the call's ``arguments`` as keywords and
            answers with text (anything else is written with ``str``). Its name in calls is the
            function's ``__name__``.
        timeout: seconds one call may run; then it is killed and answered with an error.
        max_calls_per_turn: calls of one turn that are run; further ones are answered with an error.
    """

    def __init__(
        self,
        tools: Sequence[str | Callable] = ("calculator",),
        timeout: float = 5.0,
        max_calls_per_turn: int = 4,
    ) -> None:
        check_range("timeout", timeout, low=0.0, low_inclusive=False)
        check_range("max_calls_per_turn", max_calls_per_turn, low=1)
        resolved = [TOOLS.resolve(tool, option="tools") for tool in tools]
        self.tools = list(tools)
        self.functions = {fn.__name__: fn for fn in resolved}
        self.timeout = timeout
        self.max_calls_per_turn = max_calls_per_turn

    def step(self, episode: EpisodeState) -> Observation:
        calls = parse_tool_calls(episode.turns[-1])
        if not calls:
            return Observation(done=True)
        answers, errors = [], 0
        for index, call in enumerate(calls):
            ok, text = self._run(call, index)
            errors += not ok
            answers.append(text if ok else f"error: {text}")
        return Observation(text="\n".join(answers), tool_calls=len(calls), tool_errors=errors)

    def _run(self, call: ToolCall, index: int) -> tuple[bool, str]:
        if call.error is not None:
            return False, call.error
        if index >= self.max_calls_per_turn:
            return False, f"more than {self.max_calls_per_turn} tool calls in one turn"
        fn = self.functions.get(call.name)
        if fn is None:
            return False, f"unknown tool {call.name!r}; available: {', '.join(self.functions)}"
        ok, text = call_with_timeout(fn, call.arguments, self.timeout)
        return ok, text if ok else f"{call.name} {text}"
