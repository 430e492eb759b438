"""What a GPU user's push to a rollout server on its host costs today (issue 49): the shared-memory
transfer moves the weights through host memory, so on CUDA it adds a copy to the host on the trainer's
side and a copy to the device on the server's.

- ``weight_push_host_memory_cuda``: seconds per GB of the two halves of a push of qwen2.5-1.5b's
  weights (bfloat16, random, 3.1 GB) held on the GPU, in buckets of 512 MiB (``Rollout(sync_bucket_mb)``'s
  default): the trainer's ``ShmSegment.stage`` of each bucket (the shipped code: each tensor to the
  CPU, then into the segment) and the server's load of it (each tensor as a view of the segment, as
  ``ShmReader.views`` hands it to vLLM's ``load_weights``, copied into a CUDA tensor of its shape:
  the device copy that load makes). The server side runs in this process on the trainer's mapping of
  the segment (the same memory a server's mapping is); vLLM's own work in ``load_weights`` and the
  HTTP requests are not in it (``weight_push_server_shm`` measures those, on a CPU machine).
  Baseline: the same weights copied GPU to GPU (what a device-to-device transfer such as vLLM's NCCL
  backend approaches on one host); ``pcie_floor_seconds_per_gb``: a copy to pinned host memory and
  back, the bus's own cost. Medians of ``repeats``; each push's weights are checked bit-identical.

Run: ``python -m benchmarks.machine.host_transfer_cuda [--repeats 5] [--out FILE]`` on a CUDA machine (exits 1
if a pushed tensor differs); it records into results.json, or into ``--out`` where given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from benchmarks.common import GB, MiB, entry, median, nbytes, timed
from benchmarks.shapes import SHAPES, parts
from lit_offpolicy.rollout.server.shm_sender import ShmSegment
from lit_offpolicy.rollout.weight_sync import buckets_of
from lit_offpolicy.vllm_plugin.wire import dtype_from_name

BUCKET_BYTES = 512 * MiB
DEVICE = os.environ.get("HOST_TRANSFER_DEVICE", "cuda")  # "cpu": a dry run of this script


def device_weights(shape_name: str) -> dict[str, torch.Tensor]:
    """The shape's weights, random, on the GPU in its dtype."""
    from transformers import AutoModelForCausalLM

    family, dtype, shape = parts(shape_name)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(family.config_class(**shape)).to(dtype)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def push_once(
    weights: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], pinned: bool = False
) -> tuple[float, float]:
    """Seconds of the trainer's side and of the server's side of one push through a fresh segment's
    second use (its pages already mapped, as in a run after its first push); ``pinned``: the segment
    registered with CUDA (page-locked) before it (not what a run does: what it would gain)."""
    segment, reader = ShmSegment(), object()
    segment.senders.add(reader)
    trainer_s = server_s = 0.0
    address = None
    try:
        for warm in (True, False):
            if pinned and not warm:
                address = register(segment)
            for bucket in buckets_of(weights.items(), BUCKET_BYTES):
                info: dict = {}
                seconds, _ = timed(
                    lambda bucket=bucket, info=info: info.update(segment.stage(bucket, reader)), sync
                )
                seconds_in, _ = timed(lambda info=info: load_bucket(segment, info, loaded), sync)
                if not warm:
                    trainer_s, server_s = trainer_s + seconds, server_s + seconds_in
    finally:
        if address is not None:
            torch.cuda.cudart().cudaHostUnregister(address)
        segment.close()
    return trainer_s, server_s


def register(segment: ShmSegment) -> int:
    """Page-lock the segment's mapping for the device (``cudaHostRegister``); its address."""
    probe = torch.frombuffer(segment.mapping, dtype=torch.uint8, count=1)
    address = probe.data_ptr()
    del probe
    assert int(torch.cuda.cudart().cudaHostRegister(address, len(segment.mapping), 0)) == 0
    return address


def load_bucket(segment: ShmSegment, info: dict, loaded: dict[str, torch.Tensor]) -> None:
    """The server's side of one bucket: views of the segment copied into the device's tensors."""
    for name, dtype, shape, offset in zip(
        info["names"], info["dtype_names"], info["shapes"], info["offsets"], strict=True
    ):
        dtype = dtype_from_name(dtype)
        count = torch.Size(shape).numel()
        view = torch.frombuffer(segment.mapping, dtype=dtype, count=count, offset=offset).view(shape)
        loaded[name].copy_(view)
        del view


def check_identical(weights: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    differ = [name for name, tensor in weights.items() if not torch.equal(tensor, loaded[name])]
    if differ:
        sys.exit(f"pushed weights differ: {differ[:5]}")
    for tensor in loaded.values():
        tensor.zero_()


def pcie_floor(weights: dict[str, torch.Tensor]) -> float:
    """Seconds of a copy of every tensor to pinned host memory and back."""
    pinned = {
        name: torch.empty_like(t, device="cpu", pin_memory=DEVICE == "cuda") for name, t in weights.items()
    }
    back = {name: torch.empty_like(t) for name, t in weights.items()}

    def copies() -> None:
        for name, tensor in weights.items():
            pinned[name].copy_(tensor, non_blocking=True)
        sync()
        for name, tensor in pinned.items():
            back[name].copy_(tensor, non_blocking=True)

    return timed(copies, sync)[0]


def main(repeats: int, shape: str) -> dict:
    weights = device_weights(shape)
    gb = nbytes(weights.values()) / GB
    loaded = {name: torch.empty_like(t) for name, t in weights.items()}
    pushes, pinned_pushes, devices, floors = [], [], [], []
    for _ in range(repeats):
        pushes.append(push_once(weights, loaded))
        check_identical(weights, loaded)
        if DEVICE == "cuda":
            pinned_pushes.append(push_once(weights, loaded, pinned=True))
            check_identical(weights, loaded)
        devices.append(timed(lambda: [loaded[n].copy_(t) for n, t in weights.items()], sync)[0])
        floors.append(pcie_floor(weights))
    trainer_s, server_s = median([p[0] for p in pushes]), median([p[1] for p in pushes])
    pinned = (
        [round(median([p[side] for p in pinned_pushes]) / gb, 4) for side in (0, 1)]
        if pinned_pushes
        else None
    )
    return entry(
        "weight_push_host_memory_cuda", "s", trainer_s + server_s, median(devices), repeats,
        gb=round(gb, 3),
        seconds_per_gb=round((trainer_s + server_s) / gb, 4),
        trainer_seconds_per_gb=round(trainer_s / gb, 4),
        server_device_copy_seconds_per_gb=round(server_s / gb, 4),
        device_copy_seconds_per_gb=round(median(devices) / gb, 4),
        pcie_floor_seconds_per_gb=round(median(floors) / gb, 4),
        pinned_segment_seconds_per_gb=pinned and {"trainer": pinned[0], "server": pinned[1]},
        workload=f"{shape} ({SHAPES[shape]['dtype']}, random) on {DEVICE}, 512 MiB buckets, ShmSegment",
        baseline_is="the same weights copied GPU to GPU (torch copy_)",
        not_included="vLLM's load_weights work and the HTTP requests (weight_push_server_shm, CPU)",
    )  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shape", choices=tuple(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--out", help="write the entry here (JSON) instead of into results.json")
    args = parser.parse_args()
    result = main(args.repeats, args.shape)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(result, file, indent=2)
        print(json.dumps(result))
    else:
        from benchmarks.results import record

        record([result])
