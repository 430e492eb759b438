"""Requests from many episodes at once, batched into the engine's ``generate`` calls.

The endpoint's request threads ``submit``; one thread (the rollout's, which owns the engine) ``serve``s.
A batch is generated once every running episode has a request waiting, or once no request has
arrived for ``BATCH_WINDOW_S`` (an episode may be busy running its tools), or ``BATCH_WAIT_MAX_S``
after the batch's first request.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from lit_offpolicy.rollout.engine import RolloutEngine, SamplingParams, WeightSyncHook

BATCH_WINDOW_S = 0.02
"""A batch waiting for more requests is generated after this long without a new one."""
BATCH_WAIT_MAX_S = 0.2
"""The longest a request waits for others to join its batch."""
BATCH_SEED_STRIDE = 7_919
"""Batch k of a rollout samples with the request's seed + k × this."""


@dataclasses.dataclass
class Pending:
    prompt: list[int]
    params: SamplingParams
    result: Future
    """Set to ``(generation, policy version)``, or to the engine's exception."""


class GenerationQueue:
    """Requests waiting for the engine; ``running`` counts the episodes that may still send one."""

    def __init__(self) -> None:
        self._pending: list[Pending] = []
        self._changed = threading.Condition()
        self.running = 0
        self.batches = 0
        """``generate`` calls made so far."""
        self.requests = 0
        """Requests generated so far."""

    def submit(self, prompt: list[int], params: SamplingParams) -> Future:
        pending = Pending(prompt, params, Future())
        with self._changed:
            self._pending.append(pending)
            self._changed.notify_all()
        return pending.result

    def add_running(self, change: int) -> None:
        """An episode started (+1) or ended (-1)."""
        with self._changed:
            self.running += change
            self._changed.notify_all()

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def serve(self, engine: RolloutEngine, finished: Callable[[], bool], sync: WeightSyncHook | None) -> None:
        """Generate the waiting requests in batches until ``finished()`` and none waits; an engine
        error fails every waiting request and is raised here."""
        while True:
            batch = self._next_batch(finished)
            if batch is None:
                return
            try:
                self._generate(engine, batch, sync)
            except BaseException as error:
                with self._changed:
                    batch, self._pending = batch + self._pending, []
                for pending in batch:
                    if not pending.result.done():
                        pending.result.set_exception(error)
                raise

    def fail_waiting(self, error: BaseException) -> None:
        """Answer every request still waiting with ``error`` (the rollout has ended)."""
        with self._changed:
            waiting, self._pending = self._pending, []
        for pending in waiting:
            pending.result.set_exception(error)

    def _next_batch(self, finished: Callable[[], bool]) -> list[Pending] | None:
        with self._changed:
            while not self._pending:
                if finished():
                    return None
                self._changed.wait(0.5)
            latest = time.monotonic() + BATCH_WAIT_MAX_S
            while len(self._pending) < self.running and not finished():
                count, left = len(self._pending), min(BATCH_WINDOW_S, latest - time.monotonic())
                if left <= 0 or not self._changed.wait(left) and len(self._pending) == count:
                    break  # nothing arrived within the window
            batch, self._pending = self._pending, []
            return batch

    def _generate(self, engine: RolloutEngine, batch: list[Pending], sync: WeightSyncHook | None) -> None:
        by_params: dict[SamplingParams, list[Pending]] = {}
        for pending in batch:
            params = pending.params
            if params.seed is not None:
                params = dataclasses.replace(params, seed=params.seed + self.batches * BATCH_SEED_STRIDE)
            by_params.setdefault(params, []).append(pending)
        for params, group in by_params.items():
            prompts = [pending.prompt for pending in group]
            generated = (
                engine.generate(prompts, params)
                if sync is None
                else engine.generate(prompts, params, sync=sync)
            )
            version = engine.policy_version
            self.batches += 1
            self.requests += len(group)
            for pending, (generation,) in zip(group, generated, strict=True):
                pending.result.set_result((generation, version))
