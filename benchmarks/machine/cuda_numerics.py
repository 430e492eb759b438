"""The CUDA paths no CPU test reaches, against float64: the chunked LM head's own backward and AdamW's
fused kernel as ``optimizer_and_schedule`` builds it.

1. ``chunked_head.head_statistics`` on CUDA in float64 against autograd through the whole logits on the
   CPU in float64, values and the gradients of hidden states, weight and bias: both are exact up to
   float64 rounding, so they agree to 1e-10 (sums of at most V = 151,936 terms of size ≤ 1e2:
   V · 2⁻⁵³ · 1e2 ≈ 2e-9 worst case, ~1e-12 typical); then the same inputs in float32 and bfloat16
   weights, whose error against float64 is printed, not asserted (it is the dtype's).
2. AdamW as the module builds it (fused on CUDA) for 20 steps of the same gradients, float64 on CUDA
   against the per-parameter loop in float64 on the CPU: agree to 1e-12 relative; float32 and
   bfloat16 parameters' distance from the float64 trajectory is printed.

Run: ``python -m benchmarks.machine.cuda_numerics`` on a CUDA machine (exits 1 if a float64 check fails).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

from lit_offpolicy.training import chunked_head
from lit_offpolicy.training.optim import optimizer_and_schedule
from lit_offpolicy.training.options import OptimOptions

F64 = torch.float64
DEVICE = os.environ.get("CUDA_NUMERICS_DEVICE", "cuda")  # "cpu": a dry run of this script
N, H, V, CHUNK = 300, 128, 151_936, 256


def head_inputs(device: str, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    head = nn.Linear(H, V, bias=True, dtype=F64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=generator, dtype=F64) / H**0.5)
        head.bias.copy_(torch.randn(V, generator=generator, dtype=F64))
    hidden = torch.randn(N, H, generator=generator, dtype=F64)
    tokens = torch.randint(0, V, (N,), generator=generator)
    upstream = torch.randn(N, 2, generator=generator, dtype=F64)
    head = head.to(device=device, dtype=dtype)
    hidden = hidden.to(device=device, dtype=dtype).requires_grad_(True)
    return head, hidden, tokens.to(device), upstream.to(device)


def whole_logits(head, hidden, tokens, scale):
    log_softmax = torch.log_softmax(head(hidden).double() / scale, dim=-1)
    log_probs = log_softmax.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return torch.stack((log_probs, entropy), dim=-1)


def chunked(head, hidden, tokens, scale):
    return chunked_head.head_statistics(head, hidden, tokens, scale, CHUNK, True)


def values_and_gradients(statistics, head, hidden, tokens, upstream):
    out = statistics(head, hidden, tokens, 0.7)
    (out.double() * upstream.double()).sum().backward()
    grads = [hidden.grad, head.weight.grad, head.bias.grad]
    return [t.detach().double().cpu() for t in [out, *grads]]


def max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    return [float((g - w).abs().max()) for g, w in zip(got, want, strict=True)]


def check_head() -> dict:
    head, hidden, tokens, upstream = head_inputs("cpu", F64)
    reference = values_and_gradients(whole_logits, head, hidden, tokens, upstream)
    result = {}
    for dtype in (F64, torch.float32, torch.bfloat16):
        got = values_and_gradients(chunked, *head_inputs(DEVICE, dtype))
        errors = max_error(got, reference)
        result[str(dtype)] = dict(zip(["values", "d_hidden", "d_weight", "d_bias"], errors, strict=True))
    result["float64_ok"] = max(result[str(F64)].values()) < 1e-10
    return result


def adamw_trajectory(device: str, dtype: torch.dtype, reference: bool, steps: int = 20):
    generator = torch.Generator().manual_seed(1)
    model = nn.Linear(64, 64, dtype=F64)
    with torch.no_grad():
        model.weight.copy_(torch.randn(64, 64, generator=generator, dtype=F64))
        model.bias.copy_(torch.randn(64, generator=generator, dtype=F64))
    gradients = [
        [torch.randn(64, 64, generator=generator, dtype=F64), torch.randn(64, generator=generator, dtype=F64)]
        for _ in range(steps)
    ]
    model = model.to(device=device, dtype=dtype)
    if reference:  # the per-parameter loop, with the hyper-parameters the module's AdamW gets
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False, fused=False
        )
    else:
        options = OptimOptions(lr=1e-2, weight_decay=0.1)
        optimizer = optimizer_and_schedule(model, None, options, total_steps=steps)["optimizer"]
    fused = bool(optimizer.defaults.get("fused"))
    for step_gradients in gradients:
        for parameter, gradient in zip(model.parameters(), step_gradients, strict=True):
            parameter.grad = gradient.to(device=device, dtype=dtype)
        optimizer.step()
    return torch.cat([p.detach().double().cpu().flatten() for p in model.parameters()]), fused


def check_adamw() -> dict:
    reference, _ = adamw_trajectory("cpu", F64, reference=True)
    result = {}
    for dtype in (F64, torch.float32, torch.bfloat16):
        got, fused = adamw_trajectory(DEVICE, dtype, reference=False)
        relative = float(((got - reference).abs() / reference.abs().clamp_min(1e-3)).max())
        result[str(dtype)] = {"fused": fused, "max_relative_error": relative}
    result["float64_ok"] = result[str(F64)]["fused"] and result[str(F64)]["max_relative_error"] < 1e-12
    return result


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    report = {"device": name, "torch": torch.__version__}
    report["chunked_head"] = check_head()
    report["adamw"] = check_adamw()
    print(json.dumps(report, indent=2))
    if out := os.environ.get("OUT"):
        with open(os.path.join(out, "cuda_numerics.json"), "w") as file:
            json.dump(report, file, indent=2)
    return 0 if report["chunked_head"]["float64_ok"] and report["adamw"]["float64_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
