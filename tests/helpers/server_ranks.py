"""Callbacks for the fits of several trainer ranks on rollout servers (tests/integration/
test_rollout_servers_ranks.py), given on the command line by class path: they run in every rank's
process, which the test can reach only through the files they write.

- ``RecordRanks(out)``: after each step, ``out/rank{r}_steps.pt`` holds, per trained step (a resumed
  run's appended), the
  trainer's version, the step's prompts and its ``Experience`` (per-token versions, π_rollout);
  rank 0 writes ``out/weights_v{v}.pt``, the actor's full weights of each version it pushes (version
  0 or the resumed one at the start, then one per step).
- ``KillServers``: on rank 0, SIGKILLs server 0's API server while the step after the first push
  generates (once rank 0 has requests running on it), then, before the step after the second push,
  every API server left.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import lightning as L
import psutil
import torch

from lit_offpolicy.callbacks import Rollout
from lit_offpolicy.data import batch_problems
from lit_offpolicy.rollout.weight_sync import full_state_dict


def _servers(trainer: L.Trainer) -> list:
    (rollout,) = [c for c in trainer.callbacks if isinstance(c, Rollout)]
    return rollout.worker.engine.pool.servers


class RecordRanks(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.steps: list[dict] = []

    def on_train_start(self, trainer, pl_module) -> None:
        path = self.out / f"rank{trainer.global_rank}_steps.pt"
        self.steps = torch.load(path, weights_only=False)["steps"] if path.is_file() else []  # resumed
        self._save_weights(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        experience = batch["experience"]
        self.steps.append(
            {
                "trainer_version": pl_module.policy_version - 1,
                "prompts": [problem["prompt"] for problem in batch_problems(batch)],
                "experience": experience,
            }
        )
        _save({"steps": self.steps}, self.out / f"rank{trainer.global_rank}_steps.pt")
        self._save_weights(trainer, pl_module)

    def _save_weights(self, trainer, pl_module) -> None:
        weights = full_state_dict(trainer.strategy, pl_module)  # a collective under FSDP2: every rank
        if trainer.global_rank == 0:
            weights = {name: tensor.detach().clone() for name, tensor in weights.items()}
            _save(weights, self.out / f"weights_v{pl_module.policy_version}.pt")


def _save(obj, path: Path) -> None:
    """``torch.save`` as one rename: the test reads the files while the run writes them."""
    partial = path.with_suffix(".partial")
    torch.save(obj, partial)
    os.replace(partial, path)


class KillServers(L.Callback):
    """Given before ``Rollout``: its hook runs before Rollout's generates the step."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and pl_module.policy_version == 1:
            first = _servers(trainer)[0]
            threading.Thread(target=_kill_when_busy, args=(first,), daemon=True).start()
        if trainer.global_rank == 0 and pl_module.policy_version == 2:
            for server in _servers(trainer):
                if server.alive:
                    _api_server(server).kill()


def _api_server(server) -> psutil.Process:
    (api_server,) = psutil.Process(server.launched.process.pid).children()
    return api_server


def _kill_when_busy(server) -> None:
    """SIGKILL ``server``'s API server once requests run on it (a machine lost mid-generation)."""
    deadline = time.monotonic() + 120
    while server.outstanding == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    _api_server(server).kill()
