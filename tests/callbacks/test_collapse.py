"""The run's collapse guard (``rollout.collapse.CollapseDetector``, warned by the rollout callbacks) and
the start-up line of a run that trains stale tokens without a rollout correction in its loss
(``callbacks.rollout.stale_tokens_note``); issue #38."""

from __future__ import annotations

import lightning as L
import pytest
from helpers import HashReward
from helpers.fits import make_async, make_data, make_rollout, make_trainer

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.callbacks.rollout import stale_tokens_note
from lit_offpolicy.correction import RolloutCorrection
from lit_offpolicy.rollout.collapse import CollapseDetector

# ----------------------------------------------------------------------------- the detector


def _feed(detector: CollapseDetector, rewards: list[float], truncated: list[float | None]) -> list:
    return [detector.observe(step, r, t) for step, (r, t) in enumerate(zip(rewards, truncated, strict=True))]


def test_warns_once_when_the_reward_falls_to_zero_while_responses_pin_at_max_tokens():
    rewards = [0.4, 0.38, 0.42, 0.4, 0.4] + [0.3, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0] + [0.0] * 5
    truncated = [0.0] * 5 + [0.5, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0] + [1.0] * 5
    warnings = _feed(CollapseDetector(), rewards, truncated)
    fired = [step for step, w in enumerate(warnings) if w is not None]
    # start 0.4 (steps 0..4); the first window of 5 with a mean ≤ 0.1 × 0.4 is steps 6..10 (0.1 / 5)
    assert fired == [10]
    message = warnings[10]
    assert "\n" not in message
    assert "reward/mean fell from 0.4 (first 5 steps) to 0.02 (last 5, step 10)" in message
    assert "98% of responses stop at max_tokens" in message  # (0.9 + 4 × 1.0) / 5
    assert "seq_is_rs" in message and "learning rate" in message


def test_a_collapse_with_responses_that_still_end_says_so():
    rewards = [0.5] * 5 + [0.0] * 5
    warnings = _feed(CollapseDetector(), rewards, [0.0] * 10)
    assert warnings[:9] == [None] * 9
    assert "while the responses still end on their own" in warnings[9]


@pytest.mark.parametrize(
    "rewards",
    [
        [0.4] * 5 + [0.05] * 5 + [0.4] * 5,  # fell to an eighth, not a tenth
        [0.0] * 15,  # never above 0: nothing to fall from
        [-0.5] * 5 + [-1.0] * 10,  # rewards below 0 are not "0 when wrong"
        [0.1] * 5 + [0.3] * 10,  # learning
    ],
    ids=["partial-fall", "zero-from-the-start", "negative-rewards", "learning"],
)
def test_no_warning_without_a_collapse(rewards):
    assert all(w is None for w in _feed(CollapseDetector(), rewards, [1.0] * len(rewards)))


def test_a_missing_truncated_fraction_is_not_called_pinned():
    warnings = _feed(CollapseDetector(window=2), [1.0, 1.0, 0.0, 0.0], [None] * 4)
    assert "still end on their own" in warnings[3]


# ----------------------------------------------------------------------------- the start-up line


def test_the_start_up_line_is_printed_for_stale_tokens_without_a_loss_changing_correction():
    note = stale_tokens_note(1, RolloutCorrection.disabled())
    assert note.startswith("lit-offpolicy: tokens up to 1 weight version(s) old")
    assert "π_rollout" in note and "seq_is_rs" in note and "\n" not in note
    assert stale_tokens_note(2, None) is not None
    assert stale_tokens_note(0, RolloutCorrection.disabled()) is None  # on-policy
    assert stale_tokens_note(1, RolloutCorrection.from_preset("seq_is_rs")) is None


class ZeroAfter(HashReward):
    """HashReward for the first ``calls`` calls, then 0 for every completion: a reward that collapses."""

    def __init__(self, calls: int) -> None:
        self.calls, self.seen = calls, 0

    def __call__(self, completions, **columns):
        self.seen += 1
        if self.seen > self.calls:
            return [0.0] * len(completions)
        return [0.25 + s / 2 for s in super().__call__(completions, **columns)]  # above 0


def _fit(model_dir: str, rollout: L.Callback, steps: int, correction=None) -> None:
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(model_path=model_dir, advantage="grpo", rollout_correction=correction)
    make_trainer([rollout], max_steps=steps).fit(module, datamodule=make_data(model_dir))


def test_a_run_whose_reward_collapses_warns_in_one_line(tiny_model_dir, capsys):
    """Five steps scored above 0, then five at 0: the warning comes once, at the tenth step, on stderr."""
    _fit(tiny_model_dir, make_rollout(reward=ZeroAfter(calls=5)), steps=11)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "reward collapse" in line]
    assert len(lines) == 1
    assert "(last 5, step 9)" in lines[0]


def test_an_async_run_without_correction_prints_the_start_up_line_with_one_not(tiny_model_dir, capsys):
    _fit(tiny_model_dir, make_async(max_staleness=1), steps=1)
    assert "lit-offpolicy: tokens up to 1 weight version(s) old" in capsys.readouterr().out
    _fit(tiny_model_dir, make_async(max_staleness=1), steps=1, correction="seq_is_rs")
    assert "weight version(s) old" not in capsys.readouterr().out
