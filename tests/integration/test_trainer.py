"""Integration tests of the trainer's plumbing: OffPolicyModule + Rollout callback + Lightning Trainer.

Real parts only: the built-in tiny Llama (``create_tiny_model``), the HF rollout engine, a real
``lightning.Trainer`` on CPU. The one user-supplied part is the reward: an untrained tiny model
never answers an addition right, so the exact-match reward is 0 everywhere, every advantage is 0 and
no gradient flows. ``HashReward`` (tests/helpers/__init__.py, a RewardFn, the public protocol) scores each
response with a hash of its text instead: deterministic, and different within a group.
"""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from helpers.experiences import fixed_experience
from helpers.fits import (
    BATCH_SIZE,
    N_SAMPLES,
    FixedExperience,
    MemoryLogger,
    RecordPrepare,
    clone_state,
    make_data,
    make_rollout,
    make_trainer,
    released_after_fit,
)
from helpers.tolerances import reordered_sums
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_offpolicy import OffPolicyModule, callbacks
from lit_offpolicy.advantages import Reinforce
from lit_offpolicy.core.records import OldLogProbs, StepRecord
from lit_offpolicy.correction import RolloutCorrection
from lit_offpolicy.losses import PPO, TOPR
from lit_offpolicy.training.options import KLOptions, LossOptions, OptimOptions, RewardShaping, UpdateOptions

# ----------------------------------------------------------------------------- helpers


class StartEndProbe(L.Callback):
    """Records step, policy version and actor weights when training starts; step and version at the end."""

    def on_train_start(self, trainer, pl_module):
        self.start = {
            "global_step": trainer.global_step,
            "policy_version": pl_module.policy_version,
            "actor": clone_state(pl_module.actor),
        }

    def on_train_end(self, trainer, pl_module):
        self.end = {"global_step": trainer.global_step, "policy_version": pl_module.policy_version}


# ----------------------------------------------------------------------------- one GRPO run, three checks


@pytest.fixture(scope="module")
def grpo_run(tiny_model_dir):
    """3 on-policy RL steps of GRPO + KL loss (sync_every=1, HF engine, float32, 1 epoch, 1 mini-batch)."""
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(
        model_path=tiny_model_dir,
        policy_loss=PPO(),
        advantage="grpo",
        kl=KLOptions(use_loss=True, loss_coef=0.1),
        update=UpdateOptions(ppo_epochs=1, mini_batch_size=None),
        optim=OptimOptions(lr=1e-3),
        dtype="float32",
    )
    before = {"actor": clone_state(module.actor), "reference": clone_state(module.reference)}
    recorder, logger = RecordPrepare(), MemoryLogger()
    trainer = make_trainer([make_rollout(), recorder], max_steps=3, logger=logger)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    return SimpleNamespace(
        module=module, trainer=trainer, records=recorder.records, logger=logger, before=before
    )


def test_on_policy_old_log_probs_equal_rollout_log_probs(grpo_run):
    assert len(grpo_run.records) == 3
    for step, (exp, _) in enumerate(grpo_run.records):
        assert len(exp) == BATCH_SIZE * N_SAMPLES
        assert exp.policy_versions.eq(step).all(), "with sync_every=1 the engine serves the current weights"
        valid = exp.response_mask.bool()
        assert valid.sum() > 0
        # π_old (the trainer's teacher-forced recompute) = π_rollout (generate's per-step logits): float32,
        # the same sums (≤ 512 terms, the MLP) grouped otherwise by the KV cache in each of 4 blocks, on
        # both paths (helpers.tolerances): 2 × 4 × eps32 × √512 × max|lp| ≈ 2.2e-5 × 5.4 ≈ 1.2e-4
        atol = reordered_sums(exp.old_log_probs[valid], terms=512, stages=4)
        assert torch.allclose(exp.old_log_probs[valid], exp.rollout_log_probs[valid], atol=atol, rtol=0)
        assert torch.isfinite(exp.rollout_log_probs[valid]).all()
    ratio_means = grpo_run.logger.values("actor/ratio_mean")
    assert len(ratio_means) == 3
    # one optimizer step per RL step: π_old is read off the update's own forward, so the ratio is
    # exp(0) = 1 exactly; abs 1e-5 (≈ 100 eps32) only absorbs the mean's last bits
    assert ratio_means[0] == pytest.approx(1.0, abs=1e-5)


def test_grpo_group_advantages_sum_to_zero(grpo_run):
    nonzero_groups = 0
    for exp, _ in grpo_run.records:
        valid = exp.response_mask.bool()
        group_ids = exp.group_ids.unique()
        assert len(group_ids) == BATCH_SIZE
        for group in group_ids:
            rows = (exp.group_ids == group).nonzero().flatten().tolist()
            assert len(rows) == N_SAMPLES
            sequence_advantages = []
            for row in rows:
                token_advantages = exp.advantages[row][valid[row]]
                # GRPO gives every token of a response its sequence-level advantage: copies, exact (well
                # inside allclose's defaults, rtol 1e-5, atol 1e-8)
                assert torch.allclose(token_advantages, token_advantages[0].expand_as(token_advantages))
                sequence_advantages.append(token_advantages[0].item())
            # float32 advantages ≤ 1.5 of a 4-sample group: the mean, the std and this sum round to
            # ≲ 4 eps32 × 1.5 ≈ 7e-7; abs 1e-4 (a baseline that missed the mean would be off by ~1)
            assert sum(sequence_advantages) == pytest.approx(0.0, abs=1e-4)
            nonzero_groups += any(abs(a) > 1e-3 for a in sequence_advantages)
    assert nonzero_groups > 0, "every group had equal scores: the check above would be vacuous"


def test_reference_is_frozen_while_the_actor_trains(grpo_run):
    module = grpo_run.module
    assert grpo_run.trainer.global_step == 3
    reference_after = module.reference.state_dict()
    assert reference_after.keys() == grpo_run.before["reference"].keys()
    for name, tensor in grpo_run.before["reference"].items():
        assert torch.equal(reference_after[name], tensor), f"reference parameter {name} changed"
    assert not any(p.requires_grad for p in module.reference.parameters())
    actor_after = module.actor.state_dict()
    changed = [
        name
        for name, tensor in grpo_run.before["actor"].items()
        if not torch.equal(actor_after[name], tensor)
    ]
    assert changed, "the actor did not change in 3 steps"
    # the actor moved away from the reference, so the KL loss that uses the reference is non-zero
    assert grpo_run.logger.values("actor/kl_loss")[-1] > 0


# ----------------------------------------------------------------------------- checkpoint and resume


class RecordPrompts(L.Callback):
    """Records each step's prompts."""

    def __init__(self) -> None:
        self.prompts: list[list[str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.prompts.append(list(batch["prompt"]))


@pytest.fixture(scope="module")
def resume_runs(tiny_model_dir, tmp_path_factory):
    """2 steps saving last.ckpt, a fresh Trainer resuming from it up to step 4, and 4 uninterrupted steps."""
    checkpoints = tmp_path_factory.mktemp("checkpoints")

    def fit(max_steps: int, callbacks: list, ckpt_path: str | None = None):
        L.seed_everything(0, verbose=False)
        module = OffPolicyModule(model_path=tiny_model_dir, advantage="grpo", optim=OptimOptions(lr=1e-3))
        logger, prompts = MemoryLogger(), RecordPrompts()
        trainer = make_trainer(
            [make_rollout(), prompts, *callbacks],
            max_steps=max_steps,
            logger=logger,
            enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
            default_root_dir=checkpoints.parent,
        )
        trainer.fit(module, datamodule=make_data(tiny_model_dir), ckpt_path=ckpt_path)
        return SimpleNamespace(module=module, trainer=trainer, logger=logger, prompts=prompts.prompts)

    first = fit(2, [ModelCheckpoint(dirpath=checkpoints, save_last=True, every_n_train_steps=1)])
    last = checkpoints / "last.ckpt"
    probe = StartEndProbe()
    resumed = fit(4, [probe], ckpt_path=str(last))
    uninterrupted = fit(4, [])
    return SimpleNamespace(first=first, last=last, resumed=resumed, probe=probe, uninterrupted=uninterrupted)


@pytest.mark.slow
def test_checkpoint_resume_continues_at_the_same_step(resume_runs):
    first, probe = resume_runs.first, resume_runs.probe
    assert first.trainer.global_step == 2 and first.module.policy_version == 2
    assert resume_runs.last.is_file()
    saved = torch.load(resume_runs.last, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 2
    assert saved["lit_offpolicy"]["policy_version"] == 2
    saved_actor = {
        k.removeprefix("actor."): v for k, v in saved["state_dict"].items() if k.startswith("actor.")
    }
    for name, tensor in first.module.actor.state_dict().items():
        assert torch.equal(saved_actor[name], tensor)

    assert probe.start["global_step"] == 2
    assert probe.start["policy_version"] == 2
    assert probe.start["actor"].keys() == saved_actor.keys()
    for name, tensor in probe.start["actor"].items():
        assert torch.equal(tensor, saved_actor[name]), f"actor parameter {name} not restored"
    assert probe.end == {"global_step": 4, "policy_version": 4}
    assert resume_runs.resumed.trainer.global_step == 4
    # the engine and the rollouts continue the version count: steps 3 and 4 sample with versions 2 and 3
    assert resume_runs.resumed.logger.values("rollout/policy_version") == [2.0, 3.0]
    assert resume_runs.resumed.logger.values("actor/policy_version") == [3.0, 4.0]


@pytest.mark.slow
def test_resumed_run_continues_the_prompt_stream(resume_runs):
    assert resume_runs.first.prompts == resume_runs.uninterrupted.prompts[:2]
    assert resume_runs.resumed.prompts == resume_runs.uninterrupted.prompts[2:]


# ----------------------------------------------------------------------------- micro-batching


_one_step_cache: dict[tuple, OffPolicyModule] = {}


def one_step(
    model_dir: str,
    loss_agg_mode: str,
    micro_batch_size: int | None,
    critic: bool,
    max_tokens: int | None = None,
    padding_free: bool = False,
) -> OffPolicyModule:
    """One RL step (= one optimizer step: ppo_epochs=1, one mini-batch) on the fixed experience;
    micro-batches of ``micro_batch_size`` samples or ``max_tokens`` tokens, packed with ``padding_free``."""
    key = (model_dir, loss_agg_mode, micro_batch_size, critic, max_tokens, padding_free)
    if key not in _one_step_cache:
        L.seed_everything(0, verbose=False)  # the critic's new value head is drawn from the global RNG
        module = OffPolicyModule(
            model_path=model_dir,
            policy_loss=PPO(loss_agg_mode=loss_agg_mode),
            advantage="gae" if critic else "grpo",
            critic_path=model_dir if critic else None,
            kl=KLOptions(use_loss=True),
            loss=LossOptions(entropy_coef=0.01),
            update=UpdateOptions(
                ppo_epochs=1,
                mini_batch_size=None,
                micro_batch_size=micro_batch_size,
                max_tokens_per_micro_batch=max_tokens,
            ),
            optim=OptimOptions(lr=1e-5, max_grad_norm=None),  # compare the raw accumulated gradients
            padding_free=padding_free,
        )
        trainer = make_trainer([FixedExperience(fixed_experience(model_dir))], max_steps=1)
        trainer.fit(module, datamodule=make_data(model_dir))
        assert trainer.global_step == 1
        _one_step_cache[key] = module
    return _one_step_cache[key]


@pytest.mark.parametrize(
    ("loss_agg_mode", "micro_batch_size", "critic", "max_tokens", "padding_free"),
    [
        ("token-mean", 2, False, None, False),
        ("token-mean", 5, False, None, False),  # 12 samples: micro-batches of 5, 5 and 2
        ("seq-mean-token-sum", 2, False, None, False),
        ("seq-mean-token-mean", 2, False, None, False),
        ("seq-mean-token-sum-norm", 2, False, None, False),
        ("token-mean", 2, True, None, False),
        ("seq-mean-token-sum", 2, True, None, False),
        # samples of 6 to 13 tokens in 5 uneven micro-batches (2 or 3 samples, ≤ 25 tokens), packed:
        # the reference and critic passes and the update, all padding-free
        ("seq-mean-token-mean", None, True, 25, True),
        ("seq-mean-token-sum-norm", None, False, 25, True),
    ],
)
def test_micro_batching_is_exact(
    tiny_model_dir, loss_agg_mode, micro_batch_size, critic, max_tokens, padding_free
):
    whole = one_step(tiny_model_dir, loss_agg_mode, None, critic)
    micro = one_step(tiny_model_dir, loss_agg_mode, micro_batch_size, critic, max_tokens, padding_free)
    whole_params, micro_params = dict(whole.named_parameters()), dict(micro.named_parameters())
    with_grad = [name for name, p in whole_params.items() if p.grad is not None]
    assert any(name.startswith("actor.") for name in with_grad)
    assert any(name.startswith("critic.") for name in with_grad) == critic
    for name in with_grad:
        # the gradient left by the step: the mini-batch's, accumulated over its micro-batches, whose
        # float32 sums (≤ 512 terms, 4 blocks, and the accumulation) are grouped otherwise:
        # 2 × 4 × eps32 × √512 = 2.2e-5 of the tensor's largest entry (helpers.tolerances)
        expected, got = whole_params[name].grad, micro_params[name].grad
        atol = reordered_sums(expected, terms=512, stages=4)
        assert (got - expected).abs().max().item() <= atol, f"gradient of {name}"
    # the updated parameters: Adam's first step is lr·g/(|g| + ε), at most lr = 1e-5 in either run, and
    # a gradient entry within rounding of 0 may flip its sign: ≤ 2·lr (the gradients above are the
    # sharp check)
    for name, parameter in whole_params.items():
        assert torch.allclose(micro_params[name], parameter, atol=2e-5, rtol=0), f"parameter {name}"


# ----------------------------------------------------------------------------- π_old from the update


class RecordOldLogProbs(L.Callback):
    """π_old as the step left it in the module's ``last_step`` (callbacks read it after the step)."""

    def __init__(self) -> None:
        self.old_log_probs: list[torch.Tensor] = []
        self.records: list[StepRecord] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.old_log_probs.append(pl_module.last_step.experience.old_log_probs.clone())
        self.records.append(pl_module.last_step)


def one_step_counting_passes(model_dir: str, recompute: bool) -> tuple:
    """One GRPO step (one optimizer step) on the fixed experience, in micro-batches of 5 of the 12
    samples; ``recompute`` forces the no-grad π_old pass that the module otherwise skips."""
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(
        model_path=model_dir,
        update=UpdateOptions(micro_batch_size=5),
        optim=OptimOptions(lr=1e-5, max_grad_norm=None),
    )
    if recompute:
        module.old_log_probs_source = lambda batch_size: OldLogProbs.RECOMPUTE
    passes = []
    module.actor.register_forward_hook(lambda *_: passes.append(torch.is_grad_enabled()))
    logger, recorder = MemoryLogger(), RecordOldLogProbs()
    feed = FixedExperience(fixed_experience(model_dir))
    trainer = make_trainer([feed, recorder], max_steps=1, logger=logger)
    trainer.fit(module, datamodule=make_data(model_dir))
    (record,) = recorder.records
    assert (record.version_before, record.version_after) == (0, 1)
    assert record.old_log_probs is (OldLogProbs.RECOMPUTE if recompute else OldLogProbs.UPDATE)
    return module, logger, recorder.old_log_probs[0], passes


def test_one_optimizer_step_reads_old_log_probs_off_its_forward(tiny_model_dir):
    """π_old = π_θ.detach() of the update's forward: the same π_old, gradient, step and diagnostics as
    the no-grad recompute, with half the actor passes (3 micro-batches: 3 instead of 6)."""
    skipped, skipped_log, skipped_old, skipped_passes = one_step_counting_passes(tiny_model_dir, False)
    recomputed, recomputed_log, recomputed_old, recomputed_passes = one_step_counting_passes(
        tiny_model_dir, True
    )
    assert skipped_passes == [True] * 3
    assert recomputed_passes == [False] * 3 + [True] * 3
    mask = fixed_experience(tiny_model_dir).response_mask.bool()
    # the same float32 forward on the same weights and micro-batches (grad mode picks no other kernel;
    # torch aligns every buffer to 64 bytes, so BLAS blocks alike): equal to the bit, which is the
    # point. 1e-6 (≈ 2 ulps of |lp| ≤ 6) absorbs last bits only: a bound for reordered sums (≈ 1e-4)
    # would not tell π_θ before the step from after it (lr 1e-5 moves log-probs by about that)
    torch.testing.assert_close(skipped_old[mask], recomputed_old[mask], rtol=0, atol=1e-6)
    assert skipped_log.values("actor/ratio_mean") == [1.0]  # exp(log π_θ − log π_θ.detach())
    assert skipped_log.values("actor/old_log_probs_source") == [2.0]  # update
    assert recomputed_log.values("actor/old_log_probs_source") == [1.0]  # recompute
    for name in ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_token"):
        # from π_old equal to 1e-6 on metrics ≥ 0.1 (checked below for kl): ≤ 1e-5 relative
        assert skipped_log.values(name) == pytest.approx(recomputed_log.values(name), rel=1e-5), name
    assert recomputed_log.values("rollout_corr/kl")[0] > 0.1  # the fixed rollout log-probs are far off
    for (name, p), q in zip(skipped.actor.named_parameters(), recomputed.actor.parameters(), strict=True):
        # float32 gradients of the same loss: 2 × 4 × eps32 × √512 of the largest entry, as above
        atol = reordered_sums(q.grad, terms=512, stages=4)
        assert (p.grad - q.grad).abs().max().item() <= atol, f"gradient of {name}"


UPDATE, RECOMPUTE, ROLLOUT = OldLogProbs.UPDATE, OldLogProbs.RECOMPUTE, OldLogProbs.ROLLOUT


@pytest.mark.parametrize(
    ("options", "source", "refused"),
    [
        ({}, UPDATE, ROLLOUT),
        ({"update": UpdateOptions(mini_batch_size=12)}, UPDATE, ROLLOUT),  # one mini-batch of the 12 samples
        ({"rollout_correction": "disabled"}, UPDATE, ROLLOUT),  # diagnostics only
        ({"update": UpdateOptions(ppo_epochs=2)}, RECOMPUTE, UPDATE),
        ({"update": UpdateOptions(mini_batch_size=6)}, RECOMPUTE, UPDATE),
        (
            {"kl": KLOptions(use_in_reward=True)},
            RECOMPUTE,
            UPDATE,
        ),  # the penalty needs π_old before the update
        ({"rollout_correction": "seq_is_rs"}, RECOMPUTE, UPDATE),  # IS weights and rejection reach the loss
        ({"rollout_correction": "token_tis"}, RECOMPUTE, UPDATE),
        ({"rollout_correction": "ppo_is_bypass"}, ROLLOUT, RECOMPUTE),  # π_old := π_rollout
    ],
)
def test_old_log_probs_come_from_the_update_only_with_one_step_and_nothing_before(
    tiny_model_dir, options, source, refused
):
    module = OffPolicyModule(model_path=tiny_model_dir, **options)
    assert module.old_log_probs_source(batch_size=12) is source
    with pytest.raises(ValueError, match=f"old_log_probs='{refused.value}' is not supported here"):
        module.prepare(fixed_experience(tiny_model_dir), refused)
    exp = fixed_experience(tiny_model_dir)
    module.prepare(exp)  # the source that needs no update
    if source is ROLLOUT:
        assert exp.old_log_probs is exp.rollout_log_probs
    else:
        assert not torch.equal(exp.old_log_probs, exp.rollout_log_probs)  # recomputed: the fixed ones are off


# ----------------------------------------------------------------------------- teardown


@pytest.mark.parametrize("fail", [False, True], ids=["finished", "failed"])
def test_rollout_releases_reward_and_engine_on_every_path(tiny_model_dir, fail):
    reward_closed, engine_closed, engine = released_after_fit(tiny_model_dir, callbacks.Rollout, fail)
    assert reward_closed >= 1 and engine_closed == 1 and engine is None


# ----------------------------------------------------------------------------- checkpointed configuration


def test_load_from_checkpoint_rebuilds_the_same_components(tiny_model_dir, tmp_path):
    """The checkpoint keeps loss, estimator, correction and option groups with their arguments:
    ``load_from_checkpoint`` rebuilds TOPR + seq_is_rs as trained, not the default PPO/GRPO."""
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(
        model_path=tiny_model_dir,
        policy_loss=TOPR(positive_weight=0.7, negative_weight=0.3, loss_agg_mode="seq-mean-token-sum"),
        advantage=Reinforce(gamma=0.9),
        rollout_correction="seq_is_rs",
        reward_shaping=RewardShaping(norm="batch", shift=True),
        optim=OptimOptions(lr=1e-3, warmup_steps=2, lr_schedule="cosine"),
    )
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = make_trainer(
        [FixedExperience(fixed_experience(tiny_model_dir)), checkpoint],
        max_steps=1,
        enable_checkpointing=True,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=make_data(tiny_model_dir))

    loaded = OffPolicyModule.load_from_checkpoint(tmp_path / "last.ckpt")
    assert type(loaded.policy_loss) is TOPR
    assert vars(loaded.policy_loss) == vars(module.policy_loss)
    assert type(loaded.advantage) is Reinforce and loaded.advantage.gamma == 0.9
    assert loaded.correction == RolloutCorrection.seq_is_rs()
    assert loaded.reward_shaping == module.reward_shaping and loaded.optim == module.optim
    assert loaded.policy_version == 1
    for name, tensor in module.actor.state_dict().items():
        assert torch.equal(loaded.actor.state_dict()[name], tensor), name
