"""The engine sync's weights: buckets of the state dict, streamed lazily, LoRA merged one layer at a time.

The gathers of FSDP2 and ZeRO-3 run in the multi-process fits of tests/integration/test_distributed.py
(their engines load the stream at every sync); here, one process: the bucketing and the streaming
themselves."""

import pytest
import torch
from torch import nn

from lit_offpolicy.models import create_tiny_model, load_actor
from lit_offpolicy.models.lora import LoraOptions, add_lora, merge_lora_stream, merged_weights
from lit_offpolicy.rollout.weight_sync import full_state_dict, gathered_buckets, stream_full_weights


def three_layers() -> nn.Module:
    """float32 weights of 40, 24, 400 and 8 bytes, in this order."""
    return nn.Sequential(
        nn.Linear(2, 4, bias=False), nn.Linear(2, 3, bias=False), nn.Linear(10, 10, bias=False)
    )


def test_buckets_cut_the_state_dict_in_order_and_hold_a_big_tensor_alone():
    module = nn.Sequential(three_layers(), nn.LayerNorm(2))  # + weight 8 bytes, bias 8 bytes
    buckets = [[name for name, _ in bucket] for bucket in gathered_buckets(None, module, bucket_bytes=64)]
    assert buckets == [["0.0.weight", "0.1.weight"], ["0.2.weight"], ["1.weight", "1.bias"]]
    every = [name for bucket in gathered_buckets(None, module, bucket_bytes=1) for name, _ in bucket]
    assert every == list(module.state_dict())
    # unsharded: the state dict's own tensors, no copy
    state = module.state_dict()
    for bucket in gathered_buckets(None, module):
        for name, tensor in bucket:
            assert tensor.data_ptr() == state[name].data_ptr()


def test_stream_is_lazy_and_yields_the_state_dict():
    holder = nn.ModuleDict({"actor": three_layers()})
    stream = stream_full_weights(None, holder)
    with torch.no_grad():
        holder["actor"][0].weight.add_(1.0)  # after the call, before the first item: the stream sees it
    pairs = list(stream)
    assert [name for name, _ in pairs] == list(holder["actor"].state_dict())
    assert torch.equal(pairs[0][1], holder["actor"][0].weight)
    assert full_state_dict(None, holder).keys() == holder["actor"].state_dict().keys()


def test_lora_stream_merges_a_layer_as_soon_as_its_three_parts_have_passed(tmp_path):
    create_tiny_model(tmp_path / "m", seed=0)
    actor = add_lora(load_actor(tmp_path / "m"), LoraOptions(r=2, alpha=4))
    with torch.no_grad():
        for name, parameter in actor.named_parameters():
            if "lora_B" in name:
                parameter.normal_()  # B starts at zero: make the merge change the weights
    state = actor.state_dict()
    pulled = []

    def source():
        for name, tensor in state.items():
            pulled.append(name)
            yield name, tensor

    stream = merge_lora_stream(source(), scaling=2.0)
    name, _ = next(n for n in stream if n[0].endswith("q_proj.weight"))
    # the merged q_proj came out once its lora_B had passed, before the next layer was read
    assert pulled[-1].endswith("q_proj.lora_B.default.weight"), pulled[-3:]
    rest = dict(stream)
    expected = merged_weights(actor, state)
    assert list(expected)[: len(expected) - len(rest)][-1] == name
    for key, tensor in rest.items():
        assert torch.equal(tensor, expected[key])
    holder = nn.ModuleDict({"actor": actor})
    streamed = dict(stream_full_weights(None, holder))
    assert streamed.keys() == expected.keys()
    assert all(torch.equal(streamed[k], expected[k]) for k in expected)


def test_lora_stream_refuses_a_layer_without_its_adapter_halves():
    weight, lora_a = torch.ones(2, 3), torch.ones(1, 3)
    layer = "base_model.model.model.layers.0.mlp.down_proj"
    items = [(f"{layer}.base_layer.weight", weight), (f"{layer}.lora_A.default.weight", lora_a)]
    with pytest.raises(KeyError, match=r"model.layers.0.mlp.down_proj lacks its \['B'\]"):
        list(merge_lora_stream(items, scaling=1.0))


def test_rollout_streams_its_sync_in_buckets_of_the_option_and_refuses_a_bad_size():
    from types import SimpleNamespace

    from lit_offpolicy import callbacks

    rollout = callbacks.Rollout(sync_bucket_mb=1)
    assert rollout.worker.sync_bucket_bytes == 2**20
    holder = nn.ModuleDict({"actor": three_layers()})
    pairs = list(rollout.worker.weights(SimpleNamespace(strategy=None), holder))
    assert [name for name, _ in pairs] == list(holder["actor"].state_dict())
    with pytest.raises(ValueError, match="sync_bucket_mb"):
        callbacks.Rollout(sync_bucket_mb=0)
