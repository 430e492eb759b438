"""Rollout throughput: VLLMEngine and HFEngine against the raw library calls, and weight sync vs an RL step.

64 prompts × n=8 × up to 32 tokens on the built-in tiny model, all in one process.

- ``rollout_vllm_engine_vs_raw``: ``VLLMEngine.generate`` against raw ``vllm.LLM.generate`` on the
  engine's own ``vllm.LLM``, so the ratio measures what the wrapper adds: building per-prompt requests
  and converting the outputs to ``Generation`` lists with per-token log-probs. The raw baseline asks
  vLLM for the same work (sampled-token log-probs, no detokenization).
- ``rollout_hf_engine_vs_raw``: ``HFEngine.generate`` against a hand-written ``model.generate`` call
  with the same sampling, per-step logits and log-softmax of the sampled tokens.
- ``vllm_weight_sync``: ``VLLMEngine.load_weights`` (ours) against the RL step it is part of
  (baseline), both measured in one ``Trainer.fit`` with ``Rollout(engine="vllm")`` on the demo's batch
  (128 prompts × 4 samples, ≤ 5 tokens, GRPO); ratio = step / sync, ``fraction`` = sync / step.

Each figure is the median over ``--repeats`` runs after a warm-up run; ours and the baseline
alternate so drift on a shared machine hits both alike. Tokens are the generated tokens that came back
(stop tokens included).

    python -m benchmarks.engines.rollout_vllm [--repeats 5]
"""

from __future__ import annotations

import gc
import os
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from benchmarks.common import alternate, entry, generated_tokens, machine, median, timed
from benchmarks.results import repeats_main
from lit_offpolicy.models import create_tiny_model, load_actor, load_tokenizer  # noqa: E402
from lit_offpolicy.rollout import HFEngine, SamplingParams  # noqa: E402
from lit_offpolicy.rollout.vllm_engine import VLLMEngine  # noqa: E402

NUM_PROMPTS, N, MAX_TOKENS = 64, 8, 32


def arithmetic_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, 100, (count, 2), generator=generator).tolist()
    return tokenizer([f"{a}+{b}=" for a, b in pairs]).input_ids


def tokens_per_second(fn) -> float:
    seconds, tokens = timed(fn)
    return tokens / seconds


def median_rates(ours, baseline, repeats: int) -> tuple[float, float]:
    """Median tokens/s of ``ours`` and ``baseline`` (each returns the tokens it generated) over ``repeats``
    alternating runs after one warm-up."""
    rates = alternate(
        {"ours": lambda: tokens_per_second(ours), "baseline": lambda: tokens_per_second(baseline)}, repeats
    )
    return median(rates["ours"]), median(rates["baseline"])


def raw_hf_generate(model, prompts: list[list[int]], eos: int, pad: int) -> int:
    """What a user writes without the engine: left-pad, ``generate`` with logits, log-softmax, cut at eos."""
    rows = [p for p in prompts for _ in range(N)]
    width = max(len(p) for p in rows)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
    attention_mask = (
        torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in rows])[:, None]
    ).long()
    torch.manual_seed(0)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=MAX_TOKENS,
            eos_token_id=eos,
            pad_token_id=pad,
            return_dict_in_generate=True,
            output_logits=True,
        )
        responses = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float()
        torch.log_softmax(logits, -1).gather(-1, responses.unsqueeze(-1))  # the log-probs the engine returns
    before_stop = (responses == eos).long().cumsum(-1) - (responses == eos).long() == 0
    return int(before_stop.sum())


def vllm_engine_vs_raw(model_dir: str, prompts, params, repeats: int) -> tuple[float, float, float]:
    """Median tokens/s of VLLMEngine and of raw ``vllm.LLM.generate`` on its LLM; engine start-up seconds."""
    import vllm
    from vllm.inputs import TokensPrompt

    construction_seconds, engine = timed(lambda: VLLMEngine(model_dir))
    raw_inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    raw_params = vllm.SamplingParams(
        n=N, temperature=1.0, max_tokens=MAX_TOKENS, seed=0, logprobs=0, detokenize=False
    )

    def ours() -> int:
        return generated_tokens(engine.generate(prompts, params))

    def raw() -> int:
        outputs = engine.llm.generate(raw_inputs, raw_params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    # the warm-up run compiles vLLM's log-prob kernel
    return (*median_rates(ours, raw, repeats), construction_seconds)


def weight_sync_vs_step(model_dir: str, repeats: int, root: str) -> tuple[list[float], list[float]]:
    """(sync seconds, RL step seconds) of ``repeats`` steps after a warm-up, from one ``Trainer.fit``."""
    from benchmarks.common import StepTimer, quiet_trainer
    from lit_offpolicy import OffPolicyModule
    from lit_offpolicy.callbacks import Rollout
    from lit_offpolicy.data import PromptDataModule
    from lit_offpolicy.rollout.evaluation import ValidationConfig
    from lit_offpolicy.training.options import OptimOptions

    module = OffPolicyModule(model_dir, policy_loss="ppo", advantage="grpo", optim=OptimOptions(lr=1e-4))
    data = PromptDataModule(task="addition", tokenizer_path=model_dir, batch_size=128, seed=0)
    rollout = Rollout(
        engine="vllm",
        sampling=SamplingParams(n=4, max_tokens=5, seed=0),
        validation=ValidationConfig(every_n_steps=0),
    )
    syncs: list[float] = []
    timer = StepTimer(after_step=lambda: syncs.append(rollout.worker.engine.last_sync_seconds))
    quiet_trainer(1 + repeats, [rollout, timer], root).fit(module, datamodule=data)  # teardown closes the LLM
    return syncs[1:], timer.seconds[1:]


def main(repeats: int = 5) -> list[dict]:
    import vllm

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(create_tiny_model(os.path.join(tmp, "tiny")))
        tokenizer = load_tokenizer(model_dir)
        prompts = arithmetic_prompts(tokenizer, NUM_PROMPTS)
        params = SamplingParams(n=N, temperature=1.0, max_tokens=MAX_TOKENS, seed=0)

        print("[rollout_vllm] VLLMEngine vs vllm.LLM.generate", flush=True)
        vllm_ours, vllm_raw, construction_seconds = vllm_engine_vs_raw(model_dir, prompts, params, repeats)
        gc.collect()

        print("[rollout_vllm] HFEngine vs model.generate", flush=True)
        actor = load_actor(model_dir)
        hf_engine = HFEngine(actor, tokenizer.eos_token_id, tokenizer.pad_token_id, copy_model=False)

        def hf() -> int:
            return generated_tokens(hf_engine.generate(prompts, params))

        def hf_raw() -> int:
            return raw_hf_generate(actor.eval(), prompts, tokenizer.eos_token_id, tokenizer.pad_token_id)

        hf_ours, hf_baseline = median_rates(hf, hf_raw, repeats)

        print("[rollout_vllm] weight sync within RL steps (Rollout(engine='vllm'))", flush=True)
        syncs, steps = weight_sync_vs_step(model_dir, repeats, tmp)

    workload = f"{NUM_PROMPTS} prompts x n={N} x <={MAX_TOKENS} tokens, temperature 1, log-probs, tiny Llama"
    where = f"{machine()}, vllm {vllm.__version__}"
    return [
        entry(
            "rollout_vllm_engine_vs_raw",
            "tokens/s",
            vllm_ours,
            vllm_raw,
            repeats,
            machine=where,
            target=0.95,
            workload=workload,
            engine_construction_s=round(construction_seconds, 2),
        ),
        entry(
            "rollout_hf_engine_vs_raw",
            "tokens/s",
            hf_ours,
            hf_baseline,
            repeats,
            machine=where,
            target=0.95,
            workload=workload,
            hf_engine_vs_vllm_engine=round(hf_ours / vllm_ours, 3),
        ),
        entry(
            "vllm_weight_sync",
            "s",
            median(syncs),
            median(steps),
            repeats,
            machine=where,
            fraction=round(median(syncs) / median(steps), 4),
            workload="GRPO step of 128 prompts x 4 samples, <=5 tokens, Rollout(engine='vllm'), tiny Llama",
            what="ours: VLLMEngine.load_weights (reload_weights + reset_prefix_cache); baseline: one RL step",
        ),
    ]


if __name__ == "__main__":
    repeats_main(main, __doc__)
