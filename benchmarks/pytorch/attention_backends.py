"""What turning cuDNN's attention off costs the update (``lit_offpolicy.core.attention``), on one GPU.

The update's gradient forwards run with cuDNN's ``scaled_dot_product_attention`` off because its
backward returns NaN at some sequence lengths (pytorch/pytorch#196678). This times one forward and
backward of Qwen2.5-1.5B's shape in bfloat16 (random weights) on 8 left-padded sequences of
64 + 448 tokens (512: a length where cuDNN's backward is right, so both sides compute the same thing)
with cuDNN allowed (torch's default dispatch) and with it off (``without_cudnn_attention``), in one
process, alternating, the median of ``--repeats`` after one warm-up each. The entry's ratio is
cuDNN's seconds over ours: below 1 is what the workaround costs.

    python -m benchmarks.pytorch.attention_backends [--repeats 5]      # needs CUDA
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile

import torch

from benchmarks.common import alternate, entry, median, timed, within
from benchmarks.peers.memory_vs_trl import fixed_batch
from benchmarks.results import record
from benchmarks.shapes import build_model
from lit_offpolicy.core.attention import without_cudnn_attention

SHAPE, BATCH, PROMPT, RESPONSE = "qwen2.5-1.5b", 8, 64, 448


def forward_backward(model, ids, mask, response_ids, response_mask) -> float:
    """Seconds of one masked forward and backward, the mean response log-prob as the loss."""

    def step() -> None:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=RESPONSE + 1
        ).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, response_ids[..., None])[..., 0]
        loss = -(logprobs * response_mask).sum() / response_mask.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)

    return timed(step, torch.cuda.synchronize)[0]


def main(repeats: int = 5) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("attention_backends needs a CUDA device")
    from transformers import AutoModelForCausalLM

    path = tempfile.mkdtemp(prefix="attention_backends_") + "/model"
    build_model(path, SHAPE)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda()
    data = fixed_batch(BATCH, PROMPT, RESPONSE, model.config.vocab_size)
    ids = torch.cat([data["prompt_ids"], data["response_ids"]], 1).cuda()
    mask = torch.cat([data["prompt_mask"], data["response_mask"]], 1).cuda()
    response_ids, response_mask = data["response_ids"].cuda(), data["response_mask"].cuda().float()

    def step() -> float:
        return forward_backward(model, ids, mask, response_ids, response_mask)

    sides = {"cudnn_allowed": contextlib.nullcontext, "cudnn_off": without_cudnn_attention}
    seconds = alternate({name: within(context, step) for name, context in sides.items()}, repeats)
    off, allowed = median(seconds["cudnn_off"]), median(seconds["cudnn_allowed"])
    entries = [
        entry(
            "cudnn_attention_off_cost_qwen25_1p5b_cuda",
            "s",
            off,
            allowed,
            repeats,
            baseline_is="the same forward+backward with cuDNN's attention allowed (torch's default)",
            workload=f"{SHAPE} bf16, {BATCH} x ({PROMPT} + {RESPONSE}) tokens, left-padded",
            seconds={name: [round(s, 4) for s in values] for name, values in seconds.items()},
        )
    ]
    record(entries)
    return entries


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    main(parser.parse_args().repeats)
