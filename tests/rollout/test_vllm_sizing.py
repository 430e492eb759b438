"""How the vLLM engine's ``max_model_len`` is chosen and checked at start-up, without loading vLLM."""

import json

import pytest

from lit_offpolicy.rollout import HFEngineSpec, VLLMEngineSpec
from lit_offpolicy.rollout.vllm_engine import model_positions


@pytest.fixture
def model_dir(tmp_path):
    """A model directory as far as sizing reads it: config.json with 128 positions."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    return str(tmp_path)


def test_unset_max_model_len_is_the_prompts_plus_the_response(model_dir):
    assert VLLMEngineSpec().sized(64, 5, model_dir).max_model_len == 69
    episodes = VLLMEngineSpec().sized(40, 80, model_dir, response_option="episodes.max_response_tokens")
    assert episodes.max_model_len == 120


def test_unknown_prompt_length_leaves_it_to_vllm(model_dir):
    assert VLLMEngineSpec().sized(None, 5, model_dir).max_model_len is None


def test_more_than_the_models_positions_names_the_options_and_numbers(model_dir):
    with pytest.raises(ValueError) as error:
        VLLMEngineSpec().sized(314, 512, model_dir)
    message = str(error.value)
    assert "\n" not in message
    numbers = ("data.max_prompt_length=314", "sampling.max_tokens=512", "826", "max_position_embeddings=128")
    for text in numbers:
        assert text in message


def test_a_set_max_model_len_that_cannot_hold_prompt_and_response_is_refused(model_dir):
    with pytest.raises(ValueError) as error:
        VLLMEngineSpec(max_model_len=100).sized(64, 64, model_dir)
    message = str(error.value)
    assert "\n" not in message
    for text in ("data.max_prompt_length=64", "sampling.max_tokens=64", "= 128", "max_model_len=100"):
        assert text in message
    assert VLLMEngineSpec(max_model_len=100).sized(64, 36, model_dir).max_model_len == 100


def test_max_model_len_above_the_models_positions_names_both(model_dir):
    with pytest.raises(ValueError, match=r"max_model_len=512 .*max_position_embeddings=128") as error:
        VLLMEngineSpec(max_model_len=512).sized(None, 5, model_dir)
    assert "HF engine" not in str(error.value)


def test_positions_are_read_from_the_config_or_its_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    assert model_positions(tmp_path) == 4096
    (tmp_path / "config.json").write_text(json.dumps({"n_positions": 1024}))
    assert model_positions(tmp_path) == 1024


def test_engines_without_a_limit_are_left_as_they_are(model_dir):
    spec = HFEngineSpec()
    assert spec.sized(10_000, 10_000, model_dir) is spec


def test_bad_log_level_is_refused():
    with pytest.raises(ValueError, match="log_level='LOUD'"):
        VLLMEngineSpec(log_level="LOUD")
