"""Callbacks for the fits of several trainer ranks on rollout servers (tests/integration/
test_rollout_servers_ranks.py), given on the command line by class path: they run in every rank's
process, which the test can reach only through the files they write.

- ``RecordRanks(out)``: after each step, ``out/rank{r}_steps.pt`` holds, per trained step (a resumed
  run's appended), the trainer's version, the step's prompts, its ``Experience`` (per-token versions,
  π_rollout), how many servers the rank's pool has alive and how many times its servers came back;
  rank 0 writes ``out/weights_v{v}.pt``, the actor's full weights of each version it pushes (version 0
  or the resumed one at the start, then one per step).
- ``KillServers``: on rank 0, SIGKILLs server 0's API server while the step after the first push
  generates (once rank 0 has requests running on it), then, before the step after the second push,
  every API server left.
- ``HandOverMidGeneration``: on rank 0, each step's weights are handed over while the async producer's
  requests run, so that the push lands in the middle of responses.
- ``AwaitComeback``: on rank 0, after the steps trained while a server is lost, the run waits for the
  server's restart instead of training through it.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import lightning as L
import psutil
import requests
import torch

from lit_offpolicy.callbacks import Rollout
from lit_offpolicy.data import batch_problems
from lit_offpolicy.rollout.server.process import server_of
from lit_offpolicy.rollout.weight_sync import full_state_dict


def _servers(trainer: L.Trainer) -> list:
    return _rollout(trainer).worker.engine.pool.servers


class RecordRanks(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.steps: list[dict] = []

    def on_train_start(self, trainer, pl_module) -> None:
        path = self.out / f"rank{trainer.global_rank}_steps.pt"
        self.steps = torch.load(path, weights_only=False)["steps"] if path.is_file() else []  # resumed
        self._save_weights(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        experience, servers = batch["experience"], _servers(trainer)
        self.steps.append(
            {
                "trainer_version": pl_module.policy_version - 1,
                "prompts": [problem["prompt"] for problem in batch_problems(batch)],
                "experience": experience,
                "servers_alive": sum(server.alive for server in servers),
                "server_restarts": sum(server.comebacks for server in servers),
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
    return server_of(psutil.Process(server.launched.process.pid))


def _kill_when_busy(server) -> None:
    """SIGKILL ``server``'s API server once requests run on it (a machine lost mid-generation)."""
    deadline = time.monotonic() + 120
    while server.outstanding == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    _api_server(server).kill()


class HandOverMidGeneration(L.Callback):
    """Given before ``AsyncRollout`` (its hand-over runs after this hook), with partial rollouts and
    ``max_staleness`` 2. On rank 0, once the first step is done, the producer starts each generation
    only at the end of a step, and the trainer hands its weights over only once that generation's
    requests have sampled ``tokens`` tokens (the servers' counters) and not all ended: the push lands
    in the middle of rank 0's responses. Each wait ends after ``wait_s`` at most, and with the run."""

    def __init__(self, tokens: int = 16, wait_s: float = 30.0) -> None:
        self.tokens, self.wait_s = tokens, wait_s
        self.steps_done = 0
        self.producer_waits = threading.Event()
        self.step_end = threading.Event()
        self.generating = threading.Event()
        self.sampled_before = 0.0
        self.servers: list = []

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != 0:
            return
        engine = _rollout(trainer).worker.engine
        self.servers = engine.pool.servers
        generate = engine.generate

        def gated_generate(prompts, params, sync=None):
            if sync is not None and self.steps_done > 0:
                self.producer_waits.set()
                self.step_end.wait(self.wait_s)
                self.step_end.clear()
                self.producer_waits.clear()
                self.sampled_before = _sampled(self.servers)
                self.generating.set()
            try:
                return generate(prompts, params, sync)
            finally:
                self.generating.clear()

        engine.generate = gated_generate

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank != 0:
            return
        self.steps_done += 1
        if not self.producer_waits.is_set():
            return  # done with the batches it may start (max_staleness ahead): it starts after the release
        self.step_end.set()
        deadline = time.monotonic() + self.wait_s
        self.generating.wait(self.wait_s)
        while self.generating.is_set() and time.monotonic() < deadline:
            if _sampled(self.servers) >= self.sampled_before + self.tokens:
                return
            time.sleep(0.002)

    def teardown(self, trainer, pl_module, stage) -> None:
        self.steps_done = 0
        self.step_end.set()


class AwaitComeback(L.Callback):
    """Given before the rollout callback (its push admits a server that is back). On rank 0, once
    ``steps_alone`` steps have ended with a server lost, each step's end waits until the lost servers
    are started again and answer (``wait_s`` at most): the run trains ``steps_alone`` steps on the
    servers left, not as many as a restart lasts (each one CPU the restart shares), and the next push
    admits them."""

    def __init__(self, steps_alone: int = 2, wait_s: float = 300.0) -> None:
        self.steps_alone, self.wait_s = steps_alone, wait_s
        self.ended_alone = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank != 0:
            return
        pool = _rollout(trainer).worker.engine.pool
        lost = [server for server in pool.servers if not server.alive]
        self.ended_alone = self.ended_alone + 1 if lost else 0
        if self.ended_alone <= self.steps_alone:
            return
        deadline = time.monotonic() + self.wait_s
        while (
            not all(server.ready for server in lost)
            and not pool.closing.is_set()
            and not pool.signalled()
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)


def _rollout(trainer: L.Trainer) -> Rollout:
    (rollout,) = [c for c in trainer.callbacks if isinstance(c, Rollout)]
    return rollout


def _sampled(servers: list) -> float:
    """How many tokens the live ``servers`` have sampled (their Prometheus counters)."""
    total = 0.0
    for server in servers:
        if not server.alive:
            continue
        try:
            lines = requests.get(f"{server.url}/metrics", timeout=5).text.splitlines()
        except requests.RequestException:
            continue
        total += sum(
            float(line.rsplit(" ", 1)[1])
            for line in lines
            if line.startswith("vllm:generation_tokens_total{")
        )
    return total
