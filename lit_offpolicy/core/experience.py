"""Experience: one batch of rollouts as tensors, and its split into mini- and micro-batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_offpolicy.core.generation import Generation


@dataclass
class Experience:
    """Rollouts of B samples: prompts left-padded to P tokens, responses right-padded to R tokens.

    The rollout callback fills the token ids and masks, ``rollout_log_probs``, ``scores``,
    ``group_ids``, ``policy_versions``, ``temperature``, ``truncated``, ``token_versions`` and
    ``action_mask``; the module fills the others at the start of its step. Masks are 1 on real tokens
    and 0 on padding. A multi-turn episode's response holds its turns and the environment's
    observations in order, so the forward passes condition on both, while losses, advantages and
    rollout correction count only the policy's tokens (:attr:`policy_mask`).
    """

    prompt_ids: Tensor
    """[B, P] long: prompt token ids, left-padded."""
    prompt_mask: Tensor
    """[B, P] long: 1 on prompt tokens."""
    response_ids: Tensor
    """[B, R] long: response token ids, right-padded."""
    response_mask: Tensor
    """[B, R] long: 1 on response tokens."""
    rollout_log_probs: Tensor
    """[B, R] float32: log π_rollout of each sampled token, as the engine sampled it; 0 on padding and
    on an environment's tokens."""
    scores: Tensor
    """[B] float32: each sample's reward."""
    group_ids: Tensor
    """[B] long: the samples of one prompt share an id (unique over steps and ranks)."""
    policy_versions: Tensor
    """[B] long: the policy version that started the sample (its oldest token's)."""
    temperature: float = 1.0
    """The sampling temperature: every log-prob is computed at it (the engines' convention)."""
    old_log_probs: Tensor | None = None
    """[B, R] float32: log π_old (module)."""
    ref_log_probs: Tensor | None = None
    """[B, R] float32: log-probs of the frozen reference (module, with a KL term)."""
    values: Tensor | None = None
    """[B, R] float32: the critic's value per response token (module, with a critic)."""
    advantages: Tensor | None = None
    """[B, R] float32: each response token's advantage (module)."""
    returns: Tensor | None = None
    """[B, R] float32: the critic's regression targets (module, with a critic)."""
    loss_mask: Tensor | None = None
    """[B, R] 0/1: the tokens the policy loss counts, the policy's that rollout correction kept (module)."""
    is_weights: Tensor | None = None
    """[B, R] float32: rollout correction's importance weights (module); None: no reweighting."""
    truncated: Tensor | None = None
    """[B] bool: the engine stopped the sample at its max tokens (finish reason "length"); None: not
    recorded."""
    token_versions: Tensor | None = None
    """[B, R] long: the policy version that sampled each response token; they differ within a response
    cut and resumed by a weight sync (partial rollouts). Padding holds the sample's last version.
    None: every token has the sample's ``policy_versions``."""
    action_mask: Tensor | None = None
    """[B, R] long: 1 where the policy sampled the token, 0 where an environment wrote it (a
    multi-turn episode's observations) and on padding. None: every response token is the policy's."""

    @classmethod
    def from_generations(
        cls,
        prompts: Sequence[Sequence[int]],
        generations: Sequence[Sequence[Generation]],
        scores: Sequence[float],
        pad_token_id: int,
        policy_version: int,
        temperature: float = 1.0,
        group_offset: int = 0,
        response_width: int | None = None,
    ) -> Experience:
        """Pack ``generations[i]`` (the n responses to ``prompts[i]``) into tensors, prompt-major.

        ``scores`` lists one score per response in the same order; prompt i's responses get
        group id ``group_offset + i``. Responses are right-padded to ``response_width`` (the
        engine's max tokens, so that the loss mask has a constant length, as
        seq-mean-token-sum-norm assumes), or to the longest response when it is None.
        """
        rows = [(i, g) for i, group in enumerate(generations) for g in group]
        if len(scores) != len(rows):
            raise ValueError(f"got {len(scores)} scores for {len(rows)} responses")
        prompt_ids, prompt_mask = _pad([prompts[i] for i, _ in rows], pad_token_id, left=True)
        responses = [g.token_ids for _, g in rows]
        response_ids, response_mask = _pad(responses, pad_token_id, left=False, width=response_width)
        log_probs, _ = _pad(
            [g.log_probs for _, g in rows], 0.0, left=False, width=response_width, dtype=torch.float32
        )
        versions = [g.versions or [policy_version] * len(g.token_ids) for _, g in rows]
        token_versions = _pad_with_last(versions, policy_version, response_ids.shape[1])
        action_mask = None
        if any(g.action_mask is not None for _, g in rows):
            actions = [
                g.action_mask if g.action_mask is not None else [1] * len(g.token_ids) for _, g in rows
            ]
            action_mask, _ = _pad(actions, 0, left=False, width=response_ids.shape[1])
        return cls(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            rollout_log_probs=log_probs,
            scores=torch.tensor(list(scores), dtype=torch.float32),
            group_ids=torch.tensor([group_offset + i for i, _ in rows], dtype=torch.long),
            policy_versions=torch.tensor([v[0] if v else policy_version for v in versions], dtype=torch.long),
            temperature=temperature,
            truncated=torch.tensor([g.finish_reason == "length" for _, g in rows], dtype=torch.bool),
            token_versions=token_versions,
            action_mask=action_mask,
        )

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def policy_mask(self) -> Tensor:
        """1 on the response tokens the policy sampled (``response_mask`` ∧ ``action_mask``): the tokens
        that are trained on, advantaged and corrected; ``response_mask`` itself without an action mask."""
        if self.action_mask is None:
            return self.response_mask
        return self.response_mask * self.action_mask.to(self.response_mask.dtype)

    @property
    def response_versions(self) -> Tensor:
        """[B, R] long: the policy version that sampled each response token (``token_versions``, or
        each sample's ``policy_versions`` where those are not recorded); padding included."""
        if self.token_versions is not None:
            return self.token_versions.long()
        return self.policy_versions.long()[:, None].expand_as(self.response_ids)

    def _map(self, fn) -> Experience:
        changes = {
            f.name: fn(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> Experience:
        return self._map(lambda t: t.to(device))

    def select(self, indices: Tensor) -> Experience:
        """The samples at ``indices`` (every per-sample tensor indexed along dim 0)."""
        return self._map(lambda t: t[indices])

    @classmethod
    def cat(cls, parts: Sequence[Experience], pad_token_id: int) -> Experience:
        """The samples of ``parts`` in order, one batch: prompts left-padded anew to the widest part's
        width; every other per-sample tensor must have the same shape past dim 0 in every part."""
        if not parts:
            raise ValueError("Experience.cat needs at least one part")
        if len({part.temperature for part in parts}) > 1:
            raise ValueError(f"parts sampled at different temperatures: {[p.temperature for p in parts]}")
        width = max(part.prompt_ids.shape[1] for part in parts)
        fills = {"prompt_ids": pad_token_id, "prompt_mask": 0}
        changes = {}
        for f in dataclasses.fields(cls):
            tensors = [getattr(part, f.name) for part in parts]
            if not any(isinstance(t, Tensor) for t in tensors):
                continue  # unset in every part, or not per sample (the temperature)
            if not all(isinstance(t, Tensor) for t in tensors):
                raise ValueError(f"Experience.cat: {f.name} is set in some parts only")
            if f.name in fills:
                tensors = [F.pad(t, (width - t.shape[1], 0), value=fills[f.name]) for t in tensors]
            shapes = {tuple(t.shape[1:]) for t in tensors}
            if len(shapes) > 1:
                raise ValueError(
                    f"Experience.cat: {f.name} has per-sample shapes {sorted(shapes)}; pack every part with "
                    "the same response_width"
                )
            changes[f.name] = torch.cat(tensors)
        return dataclasses.replace(parts[0], **changes)

    def widened(self, width: int, pad_token_id: int) -> Experience:
        """The responses right-padded to ``width`` tokens: ids with ``pad_token_id``, ``token_versions``
        with each sample's last version, every other per-token tensor with 0."""
        extra = width - self.response_ids.shape[1]
        if extra <= 0:
            return self
        changes = {}
        for f in dataclasses.fields(self):
            tensor = getattr(self, f.name)
            if f.name.startswith("prompt") or not isinstance(tensor, Tensor) or tensor.dim() < 2:
                continue
            if f.name == "token_versions":
                changes[f.name] = torch.cat([tensor, tensor[:, -1:].expand(-1, extra)], dim=1)
            else:
                fill = pad_token_id if f.name == "response_ids" else 0
                changes[f.name] = F.pad(tensor, (0, extra), value=fill)
        return dataclasses.replace(self, **changes)

    def split(self, size: int, generator: torch.Generator | None = None) -> list[Experience]:
        """Chunks of ``size`` samples (the last may be smaller); shuffled first when a generator is given."""
        order = (
            torch.arange(len(self)) if generator is None else torch.randperm(len(self), generator=generator)
        )
        return [self.select(chunk.to(self.response_ids.device)) for chunk in order.split(size)]


def _pad_with_last(rows: Sequence[Sequence[int]], empty: int, width: int) -> Tensor:
    """(len(rows), width) long: each row right-padded with its last value (``empty`` for an empty row)."""
    return torch.tensor(
        [list(row) + [row[-1] if row else empty] * (width - len(row)) for row in rows], dtype=torch.long
    ).reshape(len(rows), width)


def _pad(
    rows: Sequence[Sequence], value, left: bool, width: int | None = None, dtype: torch.dtype = torch.long
) -> tuple[Tensor, Tensor]:
    """Stack ragged rows into (len(rows), width or longest) with ``value`` padding, and the 0/1 mask."""
    longest = max((len(r) for r in rows), default=0)
    if width is not None and width < longest:
        raise ValueError(f"response_width={width} is shorter than the longest response ({longest} tokens)")
    width = longest if width is None else width
    if not rows:
        return torch.full((0, width), value, dtype=dtype), torch.zeros((0, width), dtype=torch.long)
    # padded Python lists and one tensor each, not a small tensor per row (docs/reliability.md)
    padded, mask = [], []
    for row in rows:
        row, gap = list(row), width - len(row)
        padded.append([value] * gap + row if left else row + [value] * gap)
        mask.append([0] * gap + [1] * len(row) if left else [1] * len(row) + [0] * gap)
    return torch.tensor(padded, dtype=dtype), torch.tensor(mask, dtype=torch.long)
