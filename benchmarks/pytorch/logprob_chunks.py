"""Memory and time of one actor update with the LM head in chunks (``logprob_chunk_size``) or not.

A Llama with a real vocabulary and a small body (hidden 256, 2 layers, random weights), a batch of
B = 4 samples with 64-token prompts and R = 256-token responses: the update is the forward of
``policy_log_probs`` (with the entropy), a loss and its backward, where the (B, R, V) logits of the
plain path are the largest tensors. Each variant runs in a fresh child process (one warm-up update,
then ``--steps`` timed ones) that reports its peak RSS (``VmHWM``, see benchmarks.pytorch.memory), its RSS
before the first update, and the median time of an update.

    python -m benchmarks.pytorch.logprob_chunks [--vocab 151936 32000] [--chunks none 1024 4096] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks.common import median, status_mib, timed

BATCH, PROMPT_LEN, RESPONSE_LEN = 4, 64, 256


def child(vocab: int, chunk_size: int | None, steps: int) -> dict:
    """Build the model and batch, run 1 + ``steps`` updates; report RSS (MiB) and seconds per update."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lit_offpolicy.core.experience import Experience
    from lit_offpolicy.core.generation import Generation
    from lit_offpolicy.training.forward import policy_log_probs

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=PROMPT_LEN + RESPONSE_LEN,
    )
    model = LlamaForCausalLM(config).train()
    prompts = [torch.randint(3, vocab, (PROMPT_LEN,)).tolist() for _ in range(BATCH)]
    groups = [[Generation(torch.randint(3, vocab, (RESPONSE_LEN,)).tolist(), [0.0] * RESPONSE_LEN, "length")]]
    scores = [0.0] * BATCH
    exp = Experience.from_generations(prompts, groups * BATCH, scores, pad_token_id=0, policy_version=0)
    before = status_mib("VmRSS")

    def update() -> None:
        log_probs, entropy = policy_log_probs(model, exp, 0.7, with_entropy=True, chunk_size=chunk_size)
        loss = -(log_probs * exp.response_mask).mean() - 0.01 * (entropy * exp.response_mask).mean()
        loss.backward()
        model.zero_grad(set_to_none=False)

    seconds = [timed(update)[0] for _ in range(1 + steps)]
    return {"peak_rss_mib": status_mib("VmHWM"), "rss_before_mib": before, "update_s": median(seconds[1:])}


def measure(vocab: int, chunk_size: int | None, steps: int) -> dict:
    code = (
        "import json, sys; from benchmarks.pytorch.logprob_chunks import child; "
        f"print(json.dumps(child({vocab}, {chunk_size}, {steps})))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 32000])
    parser.add_argument("--chunks", nargs="+", default=["none", "1024", "4096"])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print("vocab  chunk  peak RSS MiB  extra over model MiB  update s")
    for vocab in args.vocab:
        for chunk in args.chunks:
            chunk_size = None if chunk == "none" else int(chunk)
            row = measure(vocab, chunk_size, args.steps)
            extra = row["peak_rss_mib"] - row["rss_before_mib"]
            print(f"{vocab:6d} {chunk:>6} {row['peak_rss_mib']:12.0f} {extra:21.0f} {row['update_s']:9.3f}")


if __name__ == "__main__":
    main()
