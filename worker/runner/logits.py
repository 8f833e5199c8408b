"""What happens to a batch's logits between the forward and the draw, for the rows that asked
for it (the others pay nothing), and the log-probabilities of what was drawn.

    grammar mask   the row's bitmask (one bit per token, from its matcher, computed on the
                   host while the forward ran) → -inf where the grammar forbids the token
    min_tokens     -inf on the stop ids (EOS included) while the output is shorter
    logit_bias     + bias (clamped to ±100 by `SamplingParams`)
    penalties      repetition (vLLM's / HF's: a seen logit is divided by p when positive,
                   multiplied when negative; seen = prompt + output), then frequency and
                   presence (OpenAI's: − count × frequency − [count > 0] × presence; count =
                   how often the output holds the token)
    temperature    (the sampler)

Each penalized request keeps its counters on the device (`PenaltyState`: its output counts and
the tokens it has seen), updated from the sampled tokens: nothing per step grows with the
sequence. Log-probabilities (`logprobs`) are those of the distribution the token was drawn
from: log-softmax of the processed logits over the temperature (1 for greedy rows), before
top-k / top-p / min-p cut it, as vLLM's `processed_logprobs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from swaserve.proto.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from swaserve.proto.stream import TokenLogprob
from swaserve.worker.runner.host_tensors import float_tensor, int_tensor, to_device

MIN_LOGPROB = -9999.0
"""The log-probability reported for a token the row's processing forbade (-inf is not JSON;
OpenAI reports -9999 likewise)."""

_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


class ProcessedRow(Protocol):
    """What the processing reads of a request (the engine's `Request`)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: frozenset[int]


@dataclass(slots=True)
class PenaltyState:
    """A request's penalty counters on its device: `counts` [V] float32, how often its output
    holds each token; `seen` [V] bool, which tokens its prompt or output holds."""

    counts: torch.Tensor
    seen: torch.Tensor

    @classmethod
    def of(
        cls, row: ProcessedRow, resumed: list[int], vocab: int, device: torch.device
    ) -> PenaltyState:
        """Counters for a request's tokens so far (its prompt and output: once, at its first
        penalized draw); `resumed`: the prompt's last tokens that it generated before a
        migration, which count as output."""
        counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        output = resumed + row.output_ids
        if output:
            out = to_device(int_tensor(output), device)
            counts.index_add_(0, out, torch.ones(len(output), device=device))
        seen = counts > 0
        if row.params.repetition_penalty != 1.0:
            seen[to_device(int_tensor(row.prompt_ids), device)] = True
        return cls(counts, seen)

    def add(self, token: int) -> None:
        self.counts[token] += 1.0
        self.seen[token] = True

    def after(self, tokens: list[int]) -> PenaltyState:
        """The counters once `tokens` follow (a copy; itself when there are none): a verified
        draft row's, whose drafts before it count as output."""
        if not tokens:
            return self
        counts, seen = self.counts.clone(), self.seen.clone()
        index = to_device(int_tensor(tokens), counts.device)
        counts.index_add_(0, index, torch.ones(len(tokens), device=counts.device))
        seen[index] = True
        return PenaltyState(counts, seen)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf in place where `bitmask` ([b, ⌈V/32⌉] int32, bit j of word w: token 32w + j allowed)
    clears the token of `logits` ([b, V] float). Token ids past the bitmask are forbidden."""
    device, vocab = logits.device, logits.shape[1]
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    bits = (bitmask.unsqueeze(2) >> shifts) & 1  # [b, words, 32] int32
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()  # [b, ≤V] bool
    logits[:, : allowed.shape[1]].masked_fill_(~allowed, float("-inf"))
    logits[:, allowed.shape[1] :] = float("-inf")


def process_logits(
    logits: torch.Tensor,  # [S, V] float32, modified in place
    rows: Sequence[ProcessedRow],
    penalties: Sequence[PenaltyState | None],
    bitmask: torch.Tensor | None,  # [m, words] int32 on logits' device: the masked rows'
    masked_rows: Sequence[int],  # which rows of `logits` the bitmask's rows are
) -> None:
    """Apply each row's grammar mask, `min_tokens`, `logit_bias` and penalties in place."""
    device = logits.device
    if bitmask is not None and masked_rows:
        index = to_device(int_tensor(list(masked_rows)), device)  # [m] int64
        sub = logits[index]
        apply_bitmask(sub, bitmask)
        logits[index] = sub
    rows_i, cols = [], []
    for i, r in enumerate(rows):
        p = r.params
        if p.min_tokens and len(r.output_ids) < p.min_tokens and r.stop_ids:
            rows_i += [i] * len(r.stop_ids)
            cols += sorted(r.stop_ids)
    if rows_i:
        logits[to_device(int_tensor(rows_i), device), to_device(int_tensor(cols), device)] = float(
            "-inf"
        )
    rows_i, cols, values = [], [], []
    for i, r in enumerate(rows):
        if r.params.logit_bias:
            for token, bias in r.params.logit_bias.items():
                rows_i.append(i)
                cols.append(token)
                values.append(bias)
    if rows_i:
        logits.index_put_(
            (to_device(int_tensor(rows_i), device), to_device(int_tensor(cols), device)),
            to_device(float_tensor(values), device),
            accumulate=True,
        )
    penalized = [i for i, s in enumerate(penalties) if s is not None]
    if penalized:
        index = to_device(int_tensor(penalized), device)  # [k] int64
        sub = logits[index]  # [k, V] float32
        states = [penalties[i] for i in penalized]
        params = [rows[i].params for i in penalized]
        seen = torch.stack([s.seen for s in states if s is not None])  # [k, V] bool
        counts = torch.stack([s.counts for s in states if s is not None])  # [k, V] float32
        rep = to_device(float_tensor([p.repetition_penalty for p in params]), device)[:, None]
        repeated = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, repeated, sub)
        freq = to_device(float_tensor([p.frequency_penalty for p in params]), device)[:, None]
        pres = to_device(float_tensor([p.presence_penalty for p in params]), device)[:, None]
        sub = sub - counts * freq - (counts > 0).float() * pres
        logits[index] = sub


def token_logprobs(
    logits: torch.Tensor,  # [b, V] float32: the processed logits of the rows that asked
    params: Sequence[SamplingParams],
    tokens: Sequence[int],
) -> list[TokenLogprob]:
    """Each row's drawn token's log-probability and its top `params.logprobs` tokens."""
    temps = to_device(
        float_tensor(
            [p.temperature if p.temperature >= GREEDY_TEMPERATURE else 1.0 for p in params]
        ),
        logits.device,
    )
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)  # [b, V] float32
    chosen = logp.gather(1, to_device(int_tensor(list(tokens)), logits.device)[:, None])  # [b, 1]
    k = max(p.logprobs or 0 for p in params)
    top_v, top_i = torch.topk(logp, k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    chosen_l = chosen[:, 0].clamp(min=MIN_LOGPROB).tolist()
    top_vl, top_il = top_v.clamp(min=MIN_LOGPROB).tolist(), top_i.tolist()
    out = []
    for j, (p, token) in enumerate(zip(params, tokens, strict=True)):
        n = p.logprobs or 0
        top = tuple(zip(top_il[j][:n], top_vl[j][:n], strict=True))
        out.append(TokenLogprob(token, chosen_l[j], top))
    return out
