"""One rank of the sequence-parallel equivalence check (``tests/training/test_sequence_parallel.py``).

``python -m helpers.sequence_parallel_ranks RANK WORLD PORT OUT MODEL_DIR...`` (from ``tests/``): on a gloo
group of WORLD processes, for each model directory and each case, the log-probs, entropy, values and
parameter gradients of a float64 batch computed with the row split across sequence groups of 2 and of
WORLD ranks, against the same computed in this process alone on the padded (left-padded prompts) batch.
Writes ``OUT/rank{RANK}.json``: per case, the largest difference and its bound (``helpers.tolerances``).

The DDP case: WORLD ranks in sequence groups of 2 under a real ``DistributedDataParallel``, group g
training on batch g with the loss scaled by 2 (as the module does): the averaged gradient must be the
mean of the one-process gradients of the WORLD / 2 batches.

The module case: ``OffPolicyModule`` (float32, GRPO with KL and entropy terms) with the sequence groups
of 2 its ``setup`` makes, each rank with rollouts of its own: the group joins them
(``joined_experience``), ``prepare`` estimates the advantages over one rank of each group, and the
micro-batch's loss × 2, its gradient summed over the ranks and divided by WORLD (DDP's mean), must be
the mean over the groups of the gradient that one process computes on all ranks' rollouts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from helpers.experiences import experience
from helpers.tolerances import reordered_sums
from lit_offpolicy import OffPolicyModule
from lit_offpolicy.core.experience import Experience
from lit_offpolicy.models import load_actor, load_critic
from lit_offpolicy.models.lora import LoraOptions, add_lora
from lit_offpolicy.training.forward import critic_values, policy_log_probs
from lit_offpolicy.training.sequence_parallel import SequenceGroup, joined_experience, sequence_groups

TEMPERATURE = 0.7
# responses of 4, 0 (empty), 1, 6 and 2 tokens after prompts of 6, 2, 3, 1, 6 tokens, left-padded: 31
# real tokens, not a multiple of 2 or 4 (the row is padded)
RESPONSES = (4, 0, 1, 6, 2)


def _loss(log_probs, entropy, values, exp):
    """A loss that reaches every output: weighted log-probs, entropy and values at the response tokens."""
    weights = torch.linspace(-1.0, 2.0, log_probs.numel(), dtype=log_probs.dtype).reshape(log_probs.shape)
    terms = weights * log_probs + 0.3 * entropy + (0.5 * values if values is not None else 0.0)
    return (terms * exp.response_mask).sum()


def _gradients(*models) -> dict[str, torch.Tensor]:
    """Each parameter's gradient, named actor.* and critic.*."""
    return {
        f"{tag}.{name}": p.grad.detach().clone()
        for tag, model in zip(("actor", "critic"), models, strict=False)
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def _outputs(actor, critic, exp, chunk_size, sequence=None, scale=1.0):
    """log-probs, entropy, values (detached) and the parameters' gradients of ``_loss`` × ``scale``: on
    the padded batch without ``sequence``, else on this rank's share of the packed row."""
    for model in (actor, critic):
        model.zero_grad()
    log_probs, entropy = policy_log_probs(actor, exp, TEMPERATURE, True, chunk_size, False, sequence)
    values = critic_values(critic, exp, False, sequence)
    (scale * _loss(log_probs, entropy, values, exp)).backward()
    outputs = {"log_probs": log_probs.detach(), "entropy": entropy.detach(), "values": values.detach()}
    return outputs, _gradients(actor, critic)


def _worst_gradient(grads, reference, layers) -> tuple[float, float]:
    """(difference, bound) of the parameter whose gradient is furthest past its bound."""
    pairs = [
        ((grads[n] - g).abs().max().item(), reordered_sums(g, 512, 2 * layers + 2))
        for n, g in reference.items()
    ]
    return max(pairs, key=lambda pair: pair[0] / pair[1])


def _compare(report, case, reference, split, exp, layers):
    """Largest difference and bound of each output and of all gradients, into ``report[case]``."""
    mask = exp.response_mask.bool()
    (ref_out, ref_grads), (out, grads) = reference, split
    # outputs: sums of ≤ 512 terms (the MLP) grouped differently in each block's stages; gradients also
    # sum over the row's 31 tokens and the group's ranks, within the same 512-term bound
    for name in ref_out:
        bound = reordered_sums(ref_out[name][mask], terms=512, stages=2 * layers + 2)
        report[f"{case}/{name}"] = ((out[name] - ref_out[name])[mask].abs().max().item(), bound)
        report[f"{case}/{name}_padding"] = (out[name][~mask].abs().max().item(), 0.0)
    report[f"{case}/gradient_names"] = (float(set(grads) != set(ref_grads) or len(ref_grads) < 10), 0.0)
    report[f"{case}/gradients"] = _worst_gradient(grads, ref_grads, layers)


def _summed(grads, group):
    for grad in grads.values():
        dist.all_reduce(grad, group=group)
    return grads


def _models(model_dir, checkpointing, lora):
    torch.manual_seed(0)
    actor = load_actor(model_dir, torch.float64, checkpointing, "sdpa")
    if lora:
        actor = add_lora(actor, LoraOptions(r=4, alpha=8.0))
        for name, p in actor.named_parameters():
            if "lora_B" in name:  # B = 0 would give A no gradient
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
    critic = load_critic(model_dir, torch.float64, checkpointing, "sdpa")
    return actor, critic


def main(rank: int, world: int, port: str, out: str, model_dirs: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    groups = {size: sequence_groups(size) for size in sorted({2, world})}
    exp = experience(RESPONSES, width=6)
    report: dict[str, tuple[float, float]] = {}
    cases = [(d, None, False, False) for d in model_dirs]  # each family, the whole logits
    cases += [(model_dirs[0], 3, False, False), (model_dirs[0], 3, True, True)]  # chunked head; + ckpt, LoRA
    for model_dir, chunk, checkpointing, lora in cases:
        actor, critic = _models(model_dir, checkpointing, lora)
        layers = actor.config.num_hidden_layers
        reference = _outputs(actor, critic, exp, chunk)
        name = f"{Path(model_dir).parent.name}/chunk={chunk}/ckpt={checkpointing}/lora={lora}"
        for size, sequence in groups.items():
            outputs, grads = _outputs(actor, critic, exp, chunk, sequence)
            split = (outputs, _summed(grads, sequence.group))
            _compare(report, f"{name}/sp={size}", reference, split, exp, layers)
    _data_parallel(report, model_dirs[0], world, groups[2])
    _module(report, model_dirs[0], world, groups[2])
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _data_parallel(report, model_dir, world, sequence):
    """DDP over WORLD ranks in sequence groups of 2: the gradient is the mean over the groups' batches."""
    actor, critic = _models(model_dir, False, False)
    batches = [experience(RESPONSES, width=6, seed=g) for g in range(world // 2)]
    references = [_outputs(actor, critic, batch, None)[1] for batch in batches]
    mean = {name: sum(r[name] for r in references) / len(references) for name in references[0]}
    wrapped = [torch.nn.parallel.DistributedDataParallel(model) for model in (actor, critic)]
    _, grads = _outputs(*wrapped, batches[dist.get_rank() // 2], None, sequence, scale=2.0)
    grads = {name.replace(".module.", ".", 1): grad for name, grad in grads.items()}
    report["ddp/gradients"] = _worst_gradient(grads, mean, actor.config.num_hidden_layers)


def _rollouts(rank: int) -> Experience:
    """Rank ``rank``'s rollouts: 5 samples in groups of 2, 2 and 1 (ids unique over ranks), random scores."""
    exp = experience(RESPONSES, width=6, seed=rank)
    scores = torch.rand(len(exp), generator=torch.Generator().manual_seed(rank))
    groups = torch.tensor([0, 0, 1, 1, 2]) + 3 * rank
    return dataclasses.replace(exp, scores=scores, group_ids=groups)


def _module_gradient(module, exp, scale: float) -> dict[str, torch.Tensor]:
    module.actor.zero_grad()
    module.prepare(exp)
    actor_loss, _, _ = module.micro_batch_loss(exp)
    (scale * actor_loss).backward()
    return _gradients(module.actor)


def _module(report, model_dir, world, sequence):
    torch.manual_seed(0)
    kl = {"use_loss": True, "loss_coef": 0.1}
    module = OffPolicyModule(model_dir, kl=kl, loss={"entropy_coef": 0.01}, attn_implementation="sdpa")
    solos = [dist.new_group([rank]) for rank in range(world)]  # every rank makes every group
    solo = solos[dist.get_rank()]
    rollouts = [_rollouts(rank) for rank in range(world)]
    everything = Experience.cat(rollouts, 0)
    module.sequence = SequenceGroup(group=solo, size=1, rank=0, data_group=solo)  # one process
    module.prepare(everything)
    per_group = []
    for group in range(world // 2):
        mine = torch.arange(10 * group, 10 * group + 10)  # the group's 2 ranks' 5 samples each
        part = everything.select(mine)
        module.actor.zero_grad()
        actor_loss, _, _ = module.micro_batch_loss(part)
        actor_loss.backward()
        per_group.append(_gradients(module.actor))
    mean = {name: sum(g[name] for g in per_group) / len(per_group) for name in per_group[0]}
    module.sequence = sequence  # as setup makes it
    joined = joined_experience(rollouts[dist.get_rank()], sequence, 0)
    grads = _module_gradient(module, joined, float(sequence.size))
    for grad in grads.values():
        dist.all_reduce(grad)
        grad /= world
    # float32: the same 512-term sums as above, at float32's epsilon
    report["module/gradients"] = _worst_gradient(grads, mean, module.actor.config.num_hidden_layers)
    report["module/gradient_names"] = (float(set(grads) != set(mean) or len(mean) < 10), 0.0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:])
