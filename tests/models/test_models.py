import pytest
import torch
from helpers.tolerances import reordered_sums
from safetensors.torch import load_file

from lit_offpolicy.models import (
    build_tokenizer,
    create_tiny_model,
    load_actor,
    load_critic,
    load_reference,
    load_tokenizer,
    tiny_llama_config,
)
from lit_offpolicy.models.loading import CHARACTERS


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return load_tokenizer(tiny_dir)


def test_tokenizer_special_tokens_and_vocabulary():
    tokenizer = build_tokenizer()
    assert (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.unk_token_id,
    ) == (
        0,
        1,
        2,
        3,
    )
    assert len(tokenizer) == 4 + len(CHARACTERS) == 100
    assert tokenizer.chat_template is None


@pytest.mark.parametrize("text", ["12+34=", "(7-9)+2=", " a  b \n\\boxed{-3/4}. ", "".join(CHARACTERS)])
def test_tokenizer_round_trips_one_token_per_character(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == len(text) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text


def test_tokenizer_maps_unknown_characters_to_unk(tokenizer):
    assert tokenizer("é", add_special_tokens=False).input_ids == [tokenizer.unk_token_id]


def test_tiny_config_has_about_a_million_parameters(tiny_dir):
    model = load_actor(tiny_dir)
    assert 0.9e6 < sum(p.numel() for p in model.parameters()) < 1.2e6
    assert model.config.max_position_embeddings == 128
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (0, 1, 2)
    assert tiny_llama_config(100, hidden_size=64).hidden_size == 64


def test_create_tiny_model_is_deterministic_per_seed(tmp_path, tiny_dir):
    same = load_file(create_tiny_model(tmp_path / "same", seed=0) / "model.safetensors")
    other = load_file(create_tiny_model(tmp_path / "other", seed=1) / "model.safetensors")
    reference = load_file(tiny_dir / "model.safetensors")
    assert all(torch.equal(reference[name], same[name]) for name in reference)
    assert not all(torch.equal(reference[name], other[name]) for name in reference)


def test_actor_saves_and_reloads_with_identical_logits(tmp_path, tiny_dir, tokenizer):
    actor = load_actor(tiny_dir)
    assert actor.training
    actor.save_pretrained(tmp_path)
    reloaded = load_actor(tmp_path)
    batch = tokenizer(["12+34=", "5+6="], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(actor(**batch).logits, reloaded(**batch).logits)


def test_reference_is_frozen(tiny_dir):
    reference = load_reference(tiny_dir)
    assert not reference.training
    assert not any(p.requires_grad for p in reference.parameters())


def test_critic_returns_one_value_per_token_and_trains(tmp_path, tiny_dir, tokenizer):
    critic = load_critic(tiny_dir)
    batch = tokenizer(["12+34=", "5+6="], padding=True, return_tensors="pt")
    values = critic(**batch)
    assert values.shape == batch.input_ids.shape
    values.sum().backward()
    assert critic.model.score.weight.grad is not None
    critic.save_pretrained(tmp_path)
    reloaded = load_critic(tmp_path)
    saved = critic.state_dict()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    # the same weights give the same values, to the bit but for BLAS kernels that block their sums by
    # memory alignment or thread schedule: sums of ≤ 512 terms (the MLP) in 4 blocks, both paths, on
    # values ≤ 0.3: 2 × 4 × eps32 × √512 × max|value| (≈ 6.5e-6 here)
    with torch.no_grad():
        values = critic(**batch)
        atol = reordered_sums(values, terms=512, stages=4)
        torch.testing.assert_close(reloaded(**batch), values, rtol=0, atol=atol)


def test_actor_generates_from_the_saved_directory(tiny_dir, tokenizer):
    prompt = tokenizer(["12+34="], return_tensors="pt")
    output = load_actor(tiny_dir).generate(**prompt, max_new_tokens=4, do_sample=False)
    assert output.shape == (1, prompt.input_ids.shape[1] + 4)


def test_missing_directory_names_the_path(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=f"{tmp_path / 'nowhere'} does not exist.*lit-offpolicy create-tiny-model"
    ):
        load_actor(tmp_path / "nowhere")


def test_directory_without_config_or_weights_names_what_is_missing(tmp_path, tiny_dir):
    with pytest.raises(FileNotFoundError, match=f"no config.json in {tmp_path}"):
        load_reference(tmp_path)
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=f"no \\*.safetensors weights in {tmp_path}"):
        load_critic(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"no tokenizer.json or tokenizer_config.json in {tmp_path}"):
        load_tokenizer(tmp_path)


def test_unloadable_weights_raise_naming_the_path(tmp_path, tiny_dir):
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(OSError, match=f"could not load .* from {tmp_path}"):
        load_actor(tmp_path)
