"""A run's guard against reward collapse: one warning when a reward that started above 0 falls to 0."""

from __future__ import annotations

from collections import deque


class CollapseDetector:
    """Watches ``reward/mean`` and ``rollout/truncated_fraction`` step by step; warns once.

    start = the mean reward of the first ``window`` RL steps; the run has collapsed when the mean of the
    last ``window`` steps is at most ``fall`` × start (start > 0: rewards that are 0 when wrong, as the
    built-in ones). The warning says whether the responses pin at ``max_tokens`` (mean truncated
    fraction of the window ≥ ``pinned``: the policy stopped ending its responses) and names the
    likely causes (docs/async.md, "When the reward collapses").
    """

    def __init__(self, window: int = 5, fall: float = 0.1, pinned: float = 0.9) -> None:
        self.window, self.fall, self.pinned = window, fall, pinned
        self.start: float | None = None
        self.first: list[float] = []
        self.recent: deque[tuple[float, float | None]] = deque(maxlen=window)
        self.warned = False

    def observe(self, step: int, reward_mean: float, truncated_fraction: float | None) -> str | None:
        """Take one RL step's metrics; the one-line warning the first time the reward has collapsed."""
        if self.start is None:
            self.first.append(reward_mean)
            if len(self.first) == self.window:
                self.start = sum(self.first) / self.window
            return None
        self.recent.append((reward_mean, truncated_fraction))
        if self.warned or self.start <= 0 or len(self.recent) < self.window:
            return None
        now = sum(reward for reward, _ in self.recent) / self.window
        if now > self.fall * self.start:
            return None
        self.warned = True
        return self._message(step, now)

    def _message(self, step: int, now: float) -> str:
        fractions = [fraction for _, fraction in self.recent if fraction is not None]
        truncated = sum(fractions) / len(fractions) if fractions else None
        fell = (
            f"reward/mean fell from {self.start:.3g} (first {self.window} steps) to {now:.3g} "
            f"(last {self.window}, step {step})"
        )
        if truncated is not None and truncated >= self.pinned:
            shape = f"while {truncated:.0%} of responses stop at max_tokens: the policy no longer ends them"
        else:
            shape = "while the responses still end on their own"
        return (
            f"lit-offpolicy: warning: reward collapse: {fell} {shape}. Likely causes: stale samples "
            "trained without rollout correction (max_staleness > 0: set model.rollout_correction, e.g. "
            "seq_is_rs), a learning rate too high for the sampling temperature, or a reward that gives "
            "0 to every truncated response. Warned once (docs/async.md)."
        )
