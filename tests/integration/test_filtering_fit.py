"""DAPO's group filter, dynamic sampling and GRESO's pre-rollout filter (``lit_offpolicy.rollout.filtering``)
through real runs: the tiny Llama, the HF engine, a Lightning Trainer on CPU. The filters on hand
values are tested in tests/rollout/test_filtering.py."""

from __future__ import annotations

import pytest
from helpers.fits import (
    BATCH_SIZE,
    N_SAMPLES,
    MemoryLogger,
    RecordPrepare,
    make_data,
    make_trainer,
    rollout_options,
)

from lit_offpolicy import OffPolicyModule, callbacks
from lit_offpolicy.data import PromptDataModule
from lit_offpolicy.losses import TOPR


class HalfUniformReward:
    """Scores every response to an even answer 1 (uniform groups) and the others by their length
    (varied within a group, as the untrained model's responses differ in length)."""

    def __call__(self, completions: list[str], answer: list[str], **columns) -> list[float]:
        return [1.0 if int(a) % 2 == 0 else float(len(c)) for c, a in zip(completions, answer, strict=True)]


def test_a_run_with_filter_groups_trains_only_on_groups_with_different_rewards(tiny_model_dir):
    module = OffPolicyModule(model_path=tiny_model_dir, policy_loss=TOPR(), advantage="grpo", dtype="float32")
    recorder, logger = RecordPrepare(), MemoryLogger()
    rollout = callbacks.Rollout(**rollout_options(reward=HalfUniformReward(), filter_groups=True))
    trainer = make_trainer([rollout, recorder], max_steps=3, logger=logger)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))

    fractions = logger.values("rollout/filtered_groups_fraction")
    assert len(fractions) == len(recorder.records) == 3
    dropped_somewhere = False
    for (exp, _), fraction in zip(recorder.records, fractions, strict=True):
        kept_groups = exp.group_ids.unique()
        assert len(exp) == len(kept_groups) * N_SAMPLES
        for group in kept_groups:
            scores = exp.scores[exp.group_ids == group]
            assert scores.max() > scores.min(), "a group with equal rewards reached the update"
        assert fraction == pytest.approx(1 - len(kept_groups) / BATCH_SIZE)  # k/4, exact in float32
        dropped_somewhere |= len(kept_groups) < BATCH_SIZE
    assert dropped_somewhere, "no step had a uniform group: the check above would be vacuous"
    assert module.policy_version == 3


def test_a_step_where_every_group_has_equal_rewards_trains_on_all_of_them(tiny_model_dir):
    module = OffPolicyModule(model_path=tiny_model_dir, policy_loss=TOPR(), advantage="grpo", dtype="float32")
    recorder, logger = RecordPrepare(), MemoryLogger()
    constant = lambda completions, **columns: [1.0] * len(completions)  # noqa: E731
    rollout = callbacks.Rollout(**rollout_options(reward=constant, filter_groups=True))
    trainer = make_trainer([rollout, recorder], max_steps=1, logger=logger)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))
    ((exp, _),) = recorder.records
    assert len(exp) == BATCH_SIZE * N_SAMPLES
    assert exp.advantages.abs().max() == 0, "a group baseline gives equal rewards no advantage"
    assert logger.values("rollout/filtered_groups_fraction") == [0.0]


@pytest.mark.parametrize("rollout_class", [callbacks.Rollout, callbacks.AsyncRollout])
def test_re_sampling_fills_each_step_with_a_batch_of_informative_groups(tiny_model_dir, rollout_class):
    module = OffPolicyModule(model_path=tiny_model_dir, policy_loss=TOPR(), advantage="grpo", dtype="float32")
    recorder, logger = RecordPrepare(), MemoryLogger()
    rollout = rollout_class(
        **rollout_options(reward=HalfUniformReward(), filter_groups=True, max_sampling_rounds=4)
    )
    trainer = make_trainer([rollout, recorder], max_steps=3, logger=logger)
    trainer.fit(module, datamodule=make_data(tiny_model_dir))

    rounds = logger.values("rollout/sampling_rounds")
    sampled = logger.values("rollout/sampled_prompts")
    fractions = logger.values("rollout/filtered_groups_fraction")
    assert len(rounds) == len(sampled) == len(recorder.records) == 3
    for (exp, _), step_rounds, step_prompts, fraction in zip(
        recorder.records, rounds, sampled, fractions, strict=True
    ):
        kept_groups = exp.group_ids.unique()
        assert len(kept_groups) == BATCH_SIZE or step_rounds == 4, "a step ended short before its last round"
        assert len(exp) == len(kept_groups) * N_SAMPLES
        for group in kept_groups:
            scores = exp.scores[exp.group_ids == group]
            assert scores.max() > scores.min(), "a group with equal rewards reached the update"
        assert (step_rounds == 1) == (step_prompts == BATCH_SIZE)
        # a ratio of counts ≤ 64, logged in float32: one rounding, 6e-8 ≪ approx's default rel=1e-6
        assert fraction == pytest.approx(1 - len(exp) / (step_prompts * N_SAMPLES))
    # one process: the rank balance keeps every group (tests/integration/test_distributed.py has two)
    kept = [len(exp.group_ids.unique()) for exp, _ in recorder.records]
    assert logger.values("rollout/train_groups") == kept
    assert logger.values("rollout/rank_balance_cut_groups") == [0.0] * 3
    assert max(rounds) > 1, "no step re-sampled: the checks above would be vacuous"
    assert module.policy_version == 3


def test_pre_rollout_filter_skips_prompts_whose_groups_had_equal_rewards(tiny_model_dir):
    module = OffPolicyModule(model_path=tiny_model_dir, policy_loss=TOPR(), advantage="grpo", dtype="float32")
    recorder, logger = RecordPrepare(), MemoryLogger()
    options = rollout_options(
        reward=HalfUniformReward(), filter_groups=True, max_sampling_rounds=3, pre_rollout_filter=0.1
    )
    rollout = callbacks.Rollout(**options)
    # 8 training problems, so that problems come back within the 4 steps
    data = PromptDataModule(tokenizer_path=tiny_model_dir, batch_size=BATCH_SIZE, num_train_samples=8)
    trainer = make_trainer([rollout, recorder], max_steps=4, logger=logger)
    trainer.fit(module, datamodule=data)

    skipped = logger.values("rollout/skipped_prompts")
    assert len(skipped) == 4 and sum(skipped) > 0
    history = rollout.worker.history
    answers = {p["prompt"]: p["answer"] for p in data.train_problems}
    even = [prompt for prompt in history.streaks if int(answers[prompt]) % 2 == 0]
    assert even and all(history.streaks[prompt] >= 1 for prompt in even)  # always uniform groups
    restored = callbacks.Rollout(**options)
    restored.load_state_dict(rollout.state_dict())
    assert restored.worker.history.streaks == history.streaks
