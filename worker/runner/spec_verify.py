"""Verifying draft tokens (speculative decoding, issue #44): which of a request's k drafts the
target model accepts, and the token it emits after them, such that the output is exactly what
decoding without drafts would give.

- Greedy: the drafts accepted are the longest prefix that equals the target's argmax at each
  position; the emitted tokens are the target's argmax up to and including the first position
  that disagrees (or the bonus position k when all agree): one to k + 1 tokens per step.
- Sampling (the standard rule, Leviathan et al. / Chen et al.): draft d_j drawn from q_j is
  accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the emitted
  token is drawn from normalize(max(p_j − q_j, 0)); when all k are accepted a bonus token is
  drawn from p_k. Every emitted token is then distributed by the target's p exactly
  (`rejection_sample`, for drafts from a model).
- A drafter without a model (n-gram) proposes deterministically: q_j is one-hot at d_j, so the
  rule accepts d_j with probability p_j(d_j) and redraws a rejection from p_j without d_j.
  Drawing x_j from p_j and keeping d_j exactly when x_j = d_j (emitting x_j at the first
  x_j != d_j) is that rule: P(keep) = p_j(d_j), and x_j given x_j != d_j is p_j without d_j. The
  engine does this with `greedy_accept` over x, each x_j drawn as plain decoding draws the token
  at its position (`Sampler.sample_at`): a seeded request's tokens are then the ones it gets
  without drafts, whatever was drafted.

p here is the target's processed distribution (after penalties, grammar, bias, temperature,
top-k / top-p), the one plain decoding samples from.
"""

from __future__ import annotations

import torch


def greedy_accept(drafts: list[int], target_argmax: list[int]) -> list[int]:
    """The tokens a greedy step emits: `target_argmax` ([k + 1]: the target's choice after the
    request's last token and after each draft) up to its first disagreement with `drafts`
    ([k]), inclusive."""
    if len(target_argmax) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target tokens")
    emitted = []
    for draft, target in zip(drafts, target_argmax, strict=False):
        emitted.append(target)
        if draft != target:
            return emitted
    emitted.append(target_argmax[-1])
    return emitted


def rejection_sample(
    drafts: list[int],
    target_probs: torch.Tensor,  # [k + 1, V] float32: p after each prefix, rows sum to 1
    draft_probs: torch.Tensor | None,  # [k, V] float32: q of each draft; None: one-hot drafts
    generator: torch.Generator,
) -> list[int]:
    """The tokens a sampled step emits (1 to k + 1) by the rule in the module docstring."""
    k = len(drafts)
    if target_probs.shape[0] != k + 1 or (draft_probs is not None and draft_probs.shape[0] != k):
        raise ValueError(f"{k} drafts need {k + 1} target rows and {k} draft rows")
    emitted: list[int] = []
    for j, draft in enumerate(drafts):
        p = target_probs[j]
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        accept = min(1.0, float(p[draft]) / q_d) if q_d > 0 else 0.0
        if float(torch.rand((), generator=generator, device=p.device)) < accept:
            emitted.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = torch.clamp(p - draft_probs[j], min=0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p is q (or p is one-hot at d): nothing left to correct to
            residual, total = p, float(p.sum())
        emitted.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return emitted
