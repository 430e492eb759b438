"""MetricMeans by hand: the step's metric means, kept on the device until the step's end (the update's
host reads through a real fit: tests/integration/test_step_metrics_fit.py)."""

from __future__ import annotations

import torch

from lit_offpolicy.training.step_metrics import MetricMeans


def test_metric_means_by_hand():
    means = MetricMeans()
    means.add("a", torch.tensor(1.0))
    means.add("a", torch.tensor(2.0, dtype=torch.float64))
    means.add("b", 0.5)  # a custom loss's float
    means.add_all({"b": torch.tensor(1.5), "c": torch.tensor(-3.0)})
    assert means.means() == {"a": 1.5, "b": 1.0, "c": -3.0}
    assert MetricMeans().means() == {}
