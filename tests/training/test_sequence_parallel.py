"""Sequence parallelism (training/sequence_parallel.py, sequence_shard.py): the shard of a packed row,
the refusals, and the passes across 2 and 4 real gloo processes against one process, in float64.

The multi-process check (``helpers.sequence_parallel_ranks``, its docstring says what each rank does):
tiny Llama, Qwen2 (GQA, q/k/v biases), Qwen3 (GQA, q/k norms) and Mistral (GQA); a batch of
left-padded prompts and responses of 0, 1 and more tokens, 31 real tokens, so the row is padded for 2
and 4 ranks; the whole logits and the chunked head; gradient checkpointing with LoRA; a real DDP
over the 4 ranks in 2 sequence groups; and ``OffPolicyModule``'s prepare and loss on each rank's own
rollouts, joined in each group, against one process on all of them.

Tolerances (``helpers.tolerances.reordered_sums``): the split row's GEMMs group the same sums
differently (≤ 512 terms, the MLP) in each of a block's stages, and the gradients sum over the group's
ranks as well: 2 × (2 · layers + 2) × eps × √512 × max|reference|, eps of float64 (the module's
float32). Measured: at most 0.7% of the bound. An exchange that scrambled the heads was off by 0.1
to 1; advantages estimated over every rank (each group's rollouts twice) by 1,400 bounds.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.experiences import experience
from lightning.pytorch.strategies import DeepSpeedStrategy
from transformers import AutoModelForCausalLM, GPT2Config

from lit_offpolicy.models import create_tiny_model, load_actor
from lit_offpolicy.rollout.server.process import free_port
from lit_offpolicy.training.packing import pack
from lit_offpolicy.training.sequence_parallel import SequenceGroup, check, check_splittable, start
from lit_offpolicy.training.sequence_shard import shard

TESTS = Path(__file__).resolve().parents[1]


def _group(size: int, rank: int) -> SequenceGroup:
    """A group's shape without processes: ``shard`` reads only the size and the rank."""
    return SequenceGroup(group=None, size=size, rank=rank, data_group=None)


def test_a_row_is_padded_and_split_with_each_ranks_response_tokens():
    packed = pack(experience((2, 1), width=2))  # prompts of 6 and 2 tokens: rows of 8 and 3, 11 tokens
    assert packed.lengths == (8, 3) and packed.predicting.tolist() == [5, 6, 9]
    shards = [shard(packed, _group(2, rank)) for rank in range(2)]
    assert [s.input_ids.shape[1] for s in shards] == [6, 6]  # 11 tokens padded to 12
    assert torch.equal(torch.cat([s.input_ids for s in shards], 1)[:, :11], packed.input_ids)
    assert shards[1].input_ids[0, -1] == 0 and shards[1].position_ids[0, -1] == 0  # the padding, alone
    assert shards[0].lengths == (8, 3, 1)
    assert shards[0].predicting.tolist() == [5] and shards[1].predicting.tolist() == [0, 3]  # 6 − 6, 9 − 6
    assert shards[0].counts == shards[1].counts == (1, 2)
    assert torch.equal(torch.cat([s.targets for s in shards], 1), packed.targets)


def test_a_rank_without_response_tokens_has_an_empty_share():
    packed = pack(experience((1,), width=1))  # 6 prompt tokens, 1 response token: predicted at 5
    shards = [shard(packed, _group(4, rank)) for rank in range(4)]
    assert [s.counts for s in shards] == [(0, 0, 1, 0)] * 4
    assert [len(s.predicting) for s in shards] == [0, 0, 1, 0] and shards[2].predicting.tolist() == [1]


def test_responses_are_widened_for_a_group_with_padding_the_masks_ignore():
    exp = experience((2, 1), width=2)
    exp = dataclasses.replace(exp, token_versions=torch.tensor([[3, 4], [5, 5]]))
    wide = exp.widened(4, pad_token_id=0)
    assert wide.response_ids.shape == (2, 4) and wide.response_ids[:, 2:].eq(0).all()
    assert torch.equal(wide.response_mask[:, :2], exp.response_mask) and not wide.response_mask[:, 2:].any()
    assert wide.token_versions.tolist() == [[3, 4, 4, 4], [5, 5, 5, 5]]  # padding: the last version
    assert torch.equal(wide.prompt_ids, exp.prompt_ids) and wide.scores is exp.scores
    assert exp.widened(2, 0) is exp


def test_a_size_that_does_not_divide_the_ranks_or_deepspeed_or_compile_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"sequence_parallel=2 does not divide the 3 trainer ranks; allowed"):
        check(2, [], None, False, 3)
    with pytest.raises(ValueError, match=r"not DeepSpeedStrategy; allowed values with DeepSpeed: 1"):
        check(2, [], DeepSpeedStrategy(), False, 2)
    with pytest.raises(ValueError, match=r"runs without compile; allowed values with compile=True: 1"):
        check(2, [], None, True, 2)
    check(1, [], DeepSpeedStrategy(), True, 3)  # off: nothing to refuse
    assert start(1, [], None, False) is None


def test_heads_that_do_not_divide_are_refused(tiny_model_dir):
    model = load_actor(tiny_model_dir, attn_implementation="sdpa")  # 4 heads, 4 key/value heads
    check_splittable(model, 2)
    check_splittable(model, 4)
    with pytest.raises(ValueError, match=r"4 key/value heads\); allowed values for this model: 1, 2, 4$"):
        check_splittable(model, 3)


def test_grouped_query_attention_splits_with_fewer_key_value_heads_than_ranks(tmp_path):
    model = load_actor(create_tiny_model(tmp_path / "qwen2", arch="qwen2"), attn_implementation="sdpa")
    check_splittable(model, 4)  # 4 heads, 2 key/value heads: each goes to 2 ranks
    with pytest.raises(ValueError, match=r"\(2 key/value heads\); allowed values for this model: 1, 2, 4$"):
        check_splittable(model, 3)


def test_another_attention_or_family_is_refused(tiny_model_dir):
    eager = load_actor(tiny_model_dir, attn_implementation="eager")
    with pytest.raises(ValueError, match=r"allowed values of attn_implementation with it: None, 'sdpa'"):
        check_splittable(eager, 2)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, attn_implementation="sdpa")
    gpt2 = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"cannot split the attention of a 'gpt2' model; allowed model fam"):
        check_splittable(gpt2, 2)


@pytest.mark.slow  # 4 processes
def test_two_and_four_ranks_give_the_one_process_outputs_and_gradients(tiny_model_dir, tmp_path):
    families = [str(create_tiny_model(tmp_path / a / "m", arch=a)) for a in ("qwen2", "qwen3", "mistral")]
    models = [tiny_model_dir, *families]
    world, port = 4, str(free_port())
    command = [sys.executable, "-m", "helpers.sequence_parallel_ranks"]
    ranks = [
        subprocess.Popen([*command, str(rank), str(world), port, str(tmp_path), *models], cwd=TESTS)
        for rank in range(world)
    ]
    assert [rank.wait(timeout=300) for rank in ranks] == [0] * world
    for rank in range(world):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(report) == 99  # 6 cases × 2 group sizes × 8 checks, the DDP case, the module's 2
        failed = {case: values for case, values in report.items() if values[0] > values[1]}
        assert not failed, failed
