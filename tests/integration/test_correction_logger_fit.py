"""RolloutCorrectionLogger in a real run: the TensorBoard histograms of log-ratios and IS weights (tiny
Llama, HF engine lagging one version with sync_every=2, seq_is_rs correction). Its warnings on
hand-computed gaps are tested in tests/callbacks/test_correction_logger.py."""

from __future__ import annotations

import lightning as L
import pytest
from helpers.fits import make_data, make_rollout, make_trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_offpolicy import OffPolicyModule, callbacks
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.core.tensorboard import latest_run
from lit_offpolicy.training.options import OptimOptions


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
        # TensorBoard sums the float32 values in float64; torch's float32 sum of ≤ 80 of them rounds by
        # ≤ 80 × eps32 × max|r| ≤ 0.5 ≈ 5e-6 at worst (abs 1e-5), and for positive weights ≈ 1 by ≤
        # 80 × eps32 = 9.5e-6 relative (rel 1e-5)
        assert ratio_event.histogram_value.sum == pytest.approx(r.sum().item(), abs=1e-5)
        assert weight_event.histogram_value.num == kept.sum().item()
        assert weight_event.histogram_value.sum == pytest.approx(exp.is_weights[kept].sum().item(), rel=1e-5)
    lagging = keep.experiences[1]
    assert lagging.policy_versions.eq(0).all()
    gap_size = (lagging.old_log_probs - lagging.rollout_log_probs)[lagging.response_mask.bool()].abs().max()
    assert gap_size > 1e-3, "the engine one version behind should give a visible gap"
