"""On-policy distillation: the per-token advantage by hand, and through ``OffPolicyModule.prepare``
with a real teacher (the student itself, and a perturbed copy)."""

from __future__ import annotations

import pytest
import torch
from helpers.engines import perturbed
from helpers.experiences import fixed_experience

from lit_offpolicy import OffPolicyModule
from lit_offpolicy.advantages import GRPO
from lit_offpolicy.advantages.distillation import distillation_advantages, reverse_kl
from lit_offpolicy.core.records import OldLogProbs
from lit_offpolicy.correction import RolloutCorrection
from lit_offpolicy.models import create_tiny_model, load_actor
from lit_offpolicy.training.forward import frozen_log_probs
from lit_offpolicy.training.frozen import checked_source
from lit_offpolicy.training.options import DistillOptions, KLOptions, UpdateOptions


def test_the_advantage_by_hand_in_float64():
    """Two samples, three positions, the second sample one token long (two padded).
    gaps log π_s − log π_t: (−1 − (−2), −0.5 − (−0.25), −3 − (−1)) = (1, −0.25, −2) and (−0.1 − (−0.2)) = 0.1.
    coef 0.5, task_coef 2, task advantages 1 and −1 per token:
    row 1: 2·1 − 0.5·(1, −0.25, −2) = (1.5, 2.125, 3); row 2: 2·(−1) − 0.5·0.1 = −2.05, then 0, 0.
    reverse KL = (1 − 0.25 − 2 + 0.1) / 4 = −0.2875."""
    f64 = torch.float64
    student = torch.tensor([[-1.0, -0.5, -3.0], [-0.1, 9.0, 9.0]], dtype=f64)
    teacher = torch.tensor([[-2.0, -0.25, -1.0], [-0.2, -9.0, -9.0]], dtype=f64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    task = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=f64)
    got = distillation_advantages(task, student, teacher, mask, coef=0.5, task_coef=2.0)
    # float64, a handful of operations on dyadic or short decimals: within a few eps64 of the hand values
    torch.testing.assert_close(got, torch.tensor([[1.5, 2.125, 3.0], [-2.05, 0.0, 0.0]], dtype=f64))
    assert got.dtype == f64
    assert reverse_kl(student, teacher, mask).item() == pytest.approx(-0.2875, rel=1e-12)


def test_a_teacher_equal_to_the_student_leaves_the_task_advantage():
    logp = torch.tensor([[-1.5, -0.7], [-2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    task = torch.tensor([[0.3, 0.3], [-0.3, -0.3]], dtype=torch.float64)
    assert torch.equal(distillation_advantages(task, logp, logp, mask), task * mask)
    assert torch.equal(distillation_advantages(task, logp, logp, mask, task_coef=0.0), torch.zeros_like(task))
    assert reverse_kl(logp, logp, mask).item() == 0.0


def test_distillation_needs_pi_old_before_the_update():
    update, kl, off = UpdateOptions(), KLOptions(), RolloutCorrection.disabled()
    assert checked_source(None, 4, off, update, kl) is OldLogProbs.RECOMPUTE
    assert checked_source(OldLogProbs.UPDATE, 4, off, update, kl) is OldLogProbs.UPDATE
    with pytest.raises(ValueError, match="allowed values: 'recompute'"):
        checked_source(OldLogProbs.UPDATE, 4, off, update, kl, old_before_update=True)
    with pytest.raises(ValueError, match="distill.coef=-1.0 is out of range"):
        DistillOptions(teacher_path="t", coef=-1.0)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_model_dir) -> str:
    """The tiny model with perturbed weights: a teacher that disagrees with the student."""
    directory = tmp_path_factory.mktemp("teacher") / "teacher"
    model = load_actor(tiny_model_dir)
    model.load_state_dict(perturbed(tiny_model_dir, seed=7, scale=0.5))
    model.save_pretrained(directory)
    from lit_offpolicy.models import load_tokenizer

    load_tokenizer(tiny_model_dir).save_pretrained(directory)
    return str(directory)


def _prepared(model_dir: str, teacher: str | None, **distill) -> tuple[OffPolicyModule, object, dict]:
    torch.manual_seed(0)
    options = DistillOptions(teacher_path=teacher, **distill)
    module = OffPolicyModule(model_path=model_dir, advantage=GRPO(), distill=options)
    exp = fixed_experience(model_dir)
    metrics = module.prepare(exp)
    return module, exp, metrics


def test_prepare_with_the_student_as_teacher_gives_the_task_advantages(tiny_model_dir):
    """The teacher is a second copy of the student's weights: the same forward on the same tokens, so
    every gap is 0 (bit for bit) and the advantages are GRPO's alone."""
    _, plain, _ = _prepared(tiny_model_dir, None)
    _, distilled, metrics = _prepared(tiny_model_dir, tiny_model_dir)
    assert metrics["distill/reverse_kl"] == 0.0
    assert torch.equal(distilled.advantages, plain.advantages)


def test_prepare_adds_the_teacher_s_per_token_reverse_kl(tiny_model_dir, teacher_dir):
    """Against an independent computation: log-probs of student and teacher on the step's tokens
    (no-grad passes of the two models), then the formula."""
    _, plain, _ = _prepared(tiny_model_dir, None)
    module, exp, metrics = _prepared(tiny_model_dir, teacher_dir, coef=0.5, task_coef=0.25)
    everything = [torch.arange(len(exp))]
    student = frozen_log_probs(
        load_actor(tiny_model_dir).eval(), exp, exp.temperature, everything, None, False
    )
    teacher = frozen_log_probs(load_actor(teacher_dir).eval(), exp, exp.temperature, everything, None, False)
    mask = exp.response_mask
    want = (0.25 * plain.advantages - 0.5 * (student - teacher)) * mask
    # float32: the same passes in another batching (one micro-batch here, the module's own there) agree
    # to a few ulp of log-probs of magnitude ≤ ~10: atol 1e-5 covers 100 ulp of 1e-7 relative error
    torch.testing.assert_close(exp.advantages * mask, want, atol=1e-5, rtol=1e-5)
    assert metrics["distill/reverse_kl"] == pytest.approx(reverse_kl(student, teacher, mask).item(), abs=1e-5)
    assert metrics["distill/reverse_kl"] != 0.0
    assert module.hparams["distill"] == {"teacher_path": teacher_dir, "coef": 0.5, "task_coef": 0.25}


def test_a_teacher_with_another_vocabulary_is_refused_in_one_line(tiny_model_dir, tmp_path):
    other = create_tiny_model(tmp_path / "qwen2", seed=0, arch="qwen2")
    with pytest.raises(ValueError) as error:
        OffPolicyModule(model_path=tiny_model_dir, distill=DistillOptions(teacher_path=str(other)))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"distill.teacher_path={other}: its tokenizer is not the student's (")
    # what the numbers are: each differing token's id in the teacher's vocabulary, then in the student's
    assert "tokens whose id differs, as (teacher's id, student's id): '<pad>' (none, 0), " in message
    assert "the teacher scores the student's token ids, so it needs the same vocabulary" in message


def test_a_missing_teacher_is_named_by_its_option(tiny_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        OffPolicyModule(
            model_path=tiny_model_dir, distill=DistillOptions(teacher_path=str(tmp_path / "none"))
        )
    assert str(error.value).startswith(
        f"distill.teacher_path: model directory {tmp_path / 'none'} does not exist"
    )
