"""The router decides over its workers as columns (`WorkerTable`): the same choices as the
per-worker rules (`WorkerState`, `request_need`, a policy's `choose` over a list), past the
table's first capacity and with bits out of add order; `check()` catches a stale row."""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from router_scenario import Cluster, P, stored

from swaserve.router import POLICIES, Candidate, Outcome, Router, RouteRequest, request_need
from swaserve.router.policies import BALANCE_FREE_SHARE, Candidates
from swaserve.router.worker_table import SAME_SPEED, SPEED_PRIOR_TOKENS

SYSTEMS = [[100 * s + j for j in range(12)] for s in range(3)]


def expected_choice(router: Router, request: RouteRequest) -> tuple[str, int] | None:
    """(worker, hit) the per-worker rules give, one worker at a time; None: no worker fits or
    the policy holds the request. Works on a copy of the policy (its own state moves)."""
    now = router.clock()
    fresh = [w for w in router._workers.values() if w.is_fresh(now, router.config.report_timeout_s)]
    hits = router.predict_hits(request.token_ids[:-1])
    measured = {w.bit: w.prefill_sample for w in fresh if w.prefill_sample[1]}
    if measured:  # each blended with SPEED_PRIOR_TOKENS at the pooled speed
        pooled = sum(s for s, _ in measured.values()) / sum(t for _, t in measured.values())
        prior = SPEED_PRIOR_TOKENS
        observed = {b: (s + prior * pooled) / (t + prior) for b, (s, t) in measured.items()}
    else:  # no report measured a prefill: the speeds observed per finish
        observed = {w.bit: w.s_per_token for w in fresh if w.s_per_token}
    fastest = min(observed.values(), default=1.0)
    candidates, waiting = [], []
    for w in fresh:  # add order
        assert w.headroom is not None
        hit = hits[w.worker_id]
        need = request_need(w.headroom, len(request.token_ids), hit, request.max_new_tokens)
        speed = fastest / observed[w.bit] if w.bit in observed else 1.0
        speed = 1.0 if speed >= SAME_SPEED else speed
        c = Candidate(
            w.worker_id,
            w.order,
            w.load,
            hit,
            w.queued_prefill_tokens,
            speed,
            w.headroom.full_free_tokens,
            w.headroom.full_total_tokens,
            w.decode_tokens,
        )
        if w.fits(need):
            candidates.append(c)
        elif w.fits_when_idle(need):
            waiting.append(c)
    if not candidates:
        return None
    policy = copy.deepcopy(router.policy)
    chosen = policy.choose(request, candidates)
    if waiting and policy.hold(request, chosen, Candidates.of(waiting)):
        return None
    return chosen.worker_id, chosen.hit_tokens


def random_headroom(rng: random.Random) -> dict[str, object]:
    hybrid = rng.random() < 0.8
    full_total = rng.choice([64, 400, 4000, 100_000])
    swa_total = rng.choice([40, 400, 4000]) if hybrid else full_total
    return {
        "hybrid": hybrid,
        "full_total_tokens": full_total,
        "full_free_tokens": rng.randint(rng.choice([0, full_total // 2]), full_total),
        "full_evictable_tokens": rng.randint(0, 20),
        "swa_total_tokens": swa_total,
        "swa_free_tokens": rng.randint(rng.choice([0, swa_total // 2]), swa_total),
        "num_running": rng.randint(0, 6),
        "num_waiting": rng.randint(0, 3),
        "queued_prefill_tokens": rng.choice([0, 0, 10, 300]),
        "full_reserved_tokens": rng.randint(0, 30),
        "swa_reserved_tokens": rng.randint(0, 10),
        "sliding_window_size": rng.choice([0, 4, 8]),
        "window_repair_tokens": rng.choice([0, 0, 4]),
        "chunked_prefill_size": rng.choice([0, 8, 64]),
        "prompt_tokens_total": rng.randint(0, 10_000),
        "cached_tokens_total": rng.randint(0, 5_000),
        "prefilling_tokens": rng.choice([0, 0, 50, 2000]),
        "prefill_tokens_total": rng.choice([0, rng.randint(0, 10_000)]),
        "prefill_s_total": rng.choice([0.0, 0.5, 2.0]),
        "decode_steps_total": rng.choice([0, rng.randint(1, 1000)]),
        "decode_s_total": rng.choice([0.0, 0.3, 5.0]),
    }


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 2**32 - 1), workers=st.integers(1, 80))
def test_columns_decide_as_the_per_worker_rules(policy: str, seed: int, workers: int) -> None:
    """Random fleets (up to 80 workers: past the table's first 64 rows; some removed and
    re-added, so bits leave add order; some without KV events, some stale), random reports,
    routes, finishes with speed samples: every decision is the one of the per-worker rules."""
    rng = random.Random(seed)
    c = Cluster(report_timeout_s=20.0, policy=policy, max_hold_s=1.0, seed=seed)
    names = [f"w{k}" for k in range(workers)]
    for name in names:
        c.router.add_worker(name, kv_events=rng.random() < 0.8)
    for name in rng.sample(names, k=workers // 4):  # gaps in the bits, then reuse
        c.router.remove_worker(name)
        c.router.add_worker(name, kv_events=rng.random() < 0.8)
    open_requests: list[str] = []
    for step in range(80):
        c.clock.now += rng.choice([0.0, 0.5, 2.0])
        draw = rng.random()
        if draw < 0.3:
            name = rng.choice(names)
            system = rng.choice(SYSTEMS)
            events = [stored(system[: rng.choice([4, 8, 12])])] if rng.random() < 0.6 else []
            admitted = rng.sample(open_requests, k=min(2, len(open_requests)))
            c.report(name, events, admitted=admitted, page_size=P, **random_headroom(rng))
        elif draw < 0.55 and open_requests:
            request_id = open_requests.pop(rng.randrange(len(open_requests)))
            c.router.finish(request_id, rng.choice([None, 0, 5, 50]))
        else:
            prompt = rng.choice(SYSTEMS)[: rng.randint(2, 12)] + [7] * rng.randint(1, 20)
            request = RouteRequest(f"r{step}", prompt, rng.choice([1, 16, 400]), f"s{step % 5}")
            expected = expected_choice(c.router, request)
            decision = c.router.route(
                request.request_id,
                prompt,
                request.max_new_tokens,
                session_key=request.session_key,
                deadline_s=c.clock.now + 1.0,
            )
            got = decision.worker_id, decision.predicted_hit_tokens
            if decision.outcome is Outcome.ROUTED:
                open_requests.append(request.request_id)
                assert got == expected
            else:
                assert expected is None
                c.router.finish(request.request_id)
        c.router.check()


def reference_pick(policy: str, request: RouteRequest, cands: list[Candidate]) -> Candidate:
    """The policies' rules as plain Python over a list (ties as documented)."""

    def cost(c: Candidate) -> float:
        work = c.queued_prefill_tokens + c.decode_tokens + len(request.token_ids) - c.hit_tokens
        return work / c.speed

    if policy == "prefix":

        def score(c: Candidate) -> float:
            return cost(c) + (len(request.token_ids) - c.hit_tokens) * c.load / c.speed

        return min(cands, key=lambda c: (score(c), -c.hit_tokens, c.load, c.order))
    if policy == "least_load":
        return min(cands, key=lambda c: (c.load, -c.hit_tokens, c.order))
    assert policy == "ttft"

    best = min(cands, key=lambda c: (cost(c), -c.hit_tokens, c.load, c.order))
    if best.free_tokens >= BALANCE_FREE_SHARE * best.total_tokens:
        return best
    near = [c for c in cands if cost(c) <= cost(best) + 1024]

    def writes(c: Candidate) -> int:
        return len(request.token_ids) - c.hit_tokens

    def evicted(c: Candidate) -> int:
        return max(writes(c) - c.free_tokens, 0)

    spares = [c for c in near if evicted(best) - evicted(c) >= writes(c) - writes(best)]
    if len(spares) == 1:  # no move spares more cached KV than it recomputes
        return best
    return min(
        spares,
        key=lambda c: (evicted(c), -c.free_tokens, cost(c), -c.hit_tokens, c.load, c.order),
    )


@pytest.mark.parametrize("policy", ["prefix", "least_load", "ttft"])
@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 6),  # load
            st.sampled_from([0, 16, 32, 1024, 2048]),  # hit
            st.sampled_from([0, 100, 1500, 4000]),  # queued prefill
            st.sampled_from([1.0, 0.5, 0.25]),  # speed
            st.sampled_from([0, 64, 1000, 2112, 4999, 5000, 10_000]),  # free (of 10,000)
            st.sampled_from([0, 60, 200]),  # decode step, in prompt tokens
        ),
        min_size=1,
        max_size=12,
    )
)
def test_column_picks_equal_the_rules_over_a_list(policy: str, rows: list[tuple]) -> None:
    """Many ties (few distinct loads, hits, costs): the array pick is the list rule's."""
    from swaserve.router import RouterConfig

    cands = [
        Candidate(f"w{i}", i, load, hit, queued, speed, free, 10_000, decode)
        for i, (load, hit, queued, speed, free, decode) in enumerate(rows)
    ]
    request = RouteRequest("r", list(range(2048 + 64)), 8)
    chosen = POLICIES[policy](RouterConfig()).choose(request, cands)
    assert chosen == reference_pick(policy, request, cands)


def test_check_catches_a_stale_row_a_lost_order_and_a_ghost_row() -> None:
    c = Cluster("a", "b")
    c.report("a")
    c.report("b")
    c.router.route("r", [1, 2, 3], 4)
    c.router.check()
    table = c.router._table
    a = c.router.worker("a").bit
    for column, value in (("full_budget", 1), ("load", 7), ("window", 99), ("reported", False)):
        saved = getattr(table, column)[a]
        getattr(table, column)[a] = value
        with pytest.raises(AssertionError, match=column):
            c.router.check()
        getattr(table, column)[a] = saved
    c.router.check()
    table.by_order = table.by_order[::-1]
    with pytest.raises(AssertionError, match="add order"):
        c.router.check()
    table.by_order = table.by_order[::-1]
    table.present[5] = True
    with pytest.raises(AssertionError, match="present"):
        c.router.check()


def test_a_removed_worker_leaves_no_row_and_its_bit_is_reused() -> None:
    c = Cluster("a", "b", "c")
    for w in "abc":
        c.report(w, [stored(SYSTEMS[0])])
    b = c.router.worker("b").bit
    c.router.remove_worker("b")
    table = c.router._table
    assert not table.present[b] and table.ids[b] is None and b not in table.by_order
    c.router.add_worker("d")
    assert c.router.worker("d").bit == b and table.by_order[-1] == b  # last in add order
    assert c.router.predict_hits(SYSTEMS[0] + [1]) == {"a": 12, "c": 12}  # d: no report yet
    c.router.check()


def test_a_burst_of_reports_is_one_row_write_at_the_next_decision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = Cluster("a", "b")
    table = c.router._table
    written: list[str] = []
    write = table.write
    monkeypatch.setattr(
        table, "write", lambda s, **kw: (written.append(s.worker_id), write(s, **kw))
    )
    for free in (10, 20, 5000):
        c.report("a", full_free_tokens=free)
    c.report("b")
    assert written == []  # nothing read yet
    assert c.router.route("r", [1, 2, 3], 4).worker_id == "a"  # a's last report counts
    assert sorted(written) == ["a", "b"]
    assert table.full_free[c.router.worker("a").bit] == 5000
    c.router.check()
