"""Weight sync: seconds per GB into each engine, and a rank's extra peak memory under FSDP2.

- ``weight_sync_hf_engine`` / ``weight_sync_vllm_engine``: one sync of the Qwen3-shaped model of
  memory_vs_trl (181M parameters, float32, 0.72 GB) from the actor into the engine, streamed
  (``weight_sync.stream_full_weights`` into ``load_weights``), against the engine's own bulk load in
  the same run (``load_state_dict`` of the whole state dict; vLLM's ``reload_weights`` with the whole
  list). Medians of ``repeats``; the figure a projection reads is ``seconds_per_gb``.
- ``weight_sync_fsdp2_extra_peak``: two CPU processes (gloo) hold the model sharded by FSDP2 and an HF
  engine's full copy each; a sync's extra peak RSS of a rank above what it held before, streamed in
  buckets of ``bucket_mib`` against the whole state dict gathered first (the sync before buckets).

    python -m benchmarks.weight_sync [--quick]
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile

import torch

from benchmarks.common import entry, median, timed
from benchmarks.memory import status_mib
from benchmarks.memory_vs_trl import build_model
from benchmarks.results import record

SHAPE = "qwen3-180m"
GB = 1e9
MiB = 2**20


def state_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def hf_engine_entry(model_dir: str, n: int) -> dict:
    from lit_offpolicy.models import load_actor
    from lit_offpolicy.rollout import HFEngine
    from lit_offpolicy.rollout.weight_sync import stream_full_weights

    holder = torch.nn.ModuleDict({"actor": load_actor(model_dir)})
    engine = HFEngine(holder["actor"], eos_token_id=0, pad_token_id=0)
    gb = state_bytes(holder["actor"]) / GB
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
        gb = state_bytes(holder["actor"]) / GB

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


def _fsdp2_rank(rank: int, model_dir: str, port: int, bucket_mib: int, results) -> None:
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
    results[rank] = extra
    dist.destroy_process_group()


def fsdp2_entry(model_dir: str, bucket_mib: int) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_fsdp2_rank, args=(model_dir, port, bucket_mib, results), nprocs=2, join=True)
    streamed = max(results[r]["streamed"] for r in range(2))
    whole = max(results[r]["whole"] for r in range(2))
    from lit_offpolicy.models import load_actor

    return entry(
        "weight_sync_fsdp2_extra_peak", "MiB", streamed, whole, 1,
        bucket_mib=bucket_mib, model_mib=round(state_bytes(load_actor(model_dir)) / MiB, 1),
        baseline_is="the whole state dict gathered on each rank, then loaded (the sync before buckets)",
    )  # fmt: skip


def main(repeats: int = 3, bucket_mib: int = 128) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = f"{tmp}/model"
        build_model(model_dir, SHAPE)
        entries = [hf_engine_entry(model_dir, repeats), vllm_engine_entry(model_dir, repeats)]
        entries.append(fsdp2_entry(model_dir, bucket_mib))
    record(entries)
    return entries


if __name__ == "__main__":
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="one repeat: checks that it runs")
    args = parser.parse_args()
    main(1 if args.quick else args.repeats, args.bucket_mib)
