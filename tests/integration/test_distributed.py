"""Data-parallel RL and SLURM: a real 2-process DDP fit, the sharded sampler, cross-rank helpers,
the strategy configs and the SLURM templates.

Real parts: the tiny Llama, Lightning's DDP and FSDP2 (ModelParallelStrategy) strategies with the
gloo backend on CPU (2 processes each), LightningCLI and bash. Mocked, because they cannot exist
here: SLURM (its variables are set by the tests, ``srun`` is a stand-in script) and GPUs (the
DeepSpeed configs are built into strategy objects but not run: Lightning refuses DeepSpeed on CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml
from helpers import REPO, TESTS, subprocess_env
from helpers.tolerances import reordered_sums
from jsonargparse import ArgumentParser
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    Strategy,
)
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lit_offpolicy.advantages import GRPO, token_level_rewards, whiten_advantages
from lit_offpolicy.core.distributed import (
    barrier,
    destroy_process_group,
    from_rank_zero,
    gather_objects,
    gather_rows,
    max_over_ranks_each,
    min_over_ranks,
    params_sharded,
    reduce_metrics,
)
from lit_offpolicy.data import PromptDataModule
from lit_offpolicy.data.sampler import ResumableShuffleSampler
from lit_offpolicy.models import create_tiny_model, load_actor
from lit_offpolicy.rollout.weight_sync import full_state_dict
from lit_offpolicy.training.strategy import check_strategy, clip_grad_norm, configure_deepspeed

STRATEGIES = ("ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3")
PARITY = 1e-4
"""max |log π_engine − log π_trainer| (float32 both): tests/integration/test_model_families.py's bound."""


# ----------------------------------------------------------------------------- the 2-process DDP fit


FITS = {
    "ddp": ("ddp", {}, None),
    "fsdp": ("fsdp", {}, None),
    "async_ddp": ("ddp", {"DDP_FIT_MAX_STALENESS": "1"}, None),
    "token_budget_ddp": ("ddp", {"DDP_FIT_FILTER": "1", "DDP_FIT_TOKEN_BUDGET": "40"}, None),
    "filtered_async_ddp": ("ddp", {"DDP_FIT_FILTER": "1", "DDP_FIT_MAX_STALENESS": "1"}, None),
    "checkpointed_fsdp": ("fsdp", {"DDP_FIT_GRADIENT_CHECKPOINTING": "1"}, None),
    "lora_fsdp": ("fsdp", {"DDP_FIT_LORA": "1"}, None),
    "qwen3_fsdp": ("fsdp", {}, "qwen3"),
}
"""The 2-process fits the tests read: name -> (strategy, tests/helpers/ddp_rl_fit.py's options, the
tiny model's ``arch``: None for the session's tiny Llama; qwen3 has tied embeddings and q/k norms)."""


@pytest.fixture(scope="module")
def fits(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """tests/helpers/ddp_rl_fit.py's fits of :data:`FITS`, 3 RL steps each, one after another in the same
    2 CPU processes (gloo): name -> the directory of its outputs."""
    base = tmp_path_factory.mktemp("two-rank-fits")
    outs = {name: base / name for name in FITS}
    runs = [
        {
            "out": str(outs[name]),
            "strategy": strategy,
            "options": options,
            "model": arch and str(create_tiny_model(base / f"tiny-{arch}", arch=arch)),
        }
        for name, (strategy, options, arch) in FITS.items()
    ]
    (base / "runs.json").write_text(json.dumps(runs))
    result = subprocess.run(
        [sys.executable, str(TESTS / "helpers" / "ddp_rl_fit.py"), tiny_model_dir, "--runs", "runs.json"],
        cwd=base,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return outs


def _steps(run: Path, rank: int) -> list[dict]:
    return torch.load(run / f"rank{rank}_steps.pt")["steps"]


@pytest.mark.slow
def test_ddp_fit_ends_with_identical_changed_parameters_on_both_ranks(fits):
    initial = torch.load(fits["ddp"] / "initial.pt")
    rank0, rank1 = torch.load(fits["ddp"] / "rank0.pt"), torch.load(fits["ddp"] / "rank1.pt")
    assert rank0.keys() == rank1.keys() == initial.keys()
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    change = max((rank0[name] - initial[name]).abs().max().item() for name in rank0)
    assert change > 1e-3  # lr 1e-2, 6 optimizer steps: the weights moved


@pytest.mark.slow
def test_ddp_ranks_train_on_different_prompts_with_unique_groups(fits):
    steps = [_steps(fits["ddp"], rank) for rank in (0, 1)]
    assert len(steps[0]) == len(steps[1]) == 3
    for step, (mine, theirs) in enumerate(zip(*steps, strict=True)):
        assert len(mine["prompts"]) == len(theirs["prompts"]) == 4
        assert not set(mine["prompts"]) & set(theirs["prompts"])
        # ids of step s: rank 0 has 8s..8s+3, rank 1 8s+4..8s+7
        assert sorted(set(mine["group_ids"].tolist())) == list(range(8 * step, 8 * step + 4))
        assert sorted(set(theirs["group_ids"].tolist())) == list(range(8 * step + 4, 8 * step + 8))


@pytest.mark.slow
def test_ddp_advantages_are_whitened_over_both_ranks(fits):
    """GRPO + whiten_advantages over the union of both ranks' samples, as one process would compute,
    and not each rank's batch on its own (which gives different numbers)."""
    steps = [_steps(fits["ddp"], rank) for rank in (0, 1)]
    for mine, theirs in zip(*steps, strict=True):

        def advantages(*parts):
            scores = torch.cat([p["scores"] for p in parts])
            mask = torch.cat([p["response_mask"] for p in parts])
            groups = torch.cat([p["group_ids"] for p in parts])
            raw, _ = GRPO()(token_level_rewards(scores, mask), mask, group_ids=groups)
            return whiten_advantages(raw, mask)

        got = torch.cat([mine["advantages"], theirs["advantages"]])
        # float32: the ranks' partial sums of the whitening's mean and variance (≤ 160 tokens, values
        # ≤ 3) regrouped change them by ≲ eps32·√160 relative (1.5e-6), and the whitened values (≤ 3)
        # by a few roundings more: 2 × eps32 × 3 ≈ 7e-7 → 1e-6
        torch.testing.assert_close(got, advantages(mine, theirs), rtol=0, atol=1e-6)
        assert (mine["advantages"] - advantages(mine)).abs().max() > 1e-4


@pytest.mark.slow
def test_ddp_ranks_validate_disjoint_halves_and_agree_on_the_whole_set(fits, tiny_model_dir):
    """Each rank generates for its half of the validation prompts; the summed counts give both ranks
    the metrics one process gets on the whole set with the final weights (one prompt per batch on
    both sides, so the greedy answers are computed identically)."""
    from helpers.ddp_rl_fit import AnswerHashReward

    from lit_offpolicy.models import load_actor, load_tokenizer
    from lit_offpolicy.rewards import WeightedRewards
    from lit_offpolicy.rollout import HFEngine
    from lit_offpolicy.rollout.evaluation import evaluate

    ranks = [torch.load(fits["ddp"] / f"rank{rank}_val.pt") for rank in (0, 1)]
    assert len(ranks[0]["prompts"]) == len(ranks[1]["prompts"]) == 4
    assert not set(ranks[0]["prompts"]) & set(ranks[1]["prompts"])
    assert ranks[0]["metrics"] == ranks[1]["metrics"]

    data = PromptDataModule(
        task="addition", tokenizer_path=tiny_model_dir, num_val_samples=8, val_batch_size=1
    )
    data.setup("fit")
    whole = data.val_dataloader()
    assert sorted(ranks[0]["prompts"] + ranks[1]["prompts"]) == sorted(b["prompt"][0] for b in whole)
    tokenizer = load_tokenizer(tiny_model_dir)
    actor = load_actor(tiny_model_dir).eval()
    actor.load_state_dict(torch.load(fits["ddp"] / "rank0.pt"))
    engine = HFEngine(actor, tokenizer.eos_token_id, tokenizer.pad_token_id, copy_model=False)
    rewards = WeightedRewards({"answer_hash": AnswerHashReward()})
    one_process = evaluate(engine, tokenizer, whole, rewards, max_tokens=4)
    assert one_process == ranks[0]["metrics"]
    assert 0 < one_process["val/reward"] < 1  # scores vary by problem: a lost or repeated one shows


@pytest.mark.slow
def test_async_ddp_ranks_train_their_own_prompts_at_most_one_version_old(fits):
    """AsyncRollout under DDP (max_staleness 1): a producer per rank reading its rank's share of the
    prompts (the sharded sampler, not sharded again: that trained 20 distinct prompts of 24), so no
    prompt is trained twice; every trained sample is at most one weight version behind the trainer;
    both ranks end with the same, trained weights."""
    steps = [_steps(fits["async_ddp"], rank) for rank in (0, 1)]
    assert len(steps[0]) == len(steps[1]) == 3
    trained = [prompt for rank_steps in steps for step in rank_steps for prompt in step["prompts"]]
    assert len(trained) == len(set(trained)) == 2 * 3 * 4
    for rank_steps in steps:
        for version, step in enumerate(rank_steps):
            assert step["trainer_version"] == version
            ages = version - step["sample_versions"]
            assert ages.min().item() >= 0 and ages.max().item() <= 1
    initial = torch.load(fits["async_ddp"] / "initial.pt")
    rank0, rank1 = torch.load(fits["async_ddp"] / "rank0.pt"), torch.load(fits["async_ddp"] / "rank1.pt")
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    assert max((rank0[name] - initial[name]).abs().max().item() for name in rank0) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("run", ["token_budget_ddp", "filtered_async_ddp"])
def test_ddp_ranks_train_equally_many_groups_under_dynamic_sampling(run, fits):
    """DAPO's filter and 2 sampling rounds under DDP, synchronous (the token-budget run's: the filter is
    the rollout's, the budget the update's) and asynchronous: rank 1's reward
    leaves one informative group per round (2 in all), rank 0 finds its 4; both ranks train on 2
    whole groups (rank 0 keeps its first 2), take the same optimizer steps and end with the same,
    trained weights; ``_fit``'s timeout bounds a hang."""
    out = fits[run]
    steps = [_steps(out, rank) for rank in (0, 1)]
    assert len(steps[0]) == len(steps[1]) == 3
    for mine, theirs in zip(*steps, strict=True):
        for step in (mine, theirs):
            groups, sizes = step["group_ids"].unique(return_counts=True)
            assert len(groups) == 2 and sizes.tolist() == [4, 4]
            assert step["metrics"]["rollout/train_groups"] == 2.0
            assert step["metrics"]["rollout/rank_balance_cut_groups"] == 1.0  # rank 0 cut 2, rank 1 none
            assert step["metrics"]["rollout/sampling_rounds"] == 1.5  # rank 0 one round, rank 1 two
            assert (step["advantages"].abs().amax(dim=1) > 0).all()  # informative groups only
    initial = torch.load(out / "initial.pt")
    rank0, rank1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    assert max((rank0[name] - initial[name]).abs().max().item() for name in rank0) > 1e-3


@pytest.mark.slow
def test_token_budget_micro_batches_keep_ddp_ranks_in_step(fits):
    """Padding-free micro-batches of at most 40 tokens under DDP, each rank with its own samples: where
    one rank's samples fit in fewer micro-batches than the other's, it splits its largest so that both
    make as many backward passes (each all-reduces the gradients); both end with the same weights."""
    steps = [_steps(fits["token_budget_ddp"], rank) for rank in (0, 1)]
    assert len(steps[0]) == len(steps[1]) == 3
    for mine, theirs in zip(*steps, strict=True):
        agreed = max(mine["own_micro_batches"], theirs["own_micro_batches"])
        assert mine["micro_batches"] == theirs["micro_batches"] == agreed
    assert any(m["own_micro_batches"] != t["own_micro_batches"] for m, t in zip(*steps, strict=True))
    initial = torch.load(fits["token_budget_ddp"] / "initial.pt")
    rank0, rank1 = (torch.load(fits["token_budget_ddp"] / f"rank{rank}.pt") for rank in (0, 1))
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    assert max((rank0[name] - initial[name]).abs().max().item() for name in rank0) > 1e-3


@pytest.mark.slow
def test_fsdp2_fit_on_cpu_shards_and_matches_ddp(fits):
    """FSDP2 (ModelParallelStrategy + fully_shard, gloo): the actor really is sharded, both ranks end
    with the same full weights, and the run is the DDP run up to float summation order: the same
    rollouts and advantages at every step (so each engine sync delivered the right full weights)
    and final weights equal to 1e-4 but for Adam's near-zero-gradient coordinates (at most 1 %). Both
    run shared-prefix rows (the default): each prompt once for its 4 samples in a micro-batch."""
    assert torch.load(fits["fsdp"] / "rank0_steps.pt")["sharded"]
    assert not torch.load(fits["ddp"] / "rank0_steps.pt")["sharded"]
    fsdp = [torch.load(fits["fsdp"] / f"rank{rank}.pt") for rank in (0, 1)]
    ddp = torch.load(fits["ddp"] / "rank0.pt")
    for name in ddp:
        assert torch.equal(fsdp[0][name], fsdp[1][name]), name
    for rank in (0, 1):
        for ours, theirs in zip(_steps(fits["fsdp"], rank), _steps(fits["ddp"], rank), strict=True):
            assert ours["prompts"] == theirs["prompts"]
            # the same samples and scores: as in test_ddp_advantages_are_whitened_over_both_ranks, 1e-6
            torch.testing.assert_close(ours["advantages"], theirs["advantages"], rtol=0, atol=1e-6)
            assert ours["shared_prefix_saving"] > 0 and theirs["shared_prefix_saving"] > 0
    gaps = torch.cat([(fsdp[0][name] - ddp[name]).abs().flatten() for name in ddp])
    # The gradients differ by their reduce-scatter's and all-reduce's summation order, ≲ 2.2e-5 of a
    # tensor's largest entry (helpers.tolerances); AdamW moves an entry by ≈ lr·δ/|g| for such a
    # difference δ, so a gap of lr/100 = 1e-4 over 6 steps needs |g| ≲ 600δ at some step: up to ~1 %
    # of the entries if gradients spread evenly near 0 (the 99th percentile stays below 1e-4), while
    # a wrong sync would move most. No entry moves by more than lr per step (|m̂| ≤ √v̂ unless a
    # gradient jumps), so no gap exceeds 2 × 6 × lr = 0.12.
    assert (gaps > 1e-4).float().mean() < 1e-2 and gaps.max() < 0.12
    initial = torch.load(fits["fsdp"] / "initial.pt")
    assert max((fsdp[0][name] - initial[name]).abs().max().item() for name in ddp) > 1e-3


@pytest.mark.slow
def test_fsdp2_fit_with_gradient_checkpointing_is_the_fit_without(fits):
    """FSDP2 with the actor's blocks recomputed in the backward (``gradient_checkpointing``): the same
    rollouts, advantages and final weights on both ranks as the FSDP2 run that keeps the activations."""
    for rank in (0, 1):
        ours = torch.load(fits["checkpointed_fsdp"] / f"rank{rank}.pt")
        theirs = torch.load(fits["fsdp"] / f"rank{rank}.pt")
        # recomputing the blocks repeats the same float32 operations on the same inputs: equal to the
        # bit; 1e-6 (≈ 10 ulps of weights and advantages ≤ 1) absorbs last bits only
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)
        for mine, other in zip(
            _steps(fits["checkpointed_fsdp"], rank), _steps(fits["fsdp"], rank), strict=True
        ):
            assert mine["prompts"] == other["prompts"]
            torch.testing.assert_close(mine["advantages"], other["advantages"], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_fsdp2_fit_with_lora_trains_the_adapters_and_syncs_merged_weights(fits):
    """FSDP2 with LoRA (r = 4 on q_proj, v_proj) and a KL loss to the adapter-disabled actor: both
    ranks end with the same merged weights; every other weight is the initial one to the bit, and
    each adapted weight moved by a matrix of rank ≤ r (W' − W = (α/r) B A); at every step each rank's
    engine, a full copy given the merged weights, sampled with the log-probs of the sharded actor
    with its adapters unmerged. (Against DDP with LoRA the final weights agreed to 8e-7.)"""
    assert torch.load(fits["lora_fsdp"] / "rank0_steps.pt")["sharded"]
    initial = torch.load(fits["lora_fsdp"] / "initial.pt")
    final = [torch.load(fits["lora_fsdp"] / f"rank{rank}.pt") for rank in (0, 1)]
    assert final[0].keys() == final[1].keys() == initial.keys()
    adapted = 0
    for name, tensor in initial.items():
        assert torch.equal(final[0][name], final[1][name]), name
        change = final[0][name].double() - tensor.double()
        if name.endswith(("q_proj.weight", "v_proj.weight")):
            assert change.abs().max() > 1e-3, name
            # W' = W + (α/r)·B·A is stored in float32: entries ≤ 0.1 round by ≤ ulp(0.1)/2 = 3.7e-9, a
            # noise matrix whose largest singular value is ≈ 2 × 2.2e-9 (its std) × √128 = 5e-8 < 1e-7
            assert torch.linalg.matrix_rank(change, atol=1e-7) <= 4, name
            adapted += 1
        else:
            assert torch.equal(final[0][name], tensor), f"frozen weight {name} changed"
    assert adapted == 8  # 4 layers × (q_proj, v_proj)
    for rank in (0, 1):
        for step in _steps(fits["lora_fsdp"], rank):
            mask = step["response_mask"].bool()
            gap = (step["rollout_log_probs"] - step["actor_log_probs"])[mask].abs().max().item()
            # float32, the engine's merged weights and cached decoding against the sharded actor's
            # W·x + (α/r)·B·(A·x): sums of ≤ 512 terms grouped otherwise in 4 blocks, both paths
            assert gap <= reordered_sums(step["actor_log_probs"][mask], terms=512, stages=4), gap
    exported = load_actor(fits["lora_fsdp"] / "actor").state_dict()  # HFExport: merged, gathered from shards
    assert exported.keys() == final[0].keys()
    assert all(torch.equal(exported[name], tensor) for name, tensor in final[0].items())
    assert (fits["lora_fsdp"] / "actor" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_fsdp2_fit_on_qwen3_syncs_the_gathered_weights(fits):
    """ddp_rl_fit.py under FSDP2 on the tiny Qwen3 (tied embeddings, q/k norms): the actor is sharded,
    both ranks end with the same moved weights, and at every step the HF engine's copy (loaded from the
    directory, then given the gathered weights) samples with the sharded actor's log-probs."""
    out = fits["qwen3_fsdp"]
    initial = torch.load(out / "initial.pt")
    final = [torch.load(out / f"rank{rank}.pt") for rank in (0, 1)]
    assert final[0].keys() == initial.keys()
    assert all(torch.equal(final[0][name], final[1][name]) for name in initial)
    assert max((final[0][name] - initial[name]).abs().max().item() for name in initial) > 1e-3
    for rank in (0, 1):
        record = torch.load(out / f"rank{rank}_steps.pt")
        assert record["sharded"] and len(record["steps"]) == 3
        for step, values in enumerate(record["steps"]):
            assert values["sample_versions"].eq(step).all() and values["trainer_version"] == step
            mask = values["response_mask"].bool()
            gap = (values["rollout_log_probs"] - values["actor_log_probs"])[mask].abs().max().item()
            assert gap <= PARITY, (rank, step, gap)


# ----------------------------------------------------------------------------- the sampler


def test_sampler_shards_disjoint_equal_deterministic():
    shards = [ResumableShuffleSampler(11, seed=3, num_replicas=3, rank=r) for r in range(3)]
    orders = [list(s) for s in shards]
    assert [len(s) for s in shards] == [3, 3, 3] and all(len(o) == 3 for o in orders)
    assert len(set().union(*orders)) == 9  # disjoint; 11 // 3 * 3 prompts used this epoch
    full = list(ResumableShuffleSampler(11, seed=3))
    assert orders[1] == full[:9][1::3]  # rank r takes every 3rd index of the common permutation
    assert orders == [list(ResumableShuffleSampler(11, seed=3, num_replicas=3, rank=r)) for r in range(3)]
    for s in shards:
        s.set_epoch(1)
    assert [list(s) for s in shards] != orders


def test_sampler_resumes_each_rank_where_it_stopped():
    sampler = ResumableShuffleSampler(12, seed=0, num_replicas=2, rank=1)
    whole = list(sampler)
    sampler.skip_once(4)
    assert list(sampler) == whole[4:]
    assert list(sampler) == whole  # the skip applies once


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"rank": 2, "num_replicas": 2}, "rank"), ({"num_replicas": 0}, "num_replicas")]
)
def test_sampler_rejects_bad_ranks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ResumableShuffleSampler(10, **kwargs)


def test_lightning_keeps_the_sampler_under_ddp(tiny_model_dir, tmp_path):
    """Lightning wraps a custom sampler in its DistributedSamplerWrapper unless it is a DistributedSampler;
    ours is one, so the loader is used as the data module built it (with use_distributed_sampler on)."""
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, default_root_dir=tmp_path)
    assert trainer._accelerator_connector.use_distributed_sampler
    data = PromptDataModule(
        task="addition", batch_size=4, num_train_samples=20, tokenizer_path=tiny_model_dir
    )
    data.setup("fit")
    loader = data.train_dataloader()
    assert not trainer._data_connector._requires_distributed_sampler(loader)


def _trainer_at(rank: int, world_size: int, processed: int = 0) -> SimpleNamespace:
    """What ``train_dataloader`` reads of a trainer: ranks and the batches this epoch already processed."""
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed))
    return SimpleNamespace(
        world_size=world_size,
        global_rank=rank,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
    )


def test_datamodule_gives_each_rank_its_share(tiny_model_dir):
    data = PromptDataModule(
        task="addition", batch_size=4, num_train_samples=20, tokenizer_path=tiny_model_dir
    )
    data.setup("fit")
    shares = []
    for rank in (0, 1):
        data.trainer = _trainer_at(rank, 2)
        shares.append([p for batch in data.train_dataloader() for p in batch["prompt"]])
    assert len(shares[0]) == len(shares[1]) == 8  # 10 prompts per rank, 2 full batches of 4
    assert not set(shares[0]) & set(shares[1])
    data.trainer = _trainer_at(1, 2, processed=1)  # resumed after one batch of this epoch
    assert [p for batch in data.train_dataloader() for p in batch["prompt"]] == shares[1][4:]
    data.batch_size = 11
    with pytest.raises(ValueError, match="20 training prompts shared by 2 ranks leave 10 per rank"):
        data.train_dataloader()


# ----------------------------------------------------------------------------- cross-rank helpers


@pytest.mark.slow
def test_gather_rows_reduce_metrics_and_min_over_ranks_across_two_processes(fits):
    """Run by tests/helpers/ddp_rl_fit.py in its process group: ranks with different row counts, widths and
    metric names."""
    expected = torch.tensor(
        [[0, 1, 2], [3, 4, 5], [100, 101, 0], [102, 103, 0], [104, 105, 0]], dtype=torch.float32
    )
    for rank in (0, 1):
        result = torch.load(fits["ddp"] / f"rank{rank}_collectives.pt")
        torch.testing.assert_close(result["gathered"], expected)  # small integers: exact
        assert result["ids"].tolist() == [0, 1, 10, 11, 12] and result["missing"] is None
        assert result["mine"] == ((0, 2) if rank == 0 else (2, 5))
        expected_metrics = {"a": 0.5, "len_max": 6.0, "len_min": 5.0, "only_one": 7.0, "perf/peak_rss": 2.0}
        assert result["metrics"] == expected_metrics
        assert result["fewest"] == 3  # rank 0 passes 7, rank 1 3


def test_helpers_are_plain_in_one_process():
    x = torch.ones(3, 2)
    (same, none), mine = gather_rows(x, None)
    assert same is x and none is None and mine == slice(0, 3)
    assert reduce_metrics({"a": 1.0}) == {"a": 1.0}
    assert min_over_ranks(7) == 7
    assert max_over_ranks_each([0, 1]) == [0, 1]
    urls = ["http://a:1"]
    assert from_rank_zero(urls) is urls and gather_objects(urls) == [urls] and barrier() is None
    assert not params_sharded(None) and not params_sharded(DDPStrategy())
    layer = torch.nn.Linear(2, 1)
    assert full_state_dict(None, torch.nn.ModuleDict({"actor": layer})).keys() == layer.state_dict().keys()


CLI_RANK = """
import sys, torch.distributed as dist
from lit_offpolicy.cli import main
rank, store_path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
dist.barrier()
try:
    main(["fit", "--trainer.max_steps", "not-a-number"])
except SystemExit as exit:
    print(f"exit={exit.code} group_open={dist.is_initialized()}")
"""


def test_the_cli_ends_a_multi_process_group_even_when_it_fails(tmp_path):
    """An open gloo group can abort the interpreter's exit (SIGABRT, pytorch/pytorch#190489): the CLI
    ends it on every path, here a bad option in a real 2-process group."""
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", CLI_RANK, str(rank), str(tmp_path / "store")],
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for process in ranks:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-2000:]
        assert out.strip() == "exit=2 group_open=False"


def test_a_one_process_group_is_left_open(tmp_path):
    """The in-process vLLM engine's world-1 group stays: later engines in this process reuse it."""
    import torch.distributed as dist

    ours = not dist.is_initialized()  # else a vLLM test in this process made it: the same case
    if ours:
        store = dist.FileStore(str(tmp_path / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert dist.get_world_size() == 1
        destroy_process_group()
        assert dist.is_initialized()
    finally:
        if ours:
            dist.destroy_process_group()


def test_clip_grad_norm_on_one_device_matches_torch():
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([3.0, 4.0])
    # float32 √(9 + 16) = 5 exactly, then 3/5 and 4/5 rounded once: the defaults (approx rel 1e-6,
    # assert_close rtol 1.3e-6) hold a rounding of 6e-8
    assert clip_grad_norm(None, [param], max_norm=1.0) == pytest.approx(5.0)
    torch.testing.assert_close(param.grad, torch.tensor([0.6, 0.8]))
    assert clip_grad_norm(DeepSpeedStrategy(stage=2), [param], max_norm=1.0) is None  # the engine clips


def test_configure_deepspeed_hands_the_norm_and_the_boundary_to_the_engine():
    strategy = DeepSpeedStrategy(stage=2)
    configure_deepspeed(strategy, max_grad_norm=0.5)
    assert strategy.config["gradient_clipping"] == 0.5
    assert strategy.config["managed_gradient_accumulation"] is False
    configure_deepspeed(strategy, max_grad_norm=0.5)  # idempotent
    with pytest.raises(ValueError, match="gradient_clipping=0.5 differs from the module's max_grad_norm=1.0"):
        configure_deepspeed(strategy, max_grad_norm=1.0)
    stage3 = DeepSpeedStrategy(stage=3)
    configure_deepspeed(stage3, max_grad_norm=None)
    assert stage3.config["gradient_clipping"] == 0.0 and params_sharded(stage3)


def test_val_accuracy_refuses_sharded_parameters():
    from lit_offpolicy.callbacks import ValAccuracy

    callback = ValAccuracy()
    for strategy in (ModelParallelStrategy(), DeepSpeedStrategy(stage=3)):
        with pytest.raises(ValueError, match="ValAccuracy evaluates the actor in place.*allowed strategies"):
            callback.setup(SimpleNamespace(strategy=strategy), None, "fit")
    for strategy in (DDPStrategy(), DeepSpeedStrategy(stage=2), None):
        callback.setup(SimpleNamespace(strategy=strategy), None, "fit")


def test_fsdp1_is_refused_with_the_supported_strategies():
    with pytest.raises(ValueError, match="FSDPStrategy .FSDP1. is not supported.*ModelParallelStrategy"):
        check_strategy(FSDPStrategy())
    for strategy in (None, DDPStrategy(), ModelParallelStrategy(), DeepSpeedStrategy(stage=2)):
        check_strategy(strategy)


# ----------------------------------------------------------------------------- strategy configs


@pytest.mark.parametrize("name", STRATEGIES)
def test_strategy_configs_build_their_strategies(name):
    spec = yaml.safe_load((REPO / "configs" / "strategy" / f"{name}.yaml").read_text())
    parser = ArgumentParser()
    parser.add_argument("--strategy", type=str | Strategy)
    strategy = parser.instantiate(parser.parse_object({"strategy": spec["strategy"]})).strategy
    expected = {"ddp": DDPStrategy, "fsdp": ModelParallelStrategy}.get(name, DeepSpeedStrategy)
    assert type(strategy) is expected
    if name.startswith("deepspeed"):
        assert strategy.config["zero_optimization"]["stage"] == int(name[-1])
    assert params_sharded(strategy) == (name in ("fsdp", "deepspeed_zero3"))


# ----------------------------------------------------------------------------- SLURM


def _slurm_job(rank: int) -> dict[str, str]:
    """The variables SLURM sets for task ``rank`` of a 2-node x 2-task job (srun inside sbatch)."""
    return {
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NAME": "lit-offpolicy",
        "SLURM_JOB_NODELIST": "node[01-02]",
        "SLURM_NODELIST": "node[01-02]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "4",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % 2),
        "SLURM_NODEID": str(rank // 2),
    }


@pytest.fixture
def keep_rank_zero():
    """Building a DDP Trainer sets Lightning's process-wide ``rank_zero_only.rank`` (here to the fake
    SLURM rank); put it back, or later tests in this process lose their rank-zero warnings and logs."""
    saved = (fabric_rank_zero_only.rank, utils_rank_zero_only.rank)
    yield
    fabric_rank_zero_only.rank, utils_rank_zero_only.rank = saved


@pytest.mark.parametrize("rank", [0, 3])
def test_slurm_environment_of_a_two_node_job(monkeypatch, tmp_path, rank, keep_rank_zero):
    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
        # set, then deleted: monkeypatch then restores the key's absence after the test, although
        # Lightning writes MASTER_ADDR (the fake node's name) and MASTER_PORT into os.environ; left
        # behind, they sent a later test's 2-process fit to "node01" and it hung
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key, value in _slurm_job(rank).items():
        monkeypatch.setenv(key, value)
    assert SLURMEnvironment.detect()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, num_nodes=2, strategy="ddp", logger=False, default_root_dir=tmp_path
    )
    environment = trainer.strategy.cluster_environment
    assert isinstance(environment, SLURMEnvironment) and environment.auto_requeue
    assert (trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.world_size) == (
        rank,
        rank % 2,
        rank // 2,
        4,
    )
    assert environment.main_address == "node01"
    assert environment.main_port == 15000 + 3456  # the job id's last 4 digits


def test_slurm_environment_checks_devices_and_nodes_against_the_job(monkeypatch):
    """Lightning's launcher calls ``validate_settings`` as fit starts: devices = tasks per node."""
    for key, value in _slurm_job(0).items():
        monkeypatch.setenv(key, value)
    environment = SLURMEnvironment()
    environment.validate_settings(num_devices=2, num_nodes=2)
    with pytest.raises(ValueError, match="ntasks-per-node=2"):
        environment.validate_settings(num_devices=3, num_nodes=2)
    with pytest.raises(ValueError, match="--nodes=2"):
        environment.validate_settings(num_devices=2, num_nodes=1)


def _run_sbatch(tmp_path: Path, srun: str, **env: str) -> subprocess.CompletedProcess:
    """configs/slurm/rl.sbatch under bash, with the variables SLURM gives the batch script, the
    stand-in ``srun`` script ``srun`` and a stand-in ``scontrol`` that knows the job's two nodes
    (tests/integration/test_slurm.py runs the script on a real cluster where SLURM is installed)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, script in (("srun", srun), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(f"#!/bin/bash\n{script}\n")
        (bin_dir / name).chmod(0o755)
    path = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    names = ("SLURM_JOB_NUM_NODES", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NODELIST")
    job = {k: v for k, v in _slurm_job(0).items() if k in names}
    return subprocess.run(
        ["bash", str(REPO / "configs" / "slurm" / "rl.sbatch")],
        cwd=REPO,
        env=subprocess_env(PATH=path, RUN_DIR=str(tmp_path / "run"), **job, **env),
        capture_output=True,
        text=True,
        timeout=180,
    )


# drops srun's own options, then runs the job's command with --print_config: LightningCLI parses
# the whole command line and prints the configuration instead of fitting
PRINT_CONFIG = 'while [[ "$1" == -* ]]; do shift; done\nexec "$@" --print_config'
# prints each argument srun would run on its own line
ECHO_ARGS = 'printf "%s\\n" "$@"'
# scontrol for node[01-02], whose addresses (NodeAddr) differ from their names
SCONTROL = """case "$1 $2" in
    "show hostnames") [[ "$3" == "node[01-02]" ]] && printf "node01\\nnode02\\n" ;;
    "show node") printf "NodeName=$3 Arch=x86_64\\n   NodeAddr=10.0.0.${3: -1} NodeHostName=$3\\n" ;;
    *) exit 1 ;;
esac"""


@pytest.mark.slow
def test_sbatch_command_line_parses_with_the_jobs_nodes_and_tasks(tmp_path):
    result = _run_sbatch(tmp_path, PRINT_CONFIG)
    assert result.returncode == 0, result.stderr[-2000:]
    config = yaml.safe_load(result.stdout)
    trainer = config["trainer"]
    # from SLURM, over the strategy file's; devices parses as the string "2", which Lightning counts as 2
    assert (trainer["num_nodes"], str(trainer["devices"])) == (2, "2")
    assert trainer["default_root_dir"] == str(tmp_path / "run")
    assert trainer["strategy"]["class_path"] == "lightning.pytorch.strategies.DDPStrategy"
    assert trainer["accelerator"] == "gpu"
    assert trainer["max_steps"] == 500 and len(trainer["callbacks"]) == 3  # the RL config's settings stay
    assert config["model"]["class_path"] == "lit_offpolicy.OffPolicyModule"
    assert config["ckpt_path"] is None  # first start: nothing to resume


def test_sbatch_takes_the_strategy_and_resumes_from_the_newest_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)

    def srun_args(**env) -> list[str]:
        result = _run_sbatch(tmp_path, ECHO_ARGS, **env)
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()

    args = srun_args(STRATEGY="configs/strategy/deepspeed_zero3.yaml")
    assert args[args.index("--trainer") + 1] == "configs/strategy/deepspeed_zero3.yaml"
    assert "--ckpt_path" not in args
    last, hpc = run / "checkpoints" / "last.ckpt", run / "hpc_ckpt_1.ckpt"
    last.write_text("written by ModelCheckpoint")
    os.utime(last, (1_000_000, 1_000_000))
    hpc.write_text("written by Lightning's SIGUSR1 handler, later")
    assert srun_args()[-2:] == ["--ckpt_path", str(hpc)]
    os.utime(hpc, (500_000, 500_000))  # last.ckpt is now the newer one
    assert srun_args()[-2:] == ["--ckpt_path", str(last)]


def test_sbatch_sets_the_main_address_to_the_first_nodes_address(tmp_path):
    """Lightning's default main address is the first node's name, which need not resolve (then the
    rendezvous retries it for 30 minutes): the script exports the first node's NodeAddr instead,
    unless MASTER_ADDR is set."""
    result = _run_sbatch(tmp_path, 'echo "$MASTER_ADDR"')
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "10.0.0.1"
    result = _run_sbatch(tmp_path, 'echo "$MASTER_ADDR"', MASTER_ADDR="head.cluster")
    assert result.stdout.strip() == "head.cluster"
