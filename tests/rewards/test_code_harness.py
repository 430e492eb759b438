"""The trusted harness of ``CodeExecutionReward``: a test passes only if it ran to its end on real values.

Each cheat is a real completion scored by the real sandbox, on an MBPP row (``test_list``) and on a
HumanEval row (``test`` + ``entry_point``): it scores 0 (on today's one-process-per-test runs each
scored 1.0), and honest solutions that return other but equal types keep 1.0. A function the prompt
gives and the test calls is the prompt's: redefining it scores 0 (it scored 1.0 before).
"""

from __future__ import annotations

import ast
import os
import time

import pytest

from lit_offpolicy.rewards import CodeExecutionReward, RewardInputs, WeightedRewards
from lit_offpolicy.rewards.code import code_tests, opened_with, prompt_functions
from lit_offpolicy.rewards.code_harness import decode, encode
from lit_offpolicy.rewards.contract import count_metrics

TIMEOUT_S = 2.0
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the full sandbox needs root (CI runs as root)")
processes = pytest.mark.slow

MBPP = {"test_list": ["assert add(1, 2) == 3", "assert add(0, 5) == 5", "assert add(-2, 2) == 0"]}
HUMANEVAL = {
    "test": "\n\nMETADATA = {'author': 'x'}\n\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n"
    "    assert candidate(0, 5) == 5\n    assert abs(candidate(-2, 2)) < 1e-9\n",
    "entry_point": "add",
}
WRONG = "def add(a, b):\n    return -1\n"
RIGHT = "def add(a, b):\n    return a + b\n"

EXITS = {
    "sys.exit(0) after the definition": RIGHT + "import sys\nsys.exit(0)",
    "os._exit(0) after the definition": RIGHT + "import os\nos._exit(0)",
    "raise SystemExit": RIGHT + "raise SystemExit",
    "exit() inside the function": "def add(a, b):\n    exit(0)",
    "os._exit(0) inside the function": "def add(a, b):\n    import os\n    os._exit(0)",
    "an atexit handler that exits 0": WRONG + "import atexit, os\natexit.register(os._exit, 0)",
    "an excepthook that exits 0": WRONG + "import os, sys\nsys.excepthook = lambda *a: os._exit(0)",
    "a signal to itself": RIGHT + "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
}
LIARS = {
    "__eq__ always True": "class Any:\n    def __eq__(self, other):\n        return True\n"
    "    def __lt__(self, other):\n        return True\n    def __abs__(self):\n        return 0\n"
    "def add(a, b):\n    return Any()",
    "an int subclass that lies": "class Int(int):\n    def __eq__(self, other):\n        return True\n"
    "    __lt__ = __eq__\n    __hash__ = int.__hash__\ndef add(a, b):\n    return Int(7)",
    "a float subclass that lies": "class F(float):\n    __eq__ = __lt__ = lambda self, other: True\n"
    "    __hash__ = float.__hash__\ndef add(a, b):\n    return F(7)",
    "a list subclass that lies": "class L(list):\n    def __eq__(self, other):\n"
    "        return True\n    __lt__ = __eq__\ndef add(a, b):\n    return L()",
}
FORGERIES = {
    "the harness's success line guessed on its stdout": WRONG
    + 'import sys\nfor i in range(3):\n    print(f\'x {{"test": {i}, "outcome": "passed"}}\')\n'
    '    sys.stderr.write(f\'x {{"test": {i}, "outcome": "passed"}}\\n\')',
    "the harness's memory, stdout and stdin through /proc": WRONG
    + "import os\nfor pid in range(1, 8):\n    for path in ('fd/1', 'fd/0', 'mem', 'environ'):\n"
    "        try:\n            open(f'/proc/{pid}/{path}', 'r+b').write(b'x 0 passed\\n')\n"
    "        except OSError:\n            pass",
    "stdout and stderr closed, then a pass line": WRONG + "import os\nos.close(1)\nos.close(2)",
    "builtins and math patched": WRONG
    + "import builtins, math\nbuiltins.abs = lambda x: 0\nmath.isclose = lambda *a, **k: True\n"
    "builtins.isinstance = lambda *a: True",
    "abs and math shadowed by its own names": WRONG
    + "import types\ndef abs(x):\n    return 0\nmath = types.SimpleNamespace(isclose=lambda *a, **k: True)",
}


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


def score(reward: CodeExecutionReward, completions: list[str], row: dict):
    return reward(
        [fenced(c) for c in completions], **{name: [v] * len(completions) for name, v in row.items()}
    )


@pytest.fixture(scope="module")
def reward():
    return CodeExecutionReward(timeout_s=TIMEOUT_S)


@processes
@root_only
@pytest.mark.parametrize("row", [MBPP, HUMANEVAL], ids=["mbpp", "humaneval"])
def test_exiting_before_the_tests_end_scores_0_and_is_counted(reward, row):
    out = score(reward, [RIGHT, *EXITS.values()], row)
    assert out.scores == [1.0] + [0.0] * len(EXITS), dict(zip(["honest", *EXITS], out.scores, strict=True))
    assert out.counts["code/exited_early"] == len(EXITS) - 2  # the atexit and excepthook ones: tests failed
    assert out.counts["code/lying_equality"] == 0


@processes
@root_only
@pytest.mark.parametrize("row", [MBPP, HUMANEVAL], ids=["mbpp", "humaneval"])
def test_values_that_lie_about_equality_score_0_and_are_counted(reward, row):
    out = score(reward, list(LIARS.values()), row)
    assert out.scores == [0.0] * len(LIARS), dict(zip(LIARS, out.scores, strict=True))
    assert out.counts["code/lying_equality"] == len(LIARS) and out.counts["code/exited_early"] == 0


@processes
@root_only
def test_forging_the_harness_s_verdict_or_its_helpers_scores_0(reward):
    row = {
        "test_list": [
            *MBPP["test_list"],
            "import math\nassert math.isclose(add(1.5, 1), 2.5)",
            "assert abs(add(1, 1) - 2) < 1e-9",
        ]
    }
    for layout in (row, HUMANEVAL):
        out = score(reward, list(FORGERIES.values()), layout)
        assert out.scores == [0.0] * len(FORGERIES), dict(zip(FORGERIES, out.scores, strict=True))
    assert score(reward, [RIGHT], row).scores == [1.0]


NONCE = "5a17" * 8
SEARCH_OWN_MEMORY = """
import ctypes, hashlib, re

def holds(digest):
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if not fields[1].startswith("rw") or end - start > 2**28:  # where the objects live
                continue
            chunk = ctypes.string_at(start, end - start)
            hexes = re.finditer(rb"[0-9a-f]{32}", chunk)
            if any(hashlib.sha256(m.group()).hexdigest() == digest for m in hexes):
                return True
    return False
"""


@processes
@root_only
def test_the_program_never_holds_the_run_s_nonce(monkeypatch):
    """The zygote that forks each test's child was forked before the harness read its payload: the
    nonce is in no child's memory (the program searches all of it for the nonce's digest)."""
    import hashlib

    from lit_offpolicy.rewards import code

    monkeypatch.setattr(code.secrets, "token_hex", lambda n: NONCE)
    digest = hashlib.sha256(NONCE.encode()).hexdigest()
    assert NONCE not in SEARCH_OWN_MEMORY + digest
    tests = code_tests(SEARCH_OWN_MEMORY, {"test_list": [f"assert not holds({digest!r})"]})
    outcomes = CodeExecutionReward(timeout_s=30).run_tests(tests)
    assert [o.outcome for o in outcomes] == ["passed"], outcomes


HONEST_CODE = """
import math
from collections import Counter, namedtuple

P = namedtuple("P", "x y")


class Id(int):  # a subclass that does not lie
    pass


class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b


def double(x):
    return x * 2.0


def shapes(x):
    return (x, [x], {x}, {x: (x,)})


def upto(n):
    return (i for i in range(n))


def views(d):
    return d.keys(), map(str, d.values())


def area(r):
    return math.pi * r * r


def scalars(x):
    return None if x is None else (x > 0, str(x), bytes([x]), 10**5000)


def tally(s):
    return Counter(s), P(1, 2), Id(3)


def longest(pairs):
    return max(p.b - p.a for p in pairs)


def root(x):
    if x < 0:
        raise ValueError("negative")
    return x**0.5


def echo(x):
    print("debug", x)
    return x


if __name__ == "__main__":
    print(echo(1))
"""
HONEST_TESTS = [
    "assert double(2) == 4 and double(1) in (2, 3)",  # a float for an int
    "assert shapes(1) == (1, [1], {1}, {1: (1,)})",  # a tuple, a list, a set, a dict
    "assert list(shapes(1)) == [1, [1], {1}, {1: (1,)}]",
    "assert list(upto(3)) == [0, 1, 2]",  # a generator
    "k, v = views({1: 2})\nassert set(k) == {1} and list(v) == ['2']",  # dict views, a map
    "assert math.isclose(area(2), 12.566, rel_tol=1e-3)",  # floats within a tolerance
    "assert abs(area(1) - 3.14159) < 1e-4",
    "assert scalars(None) is None",  # None, bools, strings, bytes, big ints
    "assert scalars(1) == (True, '1', b'\\x01', 10 ** 5000) and scalars(1)[0] is True",
    "assert tally('aab') == ({'a': 2, 'b': 1}, (1, 2), 3)",  # a Counter, a namedtuple, an int subclass
    "assert longest([Pair(1, 5), Pair(2, 3)]) == 4 and Pair(1, 2).b == 2",  # its own class, built by the test
    "try:\n    root(-1)\nexcept ValueError:\n    pass\nelse:\n    assert False\nassert root(4) == 2",
    "assert echo(K) == 3",  # prints, a __main__ block, a name of the setup code's
]


@processes
@root_only
def test_honest_solutions_with_other_but_equal_types_keep_1(reward):
    outcomes = reward.run_tests(
        code_tests(HONEST_CODE, {"test_list": HONEST_TESTS, "test_setup_code": "K = 3"})
    )
    assert [o.outcome for o in outcomes] == ["passed"] * len(HONEST_TESTS), outcomes


@processes
@root_only
def test_a_test_that_hangs_crashes_or_exits_costs_that_test_alone(reward):
    code = (
        "import os, sys\ndef add(a, b):\n    if a == 0:\n        while True:\n            pass\n"
        "    if a == -2:\n        os._exit(0)\n    return a + b\n"
    )
    started = time.monotonic()
    out = score(reward, [code], {"test_list": [*MBPP["test_list"], "assert add(2, 2) == 4"]})
    assert out.scores == [0.5] and out.counts["code/exited_early"] == 1
    assert time.monotonic() - started < 2 * TIMEOUT_S + 5.0  # one deadline, then the rest run


@processes
@root_only
def test_a_program_that_kills_the_process_that_forked_it_still_gets_each_test_run(reward):
    """Its parent is the zygote that forks each test's child: killed, it is replaced by a fresh one."""
    code = RIGHT + "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"
    assert score(reward, [code], MBPP).scores == [1.0]


@processes
@root_only
def test_the_counts_reach_the_logged_metrics(reward):
    functions = WeightedRewards({"code": reward})
    problems = [{"prompt": "p", "answer": "", "columns": MBPP}] * 4
    texts = [fenced(c) for c in (RIGHT, EXITS["raise SystemExit"], LIARS["__eq__ always True"], WRONG)]
    metrics = count_metrics([functions(RewardInputs.of(problems, texts, [[0]] * 4))])
    assert metrics == {"reward/code/exited_early_fraction": 0.25, "reward/code/lying_equality_fraction": 0.25}


def test_values_cross_as_exact_builtins_and_a_liar_cannot_be_encoded_as_data():
    import collections

    values = [1, 2.5, float("inf"), "s", b"b", 1j, None, True, (1, [2]), {3}, frozenset({4}), {(1,): {2: 3}}]
    values += [range(1, 9, 2), collections.Counter("aab"), collections.OrderedDict([(2, 1), (1, 2)])]
    for value in values:
        back = decode(encode(value, None), None)
        assert back == value and type(back) is type(value)

    class Int(int):
        def __eq__(self, other):
            return True

    def refuse(value):
        raise TypeError(f"{type(value).__name__} is not data")

    with pytest.raises(TypeError, match="Int is not data"):
        encode(Int(1), refuse)


GIVEN_PROMPT = (  # gives ``encode`` and asks for ``decode``, as HumanEval/38 and /50 do
    'from typing import List\n\n\ndef encode(s: str) -> str:\n    """Each letter moved one on."""\n'
    '    return "".join(chr(ord(c) + 1) for c in s)\n\n\ndef decode(s: str) -> str:\n'
    '    """The inverse of encode."""\n'
)
GIVEN = {
    "test": "def check(candidate):\n    for s in ('abc', 'hello'):\n"
    "        assert candidate(encode(s)) == s\n",
    "entry_point": "decode",
}
BODY = '    return "".join(chr(ord(c) - 1) for c in s)\n'
GIVEN_COMPLETIONS = {
    "the prompt's encode left as it is": GIVEN_PROMPT + BODY,
    "encode left out (decode does not need it)": "def decode(s):\n" + BODY,
    "encode left out and called (HumanEval/38's canonical body)": "from __future__ import annotations\n\n\n"
    "def decode(s):\n    return ''.join(chr(ord(c) - 2) for c in encode(s))\n",
    "a helper of its own": "def back(c):\n    return chr(ord(c) - 1)\n\n\n"
    "def decode(s):\n    return ''.join(map(back, s))\n",
    "encode and decode redefined as the identity": "def encode(s):\n    return s\n\n\n"
    "def decode(s):\n    return s\n",
}


@processes
@root_only
@pytest.mark.parametrize(
    "prompt",
    [
        {"prompt": GIVEN_PROMPT},
        {"prompts": [{"role": "user", "content": f"Complete this:\n```python\n{GIVEN_PROMPT}```"}]},
    ],
    ids=["prompt column", "chat prompt"],
)
def test_a_function_the_prompt_gives_is_the_prompt_s_in_the_test(reward, prompt):
    out = score(reward, list(GIVEN_COMPLETIONS.values()), {**GIVEN, **prompt})
    assert out.scores == [1.0, 1.0, 1.0, 1.0, 0.0], dict(zip(GIVEN_COMPLETIONS, out.scores, strict=True))


def test_the_prompt_s_functions_are_its_finished_ones_but_the_entry_point():
    """Imports, then finished functions; a stub (only a docstring, ``pass`` or ``...``) is the
    completion's, as is the entry point; a prompt that is not Python gives none."""
    stubs = "def later(x):\n    pass\n\n\ndef dots(x):\n    ...\n\n\n"
    given = prompt_functions({"prompt": stubs + GIVEN_PROMPT + "    return s[::-1]\n"}, "decode")
    assert ast.dump(ast.parse(given)) == ast.dump(ast.parse(GIVEN_PROMPT.split("def decode")[0]))
    assert code_tests("", {**GIVEN, "prompt": GIVEN_PROMPT})[0].check.startswith(given + GIVEN["test"])
    for row in ({"prompt": stubs}, {"prompt": "Write a function decode."}, {"prompts": "x = ("}, {}):
        assert prompt_functions(row, "decode") == ""


def test_the_prompt_s_functions_open_the_completion_after_what_must_come_first():
    given = "def encode(s):\n    return s\n\n"
    assert opened_with(given, "def decode(s): ...\n") == given + "def decode(s): ...\n"
    opening = '"""Mine."""\nfrom __future__ import annotations\n'
    assert opened_with(given, opening + "x = 1\n") == opening + "\n" + given + "x = 1\n"
    assert opened_with("", "x = (") == "x = (" and opened_with(given, "x = (") == given + "x = ("
    compile(opened_with(given, opening + "x = 1\n"), "solution.py", "exec")  # the future import first
