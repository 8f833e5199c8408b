"""MTP drafts for speculative decoding (issue #44): the checkpoint's multi-token-prediction
depths (`models.mtp`) propose each request's next k tokens at the end of every step, from the
hidden states the step's target forward just computed; the next step verifies them as any
drafts (`Engine._verify`), so the output is the target's whatever the drafts are.

After a step, per request of the batch, with p0 its first position in the step and c the
positions it committed (a prefill chunk's tokens; a decode's token and its accepted drafts):

    refresh   every depth j at positions [p0, p0 + c), token t_{p+1}, the target's h_p
              (their KV lands at the positions' own slots: each depth's cache is complete
              up to the committed length, as the stack's is)
    chain     a request that decodes next (m = p0 + c - 1, its last committed position):
              draft 1 = argmax of depth 0's logits at m (the refresh's last row);
              draft s + 1 = argmax of depth min(s, L - 1) at RoPE position m + s, token
              draft s, the target's h_m (every depth reads the anchor's target state)

Depth 0's refresh gives draft 1; depth s's refresh and chain step s are then one forward (the
refresh rows write their KV before the chain row reads it), so k = L = 3 costs three draft
forwards; chain steps past the last depth run alone. A chain step attends to its depth's cache
up to m and to itself. Its KV goes to the table
position m + 1 (the next one with no KV), at the request's own page tail when m + 1 is inside
its last page, else at the request's scratch page (`KVPool.scratch_base`, one page per
slot-table row); the next step writes its own slot there before anything reads it. A depth
never reads a rejected draft: the refresh writes only committed positions.

Drafts are greedy (the argmax): `Engine._verify` keeps any drafts' target distribution
exactly (sampled requests draw at each position what plain decoding draws there).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from swaserve.worker.runner.draft_step import DraftRows
from swaserve.worker.runner.host_tensors import int_tensor, to_device
from swaserve.worker.runner.model_input import ModelInput, SlotWrites
from swaserve.worker.runner.sampler import argmax_rows

if TYPE_CHECKING:
    from swaserve.worker.engine.request import Request
    from swaserve.worker.engine.scheduler import ScheduledBatch
    from swaserve.worker.runner.model_executor import ModelExecutor

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Rows:
    """The refresh rows of one request: positions [p0, p0 + len(next_tokens)) of its
    slot-table row, from the target's rows [first, first + len)."""

    req: Request
    row: int
    p0: int
    first: int  # its first row in the target forward
    next_tokens: list[int]
    cap: int  # drafts it takes after this step (0: it does not decode next, or takes none)

    @property
    def chains(self) -> bool:
        return self.cap > 0


class MTPDrafter:
    """The engine's MTP drafter (see the module docstring). The scheduler asks `propose` for a
    request's drafts as it asks the n-gram drafter; `after_step` makes them."""

    def __init__(
        self,
        executor: ModelExecutor,
        *,
        num_layers: int,
        page_size: int,
        scratch_base: int,
    ) -> None:
        """`num_layers`: the depths the model runs; `scratch_base`: the first scratch id of
        the pool that holds the SWA layers (`kv.memory.scratch_base`)."""
        self.executor = executor
        self.num_layers = num_layers
        self.page_size = page_size
        self.scratch_base = scratch_base

    def new_step(self) -> None:
        """Nothing to reset per step (the n-gram drafter's step budget)."""

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to `k` of the drafts the last step made for `req` ([] when it made none for
        its current tokens)."""
        if req.mtp_drafts is None or req.mtp_anchor != req.seq_len:
            return []
        return req.mtp_drafts[:k]

    def after_step(
        self,
        batch: ScheduledBatch,
        inp: ModelInput,
        next_tokens: list[int | None],
        emitted: list[list[int]] | None,
        caps: list[int],
    ) -> None:
        """Refresh every depth over what the step committed and chain the drafts of the
        requests that decode next; `caps[i]`: the drafts request i may take (0: none).
        Call after the step's tokens are accepted, before the scheduler commits them."""
        rows = self._rows(batch, next_tokens, emitted, caps)
        if not rows:
            return
        for r in rows:
            r.req.mtp_drafts = None
        anchors = [i for i, r in enumerate(rows) if r.chains]
        chained = [rows[i] for i in anchors]
        found: list[torch.Tensor] | None = None
        if inp.window_repair is None:  # the compiled depths read no SWA floor
            forwards = self._forwards(rows, chained)
            with self.executor.draft_hold(forwards) as held:
                if held:
                    found = self._draft_compiled(rows, anchors, inp)
        if found is None:
            found = self._draft_eager(rows, anchors, inp)
        if not found:
            return
        table = torch.stack(found, dim=1).tolist()  # [A, steps]: the one read back
        for r, proposed in zip(chained, table, strict=True):
            r.req.mtp_drafts = proposed[: r.cap]
            r.req.mtp_anchor = r.p0 + len(r.next_tokens) + 1  # its tokens once committed

    def _chain_steps(self, chained: list[_Rows]) -> Iterator[tuple[int, int, list[int]]]:
        """(s, depth, the chaining requests that take draft s + 1) of each forward after the
        first: chain step s with its depth's refresh (s < L), or alone."""
        steps = max((r.cap for r in chained), default=0)
        for s in range(1, max(steps, self.num_layers)):
            yield s, min(s, self.num_layers - 1), [i for i, r in enumerate(chained) if r.cap > s]

    def _forwards(self, rows: list[_Rows], chained: list[_Rows]) -> list[tuple[int, int]]:
        """(depth, rows) of each depth forward `after_step` runs."""
        refresh = sum(len(r.next_tokens) for r in rows)
        out = [(0, refresh)]
        for s, depth, live in self._chain_steps(chained):
            if s < self.num_layers:
                out.append((depth, refresh + len(live)))
            elif live:
                out.append((depth, len(live)))
        return out

    def _draft_eager(
        self, rows: list[_Rows], anchors: list[int], inp: ModelInput
    ) -> list[torch.Tensor]:
        """The depths' forwards as extend steps (`ModelRunner.draft_forward`): draft s + 1
        of each chaining request, [A] on the device, per chain step."""
        chained = [rows[i] for i in anchors]
        refresh, hidden_rows, _ = self._refresh_input(rows, inp)
        forward = self.executor.draft_forward
        logits = forward(refresh, hidden_rows, 0, chain_entries=0, with_logits=bool(anchors))
        found: list[torch.Tensor] = []  # draft s + 1 of each chaining request, [A] (device)
        if logits is not None:
            found.append(argmax_rows(logits))
            # the refresh's tokens where the chain's are, once (a concat then copies nothing)
            refresh_ids = to_device(refresh.input_ids, found[0].device)
        anchor_rows = hidden_rows[self._anchor_offsets(rows, anchors)]  # [A] target rows
        for s, depth, live in self._chain_steps(chained):
            if not live:  # no chain step: the depth's refresh alone
                if s < self.num_layers:
                    forward(refresh, hidden_rows, depth, chain_entries=0, with_logits=False)
                continue
            index = to_device(torch.as_tensor(live), found[-1].device)  # pinned, no sync
            chain = self._chain_input([chained[i] for i in live], s, inp, found[-1][index])
            chain_hidden = anchor_rows[torch.as_tensor(live)]
            if s < self.num_layers:  # the depth's refresh and its chain step: one forward
                chain = _concat(refresh, refresh_ids, chain)
                chain_hidden = torch.cat([hidden_rows, chain_hidden])
            logits = forward(chain, chain_hidden, depth, chain_entries=len(live), with_logits=True)
            assert logits is not None
            step = torch.zeros_like(found[0])
            step[index] = argmax_rows(logits)
            found.append(step)
        return found

    def _draft_compiled(
        self, rows: list[_Rows], anchors: list[int], inp: ModelInput
    ) -> list[torch.Tensor]:
        """`_draft_eager` through the compiled draft step (`runner.draft_step`, inside its
        hold): the same rows as one-token rows, the LM head on the drafting rows only."""
        chained = [rows[i] for i in anchors]
        refresh = self._refresh_rows(rows, inp)
        run, logits_of = self.executor.draft_rows, self.executor.draft_logits
        out = run(refresh, 0)  # [N0, D]
        found: list[torch.Tensor] = []
        offsets = torch.as_tensor(self._anchor_offsets(rows, anchors), dtype=torch.int64)
        if anchors:
            found.append(argmax_rows(logits_of(out[to_device(offsets, out.device)])))
        anchor_rows = refresh.hidden_rows[offsets]  # [A] target rows
        for s, depth, live in self._chain_steps(chained):
            if not live:
                if s < self.num_layers:
                    run(refresh, depth)
                continue
            index = to_device(torch.as_tensor(live), found[-1].device)
            chain = self._chain_rows(
                [chained[i] for i in live], s, inp, found[-1][index], anchor_rows[live]
            )
            out = run(_concat_rows(refresh, chain) if s < self.num_layers else chain, depth)
            step = torch.zeros_like(found[0])
            step[index] = argmax_rows(logits_of(out[-len(live) :]))
            found.append(step)
        return found

    # ---- the rows ---------------------------------------------------------------------------
    def _rows(
        self,
        batch: ScheduledBatch,
        next_tokens: list[int | None],
        emitted: list[list[int]] | None,
        caps: list[int],
    ) -> list[_Rows]:
        nd = batch.num_decodes
        out: list[_Rows] = []
        first = 0
        if batch.decode is not None:
            db = batch.decode
            positions = db.seq_lens.tolist()
            for i, (req, row, p0) in enumerate(
                zip(db.reqs, db.rows.tolist(), positions, strict=True)
            ):
                drafts = 0 if batch.drafts is None else len(batch.drafts[i])
                kept = emitted[i] if emitted is not None else [next_tokens[i]]
                tokens = [t for t in kept if t is not None]
                if tokens:
                    out.append(_Rows(req, row, p0, first, tokens, caps[i]))
                first += 1 + drafts
        for i in range(nd, len(batch.reqs)):
            req, p0, n = batch.reqs[i], batch.prefix_lens[i], batch.extend_lens[i]
            tokens = req.token_slice(p0 + 1, p0 + n + 1)
            token = next_tokens[i]
            sampled = token is not None and len(tokens) < n
            if token is not None and sampled:
                tokens.append(token)
            if tokens:
                out.append(_Rows(req, req.row, p0, first, tokens, caps[i] if sampled else 0))
            first += n
        return out

    @staticmethod
    def _anchor_offsets(rows: list[_Rows], anchors: list[int]) -> list[int]:
        """Index into the refresh's rows of each anchor's last row."""
        ends = np.cumsum([len(r.next_tokens) for r in rows])
        return [int(ends[i]) - 1 for i in anchors]

    def _refresh_input(
        self, rows: list[_Rows], inp: ModelInput
    ) -> tuple[ModelInput, torch.Tensor, list[int]]:
        """(the refresh's input, its rows' target rows, the indices of the chaining requests)."""
        counts = np.asarray([len(r.next_tokens) for r in rows], dtype=np.int64)
        p0 = np.asarray([r.p0 for r in rows], dtype=np.int64)
        firsts = np.asarray([r.first for r in rows], dtype=np.int64)
        starts = np.cumsum(counts) - counts
        offsets = np.arange(int(counts.sum())) - np.repeat(starts, counts)
        hidden_rows = torch.from_numpy(np.repeat(firsts, counts) + offsets)  # [T] int64
        anchors = [i for i, r in enumerate(rows) if r.chains]
        last_rows = (starts + counts - 1)[anchors] if anchors else np.empty(0, np.int64)
        repair = None
        if inp.window_repair is not None:  # the SWA floor of each request that repairs
            starts_by_first = self._repair_by_first(inp)
            repair = (
                torch.tensor(
                    [starts_by_first.get(r.first, (0, 0)) for r in rows], dtype=torch.int64
                )
                .reshape(-1, 2)
                .T.contiguous()
            )
        tokens = [t for r in rows for t in r.next_tokens]
        refresh = ModelInput(
            input_ids=int_tensor(tokens),
            positions=torch.from_numpy(np.repeat(p0, counts) + offsets),
            req_rows=int_tensor([r.row for r in rows]),
            prefix_lens=torch.from_numpy(p0),
            seq_lens=torch.from_numpy(p0 + counts),
            out_full_loc=inp.out_full_loc[hidden_rows],
            out_swa_loc=None if inp.out_swa_loc is None else inp.out_swa_loc[hidden_rows],
            writes=SlotWrites.empty(inp.out_swa_loc is not None),
            logits_indices=torch.from_numpy(np.asarray(last_rows, dtype=np.int64)),
            sliding_window_size=inp.sliding_window_size,
            window_repair=repair,
        )
        return refresh, hidden_rows, anchors

    def _refresh_rows(self, rows: list[_Rows], inp: ModelInput) -> DraftRows:
        """The refresh (`_refresh_input`) as one-token rows."""
        counts = np.asarray([len(r.next_tokens) for r in rows], dtype=np.int64)
        starts = np.cumsum(counts) - counts
        offsets = np.arange(int(counts.sum())) - np.repeat(starts, counts)
        firsts = np.asarray([r.first for r in rows], dtype=np.int64)
        hidden_rows = torch.from_numpy(np.repeat(firsts, counts) + offsets)  # [N0] int64
        positions = torch.from_numpy(np.repeat([r.p0 for r in rows], counts) + offsets)
        return DraftRows(
            input_ids=int_tensor([t for r in rows for t in r.next_tokens]),
            chain_ids=None,
            positions=positions,
            rope_positions=positions,
            req_rows=torch.from_numpy(np.repeat([r.row for r in rows], counts)),
            full_slots=inp.out_full_loc[hidden_rows],
            swa_slots=None if inp.out_swa_loc is None else inp.out_swa_loc[hidden_rows],
            hidden_rows=hidden_rows,
        )

    def _chain_rows(
        self,
        picked: list[_Rows],
        s: int,
        inp: ModelInput,
        tokens: torch.Tensor,  # [n] draft s of each, on the device
        hidden_rows: torch.Tensor,  # [n] their anchors' target rows
    ) -> DraftRows:
        """Chain step s (`_chain_input`) as one-token rows."""
        chain = self._chain_input(picked, s, inp, tokens)
        return DraftRows(
            input_ids=torch.zeros(0, dtype=torch.int64),
            chain_ids=tokens,
            positions=chain.prefix_lens,  # table position m + 1
            rope_positions=chain.positions,  # m + s
            req_rows=chain.req_rows,
            full_slots=chain.out_full_loc,
            swa_slots=chain.out_swa_loc,
            hidden_rows=hidden_rows,
        )

    @staticmethod
    def _repair_by_first(inp: ModelInput) -> dict[int, tuple[int, int]]:
        """A repairing request's (start, end) by its first token row in the target forward."""
        extend = (inp.seq_lens - inp.prefix_lens).tolist()
        firsts = np.cumsum([0, *extend[:-1]]).tolist()
        assert inp.window_repair is not None
        pairs = inp.window_repair.T.tolist()
        return {f: (s, e) for f, (s, e) in zip(firsts, pairs, strict=True) if (s, e) != (0, 0)}

    def _chain_input(
        self, picked: list[_Rows], s: int, inp: ModelInput, tokens: torch.Tensor
    ) -> ModelInput:
        """Chain step s of the requests `picked` with `tokens` (their draft s, on the device):
        RoPE position m + s, table position m + 1 (module docstring)."""
        p = self.page_size
        q = np.asarray([r.p0 + len(r.next_tokens) for r in picked], dtype=np.int64)  # m + 1
        anchor_target = torch.as_tensor([r.first + len(r.next_tokens) - 1 for r in picked])
        pool = inp.out_swa_loc if inp.out_swa_loc is not None else inp.out_full_loc
        own = pool[anchor_target] + 1  # [A] the slot after m's, in m's page
        scratch = torch.as_tensor([self.scratch_base + r.row * p for r in picked])
        slots = torch.where(torch.from_numpy(q % p == 0), scratch, own)  # [A] int64
        n = len(picked)
        return ModelInput(
            input_ids=tokens,
            positions=torch.from_numpy(q - 1 + s),
            req_rows=int_tensor([r.row for r in picked]),
            prefix_lens=torch.from_numpy(q),
            seq_lens=torch.from_numpy(q + 1),
            out_full_loc=slots if inp.out_swa_loc is None else torch.zeros(n, dtype=torch.int64),
            out_swa_loc=None if inp.out_swa_loc is None else slots,
            writes=SlotWrites.empty(inp.out_swa_loc is not None),
            logits_indices=torch.arange(n),
            sliding_window_size=inp.sliding_window_size,
        )


def _concat(refresh: ModelInput, refresh_ids: torch.Tensor, chain: ModelInput) -> ModelInput:
    """The refresh's entries, then the chain step's (whose logits alone are wanted): one
    forward of a depth. Every row writes its KV before any attends, so a chain row reads the
    positions the refresh writes in it."""
    n = refresh.num_tokens
    tokens = chain.input_ids
    repair = refresh.window_repair
    if repair is not None:
        repair = torch.cat([repair, torch.zeros(2, chain.batch_size, dtype=torch.int64)], dim=1)
    swa = None
    if refresh.out_swa_loc is not None and chain.out_swa_loc is not None:
        swa = torch.cat([refresh.out_swa_loc, chain.out_swa_loc])
    return ModelInput(
        input_ids=torch.cat([refresh_ids, tokens]),
        positions=torch.cat([refresh.positions, chain.positions]),
        req_rows=torch.cat([refresh.req_rows, chain.req_rows]),
        prefix_lens=torch.cat([refresh.prefix_lens, chain.prefix_lens]),
        seq_lens=torch.cat([refresh.seq_lens, chain.seq_lens]),
        out_full_loc=torch.cat([refresh.out_full_loc, chain.out_full_loc]),
        out_swa_loc=swa,
        writes=refresh.writes,
        logits_indices=chain.logits_indices + n,
        sliding_window_size=refresh.sliding_window_size,
        window_repair=repair,
    )


def _concat_rows(refresh: DraftRows, chain: DraftRows) -> DraftRows:
    """The refresh's rows, then the chain step's: one forward of a depth (`_concat`)."""
    swa = None
    if refresh.swa_slots is not None and chain.swa_slots is not None:
        swa = torch.cat([refresh.swa_slots, chain.swa_slots])
    return DraftRows(
        input_ids=refresh.input_ids,
        chain_ids=chain.chain_ids,
        positions=torch.cat([refresh.positions, chain.positions]),
        rope_positions=torch.cat([refresh.rope_positions, chain.rope_positions]),
        req_rows=torch.cat([refresh.req_rows, chain.req_rows]),
        full_slots=torch.cat([refresh.full_slots, chain.full_slots]),
        swa_slots=swa,
        hidden_rows=torch.cat([refresh.hidden_rows, chain.hidden_rows]),
    )
