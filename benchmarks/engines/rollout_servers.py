"""Rollout servers (issue 34): generation through ``vllm serve``, the weight push, async training on them.

- ``rollout_server_vs_inprocess``: response tokens/s of ``VLLMServerEngine`` (one launched server,
  on every core) against the in-process ``VLLMEngine``, same prompts and sampling (64 prompts × n=8 ×
  up to 32 tokens, the built-in tiny model, seeded alike: the same tokens come back). Medians of
  ``repeats`` alternating runs after a warm-up; ratio = server / in-process.
- ``weight_push_server`` (TCP) and ``weight_push_server_shm`` (shared memory): seconds per GB of
  ``VLLMServerEngine.load_weights`` (pause, the buckets through vLLM's /update_weights, finish, KV
  cache reset, resume) of the Qwen3-shaped model of memory_vs_trl (181M parameters, float32, 0.72 GB),
  streamed from the actor as a sync does, into one launched server, each against the in-process
  ``VLLMEngine.load_weights`` of the same weights, the median of all the run's reloads (ratio =
  in-process / server: the cost of leaving the process; the issue's goal for shared memory: 0.8).
  Each repeat times a shared-memory push, an in-process reload, a TCP push, an in-process reload
  (the server's transfer re-initialised and warmed by one push between them, untimed), so that load
  from other work on the machine falls on all alike; the load average is recorded.
- ``async_servers_vs_sync``: steps/s of ``lit-offpolicy fit`` with configs/grpo.yaml +
  configs/rollout/vllm_server_async.yaml (one launched server pinned to core 1, the trainer to
  core 0 with one thread) against configs/grpo.yaml + configs/rollout/vllm.yaml (synchronous,
  in-process vLLM, every core), on the tiny model (random weights), ``steps`` steps each, the median
  step after the first 3. ``overlap_efficiency`` = async step / max(generation, prepare + update),
  the medians of ``timing/generate`` and ``timing/prepare`` + ``timing/update``; 1.0 is perfect overlap.

    python -m benchmarks.engines.rollout_servers [--repeats 5] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
import yaml  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from benchmarks import REPO  # noqa: E402
from benchmarks.common import GB, entry, generated_tokens, median, nbytes, timed  # noqa: E402
from benchmarks.engines.rollout_vllm import arithmetic_prompts, median_rates  # noqa: E402
from benchmarks.results import record  # noqa: E402
from benchmarks.shapes import build_model  # noqa: E402
from lit_offpolicy.models import create_tiny_model, load_actor, load_tokenizer  # noqa: E402
from lit_offpolicy.rollout import EngineContext, SamplingParams, VLLMServerSpec  # noqa: E402
from lit_offpolicy.rollout.server.transfer import connect_senders  # noqa: E402
from lit_offpolicy.rollout.vllm_engine import VLLMEngine  # noqa: E402
from lit_offpolicy.rollout.weight_sync import stream_full_weights  # noqa: E402

NUM_PROMPTS, N, MAX_TOKENS = 64, 8, 32


def server_engine(model_dir: str, logs: Path, max_model_len: int, weights=None):
    """One launched server on ``model_dir`` serving its own weights (or ``weights``) as version 0."""
    actor = load_actor(model_dir)
    spec = VLLMServerSpec(launch={"servers": 1, "max_model_len": max_model_len})
    context = EngineContext(
        model_path=model_dir,
        dtype="float32",
        tokenizer=load_tokenizer(model_dir),
        actor=actor,
        device=torch.device("cpu"),
        policy_version=0,
        weights=lambda: iter((weights or actor.state_dict()).items()),
        sharded=False,
        own_copy=True,
        log_file=str(logs / "vllm.log"),
    )
    return spec.build(context)


def generation_entry(work: Path, repeats: int) -> dict:
    model_dir = str(create_tiny_model(work / "tiny"))
    prompts = arithmetic_prompts(load_tokenizer(model_dir), NUM_PROMPTS)
    params = SamplingParams(n=N, temperature=1.0, max_tokens=MAX_TOKENS, seed=0)
    in_process = VLLMEngine(model_dir, max_model_len=64)
    server = server_engine(model_dir, work / "logs-generation", max_model_len=64)
    try:
        rates = median_rates(
            lambda: generated_tokens(server.generate(prompts, params)),
            lambda: generated_tokens(in_process.generate(prompts, params)),
            repeats,
        )
    finally:
        server.close()
        in_process.close()
    return entry(
        "rollout_server_vs_inprocess", "tokens/s", *rates, repeats,
        workload=f"{NUM_PROMPTS} prompts x n={N} x <= {MAX_TOKENS} tokens, tiny Llama",
        baseline_is="the in-process VLLMEngine, same prompts, sampling and seeds",
    )  # fmt: skip


def push_entries(work: Path, repeats: int) -> list[dict]:
    model_dir = str(work / "qwen3")
    build_model(model_dir, "qwen3-180m")
    holder = torch.nn.ModuleDict({"actor": load_actor(model_dir)})
    gb = nbytes(holder["actor"].state_dict().values()) / GB
    in_process = VLLMEngine(model_dir, max_model_len=128)
    server = server_engine(model_dir, work / "logs-push", max_model_len=128)
    times: dict[str, tuple[list[float], list[float]]] = {"shm": ([], []), "tcp": ([], [])}
    try:
        for version in range(1, repeats + 1):
            for transfer, (pushes, loads) in times.items():
                use_transfer(
                    server, transfer, lambda: server.load_weights(stream_full_weights(None, holder), 0)
                )
                pushes.append(
                    timed(lambda v=version: server.load_weights(stream_full_weights(None, holder), v))[0]
                )
                loads.append(
                    timed(lambda v=version: in_process.load_weights(stream_full_weights(None, holder), v))[0]
                )
    finally:
        server.close()
        in_process.close()
    reloads = times["shm"][1] + times["tcp"][1]  # one baseline for both: the run's reloads
    return [
        push_entry("weight_push_server", times["tcp"][0], reloads, gb, transport="TCP over loopback"),
        push_entry(
            "weight_push_server_shm", times["shm"][0], reloads, gb, transport="shared memory", target=0.8
        ),
    ]


def use_transfer(engine, transfer: str, push) -> None:
    """Re-initialise the server's weight transfer with ``transfer`` and ``push`` once, untimed: a run
    keeps its transfer, so its first push's costs (a fresh segment's pages) are not a push's."""
    connect_senders(engine.pool.servers, transfer, "127.0.0.1", engine.pool.servers[0].client.timeout_s)
    push()


def push_entry(name: str, pushes: list[float], loads: list[float], gb: float, **fields) -> dict:
    return entry(
        name, "s", median(pushes), median(loads), len(pushes),
        pushes_s=[round(t, 3) for t in pushes], reloads_s=[round(t, 3) for t in loads],
        gb=round(gb, 3), seconds_per_gb=round(median(pushes) / gb, 4),
        in_process_seconds_per_gb=round(median(loads) / gb, 4),
        load_average=round(os.getloadavg()[0], 1), **fields,
        baseline_is="the in-process VLLMEngine.load_weights of the same streamed weights, each after a push",
    )  # fmt: skip


def fit(
    work: Path, name: str, model_dir: str, rollout_config: str, steps: int, env: dict, prefix: list
) -> Path:
    """One ``lit-offpolicy fit`` of configs/grpo.yaml + ``rollout_config``; its TensorBoard run directory."""
    config = yaml.safe_load((REPO / "configs" / "rollout" / rollout_config).read_text())
    callbacks = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("Rollout")]
    callbacks[0]["init_args"]["validation"] = {"every_n_steps": 0, "stop_at": None}
    engine = callbacks[0]["init_args"]["engine"]
    if "launch" in engine.get("init_args", {}):
        engine["init_args"]["launch"] = {"servers": 1}
    logs = work / "logs"
    command = [
        *prefix, sys.executable, "-m", "lit_offpolicy", "fit",
        "--config", str(REPO / "configs" / "grpo.yaml"),
        "--model.init_args.model_path", model_dir,
        "--trainer.max_steps", str(steps),
        "--trainer.callbacks", json.dumps(callbacks),
        "--trainer.logger", json.dumps({
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": str(logs), "name": name},
        }),
        "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    subprocess.run(command, cwd=work, env={**os.environ, **env}, check=True, stdout=subprocess.DEVNULL)
    return next((logs / name).glob("version_*"))


def step_medians(run: Path, skip: int = 3) -> dict[str, float]:
    """Median step wall time (between consecutive actor/pg_loss events) and stage timings after ``skip``."""
    events = EventAccumulator(str(run))
    events.Reload()
    walls = [event.wall_time for event in events.Scalars("actor/pg_loss")]
    stages = {
        tag: [e.value for e in events.Scalars(tag)][skip:]
        for tag in ("timing/generate", "timing/prepare", "timing/update")
    }
    return {
        "step": median([b - a for a, b in zip(walls[skip:], walls[skip + 1 :], strict=False)]),
        **{tag: median(values) for tag, values in stages.items()},
    }


def async_entry(work: Path, steps: int) -> dict:
    model_dir = str(create_tiny_model(work / "tiny-fit"))
    sync = step_medians(fit(work, "sync", model_dir, "vllm.yaml", steps, {}, []))
    pinned = {"VLLM_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1"}
    served = step_medians(
        fit(work, "servers", model_dir, "vllm_server_async.yaml", steps, pinned, ["taskset", "-c", "0"])
    )
    compute = served["timing/prepare"] + served["timing/update"]
    return entry(
        "async_servers_vs_sync", "steps/s", 1 / served["step"], 1 / sync["step"], steps - 4,
        overlap_efficiency=round(served["step"] / max(served["timing/generate"], compute), 3),
        async_step_s=round(served["step"], 4), generate_s=round(served["timing/generate"], 4),
        prepare_plus_update_s=round(compute, 4), sync_step_s=round(sync["step"], 4),
        workload="configs/grpo.yaml on the tiny model (random weights): 64 prompts x 4 samples x <= 5 tokens",
        baseline_is="synchronous Rollout, in-process vLLM engine (configs/rollout/vllm.yaml), every core",
    )  # fmt: skip


def main(repeats: int = 5, steps: int = 20) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        entries = [
            generation_entry(work, repeats),
            *push_entries(work, repeats),
            async_entry(work, steps),
        ]
    record(entries)
    return entries


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="two repeats, 6 steps: checks that it runs")
    args = parser.parse_args()
    main(2 if args.quick else args.repeats, 6 if args.quick else args.steps)
