"""The calibration of bench/cluster_sim.py, from the real cluster: a step cost fitted to the
engines' step logs (`StepCost`, from `Engine.step_log`), and each request's measured times
outside the engine (`Hop`, from `RoutedCluster.breakdowns` and the client's TTFT)."""

from __future__ import annotations

import itertools
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from swaserve.cluster.routed import TTFTBreakdown
from swaserve.worker.engine.scheduler import ScheduledBatch
from swaserve.worker.engine.stats import StepRecord

NOISE_SAMPLES = 2000
"""Measured / fitted step times kept in a calibration (`StepCost.noise`)."""

BUSY_GAP_S = 0.05
"""Gaps between steps longer than this are idle waits, not the loop's own time."""


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: solve, drop the most negative term, repeat
    (enough for a handful of terms)."""
    keep = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while keep:
        sol = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (sol >= 0).all():
            coef[keep] = sol
            break
        keep.pop(int(np.argmin(sol)))
    return coef


@dataclass(frozen=True, slots=True)
class StepCost:
    """Seconds of one engine step,

        fixed + decode_row × rows + prefill_request × prefills + prefill_token × tokens
              + context × tokens × (tokens before each prefill, their mean) / 1000,

    fitted (least squares, no term negative) to the real engine's `StepRecord`s; `loop_s`: the
    serving loop's own time between two busy steps (report, dispatch), their gaps' median.
    `noise` / `prefill_noise`: the measured seconds over the fitted ones of the decode-only
    steps / of the steps with prefill (a sample of up to `NOISE_SAMPLES` each): a simulated
    step takes its fitted time times one of its kind's, drawn at random. Steps alike in the
    model differ by tens of percent on a shared machine, and that spread keeps requests that
    arrive together on one worker from staying in step; a hiccup of a few ms is a larger
    share of a short decode step than of a prefill, hence two samples."""

    fixed_s: float
    decode_row_s: float
    prefill_request_s: float
    prefill_token_s: float
    context_s: float
    loop_s: float
    noise: tuple[float, ...] = (1.0,)
    prefill_noise: tuple[float, ...] = (1.0,)

    @staticmethod
    def features(records: Sequence[Sequence[float]]) -> np.ndarray:
        r = np.asarray(records, np.float64).reshape(-1, len(StepRecord._fields))
        rows, prefills, tokens, context = r[:, 0], r[:, 1], r[:, 2], r[:, 3]
        ctx = np.divide(tokens * context, 1000.0 * np.maximum(prefills, 1))
        return np.c_[np.ones(len(r)), rows, prefills, tokens, ctx]

    @classmethod
    def fit(cls, logs: Sequence[Sequence[StepRecord]]) -> StepCost:
        """From each worker's step log (a list of logs: gaps count within one log only)."""
        records = [r for log in logs for r in log]
        if len(records) < 8:
            raise ValueError(f"{len(records)} steps are too few to fit a step cost")
        seconds = np.array([r[4] for r in records])
        coef = nonnegative_lstsq(cls.features(records), seconds)
        gaps = []
        for log in logs:
            for a, b in itertools.pairwise(log):
                gap = b[5] - (a[5] + a[4])
                if b[0] and 0 <= gap < BUSY_GAP_S:  # decodes ran on: the loop was busy
                    gaps.append(gap)
        loop_s = statistics.median(gaps) if gaps else 0.0
        fitted = cls.features(records) @ coef
        prefill = np.array([r[2] > 0 for r in records])
        rng = np.random.default_rng(0)

        def sample(kind: np.ndarray) -> tuple[float, ...]:
            ok = kind & (fitted > 0)
            ratios = seconds[ok] / fitted[ok]
            if len(ratios) > NOISE_SAMPLES:
                ratios = rng.choice(ratios, NOISE_SAMPLES, replace=False)
            return tuple(float(r) for r in ratios) or (1.0,)

        return cls(
            *(float(c) for c in coef),
            loop_s=loop_s,
            noise=sample(~prefill),
            prefill_noise=sample(prefill),
        )

    def seconds(self, batch: ScheduledBatch, rng: random.Random | None = None) -> float:
        """The fitted seconds of `batch`; with `rng`, times a noise factor of its kind."""
        if rng is None:
            return self.fitted(batch)
        return self.fitted(batch) * rng.choice(
            self.prefill_noise if batch.prefill_tokens else self.noise
        )

    def fitted(self, batch: ScheduledBatch) -> float:
        nd = batch.num_decodes
        prefills = len(batch.reqs) - nd
        tokens = batch.prefill_tokens
        context = sum(batch.prefix_lens[nd:])
        return (
            self.fixed_s
            + self.decode_row_s * nd
            + self.prefill_request_s * prefills
            + self.prefill_token_s * tokens
            + self.context_s * tokens * context / (1000.0 * max(prefills, 1))
        )

    def error(self, logs: Sequence[Sequence[StepRecord]]) -> float:
        """Median relative error of the fitted seconds over `logs`' steps."""
        records = [r for log in logs for r in log]
        terms = (self.fixed_s, self.decode_row_s, self.prefill_request_s, self.prefill_token_s)
        coef = np.array([*terms, self.context_s])
        seconds = np.array([r[4] for r in records])
        return float(np.median(np.abs(self.features(records) @ coef - seconds) / seconds))


@dataclass(frozen=True, slots=True)
class Hop:
    """One request's times outside the engine, as measured: `ingress_s` (client ↔ the
    cluster's front), `route_s` (asking the router to its answer), `wire_s` (to the engine
    loop and back, less the wait for the step under way, which the simulation makes)."""

    ingress_s: float
    route_s: float
    wire_s: float


@dataclass(frozen=True, slots=True)
class Calibration:
    """What the simulator takes from the real cluster: the step cost and the hops."""

    cost: StepCost
    hops: tuple[Hop, ...]

    def to_json(self) -> dict:
        return {"cost": asdict(self.cost), "hops": [asdict(h) for h in self.hops]}

    @classmethod
    def from_json(cls, data: dict) -> Calibration:
        cost = data["cost"] | {
            key: tuple(data["cost"].get(key, (1.0,))) for key in ("noise", "prefill_noise")
        }
        return cls(StepCost(**cost), tuple(Hop(**h) for h in data["hops"]))


def hops_of(ttft_s: dict[str, float], breakdowns: Iterable[TTFTBreakdown]) -> list[Hop]:
    """Each request's measured times outside the engine: `ttft_s` is its TTFT at the client
    by request id; the rest of it past `first_token_s` is the client's ingress, and the way
    to the engine and back is `transport_s` less the wait for the step under way."""
    hops = []
    for b in breakdowns:
        if b.worker is None or b.transport_s is None or b.request_id not in ttft_s:
            continue
        ingress = max(ttft_s[b.request_id] - b.first_token_s, 0.0)
        hops.append(Hop(ingress, b.route_s, max(b.transport_s - b.worker.loop_wait_s, 0.0)))
    return hops
