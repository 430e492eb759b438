"""Real data: the canonical solutions of public code benchmarks score 1.0 under ``CodeExecutionReward``;
an empty or a wrong body scores 0.

The problems (``tests/fixtures/code_benchmarks/``, whose README.md gives sources and licenses) are
scored as training scores them: one batch per layout through ``IsolatedReward`` with 2 workers, each
row's own columns, the solution as a ```python block. A failure names the problem and what its first
failing test printed.
"""

from __future__ import annotations

import ast
import os
import re

import pytest
from helpers.code_benchmarks import COLUMNS, problems, reward_problem

from lit_offpolicy.rewards import CodeExecutionReward, IsolatedReward, RewardInputs, WeightedRewards
from lit_offpolicy.rewards.code import code_tests, extract_code

MIN_PROBLEMS = 100
EXPLAINED = 5  # failures run again to show their output
EVERY_NTH = 10  # the empty and wrong bodies are scored on every 10th problem (README.md: all, once)
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the full sandbox needs root (CI runs as root)")
pytestmark = [pytest.mark.slow, root_only]  # real sandboxed processes: test-numerics leaves them out


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def entry_point(layout: str, row: dict) -> str:
    """The function the tests call: HumanEval's ``entry_point``; in MBPP, the canonical code's top-level
    function that the first test calls."""
    if layout == "humaneval":
        return row["entry_point"]
    names = [node.name for node in ast.parse(extract_code(row["solution"])).body if hasattr(node, "name")]
    return next(name for name in reversed(names) if re.search(rf"\b{name}\s*\(", row["test_list"][0]))


@pytest.fixture(scope="module")
def reward():
    """The reward in 2 worker processes, as ``reward.workers: 2`` runs it."""
    isolated = IsolatedReward(WeightedRewards({"code": CodeExecutionReward()}), timeout=600.0, num_workers=2)
    yield isolated
    isolated.close()


def scores(
    reward: IsolatedReward, layout: str, rows: list[dict], completions: list[str], prompt: bool = True
) -> list[float]:
    batch = [reward_problem(layout, row, prompt) for row in rows]
    out = reward(RewardInputs.of(batch, completions, [[0]] * len(completions)))
    assert out.num_errors == 0 and out.num_timeouts == 0, (
        f"{layout}: {out.num_errors} errors, {out.num_timeouts} timeouts"
    )
    return out.scores


def what_it_printed(row: dict, completion: str) -> str:
    """The first failing test of ``completion`` on ``row``, run again: its exit status and output."""
    code = extract_code(completion) or ""
    sandbox = CodeExecutionReward().sandbox
    for index, test in enumerate(code_tests(code, row)):
        result = sandbox.run(test.program, test.stdin)
        if not (result.succeeded and test.passed(result.stdout)):
            return (
                f"test {index}: exit status {result.returncode}, timed out {result.timed_out}, "
                f"stdout {result.stdout[-300:]!r}, stderr {result.stderr[-1200:]!r}"
            )
    return "every test passed when run again (a flaky run?)"


@pytest.mark.parametrize("layout", list(COLUMNS))
def test_canonical_solutions_score_1(layout, reward):
    rows = problems(layout)
    assert len(rows) >= MIN_PROBLEMS, f"{layout}: {len(rows)} problems in the fixture"
    got = scores(reward, layout, rows, [row["solution"] for row in rows])
    failed = [(row, score) for row, score in zip(rows, got, strict=True) if score != 1.0]
    explained = [  # the first few run again for their output; a broken sandbox fails them all
        f"{row['task_id']}: scored {score}; {what_it_printed(row, row['solution'])}"
        for row, score in failed[:EXPLAINED]
    ]
    others = ", ".join(str(row["task_id"]) for row, _ in failed[EXPLAINED:])
    assert not failed, f"{layout}: {len(failed)} canonical solutions below 1.0:\n" + "\n".join(
        explained + ([f"also: {others}"] if others else [])
    )


@pytest.mark.parametrize("layout", list(COLUMNS))
@pytest.mark.parametrize("body", ["empty", "wrong"])
def test_an_empty_or_wrong_body_scores_0(layout, body, reward):
    """Empty: a ```python block with nothing in it. Wrong: the entry point, defined to return None."""
    rows = problems(layout)[::EVERY_NTH]
    completions = [
        fenced("")
        if body == "empty"
        else fenced(f"def {entry_point(layout, row)}(*args, **kwargs):\n    return None")
        for row in rows
    ]
    got = scores(reward, layout, rows, completions)
    passed = [
        f"{row['task_id']}: scored {score}" for row, score in zip(rows, got, strict=True) if score != 0.0
    ]
    assert not passed, f"{layout}: {body} bodies scored above 0:\n" + "\n".join(passed)


def prompt_helpers(row: dict) -> list[str]:
    """The HumanEval prompt's top-level functions, other than the entry point, that its test calls."""
    used = {node.id for node in ast.walk(ast.parse(row["test"])) if isinstance(node, ast.Name)}
    functions = [node.name for node in ast.parse(row["prompt"]).body if isinstance(node, ast.FunctionDef)]
    return [name for name in functions if name != row["entry_point"] and name in used]


def echo(name: str) -> str:
    """A function that returns its one argument, or 0.0: as the helper and the entry point, it passes
    ``candidate(encode_cyclic(s)) == s`` and ``abs(poly(xs, candidate(xs))) < 1e-4``."""
    return f"def {name}(*args, **kwargs):\n    return args[0] if len(args) == 1 else 0.0\n"


def test_redefining_a_function_the_prompt_gives_scores_0_and_honest_solutions_keep_1(reward):
    """Every real row whose test calls a function its prompt gives: the attack (that function and the
    entry point redefined by ``echo``) passes where the reward is not given the prompt, and scores 0 where
    it is; the canonical solution (the prompt's function left as it is) and the canonical solution behind
    a helper of the completion's own keep 1.0."""
    rows = [row for row in problems("humaneval") if prompt_helpers(row)]
    assert [row["task_id"] for row in rows] == ["HumanEval/32", "HumanEval/38", "HumanEval/50"]
    attacks = [
        fenced("\n".join(echo(name) for name in [*prompt_helpers(row), row["entry_point"]])) for row in rows
    ]
    own = [
        fenced(
            extract_code(row["solution"]).replace(f"def {row['entry_point']}(", "def own_helper(")
            + f"\n\ndef {row['entry_point']}(*args):\n    return own_helper(*args)\n"
        )
        for row in rows
    ]
    assert scores(reward, "humaneval", rows, attacks, prompt=False) == [1.0] * len(rows)  # the attack works
    got = scores(reward, "humaneval", rows * 3, attacks + [row["solution"] for row in rows] + own)
    assert got == [0.0] * len(rows) + [1.0] * 2 * len(rows), got
