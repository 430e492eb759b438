"""A step's metric means, kept where they are computed until the step ends.

A metric read with ``.item()`` or ``float()`` as soon as it exists makes the host wait for the device
(a CUDA synchronization) once per metric and micro-batch; an update of 8 micro-batches read about 20
metrics each. ``MetricMeans`` adds the values as tensors and moves all the means to the host in one
transfer when the step's update is done.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor


class MetricMeans:
    """Means of named values (0-dim tensors or numbers) over the times each was added."""

    def __init__(self) -> None:
        self._sums: dict[str, Tensor | float] = {}
        self._counts: dict[str, int] = defaultdict(int)

    def add(self, name: str, value: Tensor | float) -> None:
        if isinstance(value, Tensor):
            value = value.detach().to(torch.float64)
        self._sums[name] = self._sums.get(name, 0.0) + value
        self._counts[name] += 1

    def add_all(self, metrics: dict[str, Tensor | float]) -> None:
        for name, value in metrics.items():
            self.add(name, value)

    def means(self) -> dict[str, float]:
        """Every mean as a float: one device-to-host transfer for all of them."""
        if not self._sums:
            return {}
        names = list(self._sums)
        # the floats (a custom loss's metrics) join the tensors' device
        device = next((s.device for s in self._sums.values() if isinstance(s, Tensor)), torch.device("cpu"))
        sums = torch.stack(
            [torch.as_tensor(self._sums[name], dtype=torch.float64, device=device) for name in names]
        )
        return {name: total / self._counts[name] for name, total in zip(names, sums.tolist(), strict=True)}
