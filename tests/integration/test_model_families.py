"""Model families end to end: Llama, Qwen2, Qwen3 and Mistral, each a tiny random-initialised model
written by ``create_tiny_model(arch=...)`` (Llama: the built-in character tokenizer; the others a
byte-level BPE tokenizer trained on the fly and a chat template).

For every family: the directory loads with the Auto classes and renders its chat template; 3 PPO
steps (GAE critic on the family's backbone, frozen reference with a KL loss) through the HF engine,
exported with HFExport; 3 GRPO steps through the vLLM engine; the HF and vLLM engines' log-probs after
a weight sync equal the trainer's teacher-forced ones (``lit_offpolicy.training.forward``) to 1e-4; the export
reloads in transformers (the actor's logits) and in vLLM. The 2-process FSDP2 run on Qwen3 is
tests/integration/test_distributed.py's (with its other 2-rank fits, in the same processes).

Real parts only: transformers, vLLM on CPU (one engine per family, started on the family's export and
lent to the vLLM fit), Lightning, gloo. The reward is ``HashReward`` (tests/helpers/__init__.py): an
untrained model never answers right, and a zero reward would train nothing.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vllm is imported
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import lightning as L  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import HashReward  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lit_offpolicy import OffPolicyModule, callbacks  # noqa: E402
from lit_offpolicy.cli import main  # noqa: E402
from lit_offpolicy.core.experience import Experience  # noqa: E402
from lit_offpolicy.data import PromptDataModule  # noqa: E402
from lit_offpolicy.losses import PPO  # noqa: E402
from lit_offpolicy.models import TINY_ARCHS, create_tiny_model, load_actor, load_tokenizer  # noqa: E402
from lit_offpolicy.rewards import RewardConfig  # noqa: E402
from lit_offpolicy.rollout import EngineSpec, HFEngine, SamplingParams  # noqa: E402
from lit_offpolicy.rollout.evaluation import ValidationConfig  # noqa: E402
from lit_offpolicy.rollout.vllm_engine import VLLMEngine  # noqa: E402
from lit_offpolicy.training.forward import frozen_log_probs  # noqa: E402
from lit_offpolicy.training.options import KLOptions, OptimOptions, UpdateOptions  # noqa: E402

RL_STEPS = 3
# max |log π_engine − log π_trainer| over the response tokens: float32 on both sides, vLLM's kernels or
# HF's cached decoding against the trainer's batched pass; as tests/integration/test_vllm_engine.py's
# PARITY (2 × blocks × eps32 × √K × logits ≲ 2, plus the log-softmax's rounding), for the families'
# 2 blocks and K = 384 (≈ 2e-5) and the tiny Llama's 4 and 512 (≈ 4.3e-5)
PARITY = 1e-4
# What each family's classes, attention and chat template look like, written out by hand.
CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
TIED = {"llama": False, "qwen2": True, "qwen3": True, "mistral": False}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+34="}]
RENDERED = {
    "qwen2": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n12+34=<|im_end|>\n"
    "<|im_start|>assistant\n",
    "mistral": "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]12+34=[/INST]",
}
RENDERED["qwen3"] = RENDERED["qwen2"]
# the first token of a training prompt: the character tokenizer's bos, ChatML's turn start, Mistral's bos
FIRST_PROMPT_TOKEN = {"llama": "<bos>", "qwen2": "<|im_start|>", "qwen3": "<|im_start|>", "mistral": "<s>"}


# ----------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module", params=TINY_ARCHS)
def family(request, tmp_path_factory) -> SimpleNamespace:
    """One family's tiny model directory (seed 0) and its tokenizer; prompts rendered as training
    renders them (the chat template when there is one)."""
    arch = request.param
    model_dir = create_tiny_model(tmp_path_factory.mktemp(arch) / "model", seed=0, arch=arch)
    tokenizer = load_tokenizer(model_dir)
    texts = ["12+34=", "7+8=", "99+1=", "3*(4+5)="]
    if tokenizer.chat_template:
        chats = [[{"role": "user", "content": text}] for text in texts]
        prompts = [
            tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
            for chat in chats
        ]
    else:
        prompts = tokenizer(texts).input_ids
    return SimpleNamespace(arch=arch, dir=model_dir, tokenizer=tokenizer, prompts=prompts)


def changed_actor(model_dir: Path, seed: int, scale: float = 0.05) -> torch.nn.Module:
    """The directory's model with seeded noise added to every parameter (norm weights and biases too;
    a tied embedding once): stands in for an actor after some training."""
    model = load_actor(model_dir).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for parameter in model.parameters():
        parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return model


def teacher_forced(model, family, outputs, temperature: float) -> tuple[torch.Tensor, Experience]:
    """The trainer's log-probs of the engine's samples (one padded batch, as π_old is recomputed)."""
    scores = [0.0] * sum(len(group) for group in outputs)
    exp = Experience.from_generations(
        family.prompts,
        outputs,
        scores,
        family.tokenizer.pad_token_id,
        policy_version=0,
        temperature=temperature,
    )
    return frozen_log_probs(model, exp, temperature, micro_batches=64), exp


def max_gap(exp: Experience, log_probs: torch.Tensor) -> float:
    """max |rollout log-prob − log_probs| over the response tokens."""
    mask = exp.response_mask.bool()
    assert mask.sum() > 20
    return (exp.rollout_log_probs - log_probs)[mask].abs().max().item()


def rollout(engine: str | EngineSpec) -> callbacks.Rollout:
    return callbacks.Rollout(
        engine=engine,
        sampling=SamplingParams(n=4, max_tokens=5, seed=0),
        reward=RewardConfig(fn=HashReward(), timeout=None),
        validation=ValidationConfig(every_n_steps=0),
        log_samples_every_n_steps=0,
    )


def fit(module: OffPolicyModule, model_dir: Path, extra_callbacks: list) -> L.Trainer:
    """``RL_STEPS`` steps on the addition task's prompts (through the chat template where there is one)."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=RL_STEPS,
        logger=False,
        callbacks=extra_callbacks,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = PromptDataModule(tokenizer_path=str(model_dir), batch_size=4, num_val_samples=8)
    trainer.fit(module, datamodule=data)
    return trainer


class RecordSteps(L.Callback):
    """After the rollout callback: each step's experience and the actor's teacher-forced log-probs of
    its samples, before the step updates the actor."""

    def __init__(self) -> None:
        self.steps: list[tuple[Experience, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        exp = copy.deepcopy(batch["experience"])
        self.steps.append((exp, frozen_log_probs(pl_module.actor, exp, exp.temperature, 64)))


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def hf_run(family, tmp_path_factory) -> SimpleNamespace:
    """3 PPO steps with a GAE critic (a value head on the family's backbone) and a KL loss against the
    frozen reference, HF engine, exported by HFExport at the end."""
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(
        model_path=str(family.dir),
        critic_path=str(family.dir),
        policy_loss=PPO(),
        advantage="gae",
        kl=KLOptions(use_loss=True, loss_coef=0.1),
        update=UpdateOptions(mini_batch_size=None),
        optim=OptimOptions(lr=1e-3),
    )
    before = {name: state(getattr(module, name)) for name in ("actor", "critic", "reference")}
    export_dir = tmp_path_factory.mktemp(f"{family.arch}-export") / "actor"
    recorder = RecordSteps()
    trainer = fit(module, family.dir, [rollout("hf"), recorder, callbacks.HFExport(str(export_dir))])
    return SimpleNamespace(
        module=module, trainer=trainer, before=before, steps=recorder.steps, export=export_dir
    )


@pytest.fixture(scope="module")
def engine(family, hf_run):
    """The family's vLLM engine, started on the HF run's export; its first greedy answers are kept for
    the export check, then the parity tests and the vLLM fit use it."""
    engine = VLLMEngine(hf_run.export)
    first_greedy = engine.generate(family.prompts, SamplingParams(temperature=0, max_tokens=8))
    yield SimpleNamespace(engine=engine, first_greedy=first_greedy)
    engine.close()


class LentEngine:
    """The module's vLLM engine lent to one fit: everything goes to it but ``close``, which the
    fixture does after the family's last test."""

    def __init__(self, engine: VLLMEngine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def close(self) -> None:
        """Left to the ``engine`` fixture."""


class SharedVLLMEngineSpec(EngineSpec):
    """Builds nothing: hands out the running engine with the actor's weights, as ``VLLMEngineSpec``
    hands out a new one (starting vLLM costs more than the rest of a family's tests)."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine

    def build(self, context):
        self.engine.load_weights(context.weights(), context.policy_version)
        return LentEngine(self.engine)


# ----------------------------------------------------------------------------- the directory


def test_tiny_model_loads_with_the_auto_classes(family):
    model = AutoModelForCausalLM.from_pretrained(family.dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(family.dir, local_files_only=True)
    assert type(model).__name__ == CLASSES[family.arch]
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.tie_word_embeddings == TIED[family.arch]
    assert model.config.eos_token_id == tokenizer.eos_token_id is not None
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    names = {name for name, _ in model.named_parameters()}
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (family.arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (family.arch == "qwen3")
    text = "12+34=46 The answer is \\boxed{46}.\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    if family.arch != "llama":  # byte-level BPE: merges, digits one per token, any text round-trips
        assert len(tokenizer) % 64 == 0 and len(tokenizer) > 256
        assert len(ids) < len(text)
        assert tokenizer.convert_ids_to_tokens(tokenizer("2024", add_special_tokens=False).input_ids) == list(
            "2024"
        )
        assert tokenizer.decode(tokenizer("naïve café", add_special_tokens=False).input_ids) == "naïve café"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))


@pytest.mark.parametrize("arch", [a for a in TINY_ARCHS if a != "llama"])
def test_chat_template_renders_with_the_generation_prompt(arch, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(create_tiny_model(tmp_path, arch=arch), local_files_only=True)
    assert tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == RENDERED[arch]
    answered = [*CHAT, {"role": "assistant", "content": "46"}]
    ending = {"mistral": "[/INST]46</s>"}.get(arch, "<|im_start|>assistant\n46<|im_end|>\n")
    assert tokenizer.apply_chat_template(answered, tokenize=False).endswith(ending)
    # the template's special tokens are single tokens, as the engines' stop and the data module need
    ids = tokenizer.apply_chat_template(answered, tokenize=True, return_dict=True)["input_ids"]
    assert tokenizer.eos_token_id in ids


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_same_seed_same_model_and_tokenizer(arch, tmp_path):
    first, again = create_tiny_model(tmp_path / "a", arch=arch), create_tiny_model(tmp_path / "b", arch=arch)
    other = create_tiny_model(tmp_path / "c", seed=1, arch=arch)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (again / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_cli_writes_each_family_and_names_the_choices_of_a_bad_one(tmp_path, capsys):
    main(["create-tiny-model", str(tmp_path / "m"), "--arch", "qwen3"])
    assert type(load_actor(tmp_path / "m")).__name__ == "Qwen3ForCausalLM"
    main(["create-tiny-model", str(tmp_path / "m"), "--overwrite"])  # llama over it: no stale template
    assert type(load_actor(tmp_path / "m")).__name__ == "LlamaForCausalLM"
    assert load_tokenizer(tmp_path / "m").chat_template is None
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["create-tiny-model", str(tmp_path / "n"), "--arch", "gpt2"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("lit-offpolicy: error: create-tiny-model: argument --arch")
    assert all(f"'{arch}'" in error for arch in TINY_ARCHS)
    with pytest.raises(ValueError, match="arch='gpt2'.*llama, qwen2, qwen3, mistral"):
        create_tiny_model(tmp_path / "n", arch="gpt2")


def test_a_tokenizer_without_a_pad_token_pads_with_its_eos(tmp_path):
    """As Llama 3's and Mistral's own tokenizers: the HF engine then left-pads prompts of different
    lengths with eos, and its log-probs are still the trainer's."""
    model_dir = create_tiny_model(tmp_path, arch="mistral")
    tokenizer = load_tokenizer(model_dir)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(model_dir)
    assert AutoTokenizer.from_pretrained(model_dir, local_files_only=True).pad_token is None
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None
    prompts = tokenizer(["12+34=", "7+8=", "3*(4+5)=1"]).input_ids
    model = load_actor(model_dir).eval()
    engine = HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, copy_model=False)
    outputs = engine.generate(prompts, SamplingParams(n=2, max_tokens=8, seed=0))
    expected, exp = teacher_forced(model, SimpleNamespace(prompts=prompts, tokenizer=tokenizer), outputs, 1.0)
    assert max_gap(exp, expected) <= PARITY


# ----------------------------------------------------------------------------- training


@pytest.mark.slow
def test_ppo_with_critic_and_reference_trains_through_the_hf_engine(family, hf_run):
    module, before = hf_run.module, hf_run.before
    assert hf_run.trainer.global_step == RL_STEPS and module.policy_version == RL_STEPS
    first_token = family.tokenizer.convert_tokens_to_ids(FIRST_PROMPT_TOKEN[family.arch])
    for step, (exp, actor_log_probs) in enumerate(hf_run.steps):
        assert exp.policy_versions.eq(step).all()
        first = exp.prompt_ids.gather(1, exp.prompt_mask.argmax(dim=1, keepdim=True))
        assert first.eq(first_token).all()  # prompts rendered as the family's tokenizer renders them
        assert max_gap(exp, actor_log_probs) <= PARITY  # the actor samples: π_rollout = π_θ
    for name in ("actor", "critic"):
        after = module.state_dict()
        moved = max(
            (after[f"{name}.{key}"] - value).abs().max().item() for key, value in before[name].items()
        )
        assert moved > 1e-4, name
    assert all(torch.equal(module.reference.state_dict()[k], v) for k, v in before["reference"].items())
    metrics = hf_run.trainer.callback_metrics
    assert metrics["actor/kl_loss"] > 0  # the actor left the reference
    assert torch.isfinite(metrics["critic/vf_loss"]) and torch.isfinite(metrics["critic/values_mean"])


@pytest.mark.slow
def test_grpo_trains_through_the_vllm_engine_with_synced_weights(family, engine):
    """Every step samples with the weights the trainer holds (π_rollout = the actor's recompute to
    1e-4 after each sync), and the actor moves."""
    L.seed_everything(0, verbose=False)
    module = OffPolicyModule(model_path=str(family.dir), advantage="grpo", optim=OptimOptions(lr=1e-3))
    initial = load_actor(family.dir).eval()
    recorder = RecordSteps()
    fit(module, family.dir, [rollout(SharedVLLMEngineSpec(engine.engine)), recorder])
    assert module.policy_version == RL_STEPS and len(recorder.steps) == RL_STEPS
    for step, (exp, actor_log_probs) in enumerate(recorder.steps):
        assert exp.policy_versions.eq(step).all()
        assert max_gap(exp, actor_log_probs) <= PARITY, step
    last, _ = recorder.steps[-1]
    assert max_gap(last, frozen_log_probs(initial, last, last.temperature, 64)) > 1e-3  # trained weights


# ----------------------------------------------------------------------------- log-prob parity


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_log_probs_match_the_trainer_after_a_weight_sync(family, engine, temperature):
    model = changed_actor(family.dir, seed=1)
    engine.engine.load_weights(model.state_dict(), version=11)
    outputs = engine.engine.generate(
        family.prompts, SamplingParams(n=4, temperature=temperature, max_tokens=16, seed=5)
    )
    expected, exp = teacher_forced(model, family, outputs, temperature)
    assert max_gap(exp, expected) <= PARITY
    stale, _ = teacher_forced(load_actor(family.dir).eval(), family, outputs, temperature)
    assert max_gap(exp, stale) > 1e-2  # the synced weights are the ones served


@pytest.mark.slow
def test_hf_engine_log_probs_match_the_trainer_after_a_weight_sync(family):
    model = changed_actor(family.dir, seed=2)
    hf_engine = HFEngine(load_actor(family.dir), family.tokenizer.eos_token_id, family.tokenizer.pad_token_id)
    hf_engine.load_weights(model.state_dict(), version=1)
    outputs = hf_engine.generate(family.prompts, SamplingParams(n=4, temperature=0.7, max_tokens=16, seed=5))
    expected, exp = teacher_forced(model, family, outputs, 0.7)
    assert max_gap(exp, expected) <= PARITY
    stale, _ = teacher_forced(load_actor(family.dir).eval(), family, outputs, 0.7)
    assert max_gap(exp, stale) > 1e-2


# ----------------------------------------------------------------------------- export


@pytest.mark.slow
def test_export_reloads_in_transformers_with_the_actors_logits(family, hf_run):
    reloaded = AutoModelForCausalLM.from_pretrained(hf_run.export, local_files_only=True).eval()
    assert AutoTokenizer.from_pretrained(hf_run.export).chat_template == family.tokenizer.chat_template
    actor = hf_run.module.actor.eval()
    batch = family.tokenizer.pad(
        {"input_ids": family.prompts}, padding=True, padding_side="left", return_tensors="pt"
    )
    with torch.no_grad():
        logits, expected = reloaded(**batch).logits, actor(**batch).logits
        initial = load_actor(family.dir).eval()(**batch).logits
    # the actor's own float32 weights, reloaded by transformers' class: the same operations on the same
    # inputs, equal to the bit; 1e-6 (≈ 10 ulps of logits ≤ 2) absorbs last bits only
    assert (logits - expected).abs().max().item() <= 1e-6
    assert (logits - initial).abs().max().item() > 1e-3  # the trained weights were exported


@pytest.mark.slow
def test_export_reloads_in_vllm(family, hf_run, engine):
    """vLLM started on the export generated (greedy, before any sync) with the exported weights: its
    log-probs are the trainer's for the exported actor, not for the initial one."""
    outputs = engine.first_greedy
    assert all(len(group[0].token_ids) > 0 for group in outputs)
    exported = load_actor(hf_run.export).eval()
    expected, exp = teacher_forced(exported, family, outputs, 1.0)
    assert max_gap(exp, expected) <= PARITY
    initial, _ = teacher_forced(load_actor(family.dir).eval(), family, outputs, 1.0)
    assert max_gap(exp, initial) > 1e-3
