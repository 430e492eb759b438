"""Weight sync: seconds per GB into each engine, and a rank's extra peak memory under FSDP2.

- ``weight_sync_hf_engine`` / ``weight_sync_vllm_engine``: one sync of the Qwen3-shaped model of
  memory_vs_trl (181M parameters, float32, 0.72 GB) from the actor into the engine, streamed
  (``weight_sync.stream_full_weights`` into ``load_weights``), against the engine's own bulk load in
  the same run (``load_state_dict`` of the whole state dict; vLLM's ``reload_weights`` with the whole
  list). Medians of ``repeats``; the figure a projection reads is ``seconds_per_gb``.
- ``weight_sync_fsdp2_extra_peak``: two CPU processes (gloo) hold the model sharded by FSDP2 and an HF
  engine's full copy each; a sync's extra peak RSS of a rank above what it held before, streamed in
  buckets of ``bucket_mib`` against the whole state dict gathered first (the sync before buckets).
- ``weight_sync_fsdp2_gather``: what a push from several ranks costs: the same streamed sync from the 2
  FSDP2 ranks (one thread each; the slower rank's median, its bucket-by-bucket all-gathers included)
  against one process streaming the unsharded model into the same engine (one thread), in the same
  run; ``gather_only_s``: the 2 ranks' stream consumed without a load, the gathers alone.

    python -m benchmarks.engines.weight_sync [--quick] [--fsdp2-only]
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile

import torch

from benchmarks.common import GB, MiB, entry, median, nbytes, status_mib, timed
from benchmarks.results import record
from benchmarks.shapes import build_model

SHAPE = "qwen3-180m"


def hf_engine_entry(model_dir: str, n: int) -> dict:
    from lit_offpolicy.models import load_actor
    from lit_offpolicy.rollout import HFEngine
    from lit_offpolicy.rollout.weight_sync import stream_full_weights

    holder = torch.nn.ModuleDict({"actor": load_actor(model_dir)})
    engine = HFEngine(holder["actor"], eos_token_id=0, pad_token_id=0)
    gb = nbytes(holder["actor"].state_dict().values()) / GB
    ours = [timed(lambda: engine.load_weights(stream_full_weights(None, holder), 1))[0] for _ in range(n)]
    bulk = [timed(lambda: engine.model.load_state_dict(holder["actor"].state_dict()))[0] for _ in range(n)]
    return entry(
        "weight_sync_hf_engine", "s", median(ours), median(bulk), n,
        gb=round(gb, 3), seconds_per_gb=round(median(ours) / gb, 4),
        baseline_is="the engine model's load_state_dict of the whole state dict",
    )  # fmt: skip


def vllm_engine_entry(model_dir: str, n: int) -> dict:
    from lit_offpolicy.models import load_actor
    from lit_offpolicy.rollout.vllm_engine import VLLMEngine
    from lit_offpolicy.rollout.weight_sync import stream_full_weights

    holder = torch.nn.ModuleDict({"actor": load_actor(model_dir)})
    engine = VLLMEngine(model_dir)
    try:
        gb = nbytes(holder["actor"].state_dict().values()) / GB

        def bulk() -> None:
            pairs = list(holder["actor"].state_dict().items())
            engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})

        ours = [timed(lambda: engine.load_weights(stream_full_weights(None, holder), 1))[0] for _ in range(n)]
        raw = [timed(bulk)[0] for _ in range(n)]
    finally:
        engine.close()
    return entry(
        "weight_sync_vllm_engine", "s", median(ours), median(raw), n,
        gb=round(gb, 3), seconds_per_gb=round(median(ours) / gb, 4),
        baseline_is="vLLM's reload_weights with the whole state dict as a list",
    )  # fmt: skip


def _fsdp2_rank(rank: int, model_dir: str, port: int, bucket_mib: int, repeats: int, results) -> None:
    """One rank: shard the actor with FSDP2, then measure each way of syncing into a full HF engine copy."""
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from lit_offpolicy.models import load_actor
    from lit_offpolicy.rollout import HFEngine
    from lit_offpolicy.rollout.weight_sync import gathered_state_dict, stream_full_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    engine = HFEngine(load_actor(model_dir), eos_token_id=0, pad_token_id=0)  # the engine's full copy
    actor = load_actor(model_dir)
    for layer in actor.model.layers:
        fully_shard(layer)
    fully_shard(actor)
    holder, strategy = torch.nn.ModuleDict({"actor": actor}), ModelParallelStrategy()
    ways = {
        "streamed": lambda: stream_full_weights(strategy, holder, bucket_bytes=bucket_mib * MiB),
        "whole": lambda: gathered_state_dict(strategy, actor),
    }
    extra = {}
    for name in ("streamed", "whole", "streamed"):  # the first streamed pass warms the allocator up
        dist.barrier()
        before = status_mib("VmRSS")
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # VmHWM restarts from the RSS of now
        engine.load_weights(ways[name](), version=1)
        extra[name] = status_mib("VmHWM") - before
    results[rank] = {**extra, **_synced_and_gathered(engine, ways["streamed"], repeats, dist.barrier)}
    dist.destroy_process_group()


def _synced_and_gathered(engine, stream, repeats: int, barrier=lambda: None) -> dict[str, float]:
    """Median seconds of a streamed sync into ``engine`` and of the stream consumed alone."""
    timings: dict[str, list[float]] = {"sync_s": [], "gather_only_s": []}
    for _ in range(repeats):
        barrier()
        timings["sync_s"].append(timed(lambda: engine.load_weights(stream(), version=1))[0])
        barrier()
        timings["gather_only_s"].append(timed(lambda: sum(1 for _ in stream()))[0])
    return {name: median(values) for name, values in timings.items()}


def fsdp2_gather_entry(model_dir: str, bucket_mib: int, repeats: int, ranks: dict) -> dict:
    """The 2 FSDP2 ranks' streamed sync (``ranks``: each rank's medians) against one process's."""
    from lit_offpolicy.models import load_actor
    from lit_offpolicy.rollout import HFEngine
    from lit_offpolicy.rollout.weight_sync import stream_full_weights

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = HFEngine(load_actor(model_dir), eos_token_id=0, pad_token_id=0)
        holder = torch.nn.ModuleDict({"actor": load_actor(model_dir)})
        single = _synced_and_gathered(
            engine, lambda: stream_full_weights(None, holder, bucket_bytes=bucket_mib * MiB), repeats
        )
    finally:
        torch.set_num_threads(threads)
    gb = nbytes(holder["actor"].state_dict().values()) / GB
    synced = max(ranks[r]["sync_s"] for r in ranks)
    return entry(
        "weight_sync_fsdp2_gather", "s", synced, single["sync_s"], repeats, threads=1,
        gb=round(gb, 3), seconds_per_gb=round(synced / gb, 3),
        gather_only_s=round(max(ranks[r]["gather_only_s"] for r in ranks), 3),
        bucket_mib=bucket_mib,
        baseline_is="one process streaming the unsharded model into the same HF engine (one thread)",
    )  # fmt: skip


def fsdp2_entry(model_dir: str, bucket_mib: int, repeats: int) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_fsdp2_rank, args=(model_dir, port, bucket_mib, repeats, results), nprocs=2, join=True)
    ranks = dict(results)
    streamed = max(results[r]["streamed"] for r in range(2))
    whole = max(results[r]["whole"] for r in range(2))
    from lit_offpolicy.models import load_actor

    peak = entry(
        "weight_sync_fsdp2_extra_peak", "MiB", streamed, whole, 1,
        bucket_mib=bucket_mib, model_mib=round(nbytes(load_actor(model_dir).state_dict().values()) / MiB, 1),
        baseline_is="the whole state dict gathered on each rank, then loaded (the sync before buckets)",
    )  # fmt: skip
    return [peak, fsdp2_gather_entry(model_dir, bucket_mib, repeats, ranks)]


def main(repeats: int = 3, bucket_mib: int = 128, fsdp2_only: bool = False) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = f"{tmp}/model"
        build_model(model_dir, SHAPE)
        entries = (
            [] if fsdp2_only else [hf_engine_entry(model_dir, repeats), vllm_engine_entry(model_dir, repeats)]
        )
        entries += fsdp2_entry(model_dir, bucket_mib, repeats)
    record(entries)
    return entries


if __name__ == "__main__":
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="one repeat: checks that it runs")
    parser.add_argument("--fsdp2-only", action="store_true", help="only the two FSDP2 entries")
    args = parser.parse_args()
    main(1 if args.quick else args.repeats, args.bucket_mib, args.fsdp2_only)
