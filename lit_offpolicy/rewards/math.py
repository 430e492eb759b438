"""Math answers: ``math_verify`` and ``gsm8k``.

``math_verify``: symbolic equivalence (the ``math-verify`` package); ``gsm8k``: GSM8K's ``#### 42``
final answers, compared as numbers.

A row's reference answer that cannot be read gives ``None`` (the reward does not apply to that row,
as TRL's ``accuracy_reward`` does for a gold solution math-verify cannot parse); a completion that
cannot be read scores 0.0 and counts as malformed.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Any

from lit_offpolicy.core.checks import check_choice, check_range
from lit_offpolicy.rewards.contract import RewardOutput, completion_text
from lit_offpolicy.rewards.verifiers import BOX, REWARDS, _check_lengths


@REWARDS.register("math_verify")
class MathVerify:
    """1.0 when the completion's final answer is mathematically equivalent to the row's answer.

    math-verify (``parse`` with LaTeX and plain-expression extraction, then ``verify``) finds the
    answer (``\\boxed{}`` or the last expression after an anchor such as "the answer is") and
    compares the two as SymPy objects: ``\\frac{1}{2}`` equals ``0.5``, ``2x+2`` equals ``2(x+1)``,
    sets and intervals compare as such. The reference is read as LaTeX, wrapped in ``$...$`` unless
    it holds a ``$`` or a ``\\boxed{}`` (a full solution). A completion with no answer to extract is
    malformed.

    ``timeout``: seconds for each parse and each comparison (math-verify's ``signal.alarm``, so whole
    seconds, and only in a main thread: in another thread, as the async rollout's producer calls the
    reward with ``reward.timeout: null``, there is none). The alarm interrupts Python code, not a
    long computation inside C, so ``reward.timeout`` stays the real bound.
    """

    def __init__(self, timeout: int = 5) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, int):
            raise ValueError(f"timeout={timeout!r} must be a whole number of seconds (math-verify's alarm)")
        self.timeout = check_range("timeout", timeout, low=1)

    def __call__(self, completions: list, answer: list, **kwargs: Any) -> RewardOutput:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

        _check_lengths(completions, answer)
        seconds = self.timeout if threading.current_thread() is threading.main_thread() else None
        targets = [LatexExtractionConfig(), ExprExtractionConfig()]
        golds: dict[str, list] = {}
        scores: list[float | None] = []
        num_malformed = 0
        for completion, reference in zip(completions, answer, strict=True):
            reference = str(reference)
            if reference not in golds:
                latex = reference if "$" in reference or BOX in reference else f"${reference}$"
                golds[reference] = parse(latex, targets, parsing_timeout=seconds)
            predicted = parse(completion_text(completion), targets, parsing_timeout=seconds)
            num_malformed += not predicted
            if not golds[reference]:
                scores.append(None)
            else:
                scores.append(
                    float(bool(predicted) and verify(golds[reference], predicted, timeout_seconds=seconds))
                )
        return RewardOutput(scores, num_malformed)


_NUMBER = r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)"
_AFTER_HASHES = re.compile(rf"\s*\$?\s*({_NUMBER})")
_ANY_NUMBER = re.compile(_NUMBER)


@REWARDS.register("gsm8k")
class GSM8KAnswer:
    """1.0 when the completion's final number equals the row's answer as a number.

    ``method="strict"``: the number right after the last ``####`` (GSM8K's answer line; ``$`` and
    spaces before it allowed); none there is malformed. ``method="flexible"``: the last number
    anywhere in the text; no number is malformed. Commas and a trailing ``.`` are dropped, and the
    numbers compare exactly as fractions (``1,000`` = ``1000.0``). The row's answer is a bare number
    or a full GSM8K solution, read the strict way.

    verl's GSM8K scorer (``verl/utils/reward_score/gsm8k.py``) has the same two methods: strict
    takes the number after ``#### `` (commas and ``$`` removed), flexible the last number in the
    text, and newer versions search only the text's last 300 characters; it compares the strings
    with a ground truth already reduced to its number. Here the whole text is searched and the
    comparison is numeric, so ``42.0`` or ``42.`` match ``42``.
    """

    def __init__(self, method: str = "strict") -> None:
        self.method = check_choice("method", method, ("strict", "flexible"))

    def __call__(self, completions: list, answer: list, **kwargs: Any) -> RewardOutput:
        _check_lengths(completions, answer)
        scores: list[float | None] = []
        num_malformed = 0
        for completion, reference in zip(completions, answer, strict=True):
            text = completion_text(completion)
            predicted = final_number(text) if self.method == "strict" else last_number(text)
            reference = str(reference)
            gold = final_number(reference) if "####" in reference else _fraction(reference.strip())
            num_malformed += predicted is None
            scores.append(None if gold is None else float(predicted == gold))
        return RewardOutput(scores, num_malformed)


def final_number(text: str) -> Fraction | None:
    """The number right after the last ``####``; None where there is none."""
    hashes = text.rfind("####")
    match = _AFTER_HASHES.match(text, hashes + 4) if hashes >= 0 else None
    return _fraction(match.group(1)) if match else None


def last_number(text: str) -> Fraction | None:
    """The last number in the text; None where there is none."""
    numbers = _ANY_NUMBER.findall(text)
    return _fraction(numbers[-1]) if numbers else None


def _fraction(text: str) -> Fraction | None:
    """``text`` as an exact number (commas, a leading ``$`` and a trailing ``.`` dropped), or None."""
    text = text.lstrip("$").replace(",", "").rstrip(".")
    if not re.fullmatch(_NUMBER, text):
        return None
    return Fraction(text)
