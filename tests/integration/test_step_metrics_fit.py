"""The update's host reads through a real Trainer fit of the tiny Llama: metrics stay on the device until
the step's end. The reads are counted with a real ``TorchFunctionMode``: every ``.item()``,
``float()``, ``int()``, ``bool()`` or ``.tolist()`` of a tensor made directly by lit_offpolicy's code
during the training step. ``MetricMeans`` by hand: tests/training/test_step_metrics.py.
"""

from __future__ import annotations

import sys
import tempfile
from collections import Counter

import lightning as L
import pytest
from torch.overrides import TorchFunctionMode

from benchmarks.common import fit_on_fixed_experience, fixed_experience
from lit_offpolicy.losses import PPO
from lit_offpolicy.models import load_tokenizer
from lit_offpolicy.module import OffPolicyModule
from lit_offpolicy.training.options import KLOptions, LossOptions, UpdateOptions

HOST_READS = {"item", "__float__", "__int__", "__bool__", "tolist", "__index__"}


class HostReads(TorchFunctionMode):
    """Counts host reads of tensors whose caller is a lit_offpolicy module, by call site."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter = Counter()
        self.counting = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.counting and getattr(func, "__name__", "") in HOST_READS:
            caller = sys._getframe(1)
            if "lit_offpolicy" in caller.f_code.co_filename:
                self.sites[(caller.f_code.co_filename.rsplit("/", 1)[-1], caller.f_lineno)] += 1
        return func(*args, **(kwargs or {}))


class CountDuringStep(L.Callback):
    def __init__(self, reads: HostReads) -> None:
        self.reads = reads

    def on_train_batch_start(self, *args) -> None:
        self.reads.counting = True

    def on_train_batch_end(self, *args) -> None:
        self.reads.counting = False


def host_reads_per_step(model_dir: str, micro_batch_size: int) -> Counter:
    """One RL step (2 mini-batches) of PPO + KL loss + entropy bonus on 64 fixed samples."""
    exp = fixed_experience(load_tokenizer(model_dir), num_prompts=16)
    module = OffPolicyModule(
        model_dir,
        policy_loss=PPO(),
        kl=KLOptions(use_loss=True),
        loss=LossOptions(entropy_coef=0.01),
        update=UpdateOptions(mini_batch_size=32, micro_batch_size=micro_batch_size),
    )
    reads = HostReads()
    with reads, tempfile.TemporaryDirectory() as root:
        fit_on_fixed_experience(module, exp, 2, [CountDuringStep(reads)], root)
    return reads.sites


@pytest.mark.parametrize("micro_batch_size", [2, 16])
def test_the_update_reads_no_metric_per_micro_batch(tiny_model_dir, micro_batch_size):
    """16 micro-batches make as many host reads as 2: the per-micro-batch metrics (policy-loss
    statistics, KL, entropy, the micro-batch weights) wait on the device for the step's end. Only the
    layout of the shared-prefix rows (the default) is read per micro-batch, once per forward."""
    reads, layout = without_layout_reads(host_reads_per_step(tiny_model_dir, micro_batch_size))
    assert reads == without_layout_reads(host_reads_per_step(tiny_model_dir, 16))[0]
    # per step: advantages/returns means, the group count, the hole check, the correction's one
    # transfer and MetricMeans' one; per optimizer step: the non-finite guard's decision
    assert sum(reads.values()) <= 10, reads
    # the shared-prefix rows' layout: one read where the step and each of its 2 mini-batches are cut into
    # micro-batches, two for the prompts the step computed once (its FLOPs), and one per forward: π_old
    # and the reference over 64 samples, the update's actor
    assert layout == 5 + 3 * 64 // micro_batch_size


def without_layout_reads(reads: Counter) -> tuple[Counter, int]:
    """The reads but the shared-prefix rows' layout (training/shared_prefix.py: one host read of the
    prompts and lengths each, as a packed row needs its lengths), and how many of those there were."""
    layout = sum(count for (file, _), count in reads.items() if file == "shared_prefix.py")
    return Counter({site: count for site, count in reads.items() if site[0] != "shared_prefix.py"}), layout
