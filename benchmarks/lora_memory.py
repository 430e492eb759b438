"""Peak memory of an RL update with full fine-tuning or LoRA (``model.init_args.lora``), on CPU.

A Llama with random weights (hidden 1024, MLP 4096, 12 layers, the 100-token character vocabulary:
201.6M parameters, float32) is written to a temporary directory; each variant builds an
``OffPolicyModule`` from it with a KL loss (full fine-tuning: a reference copy; LoRA: the actor with
its adapters disabled) and runs ``prepare`` and one AdamW step on 4 prompts × 2 samples of 16 + 64
tokens, in a fresh child process that reports its peak RSS (``VmHWM``) above the RSS after imports.

    python -m benchmarks.lora_memory [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

from benchmarks.memory import status_mib

PROMPTS, SAMPLES, PROMPT_LEN, RESPONSE_LEN = 4, 2, 16, 64


def write_model(path: str) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from lit_offpolicy.models import build_tokenizer, tiny_llama_config

    tokenizer = build_tokenizer()
    config = tiny_llama_config(
        len(tokenizer), hidden_size=1024, num_layers=12, intermediate_size=4096, max_position_embeddings=512
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def child(path: str, rank: int | None) -> dict:
    """Build the module (LoRA of ``rank`` on all linear layers, or full fine-tuning for None), run
    prepare + one update; report MiB and parameter counts."""
    import torch

    from lit_offpolicy import OffPolicyModule
    from lit_offpolicy.experience import Experience
    from lit_offpolicy.lora import LoraOptions
    from lit_offpolicy.options import KLOptions
    from lit_offpolicy.rollout import Generation

    before = status_mib("VmRSS")
    lora = None if rank is None else LoraOptions(r=rank, alpha=2.0 * rank)
    module = OffPolicyModule(model_path=path, lora=lora, kl=KLOptions(use_loss=True))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 100, (PROMPT_LEN,), generator=generator).tolist() for _ in range(PROMPTS)]
    groups = [
        [
            Generation(
                torch.randint(4, 100, (RESPONSE_LEN,), generator=generator).tolist(),
                [-1.0] * RESPONSE_LEN,
                "length",
            )
        ]
        * SAMPLES
        for _ in prompts
    ]
    exp = Experience.from_generations(prompts, groups, [0.0, 1.0] * PROMPTS, pad_token_id=0, policy_version=0)
    module.prepare(exp)
    trained = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained)
    loss, _, _ = module.micro_batch_loss(exp)
    loss.backward()
    optimizer.step()
    return {
        "peak_above_imports_mib": status_mib("VmHWM") - before,
        "parameters_m": sum(p.numel() for p in module.parameters()) / 1e6,
        "trained_m": sum(p.numel() for p in trained) / 1e6,
    }


def measure(path: str, rank: int | None) -> dict:
    code = (
        f"import json; from benchmarks.lora_memory import child; print(json.dumps(child({path!r}, {rank})))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        write_model(path)
        print("variant      parameters M  trained M  peak RSS above imports MiB")
        for name, rank in (("full", None), (f"LoRA r={args.rank}", args.rank)):
            row = measure(path, rank)
            print(
                f"{name:12} {row['parameters_m']:12.1f} {row['trained_m']:10.2f} "
                f"{row['peak_above_imports_mib']:27.0f}"
            )


if __name__ == "__main__":
    main()
