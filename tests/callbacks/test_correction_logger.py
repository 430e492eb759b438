"""RolloutCorrectionLogger: one-time χ²/KL warnings on hand-computed gaps (its TensorBoard histograms in a
real run: tests/integration/test_correction_logger_fit.py)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from lit_offpolicy import callbacks
from lit_offpolicy.core.experience import Experience


def gap(old: list[list[float]], rollout: list[list[float]]) -> Experience:
    """An experience whose only meaningful fields are π_old and π_rollout (every token valid)."""
    old_t, rollout_t = torch.tensor(old), torch.tensor(rollout)
    rows, width = old_t.shape
    ones = torch.ones(rows, width, dtype=torch.long)
    return Experience(
        prompt_ids=ones,
        prompt_mask=ones,
        response_ids=ones,
        response_mask=ones,
        rollout_log_probs=rollout_t,
        scores=torch.zeros(rows),
        group_ids=torch.arange(rows),
        policy_versions=torch.zeros(rows, dtype=torch.long),
        old_log_probs=old_t,
    )


def warned(logger: callbacks.RolloutCorrectionLogger, exp: Experience) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger.warn_if_off_policy(exp, version=7)
    return [str(w.message) for w in caught]


def test_sequence_chi2_over_the_threshold_warns_once():
    # one sequence, r = (log 4, 0): χ²_token = (4² + 1²)/2 − 1 = 7.5 < 10; χ²_seq = (4·1)² − 1 = 15 ≥ 10;
    # kl = mean(−r) = −log(4)/2 < 0.1
    logger = callbacks.RolloutCorrectionLogger()
    exp = gap([[math.log(4.0), 0.0]], [[0.0, 0.0]])
    (message,) = warned(logger, exp)
    assert message.startswith("rollout_corr/chi2_seq = 15 reached 10 at policy version 7")
    assert "seq_is_rs" in message
    assert warned(logger, exp) == [], "a quantity warns once per run"
    assert logger.warned == {"chi2_seq"}


def test_kl_over_its_threshold_warns_and_none_turns_a_warning_off():
    # r = (−0.5, −0.5): kl = mean(−r) = 0.5 ≥ 0.2; χ² = e^(−1) − 1 < 0 either way
    exp = gap([[0.0, 0.0]], [[0.5, 0.5]])
    (message,) = warned(callbacks.RolloutCorrectionLogger(kl_threshold=0.2), exp)
    assert message.startswith("rollout_corr/kl = 0.5 reached 0.2")
    assert warned(callbacks.RolloutCorrectionLogger(kl_threshold=None), exp) == []
    assert warned(callbacks.RolloutCorrectionLogger(kl_threshold=0.6), exp) == []


def test_token_chi2_exactly_at_the_threshold_warns():
    # r = log 3 on each token: χ²_token = 9 − 1 = 8 and χ²_seq = 81 − 1 = 80; threshold 8
    exp = gap([[math.log(3.0)]], [[0.0]])
    messages = warned(callbacks.RolloutCorrectionLogger(chi2_threshold=8.0, kl_threshold=None), exp)
    assert sorted(m.split(" =")[0] for m in messages) == ["rollout_corr/chi2_seq", "rollout_corr/chi2_token"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"chi2_threshold": 0.0}, "chi2_threshold=0.0 is out of range"),
        ({"kl_threshold": -1.0}, "kl_threshold=-1.0 is out of range"),
        ({"histogram_every_n_steps": -1}, "histogram_every_n_steps=-1 is out of range"),
    ],
)
def test_bad_options_fail_with_a_clear_message(options, message):
    with pytest.raises(ValueError, match=message):
        callbacks.RolloutCorrectionLogger(**options)
