"""``CodeExecutionReward``: run the completion's code against the row's tests in a sandbox.

The score is the fraction of the row's tests that pass (a crash, a time-out or too much output fails
the test). A completion without a fenced code block scores 0 and counts as malformed; a row without
tests gets None (the reward does not apply). The tests are read from the columns of public code-RL
datasets, the first present of:

- ``input_output`` (APPS, TACO; a JSON string or a mapping): ``{"inputs": [...], "outputs": [...]}``
  are stdin / expected stdout pairs; with ``"fn_name"``, each input is the argument list of that
  function (a top-level one, or a method of ``Solution``) and the output its return value (APPS
  wraps it in a one-element list; either form matches);
- ``verification_info`` (open-r1's verifiable coding problems): ``{"test_cases": [{"input": ...,
  "output": ...}, ...]}``, stdin / expected stdout;
- ``test_list`` (MBPP): assert statements, one test each, after ``test_setup_code`` where given;
- ``test`` (HumanEval, with ``entry_point``: ``check(entry_point)`` is called; else plain asserts):
  one test, which calls the prompt's own version of a function the prompt gives (``prompt_functions``).

Expected stdout matches when the lines match with trailing whitespace and trailing blank lines ignored.
A sample's tests run in one sandbox run (``lit_offpolicy.rewards.sandbox``, which says what is
isolated) of the trusted harness (``lit_offpolicy.rewards.code_harness``, which says what it checks):
each test in a child process of its own, with its own deadline; a batch's samples run in parallel
across ``reward.workers``. An assert test passes only if it ran to its end: a program that exits first
or returns a value whose type lies about equality fails it, and the samples that tried are counted
(``reward/code/exited_early_fraction``, ``reward/code/lying_equality_fraction``).
"""

from __future__ import annotations

import ast
import base64
import contextlib
import json
import logging
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lit_offpolicy.rewards import code_harness
from lit_offpolicy.rewards.contract import RewardOutput, completion_text
from lit_offpolicy.rewards.sandbox import RunResult, Sandbox, SandboxLimits
from lit_offpolicy.rewards.verifiers import REWARDS

log = logging.getLogger(__name__)

HARNESS = Path(code_harness.__file__).read_text()
HARNESS_START_S = 5.0
"""Seconds a harness run gets on top of its tests' deadlines: its own start, each child's kill."""
FENCE = re.compile(r"```[ \t]*([\w+#-]*)[^\n]*\n(.*?)```", re.DOTALL)
PYTHON_TAGS = ("", "python", "py", "python3")

CALL_HARNESS = """

import json as __json, sys as __sys
__name = {name!r}
__function = globals().get(__name) or getattr(globals()["Solution"](), __name)
print(__json.dumps(__function(*__json.loads(__sys.stdin.read()))))
"""


@dataclass(frozen=True)
class CodeTest:
    """One run of the code: its program and input, and what passing means."""

    program: str
    stdin: str = ""
    expected_stdout: str | None = None
    """The output to match line by line; None: the program must exit with status 0."""
    expected_value: Any = None
    """With ``call``: the function's return value (JSON)."""
    call: bool = False
    code: str = ""
    """With ``check``: the completion's code alone."""
    check: str | None = None
    """The dataset's own test (asserts, HumanEval's ``check(...)`` after the prompt's functions), run by
    the harness against ``code``; ``program`` is the two together, as one would run them by hand."""

    def passed(self, stdout: str) -> bool:
        if self.call:
            lines = stdout.strip().splitlines()
            try:
                value = json.loads(lines[-1]) if lines else None
            except ValueError:
                return False
            return value == self.expected_value or [value] == self.expected_value
        if self.expected_stdout is None:
            return True
        return _lines(stdout) == _lines(self.expected_stdout)


def extract_code(text: str) -> str | None:
    """The last fenced code block that is Python (or untagged); None where there is none."""
    blocks = [body for tag, body in FENCE.findall(text) if tag.lower() in PYTHON_TAGS]
    return blocks[-1] if blocks else None


def code_tests(code: str, row: Mapping[str, Any]) -> list[CodeTest] | None:
    """The row's tests of ``code`` (see the module's layouts); None where the row has none."""
    if row.get("input_output") not in (None, ""):
        spec = _json(row["input_output"])
        inputs, outputs = spec.get("inputs", []), spec.get("outputs", [])
        name = spec.get("fn_name")
        if name:
            program = code + CALL_HARNESS.format(name=name)
            return [
                CodeTest(program, json.dumps(args), expected_value=out, call=True)
                for args, out in zip(inputs, outputs, strict=True)
            ]
        return [
            CodeTest(code, _text(i), expected_stdout=_text(o)) for i, o in zip(inputs, outputs, strict=True)
        ]
    if row.get("verification_info") not in (None, ""):
        cases = _json(row["verification_info"]).get("test_cases", [])
        return [
            CodeTest(code, _text(c.get("input", "")), expected_stdout=_text(c.get("output", "")))
            for c in cases
        ]
    if row.get("test_list"):
        setup = row.get("test_setup_code") or ""
        checks = [f"{setup}\n{statement}\n" for statement in row["test_list"]]
        return [CodeTest(f"{code}\n\n{check}", code=code, check=check) for check in checks]
    if row.get("test"):
        entry = row.get("entry_point")
        given = prompt_functions(row, entry)
        check = given + row["test"] + (f"\ncheck({entry})\n" if entry else "\n")
        code = opened_with(given, code)
        return [CodeTest(f"{code}\n\n{check}", code=code, check=check)]
    return None


def prompt_functions(row: Mapping[str, Any], entry: str | None) -> str:
    """The prompt's finished top-level functions other than ``entry``, after its imports, as source.

    HumanEval's tests call functions its prompt gives (``encode_cyclic`` beside ``decode_cyclic``,
    ``poly`` beside ``find_zero``). Put before the test, they run in the harness as the prompt wrote
    them: a completion that redefines one (as the identity, say) changes only its own code. A function
    whose body is only a docstring, ``pass`` or ``...`` is the completion's to write. "" where the
    prompt gives none, or is not Python.
    """
    tree = _prompt_code(row)
    if tree is None:
        return ""
    imports = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    functions = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name != entry and not _stub(node)
    ]
    return ast.unparse(ast.Module([*imports, *functions], type_ignores=[])) + "\n\n" if functions else ""


def opened_with(given: str, code: str) -> str:
    """``given`` (the prompt's functions) before ``code``, after the module docstring and ``from
    __future__`` imports that must open it: the completion calls them as HumanEval's prompt + completion
    does (``decode_cyclic`` returning ``encode_cyclic(encode_cyclic(s))``)."""
    if not given:
        return code
    try:
        body = ast.parse(code).body
    except SyntaxError:
        return given + code
    opening = 1 if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else 0
    while (
        opening < len(body)
        and isinstance(body[opening], ast.ImportFrom)
        and body[opening].module == "__future__"
    ):
        opening += 1
    if not opening:
        return given + code
    lines = code.splitlines(keepends=True)
    end = body[opening - 1].end_lineno
    return "".join(lines[:end]) + "\n" + given + "".join(lines[end:])


def _prompt_code(row: Mapping[str, Any]) -> ast.Module | None:
    """The row's ``prompt`` column, else its prompt (chat messages: their text), parsed as Python, or
    failing that its last Python block; None where neither parses."""
    prompt = row.get("prompt") or row.get("prompts")
    if isinstance(prompt, list):
        prompt = "\n".join(str(m.get("content", "")) for m in prompt if isinstance(m, Mapping))
    if not isinstance(prompt, str):
        return None
    for text in (prompt, extract_code(prompt)):
        with contextlib.suppress(SyntaxError, ValueError, TypeError):
            return ast.parse(text)
    return None


@dataclass(frozen=True)
class TestOutcome:
    """How one test ended in the harness (``code_harness.OUTCOMES``) and whether it passed."""

    passed: bool
    outcome: str
    """``passed``, ``failed``, ``exited_early``, ``lying_equality``, ``timed_out``, ``output_exceeded``,
    ``ran`` (a stdin test that ended by itself), or ``not_run`` (the harness never reported it)."""
    detail: str = ""
    """Why it failed: the exception, and the end of the program's stderr."""


@REWARDS.register("code")
class CodeExecutionReward:
    """The fraction of the row's tests the completion's code passes, each run in a sandbox.

    Args:
        timeout_s, memory_mb, file_mb, processes, open_files, output_kb: each test run's limits
            (``SandboxLimits``).
        isolation: "auto" (root: the full sandbox; otherwise refused), "full", or "limits_only" (the
            limits alone: no security boundary; see ``lit_offpolicy.rewards.sandbox``).
    """

    def __init__(
        self,
        timeout_s: float = 10.0,
        memory_mb: int = 1024,
        file_mb: int = 16,
        processes: int = 32,
        open_files: int = 64,
        output_kb: int = 1024,
        isolation: str = "auto",
    ) -> None:
        self.limits = SandboxLimits(timeout_s, memory_mb, file_mb, processes, open_files, output_kb)
        self.sandbox = Sandbox(self.limits, isolation)
        self._sandboxes: dict[int, Sandbox] = {}
        self.sandbox.check()  # refused here, at start-up, where it cannot isolate
        if self.sandbox.mode() == "limits_only":
            log.warning(
                "lit-offpolicy: warning: CodeExecutionReward isolation: limits_only: the policy's code runs "
                "as this user, with this machine's network and files, under resource limits only; no "
                "security boundary (docs/rewards.md, 'The sandbox')"
            )

    def __call__(self, completions: list, **columns: list) -> RewardOutput:
        scores: list[float | None] = []
        malformed = 0
        tried = {"code/exited_early": 0, "code/lying_equality": 0}
        for index, completion in enumerate(completions):
            row = {name: values[index] for name, values in columns.items()}
            code = extract_code(completion_text(completion))
            tests = code_tests(code or "", row)
            if tests is None:
                scores.append(None)
            elif code is None or not tests:
                malformed += code is None
                scores.append(0.0)
            else:
                outcomes = self.run_tests(tests)
                scores.append(sum(outcome.passed for outcome in outcomes) / len(tests))
                for name in tried:
                    tried[name] += any(outcome.outcome == name.split("/")[1] for outcome in outcomes)
        return RewardOutput(scores, malformed, counts=tried)

    def run_tests(self, tests: list[CodeTest]) -> list[TestOutcome]:
        """Run ``tests`` in one sandbox run of the harness; how each ended (the lines it did not
        report, or that do not carry this run's nonce, did not pass)."""
        nonce = secrets.token_hex(16)
        payload = {
            "nonce": nonce,
            "timeout_s": self.limits.timeout_s,
            "output_bytes": self.limits.output_kb * 1024,
            "tests": [
                {"code": test.code, "check": test.check}
                if test.check is not None
                else {"program": test.program, "stdin": test.stdin}
                for test in tests
            ],
        }
        result = self._harness_sandbox(len(tests)).run(HARNESS, json.dumps(payload))
        reported = _reported(result, nonce)
        return [_judge(test, reported.get(index)) for index, test in enumerate(tests)]

    def _harness_sandbox(self, tests: int) -> Sandbox:
        """A sandbox whose runs have room for the harness and up to ``tests`` tests rounded up to a power
        of two (each its ``timeout_s`` and ``output_kb``, in base64); one kept per size."""
        size = 1 << (tests - 1).bit_length()
        if size not in self._sandboxes:
            limits = replace(
                self.limits,
                timeout_s=size * (self.limits.timeout_s + 1.0) + HARNESS_START_S,
                output_kb=size * (math.ceil(self.limits.output_kb * 4 / 3) + 8) + 16,
            )
            self._sandboxes[size] = Sandbox(limits, self.sandbox.isolation)
        return self._sandboxes[size]


def _reported(result: RunResult, nonce: str) -> dict[int, dict]:
    """The harness's outcome lines by test index: those that start with ``nonce``."""
    reported = {}
    for line in result.stdout.splitlines():
        if line.startswith(f"{nonce} "):
            outcome = json.loads(line[len(nonce) + 1 :])
            reported[outcome["test"]] = outcome
    return reported


def _judge(test: CodeTest, reported: dict | None) -> TestOutcome:
    """Whether ``test`` passed, from the harness's line for it (a stdin test's stdout judged here)."""
    if reported is None:
        return TestOutcome(False, "not_run", "the harness did not report it (its run ended first)")
    outcome, detail = reported["outcome"], reported.get("detail", "")
    if outcome not in code_harness.OUTCOMES:
        return TestOutcome(False, "failed", f"the harness reported {outcome!r}")
    if outcome != "ran":
        return TestOutcome(outcome == "passed", outcome, detail)
    stdout = base64.b64decode(reported["stdout"]).decode(errors="replace")
    passed = reported["status"] == 0 and test.passed(stdout)
    return TestOutcome(passed, "passed" if passed else "failed", detail)


def _stub(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether ``function``'s body is only a docstring, ``pass`` or ``...`` (left for the completion)."""
    return all(
        isinstance(node, ast.Pass) or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        for node in function.body
    )


def _json(value: Any) -> dict:
    return json.loads(value) if isinstance(value, str) else dict(value)


def _text(value: Any) -> str:
    """A test's input or output as text (TACO keeps some as lists of lines)."""
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines
