"""Fault soak of rollout servers (issue #59): a run on two launched vLLM servers whose processes are
killed again and again heals and learns as a run without faults does.

From the demo's SFT warm-up, ``configs/topr.yaml`` with the demo's Rollout on
``VLLMServerSpec(launch={servers: 2})``, seeded as the demo is. ``FaultInjector`` (a callback in the
run's process) SIGKILLs, ``--every`` steps after the previous fault's server came back (the first at
step ``--every``), in turn: server 0's engine core mid-generation, server 1's API server during the
weight push that ends the step, server 0's API server, server 1's engine core during a push, ...; after
``--faults`` faults and ``--every`` steps on both servers it stops the run. (A vLLM server comes back in
about 30 s on 2 CPU cores, 12 of the tiny model's steps: faults every 10 steps regardless would find
the other server still starting, and healing needs one server left.) Then a run without faults, as many
steps, gives the baseline.

The faulted run must end with exit 0, both servers serving, every fault followed by a comeback,
``rollout_corr/kl`` ≤ ``KL_BOUND`` at every step after each comeback, reward rising (the mean of the
last 10 steps above the mean of steps 0–4) and no process of its servers left. Reported: restarts,
the seconds from each kill to the server serving again, the seconds lost per fault (the faulted run's
wall time less the baseline's, per fault) and the median step time against the baseline's.

    python -m benchmarks.learning.server_faults                          # 5 faults, then the baseline
    python -m benchmarks.learning.server_faults --quick --sft-dir DIR    # .ci/run: 2 faults, no baseline
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import lightning as L
import psutil

from benchmarks import REPO
from benchmarks.common import entry, median
from benchmarks.learning.async_vs_sync import rollout_callback, warm_up
from benchmarks.results import record
from lit_offpolicy.core.tensorboard import latest_run, read_scalars
from lit_offpolicy.rollout.server import supervise
from lit_offpolicy.rollout.server.process import engine_core_of, server_of

KL_BOUND = 1e-3
"""Largest ``rollout_corr/kl`` after a comeback: the servers sample the trainer's float32 weights (the
runs without faults read below 1e-5 on the tiny model)."""
KINDS = ("engine_core", "api_server_mid_push", "api_server", "engine_core_mid_push")
"""The faults, in turn; server 0 takes the even ones, server 1 the odd ones."""
START_STEPS, END_STEPS = 5, 10


class FaultInjector(L.Callback):
    """In the run's process: SIGKILLs a server process (``KINDS`` in turn) ``every`` steps after the
    previous fault's server came back (after step 0 for the first), ``faults`` times; once the last one is
    back and ``after`` steps more ran on every server, it stops the run. One JSON line per fault and per
    step goes to ``out`` (the wall time, the servers serving, the comebacks so far)."""

    def __init__(self, out: str, every: int = 10, faults: int = 5, after: int = 10) -> None:
        self.out, self.every, self.faults, self.after = Path(out), every, faults, after
        self.injected = 0
        self.calm_since = 0
        """The step since which every server serves."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        pool = _pool(trainer)
        if self.injected == self.faults or trainer.global_step < self.calm_since + self.every:
            return
        kind = KINDS[self.injected % len(KINDS)]
        server = pool.servers[self.injected % 2]
        self.injected += 1
        process = _process(server, kind)
        if kind.endswith("mid_push"):  # at this step's push: after /pause, with its first bucket
            send = server.sender.send_bucket

            def killed_then_sent(bucket, send=send):
                server.sender.send_bucket = send
                process.kill()
                return send(bucket)

            server.sender.send_bucket = killed_then_sent
        else:
            threading.Thread(target=_kill_when_busy, args=(server, process), daemon=True).start()
        self.calm_since = 10**9  # until every server serves again
        self._write({"fault": kind, "server": server.url, "step": trainer.global_step, "time": time.time()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pool = _pool(trainer)
        serving = len(pool.serving)
        back = serving == len(pool.servers) and pool.restarts >= self.injected  # each fault's comeback
        if back and self.calm_since > trainer.global_step:
            self.calm_since = trainer.global_step
        step = {
            "step": trainer.global_step,
            "time": time.time(),
            "serving": serving,
            "restarts": pool.restarts,
        }
        self._write(step)
        if (
            self.faults
            and self.injected == self.faults
            and trainer.global_step >= self.calm_since + self.after
        ):
            trainer.should_stop = True

    def _write(self, line: dict) -> None:
        with open(self.out, "a") as file:
            file.write(json.dumps(line) + "\n")


def _pool(trainer):
    (rollout,) = [c for c in trainer.callbacks if hasattr(c, "worker")]
    return rollout.worker.engine.pool


def _process(server, kind: str) -> psutil.Process:
    api_server = server_of(psutil.Process(server.launched.process.pid))
    return api_server if kind.startswith("api_server") else engine_core_of(api_server)


def _kill_when_busy(server, process: psutil.Process) -> None:
    """SIGKILL ``process`` once the step's requests run on ``server`` (mid-generation), else after 30 s."""
    deadline = time.monotonic() + 30
    while server.outstanding == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    process.kill()


def fit(sft: Path, work: Path, name: str, steps: int, faults: int, every: int) -> tuple[int, float, Path]:
    """One run of at most ``steps`` steps (with faults: until the last fault's server came back and
    ``every`` steps more ran); its exit status, wall seconds and JSON-lines record."""
    rollout = rollout_callback(None)
    rollout["init_args"]["engine"] = {
        "class_path": "lit_offpolicy.rollout.VLLMServerSpec",
        "init_args": {"launch": {"servers": 2}, "request_timeout_s": 120},
    }
    rollout["init_args"]["validation"] = {"every_n_steps": 0, "stop_at": None}  # all the steps
    steps_file = work / f"{name}.jsonl"
    injector = {
        "class_path": "benchmarks.learning.server_faults.FaultInjector",
        "init_args": {"out": str(steps_file), "every": every, "faults": faults, "after": every},
    }
    logger = {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": str(work / "logs"), "name": name},
    }
    command = [
        *(sys.executable, "-m", "lit_offpolicy", "fit", "--config", "configs/topr.yaml"),
        *("--model.init_args.model_path", str(sft), "--trainer.max_steps", str(steps)),
        *("--trainer.callbacks", json.dumps([rollout, injector]), "--trainer.logger", json.dumps(logger)),
        *("--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false"),
        *("--trainer.default_root_dir", str(work / name)),
    ]
    started = time.monotonic()
    log = work / f"{name}.log"
    with open(log, "w") as output:
        process = subprocess.Popen(
            command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
        status = process.wait()
    seconds = time.monotonic() - started
    print(f"=== {name}: exit {status} in {seconds:.0f} s (log {log})", flush=True)
    return status, seconds, steps_file


def left_behind(sft: Path) -> list[str]:
    """Processes of servers of ``sft`` that still run (a watchdog, an API server, an engine core)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if str(sft) in line and ("vllm" in line or supervise.__file__ in line):
            found.append(f"{process.pid} {line[:80]}")
    return found


def faults_report(steps_file: Path) -> tuple[list[dict], list[dict]]:
    """(faults, steps) from the run's JSON lines; each fault with ``back_s`` and ``back_step``: the
    first step end at which the comebacks counted one more (None if never)."""
    lines = [json.loads(line) for line in steps_file.read_text().splitlines()]
    faults = [line for line in lines if "fault" in line]
    steps = [line for line in lines if "fault" not in line]
    for number, fault in enumerate(faults, start=1):
        back = next((s for s in steps if s["time"] > fault["time"] and s["restarts"] >= number), None)
        fault["back_step"] = back and back["step"]
        fault["back_s"] = back and round(back["time"] - fault["time"], 1)
    return faults, steps


def check(run: Path, faults: list[dict], steps: list[dict], status: int, sft: Path) -> list[str]:
    """What the faulted run failed of the soak's rules (empty: it passed)."""
    failed = [] if status == 0 else [f"exit status {status}"]
    if not steps or steps[-1]["serving"] != 2:
        failed.append(f"not every server serves at the end: {steps[-1:]}")
    failed += [
        f"{f['fault']} at step {f['step']}: the server never came back"
        for f in faults
        if f["back_step"] is None
    ]
    kl = dict(read_scalars(run, "rollout_corr/kl"))
    for fault in faults:
        after = {
            step: value for step, value in kl.items() if fault["back_step"] and step >= fault["back_step"]
        }
        worst = max(after.values(), key=abs, default=0.0)
        if abs(worst) > KL_BOUND:
            failed.append(
                f"rollout_corr/kl {worst:.2e} > {KL_BOUND} after the comeback of step {fault['back_step']}"
            )
    curve = sorted(read_scalars(run, "reward/mean"))
    start = sum(v for s, v in curve if s < START_STEPS) / START_STEPS
    end = sum(v for _, v in curve[-END_STEPS:]) / END_STEPS
    print(f"=== reward/mean: start {start:.3f} -> end {end:.3f}", flush=True)
    if not end > start:
        failed.append(f"reward did not rise: {start:.3f} -> {end:.3f}")
    if leftover := left_behind(sft):
        failed.append(f"left behind: {leftover}")
    return failed


def step_seconds(steps: list[dict]) -> float:
    """The median wall seconds between consecutive step ends."""
    times = [step["time"] for step in steps]
    return median([b - a for a, b in zip(times, times[1:], strict=False)])


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--faults", type=int, default=5)
    parser.add_argument("--every", type=int, default=10, help="steps from a comeback to the next fault")
    parser.add_argument(
        "--max-steps", type=int, default=300, help="the run's bound, should a server not come back"
    )
    parser.add_argument(
        "--sft-dir", type=Path, default=REPO / "outputs" / "sft-tiny", help="built if missing"
    )
    parser.add_argument("--work", type=Path, default=None, help="logs (default: a new temp dir)")
    parser.add_argument("--quick", action="store_true", help="CI: 2 faults, no baseline, no record")
    args = parser.parse_args(argv)
    if args.quick:
        args.faults = 2
    return args


class SoakFailed(RuntimeError):
    """The faulted run broke a rule of the soak; the message names each."""


def main(argv: list[str] | None = None) -> list[dict]:
    """The soak; its results.json entry (recorded; none with ``--quick``), or ``SoakFailed``."""
    args = parse(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="server_faults_"))
    work.mkdir(parents=True, exist_ok=True)
    sft = args.sft_dir.resolve()
    if not sft.is_dir():
        print(f"=== no SFT warm-up at {sft}: training one into {work} (seed 0)", flush=True)
        sft = warm_up(work, os.cpu_count() or 1)
    status, seconds, steps_file = fit(sft, work, "faults", args.max_steps, args.faults, args.every)
    faults, steps = faults_report(steps_file)
    for fault in faults:
        print(
            f"=== {fault['fault']} of {fault['server']} at step {fault['step']}: back at step "
            f"{fault['back_step']}, {fault['back_s']} s after the kill",
            flush=True,
        )
    failed = check(latest_run(work / "logs" / "faults"), faults, steps, status, sft)
    failed += [] if len(faults) == args.faults else [f"{len(faults)} faults injected of {args.faults}"]
    entries = []
    if not args.quick:  # as many steps without faults
        clean_status, clean_seconds, clean_file = fit(sft, work, "no_faults", len(steps), 0, args.every)
        _, clean_steps = faults_report(clean_file)
        ours, baseline = step_seconds(steps), step_seconds(clean_steps)
        lost = (seconds - clean_seconds) / max(len(faults), 1)
        print(
            f"=== median step {ours:.2f} s with faults, {baseline:.2f} s without; "
            f"{lost:.1f} s lost per fault",
            flush=True,
        )
        entries = [
            entry(
                "server_fault_soak",
                "s",
                ours=ours,
                baseline=baseline,
                repeats=1,
                command="python -m benchmarks.learning.server_faults",
                workload="demo TOPR from the SFT warm-up on 2 launched vLLM servers, "
                f"{len(steps)} steps, a server process SIGKILLed {args.every} steps after the last one "
                f"came back, {args.faults} times ({', '.join(KINDS)} in turn); "
                "ours: median step seconds with the faults, baseline: the same run without",
                restarts=steps[-1]["restarts"] if steps else 0,
                seconds_lost_per_fault=round(lost, 1),
                comeback_seconds=[fault["back_s"] for fault in faults],
                faults=faults,
                passed=not failed,
                baseline_exit=clean_status,
            )
        ]
        record(entries)
    if failed:
        raise SoakFailed(f"server_faults FAILED: {'; '.join(failed)}")
    print(f"=== server_faults passed: {len(faults)} faults, every server back, exit 0", flush=True)
    return entries


if __name__ == "__main__":
    try:
        main()
    except SoakFailed as failure:
        print(f"=== {failure}", flush=True)
        sys.exit(1)
