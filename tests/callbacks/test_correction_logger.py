"""RolloutCorrectionLogger: one-time χ²/KL warnings on hand-computed gaps, and the TensorBoard histograms
of a real run (tiny Llama, HF engine lagging one version with sync_every=2, seq_is_rs correction)."""

from __future__ import annotations

import math
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_trainer import make_data, make_rollout, make_trainer

from lit_offpolicy import OffPolicyModule, callbacks
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.tensorboard import latest_run
from lit_offpolicy.training.options import OptimOptions


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


class KeepExperience(L.Callback):
    """After the step (and after the logger): the experience the module filled (its ``last_step``)."""

    def __init__(self) -> None:
        self.experiences: list[Experience] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.experiences.append(pl_module.last_step.experience)


def test_histograms_of_log_ratios_and_is_weights_reach_tensorboard(tiny_model_dir, tmp_path):
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(
        model_path=tiny_model_dir,
        advantage="grpo",
        rollout_correction="seq_is_rs",
        optim=OptimOptions(lr=1e-2),
    )
    keep = KeepExperience()
    logger = TensorBoardLogger(save_dir=tmp_path, name="rc")
    rollout = make_rollout(sync_every=2)  # step 1 samples with the weights of version 0: a real gap
    trainer = make_trainer(
        [rollout, callbacks.RolloutCorrectionLogger(kl_threshold=None), keep], max_steps=2, logger=logger
    )
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    logger.experiment.flush()

    events = EventAccumulator(str(latest_run(tmp_path / "rc")), size_guidance={"histograms": 0})
    events.Reload()
    log_ratios = events.Histograms("rollout_corr/log_ratio")
    weights = events.Histograms("rollout_corr/is_weights")
    assert [e.step for e in log_ratios] == [e.step for e in weights] == [1, 2]
    for exp, ratio_event, weight_event in zip(keep.experiences, log_ratios, weights, strict=True):
        valid, kept = exp.response_mask.bool(), exp.loss_mask.bool()
        r = (exp.old_log_probs - exp.rollout_log_probs)[valid]
        assert ratio_event.histogram_value.num == valid.sum().item()
        assert ratio_event.histogram_value.sum == pytest.approx(r.sum().item(), abs=1e-5)
        assert weight_event.histogram_value.num == kept.sum().item()
        assert weight_event.histogram_value.sum == pytest.approx(exp.is_weights[kept].sum().item(), rel=1e-5)
    lagging = keep.experiences[1]
    assert lagging.policy_versions.eq(0).all()
    gap_size = (lagging.old_log_probs - lagging.rollout_log_probs)[lagging.response_mask.bool()].abs().max()
    assert gap_size > 1e-3, "the engine one version behind should give a visible gap"
