"""Rollout throughput: VLLMEngine.generate against raw vllm.LLM.generate, plus weight sync and the HF engine.

64 prompts × n=8 × up to 32 tokens on the built-in tiny model, all in one process and on one
``vllm.LLM`` (the engine's own), so the ratio measures what the wrapper adds: building per-prompt
requests and converting the outputs to ``Generation`` lists with per-token log-probs. The raw
baseline asks vLLM for the same work (sampled-token log-probs, no detokenisation). Each figure is
the median over ``--repeats`` runs after a warm-up run; ours and the baseline alternate so drift on a
shared machine hits both alike. Tokens are the generated tokens that came back (eos stops included).

    python -m benchmarks.rollout_vllm [--repeats 5]

Prints one JSON object per line; the first is the headline entry.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from benchmarks.results import record
from lit_offpolicy.models import create_tiny_model, load_actor, load_tokenizer  # noqa: E402
from lit_offpolicy.rollout import HFEngine, SamplingParams  # noqa: E402
from lit_offpolicy.rollout.vllm_engine import VLLMEngine  # noqa: E402

NUM_PROMPTS, N, MAX_TOKENS = 64, 8, 32


def arithmetic_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    pairs = torch.randint(0, 100, (count, 2), generator=generator).tolist()
    return tokenizer([f"{a}+{b}=" for a, b in pairs]).input_ids


def timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def machine() -> str:
    import vllm

    return (
        f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), vllm {vllm.__version__}, "
        f"tiny Llama float32"
    ).replace("  ", " ")


def main(repeats: int = 5) -> list[dict]:
    import vllm
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_tiny_model(os.path.join(tmp, "tiny"))
        tokenizer = load_tokenizer(model_dir)
        prompts = arithmetic_prompts(tokenizer, NUM_PROMPTS)
        params = SamplingParams(n=N, temperature=1.0, max_tokens=MAX_TOKENS, seed=0)

        load_seconds, engine = timed(lambda: VLLMEngine(model_dir))
        raw_inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        raw_params = vllm.SamplingParams(
            n=N, temperature=1.0, max_tokens=MAX_TOKENS, seed=0, logprobs=0, detokenize=False
        )

        def ours() -> int:
            return sum(len(g.token_ids) for group in engine.generate(prompts, params) for g in group)

        def raw() -> int:
            outputs = engine.llm.generate(raw_inputs, raw_params, use_tqdm=False)
            return sum(len(c.token_ids) for o in outputs for c in o.outputs)

        ours(), raw()  # warm-up: vLLM compiles its log-prob rank kernel on the first request
        ours_rates, raw_rates = [], []
        for _ in range(repeats):
            seconds, tokens = timed(ours)
            ours_rates.append(tokens / seconds)
            seconds, tokens = timed(raw)
            raw_rates.append(tokens / seconds)

        actor = load_actor(model_dir)
        generator = torch.Generator().manual_seed(1)
        state = {
            k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in actor.state_dict().items()
        }
        sync_times = []
        for version in range(1, repeats + 2):
            engine.load_weights(state, version)
            sync_times.append(engine.last_sync_seconds)
        sync_times = sync_times[1:]  # the first reload also warms up

        hf_engine = HFEngine(actor, tokenizer.eos_token_id, tokenizer.pad_token_id, copy_model=False)

        def hf() -> int:
            return sum(len(g.token_ids) for group in hf_engine.generate(prompts, params) for g in group)

        hf()
        hf_rates = []
        for _ in range(repeats):
            seconds, tokens = timed(hf)
            hf_rates.append(tokens / seconds)

    ours_median, raw_median = statistics.median(ours_rates), statistics.median(raw_rates)
    where = machine()
    workload = f"{NUM_PROMPTS} prompts x n={N} x <={MAX_TOKENS} tokens, temperature 1, log-probs"
    return [
        {
            "name": "rollout_vllm_engine_vs_raw",
            "unit": "tokens/s",
            "ours": round(ours_median, 1),
            "baseline": round(raw_median, 1),
            "ratio": round(ours_median / raw_median, 3),
            "repeats": repeats,
            "machine": where,
            "workload": workload,
        },
        {
            "name": "rollout_hf_engine",
            "unit": "tokens/s",
            "value": round(statistics.median(hf_rates), 1),
            "vs_vllm_engine": round(statistics.median(hf_rates) / ours_median, 3),
            "repeats": repeats,
            "machine": where,
            "workload": workload,
        },
        {
            "name": "vllm_weight_sync",
            "unit": "s",
            "value": round(statistics.median(sync_times), 4),
            "repeats": repeats,
            "machine": where,
            "what": "VLLMEngine.load_weights: reload_weights collective_rpc + reset_prefix_cache",
        },
        {"name": "vllm_engine_construction", "unit": "s", "value": round(load_seconds, 2), "machine": where},
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    record(main(parser.parse_args().repeats))
