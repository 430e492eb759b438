import pytest
import torch
from helpers.engines import EOS, PAD, PROMPTS, teacher_forced_log_probs, tiny_llama
from helpers.tolerances import reordered_sums
from transformers import LlamaForCausalLM

from lit_offpolicy.rollout import Generation, HFEngine, RolloutEngine, SamplingParams, token_log_probs


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(0)


def argmax_decode(model, prompt: list[int], max_tokens: int, stop_ids: set[int]) -> list[int]:
    """Greedy decoding by hand: full forward pass per step, no cache, no padding."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            if token in stop_ids:
                break
    return ids[len(prompt) :]


def token_ids(outputs: list[list[Generation]]) -> list[list[list[int]]]:
    return [[g.token_ids for g in per_prompt] for per_prompt in outputs]


def test_engine_satisfies_protocol(model):
    assert isinstance(HFEngine(model, EOS, PAD), RolloutEngine)


def test_sleep_wake_up_and_close_are_no_ops(model):
    engine = HFEngine(model, EOS, PAD)
    before = engine.generate([[5, 6]], SamplingParams(max_tokens=3, temperature=0.0))
    engine.sleep()
    engine.wake_up()
    assert engine.generate([[5, 6]], SamplingParams(max_tokens=3, temperature=0.0)) == before
    engine.close()


def test_shapes_lengths_and_finish_reasons(model):
    params = SamplingParams(n=4, max_tokens=6, stop_token_ids=(3,), seed=0)
    outputs = HFEngine(model, EOS, PAD).generate(PROMPTS, params)
    assert len(outputs) == len(PROMPTS)
    for per_prompt in outputs:
        assert len(per_prompt) == 4
        for gen in per_prompt:
            assert 1 <= len(gen.token_ids) <= 6
            assert len(gen.log_probs) == len(gen.token_ids)
            assert all(lp <= 0 for lp in gen.log_probs)
            assert not {EOS, 3} & set(gen.token_ids[:-1])
            if gen.finish_reason == "stop":
                assert gen.token_ids[-1] in {EOS, 3}
            else:
                assert gen.finish_reason == "length"
                assert len(gen.token_ids) == 6 and gen.token_ids[-1] not in {EOS, 3}
    assert {g.finish_reason for per_prompt in outputs for g in per_prompt} == {"stop", "length"}


def test_response_is_cut_after_its_first_eos(model):
    greedy = SamplingParams(temperature=0, max_tokens=8)
    free_running = [argmax_decode(model, p, 8, stop_ids=set()) for p in PROMPTS]
    eos = free_running[0][1]  # the first prompt's second greedy token becomes the eos token
    assert eos != free_running[0][0]

    outputs = HFEngine(model, eos_token_id=eos, pad_token_id=PAD).generate(PROMPTS, greedy)

    for gen, expected in zip((per_prompt[0] for per_prompt in outputs), free_running, strict=True):
        if eos in expected:
            assert gen.token_ids == expected[: expected.index(eos) + 1]
            assert gen.finish_reason == "stop"
        else:
            assert gen.token_ids == expected
            assert gen.finish_reason == "length"
    assert outputs[0][0].token_ids == free_running[0][:2]
    assert {per_prompt[0].finish_reason for per_prompt in outputs} == {"stop", "length"}


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, -1, 1.0), (0.7, -1, 1.0), (0.7, 5, 0.9)])
def test_log_probs_match_teacher_forced_forward(model, temperature, top_k, top_p):
    params = SamplingParams(n=2, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=8, seed=1)
    outputs = HFEngine(model, EOS, PAD).generate(PROMPTS, params)
    for prompt, per_prompt in zip(PROMPTS, outputs, strict=True):
        for gen in per_prompt:
            expected = teacher_forced_log_probs(model, prompt, gen.token_ids, temperature)
            # float32, cached decoding against one full pass: the same sums (≤ 128 terms, the MLP) in
            # other shapes in both blocks, on both paths (helpers.tolerances): 2 × 2 × eps32 × √128 ×
            # max|lp| ≤ 4 ≈ 2e-5 (measured: 4.8e-7, 2 ulps of 4)
            atol = reordered_sums(expected, terms=128, stages=2)
            torch.testing.assert_close(torch.tensor(gen.log_probs), expected, rtol=0, atol=atol)


def test_greedy_is_argmax_decoding_with_temperature_one_log_probs(model):
    outputs = HFEngine(model, EOS, PAD).generate(PROMPTS, SamplingParams(n=2, temperature=0, max_tokens=8))
    for prompt, per_prompt in zip(PROMPTS, outputs, strict=True):
        expected = argmax_decode(model, prompt, 8, {EOS})
        for gen in per_prompt:
            assert gen.token_ids == expected
            reference = teacher_forced_log_probs(model, prompt, gen.token_ids, 1.0)
            atol = reordered_sums(reference, terms=128, stages=2)  # as in the test above
            torch.testing.assert_close(torch.tensor(gen.log_probs), reference, rtol=0, atol=atol)


def test_top_k_one_samples_the_greedy_tokens(model):
    engine = HFEngine(model, EOS, PAD)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    top_1 = engine.generate(PROMPTS, SamplingParams(n=3, temperature=1.3, top_k=1, max_tokens=8))
    for greedy_gens, top_1_gens in zip(token_ids(greedy), token_ids(top_1), strict=True):
        assert top_1_gens == greedy_gens * 3


def test_seed_makes_sampling_reproducible_without_touching_global_rng(model):
    engine = HFEngine(model, EOS, PAD)
    params = SamplingParams(n=3, max_tokens=8, seed=123)
    rng_state = torch.get_rng_state()
    first = token_ids(engine.generate(PROMPTS, params))
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert token_ids(engine.generate(PROMPTS, params)) == first
    other_seed = SamplingParams(n=3, max_tokens=8, seed=124)
    assert token_ids(engine.generate(PROMPTS, other_seed)) != first


def test_load_weights_serves_the_new_weights_and_version(model):
    other = tiny_llama(1)
    engine = HFEngine(model, EOS, PAD)
    params = SamplingParams(n=2, max_tokens=8, seed=7)
    assert engine.policy_version == 0

    engine.load_weights(other.state_dict(), version=3)

    assert engine.policy_version == 3
    expected = HFEngine(other, EOS, PAD).generate(PROMPTS, params)
    assert engine.generate(PROMPTS, params) == expected


def test_load_weights_takes_streamed_pairs_and_refuses_a_wrong_set_of_names(model):
    other = tiny_llama(1)
    engine = HFEngine(model, EOS, PAD)
    params = SamplingParams(n=2, max_tokens=8, seed=7)

    engine.load_weights(iter(other.state_dict().items()), version=2)  # a generator, consumed once

    assert engine.policy_version == 2
    assert engine.generate(PROMPTS, params) == HFEngine(other, EOS, PAD).generate(PROMPTS, params)
    state = other.state_dict()
    with pytest.raises(KeyError, match="'model.extra' is not a weight"):
        engine.load_weights({**state, "model.extra": torch.zeros(1)}, version=3)
    missing = next(iter(state))
    with pytest.raises(KeyError, match=f"1 of the model's weights missing, e.g. \\['{missing}'\\]"):
        engine.load_weights({k: v for k, v in state.items() if k != missing}, version=3)
    assert engine.policy_version == 2


def test_copied_model_does_not_alias_the_trainer_parameters():
    trainer_model = tiny_llama(0)
    engine = HFEngine(trainer_model, EOS, PAD)
    params = SamplingParams(temperature=0, max_tokens=8)
    before = engine.generate(PROMPTS, params)
    with torch.no_grad():
        for parameter in trainer_model.parameters():
            parameter.add_(torch.randn_like(parameter))

    assert engine.generate(PROMPTS, params) == before
    engine.load_weights(trainer_model.state_dict(), version=1)
    assert engine.generate(PROMPTS, params) == HFEngine(trainer_model, EOS, PAD).generate(PROMPTS, params)
    assert engine.generate(PROMPTS, params) != before


def test_shared_model_is_served_in_eval_mode_and_stays_trainable():
    actor = tiny_llama(0).train()
    generation_config = actor.generation_config
    engine = HFEngine(actor, EOS, PAD, copy_model=False)
    assert engine.model is actor

    outputs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    engine.load_weights(actor.state_dict(), version=5)

    assert engine.policy_version == 5
    assert actor.training and actor.generation_config is generation_config
    for prompt, per_prompt in zip(PROMPTS, outputs, strict=True):
        assert per_prompt[0].token_ids == argmax_decode(actor.eval(), prompt, 8, {EOS})
    actor.train()
    loss = actor(torch.tensor([PROMPTS[1]]), labels=torch.tensor([PROMPTS[1]])).loss
    loss.backward()
    assert all(p.grad is not None for p in actor.parameters())


def test_model_generation_config_defaults_are_ignored(model):
    skewed = tiny_llama(0)
    skewed.generation_config.repetition_penalty = 50.0
    skewed.generation_config.top_k = 1
    skewed.generation_config.min_new_tokens = 8
    params = SamplingParams(n=2, max_tokens=8, seed=3)
    expected = HFEngine(model, EOS, PAD).generate(PROMPTS, params)
    assert HFEngine(skewed, EOS, PAD).generate(PROMPTS, params) == expected


def test_empty_inputs(model):
    engine = HFEngine(model, EOS, PAD)
    assert engine.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="prompts must not be empty"):
        engine.generate([[1, 2], []], SamplingParams())


def test_token_log_probs_scales_by_temperature_and_computes_in_float32():
    logits = torch.randn(2, 3, 11).to(torch.bfloat16)
    tokens = torch.randint(0, 11, (2, 3))
    for temperature, scale in [(0.5, 0.5), (1.0, 1.0), (0.0, 1.0)]:
        result = token_log_probs(logits, tokens, temperature)
        expected = torch.log_softmax(logits.float() / scale, dim=-1).gather(-1, tokens[..., None])[..., 0]
        assert result.dtype == torch.float32
        # the same float32 operations on the same upcast logits: equal up to an 11-term logsumexp's
        # order, far inside assert_close's float32 default (rtol 1.3e-6, atol 1e-5)
        torch.testing.assert_close(result, expected)


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_sampling_params_reject_invalid_values(kwargs, option):
    with pytest.raises(ValueError, match=f"^sampling\\.{option}="):
        SamplingParams(**kwargs)


def test_sampling_params_store_stop_token_ids_as_a_tuple():
    params = SamplingParams(stop_token_ids=[3, 4])
    assert params.stop_token_ids == (3, 4)
    assert hash(params) == hash(SamplingParams(stop_token_ids=(3, 4)))
