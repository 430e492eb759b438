"""Rewards that fail on every sample: per-function failure metrics, the run-level stop, factories."""

from __future__ import annotations

import os
import signal

import pytest

from lit_offpolicy.rewards import (
    IsolatedReward,
    RewardConfig,
    RewardInputs,
    RewardWorkersDied,
    WeightedRewards,
    failure_summary,
    function_metrics,
    unscored_fraction,
)

PROBLEMS = [{"prompt": "2+3=", "raw_prompt": "2+3=", "answer": "5"}, {"prompt": "4+4=", "answer": "8"}]


def readme_accuracy(completions, solution=None, **kwargs):
    """The README's reward on string prompts: indexes a string as chat messages."""
    return [float(c[0]["content"] == "5") for c in completions]


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def never_applies(completions, **kwargs):
    return [None for _ in completions]


def get_soft_overlong_punishment(max_completion_len, soft_punish_cache):
    """TRL's shape: a factory that returns the reward function."""

    def soft_overlong_punishment_reward(completion_ids, **kwargs):
        return [0.0 if len(ids) <= max_completion_len - soft_punish_cache else -1.0 for ids in completion_ids]

    return soft_overlong_punishment_reward


def test_an_isolated_failure_is_put_down_to_its_function_and_logged_per_function():
    inputs = RewardInputs.of(PROBLEMS, ["5", "6", "8", "x"], [[1], [2], [3], [4]], n=2)
    rewards = IsolatedReward(WeightedRewards({"accuracy": readme_accuracy, "length": length}), timeout=30.0)
    try:
        out = rewards(inputs)
    finally:
        rewards.close()
    assert out.scores == [0.0] * 4 and out.num_errors == 4
    assert out.errors_by_function == {"accuracy": 4}
    assert out.first_error.startswith("'accuracy' raised TypeError: string indices must be integers")
    metrics = function_metrics([out])
    assert metrics["reward/fn/accuracy/error_fraction"] == 1.0
    assert metrics["reward/fn/accuracy/none_fraction"] == 0.0
    assert "reward/fn/accuracy/mean" not in metrics
    assert metrics["reward/fn/length/mean"] == 1.0 and metrics["reward/fn/length/error_fraction"] == 0.0
    # the length function scored every sample: the step is not a failed one
    assert unscored_fraction([out]) == 0.0


def test_a_step_where_no_function_scores_any_sample_is_described_by_name():
    inputs = RewardInputs.of(PROBLEMS, ["5", "8"], [[1], [2]])
    raising = IsolatedReward(WeightedRewards({"accuracy": readme_accuracy}), timeout=30.0)
    try:
        out = raising(inputs)
    finally:
        raising.close()
    assert unscored_fraction([out]) == 1.0
    assert failure_summary([out], 30.0).startswith(
        "reward 'accuracy' failed on every sample: 'accuracy' raised TypeError: string indices must be "
        "integers"
    )
    nothing = WeightedRewards({"never_applies": never_applies})(inputs)
    assert unscored_fraction([nothing]) == 1.0
    assert function_metrics([nothing]) == {
        "reward/fn/never_applies/error_fraction": 0.0,
        "reward/fn/never_applies/none_fraction": 1.0,
    }
    assert failure_summary([nothing], None).startswith("reward 'never_applies' returned None")


def test_a_time_out_names_the_function_and_reward_timeout():
    inputs = RewardInputs.of(PROBLEMS, ["5", "8"], [[1], [2]])
    slow = IsolatedReward(WeightedRewards({"slow": _sleepy}), timeout=0.5)
    try:
        out = slow(inputs)
    finally:
        slow.close()
    assert out.num_timeouts == 2 and unscored_fraction([out]) == 1.0
    assert function_metrics([out])["reward/fn/slow/none_fraction"] == 0.0
    assert failure_summary([out], 0.5).startswith("reward 'slow' was not done within reward.timeout=0.5 s")


def _sleepy(completions, **kwargs):
    import time

    time.sleep(30)
    return [1.0 for _ in completions]


def test_a_factory_by_import_path_is_refused_with_the_class_path_form():
    with pytest.raises(ValueError) as error:
        RewardConfig(fn=f"{__name__}:get_soft_overlong_punishment", timeout=None).build()
    message = str(error.value)
    assert "\n" not in message
    assert message == (
        f"reward.fn='{__name__}:get_soft_overlong_punishment' takes (max_completion_len, soft_punish_cache), "
        "not a reward's completions and **kwargs: if it builds the reward function, give it as "
        f"{{class_path: {__name__}.get_soft_overlong_punishment, init_args: {{max_completion_len: ..., "
        "soft_punish_cache: ...}}"
    )
    spec = {
        "class_path": f"{__name__}.get_soft_overlong_punishment",
        "init_args": {"max_completion_len": 3, "soft_punish_cache": 1},
    }
    built = RewardConfig(fn=spec, timeout=None).build()
    out = built(RewardInputs.of(PROBLEMS, ["5", "8"], [[1], [2, 3, 4]]))
    assert out.scores == [0.0, -1.0]


def test_max_failed_steps_is_checked():
    with pytest.raises(ValueError, match="reward.max_failed_steps=0 is out of range"):
        RewardConfig(max_failed_steps=0)


# ------------------------------------------------------------ worker processes that die while scoring


class DiesOn:
    """Scores completions by length, and SIGKILLs the process it runs in on ``fatal`` completions: the
    first ``times`` such calls when ``marker_dir`` is given (one file per death), every one otherwise."""

    def __init__(self, fatal: str, marker_dir=None, times: int = 1) -> None:
        self.fatal, self.marker_dir, self.times = fatal, marker_dir, times

    def __call__(self, completions, **kwargs):
        if self.fatal in completions:
            deaths = sorted(self.marker_dir.iterdir()) if self.marker_dir is not None else []
            if self.marker_dir is None or len(deaths) < self.times:
                if self.marker_dir is not None:
                    (self.marker_dir / f"death-{len(deaths)}").touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return [float(len(c)) for c in completions]


def _inputs(completions: list[str]) -> RewardInputs:
    problems = [{"prompt": "p", "answer": "a"} for _ in completions]
    return RewardInputs.of(problems, completions, [[0]] * len(completions))


def _live_workers(reward: IsolatedReward) -> list[int]:
    return [worker.process.pid for worker in reward._workers if worker.process.is_alive()]


@pytest.mark.slow  # processes, not floats: test-numerics leaves it out
def test_a_worker_killed_while_scoring_is_replaced_and_its_samples_scored_again(tmp_path):
    """The kernel's OOM killer, say: SIGKILL mid-chunk. Its samples get their real scores, not 0."""
    completions = ["aa", "b", "ccc", "dddd"] * 4  # 16 samples, 2 workers: 16 chunks of 1
    reward = IsolatedReward(WeightedRewards({"length": DiesOn("ccc", tmp_path)}), timeout=60.0, num_workers=2)
    try:
        out = reward(_inputs(completions))
        assert out.scores == [float(len(c)) for c in completions]
        assert (out.num_errors, out.num_timeouts, out.worker_restarts) == (0, 0, 1)
        assert len(list(tmp_path.iterdir())) == 1 and len(_live_workers(reward)) == 2
        assert reward(_inputs(completions)).worker_restarts == 0  # counted per batch
    finally:
        reward.close()


@pytest.mark.slow  # processes, not floats: test-numerics leaves it out
def test_a_sample_that_kills_every_worker_costs_its_chunk_and_the_batch_goes_on(tmp_path):
    """Its chunk is scored twice (two workers die), then scores 0 as an error; the others score."""
    completions = ["aa", "boom", "ccc", "dddd"]
    reward = IsolatedReward(WeightedRewards({"length": DiesOn("boom")}), timeout=60.0, num_workers=1)
    try:
        out = reward(_inputs(completions))  # 4 samples, 1 worker: 4 chunks of 1
        assert out.scores == [2.0, 0.0, 3.0, 4.0]
        assert (out.num_errors, out.worker_restarts, out.errors_by_function) == (1, 2, {"length": 1})
        assert out.first_error == "reward worker died"
    finally:
        reward.close()


@pytest.mark.slow  # processes, not floats: test-numerics leaves it out
def test_a_function_that_kills_every_worker_stops_after_max_restarts():
    reward = IsolatedReward(WeightedRewards({"crashy": DiesOn("x")}), timeout=60.0, max_restarts=3)
    with pytest.raises(RewardWorkersDied) as error:
        reward(_inputs(["x", "x", "x"]))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        "reward 'crashy': its worker process died 4 times in a row (killed by SIGKILL the last time), more "
        "than reward.max_worker_restarts=3; the function ends the process it runs in"
    )
    assert reward._workers == []  # none left running


def test_max_worker_restarts_is_checked_and_wired():
    with pytest.raises(ValueError, match="reward.max_worker_restarts=-1 is out of range"):
        RewardConfig(max_worker_restarts=-1)
    reward = RewardConfig(max_worker_restarts=0).build()
    assert isinstance(reward, IsolatedReward) and reward.max_restarts == 0
