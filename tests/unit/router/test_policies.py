"""Each registered policy's choice among fitting workers, with exact picks."""

from __future__ import annotations

from collections import Counter

import pytest
from router_scenario import Cluster, stored

from swaserve.router import POLICIES, Candidate, Outcome, RouterConfig, RouteRequest, policies
from swaserve.router.policies import PowerOfTwoPolicy, SessionPolicy

PROMPT = list(range(1, 18))


def test_registry_names() -> None:
    assert sorted(POLICIES) == [
        "least_load",
        "power_of_two",
        "prefix",
        "round_robin",
        "session",
        "ttft",
    ]


def test_round_robin_cycles_in_add_order_and_skips_workers_that_do_not_fit() -> None:
    c = Cluster("a", "b", "c", policy="round_robin")
    for w in "abc":
        c.report(w)
    picks = [c.router.route(f"r{i}", PROMPT, 1).worker_id for i in range(4)]
    assert picks == ["a", "b", "c", "a"]
    c.report("b", full_free_tokens=0)
    assert [c.router.route(f"s{i}", PROMPT, 1).worker_id for i in range(2)] == ["c", "a"]


def test_least_load_prefers_the_longer_hit_among_equals() -> None:
    c = Cluster("a", "b", "c", policy="least_load")
    c.report("a", num_running=1)
    c.report("b", [stored(PROMPT)], num_running=2)
    c.report("c", [stored(PROMPT[:4])], num_running=1)
    assert c.router.route("r", PROMPT, 1).worker_id == "c"  # load 1, hit 4 beats a's 0


def test_power_of_two_takes_the_less_loaded_of_a_seeded_pair() -> None:
    loads = [3, 0, 2, 1]
    candidates = [
        Candidate(w, i, load, 0) for i, (w, load) in enumerate(zip("abcd", loads, strict=True))
    ]
    request = RouteRequest("r", PROMPT, 1)
    policy = PowerOfTwoPolicy(RouterConfig(seed=7))
    chosen = Counter(policy.choose(request, candidates).worker_id for _ in range(60))
    # Pairs are uniform: b wins the 3 pairs it is in, d 2, c 1, a (the most loaded) none.
    assert chosen == {"b": 25, "d": 21, "c": 14}
    assert policy.choose(request, candidates[:1]).worker_id == "a"


def test_session_hashing_is_sticky_and_moves_only_the_removed_workers_sessions() -> None:
    policy = SessionPolicy(RouterConfig(policy="session"))
    four = [Candidate(w, i, 0, 0) for i, w in enumerate("abcd")]
    three = [x for x in four if x.worker_id != "b"]
    sessions = [f"user-{i}" for i in range(200)]
    home = {s: policy.choose(RouteRequest("r", PROMPT, 1, s), four).worker_id for s in sessions}
    assert {home[s] for s in sessions} == set("abcd")
    again = {s: policy.choose(RouteRequest("r", PROMPT, 1, s), four).worker_id for s in sessions}
    assert again == home
    after = {s: policy.choose(RouteRequest("r", PROMPT, 1, s), three).worker_id for s in sessions}
    assert all(after[s] == home[s] for s in sessions if home[s] != "b")
    # Without a session key: least load.
    loaded = [Candidate("a", 0, 2, 0), Candidate("b", 1, 1, 0)]
    assert policy.choose(RouteRequest("r", PROMPT, 1), loaded).worker_id == "b"


def test_session_key_reaches_the_policy_through_route() -> None:
    c = Cluster("a", "b", "c", "d", policy="session")
    for w in "abcd":
        c.report(w)
    picks = {c.router.route(f"r{i}", PROMPT, 1, session_key="s-1").worker_id for i in range(5)}
    assert len(picks) == 1


def test_prefix_charges_a_prefill_to_every_request_it_delays() -> None:
    """score = queued + uncached × (1 + load), over the speed: a history stays where it is
    cached while that worker is about as busy as the others, and an idle worker costs a
    request only its own wait."""
    long_prompt = list(range(1, 65))  # 64 tokens
    c = Cluster("a", "b", "c", policy="prefix", inflight_prefixes=False)
    c.report("a", [stored(long_prompt[:48])], queued_prefill_tokens=40, num_running=1)
    c.report("b", [stored(long_prompt[:16])], num_running=1)
    c.report("c", num_running=1)
    # a: 40 + 16 × 2 = 72; b: 48 × 2 = 96; c: 64 × 2 = 128.
    assert c.router.route("r1", long_prompt, 1).worker_id == "a"
    c.router.finish("r1")
    # c idle: 64 < 72; a history is worth no more than the waits it saves.
    c.report("c", num_running=0)
    assert c.router.route("r2", long_prompt, 1).worker_id == "c"
    c.router.finish("r2")
    # a at half speed doubles its score: 144 > b's 96.
    c.report("c", num_running=1)
    c.report("a", prefill_tokens_total=256, prefill_s_total=0.02, queued_prefill_tokens=40)
    c.report("b", prefill_tokens_total=256, prefill_s_total=0.01)
    c.report("c", prefill_tokens_total=256, prefill_s_total=0.01)
    assert c.router.route("r3", long_prompt, 1).worker_id == "b"
    c.router.check()
    # Weight 0: the least predicted wait alone (a 46 against b's 48).
    plain = Cluster("a", "b", policy="prefix", prefix_load_weight=0.0, inflight_prefixes=False)
    plain.report("a", [stored(long_prompt[:48])], queued_prefill_tokens=30, num_running=5)
    plain.report("b", [stored(long_prompt[:16])])
    assert plain.router.route("r", long_prompt, 1).worker_id == "a"


def test_ttft_takes_the_shortest_queue_plus_uncached_prefill() -> None:
    c = Cluster("a", "b", "c", policy="ttft")
    c.report("a", [stored(PROMPT)], queued_prefill_tokens=40)  # hit 16: 40 + 1
    c.report("b", [stored(PROMPT[:8])], queued_prefill_tokens=20)  # hit 8: 20 + 9
    c.report("c", queued_prefill_tokens=20)  # no hit: 20 + 17
    assert c.router.predict_hits(PROMPT[:-1]) == {"a": 16, "b": 8, "c": 0}
    assert c.router.route("r1", PROMPT, 1).worker_id == "b"
    # r1's 9 uncached tokens now queue on b (pending until a report lists it). A prompt that
    # shares only b's cached page (and r1's first page, in flight there): b costs
    # 29 + 9 = 38, c 37.
    other = PROMPT[:8] + [100 + t for t in PROMPT[8:]]
    assert c.router.worker("b").queued_prefill_tokens == 29
    assert c.router.route("r2", other, 1).worker_id == "c"
    # A report that lists r1 replaces the estimate by what b says it still queues.
    c.report("b", [], admitted=["r1"], queued_prefill_tokens=0)
    assert c.router.worker("b").queued_prefill_tokens == 0
    assert c.router.route("r3", other, 1).worker_id == "b"  # 0 + 9
    c.router.check()


def test_ttft_counts_the_waiting_requests_it_routed_by_their_predicted_uncached_tokens() -> None:
    c = Cluster("a", policy="ttft")
    c.report("a", [stored(PROMPT[:8])])
    assert c.router.route("r1", PROMPT, 1).predicted_hit_tokens == 8
    # The report counts r1's prompt whole while it waits (17); the worker admits in order, so
    # its one waiting request is the last it took, r1, whose prefill costs 17 - 8.
    c.report("a", admitted=["r1"], num_waiting=1, queued_prefill_tokens=17)
    assert c.router.worker("a").queued_prefill_tokens == 9
    # Two waiting and the router routed one of them: the report's count (no reuse seen yet).
    c.report("a", num_waiting=2, queued_prefill_tokens=30)
    assert c.router.worker("a").queued_prefill_tokens == 30
    c.router.check()


def test_ttft_ties_go_to_the_longer_hit_then_the_lower_load() -> None:
    c = Cluster("a", "b", policy="ttft")
    c.report("a", queued_prefill_tokens=8, num_running=0)  # 8 + 17 = 25, hit 0
    c.report("b", [stored(PROMPT[:8])], queued_prefill_tokens=16, num_running=3)  # 16 + 9
    assert c.router.route("r", PROMPT, 1).worker_id == "b"
    c.router.finish("r")
    c.report("a", queued_prefill_tokens=0, num_running=2)
    c.report("b", queued_prefill_tokens=0, num_running=1)
    assert c.router.route("s", list(range(100, 117)), 1).worker_id == "b"  # both 17: load


def test_ttft_moves_a_request_for_memory_only_where_it_spares_more_kv_than_it_recomputes() -> None:
    """When the cheapest worker's pool is less than half free, a worker within
    `ttft_balance_tokens` takes the request where the move spares at least as much cached
    KV from eviction as it recomputes: a prompt every pool prefills alike fills the freest
    pool rather than evict; a cached history stays."""
    system = list(range(1, 513))  # 512 tokens, cached on both; a's pool is nearly full
    prompt = [*system, *range(1000, 1089)]  # 601 tokens: 89 to compute on either
    c = Cluster("a", "b", policy="ttft", inflight_prefixes=False)
    c.report("a", [stored(system)], full_free_tokens=40, full_evictable_tokens=8800)
    c.report("b", [stored(system)], full_free_tokens=9000)
    # Equal costs, a first by add order; a evicts 49 cached tokens, b none, for no recompute.
    assert c.router.route("r1", prompt, 16).worker_id == "b"
    tight = Cluster("a", "b", policy="ttft", inflight_prefixes=False, ttft_balance_tokens=0)
    tight.report("a", [stored(system)], full_free_tokens=40, full_evictable_tokens=8800)
    tight.report("b", [stored(system)], full_free_tokens=9000, queued_prefill_tokens=10)
    assert tight.router.route("r1", prompt, 16).worker_id == "a"  # b 10 over the slack
    # A history cached on a: moving its turn recomputes 488 tokens to spare 49: it stays.
    history = [*system, *range(2000, 2488)]
    c.report("a", [stored(history)], full_free_tokens=40, full_evictable_tokens=8800)
    c.report("b", admitted=["r1"], full_free_tokens=9000, queued_prefill_tokens=0)
    assert c.router.route("r2", [*history, *range(3000, 3089)], 16).worker_id == "a"
    # The cheapest pool at least half free: no memory pressure, the cheapest stays.
    c.report("a", full_free_tokens=5000, full_evictable_tokens=4000)
    assert c.router.route("r3", [*history, *range(4000, 4089)], 16).worker_id == "a"
    c.router.check()
    tight.router.check()


def test_ttft_keeps_a_turn_on_its_history_once_every_pool_is_full_of_cached_kv() -> None:
    """Once the pools are full of evictable cache (a server's steady state), a few more free
    slots in one worker's report do not draw a session's next turn off its history."""
    history = list(range(1, 601))  # 600 tokens cached on a; the next turn adds 89
    turn = [*history, *range(1000, 1089)]
    c = Cluster("a", "b", policy="ttft", inflight_prefixes=False)
    c.report("a", [stored(history)], full_free_tokens=16, full_evictable_tokens=9000)
    c.report("b", full_free_tokens=300, full_evictable_tokens=9000)
    # a: 89 to compute, 73 beyond its free slots; b: 689 (within the 1024 slack), 389 beyond.
    assert c.router.route("t2", turn, 16, session_key="s").worker_id == "a"
    c.router.finish("t2")
    # Room for the whole prompt on b spares 73 cached tokens on a for 600 recomputed: it stays.
    c.report("b", full_free_tokens=700, full_evictable_tokens=8600)
    assert c.router.route("t3", turn, 16, session_key="s").worker_id == "a"
    c.router.check()


def test_ttft_places_a_new_session_on_the_least_loaded_worker_within_the_balance_slack() -> None:
    """A session's first turn, where the cheapest worker holds a prefix that others within
    `ttft_balance_tokens` of it lack, goes to the least loaded of them (its later turns
    follow it there); its later turns, and requests without a session key, go to the
    cheapest."""
    system = list(range(1, 513))  # 512 tokens, cached on a only; a runs 3 requests
    turn1 = [*system, *range(1000, 1089)]  # 601 tokens: a 89 + 3 queued, b 601
    turn2 = [*turn1, *range(2000, 2040)]  # 641: a 129 + 3 queued (only the system prompt
    # is cached there), b 641 (turn 1 is not reported cached there yet)
    c = Cluster("a", "b", policy="ttft", inflight_prefixes=False)
    c.report("a", [stored(system)], num_running=3, queued_prefill_tokens=3)
    c.report("b")
    assert c.router.route("t1", turn1, 16, session_key="s1").worker_id == "b"
    assert c.router.route("t2", turn2, 16, session_key="s1").worker_id == "a"  # the cheapest
    assert c.router.route("n1", turn1, 16).worker_id == "a"  # no key: the cheapest
    # Where every near worker holds the same prefix and as many placed sessions, the cost
    # decides for a new session too: only a prefix that one worker lacks draws sessions by
    # load.
    both = Cluster("a", "b", policy="ttft", inflight_prefixes=False)
    both.report("a", [stored(system)], num_running=3, queued_prefill_tokens=3)
    both.report("b", [stored(system)], queued_prefill_tokens=40)
    assert both.router.route("t1", turn1, 16, session_key="s1").worker_id == "a"  # 92 < 129
    # Past the slack the cost decides for a new session too.
    tight = Cluster("a", "b", policy="ttft", inflight_prefixes=False, ttft_balance_tokens=256)
    tight.report("a", [stored(system)], num_running=3, queued_prefill_tokens=3)
    tight.report("b")
    assert tight.router.route("t1", turn1, 16, session_key="s1").worker_id == "a"  # 601 - 92
    # Memory pressure comes first: where the cheapest pool is less than half free, a new
    # session goes to the freest pool, however loaded (its next turn would move there).
    full = Cluster("a", "b", policy="ttft", inflight_prefixes=False)
    full.report("a", num_running=1, full_free_tokens=800, full_evictable_tokens=8000)
    full.report("b", num_running=3, full_free_tokens=9000)
    assert full.router.route("t1", turn1, 16, session_key="s1").worker_id == "b"
    for cluster in (c, both, tight, full):
        cluster.router.check()


def test_ttft_places_a_new_session_on_a_shared_prefix_where_the_fewest_sessions_are() -> None:
    """Where every worker within `ttft_balance_tokens` of the cheapest holds the same prefix
    of a new session, the one holding the fewest placed sessions takes it, even if its queue
    is longer just now (the other's sessions may be between turns); past the slack the
    cheapest does. A known session's turn, and a request without a key, go to the cheapest."""
    system = list(range(1, 385))

    def first_turn(i: int) -> list[int]:
        return [*system, *range(1000 + 100 * i, 1090 + 100 * i)]

    c = Cluster("a", "b", policy="ttft", inflight_prefixes=False)
    c.report("a", [stored(system)])
    c.report("b", [stored(system)])
    c.report("b", queued_prefill_tokens=2000)  # past the slack: a takes two sessions
    for i in range(2):
        assert c.router.route(f"s{i}", first_turn(i), 16, session_key=f"s{i}").worker_id == "a"
        c.router.finish(f"s{i}")
    # Both hold the system prompt; b is 50 tokens of queue dearer, a holds 2 sessions to 0.
    c.report("b", queued_prefill_tokens=50)
    assert c.router.route("s2", first_turn(2), 16, session_key="s2").worker_id == "b"
    assert c.router.route("n", first_turn(9), 16).worker_id == "a"  # no key: the cheapest
    c.router.finish("n")
    turn = [*first_turn(0), *range(5000, 5040)]  # s0's next turn: the cheapest, a
    assert c.router.route("s0-t1", turn, 16, session_key="s0").worker_id == "a"
    c.router.finish("s0-t1")
    c.router.finish("s2")
    # Past the slack the cheapest takes a new session, however many sessions it holds.
    c.report("b", queued_prefill_tokens=2000)
    assert c.router.route("s3", first_turn(3), 16, session_key="s3").worker_id == "a"
    c.router.check()


def test_ttft_moves_a_session_only_to_a_worker_holding_fewer_sessions() -> None:
    """A known session's turn that is cheaper elsewhere stays on its worker unless the other
    holds fewer sessions, or its worker's queue is past `ttft_balance_tokens`: a turn that
    moves takes the session's later turns along, and a worker whose sessions are between
    turns looks emptier than it is (one such move put 4 of 10 sessions on one of 4 workers)."""
    system = list(range(1, 385))

    def first_turn(i: int) -> list[int]:
        return [*system, *range(1000 + 100 * i, 1090 + 100 * i)]

    def next_turn(i: int) -> list[int]:
        return [*first_turn(i), *range(5000 + 100 * i, 5040 + 100 * i)]

    def route(request_id: str, tokens: list[int], session: str) -> str:
        worker = c.router.route(request_id, tokens, 16, session_key=session).worker_id
        c.router.finish(request_id)
        return worker

    c = Cluster("a", "b", policy="ttft", inflight_prefixes=False)
    c.report("a", [stored(system)])
    c.report("b", [stored(system)], queued_prefill_tokens=2000)  # past the slack
    assert [route(f"s{i}", first_turn(i), f"s{i}") for i in range(2)] == ["a", "a"]
    c.report("b", queued_prefill_tokens=0)
    assert [route(f"s{i}", first_turn(i), f"s{i}") for i in (2, 3)] == ["b", "b"]  # 2 each
    c.report("a", [stored(first_turn(0)), stored(first_turn(1))], queued_prefill_tokens=300)
    # s0's turn: 40 new tokens and 300 queued on a, 130 on an idle b; b holds as many.
    assert route("s0-t1", next_turn(0), "s0") == "a"
    # Past the slack on a, s1 leaves whatever b holds: b holds 3 sessions, a 1.
    c.report("a", queued_prefill_tokens=2000)
    assert route("s1-t1", next_turn(1), "s1") == "b"
    # s2's turn is cheaper on a, which holds fewer: it moves.
    c.report("a", queued_prefill_tokens=0)
    c.report("b", [stored(first_turn(2)), stored(first_turn(3))], queued_prefill_tokens=300)
    assert route("s2-t1", next_turn(2), "s2") == "a"
    c.router.check()


def test_ttft_breaks_ties_by_the_sessions_each_worker_holds() -> None:
    """A lone client's sessions, one at a time on an idle cluster: the second goes to the
    worker without the system prompt (the loads tie, b holds no session), and once both hold
    it, new sessions alternate; a session's later turn still follows its history."""
    system = list(range(1, 385))
    c = Cluster("a", "b", policy="ttft", inflight_prefixes=False)
    c.report("a")
    c.report("b")

    def first_turn(i: int) -> list[int]:
        return [*system, *range(1000 + 100 * i, 1090 + 100 * i)]

    assert c.router.route("s0-t0", first_turn(0), 16, session_key="s0").worker_id == "a"
    c.router.finish("s0-t0")
    c.report("a", [stored(first_turn(0))])
    assert c.router.route("s1-t0", first_turn(1), 16, session_key="s1").worker_id == "b"
    c.router.finish("s1-t0")
    c.report("b", [stored(first_turn(1))])
    picks = []
    for i in range(2, 6):
        picks.append(c.router.route(f"s{i}-t0", first_turn(i), 16, session_key=f"s{i}").worker_id)
        c.router.finish(f"s{i}-t0")
    assert picks == ["a", "b", "a", "b"]
    turn = [*first_turn(1), *range(5000, 5040)]  # s1's next turn: its history is on b
    assert c.router.route("s1-t1", turn, 16, session_key="s1").worker_id == "b"
    # Without session keys, ties go by add order as before.
    assert c.router.route("n1", first_turn(7), 16).worker_id == "a"
    c.router.check()


def test_ttft_forgets_a_session_s_worker_when_the_session_moves_or_is_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(policies, "SESSION_MEMORY", 2)
    ttft = policies.TTFTPolicy(RouterConfig(policy="ttft"))
    a, b = Candidate("a", 0, 0, 0, 0, 1.0, 1000, 1000), Candidate("b", 1, 0, 0, 0, 1.0, 1000, 1000)

    def pick(session: str) -> str:
        return ttft.choose(RouteRequest("r", list(range(10)), 16, session), [a, b]).worker_id

    ttft.placed(RouteRequest("r", [], 16, "s1"), a)
    assert pick("s9") == "b"  # a holds one session
    ttft.placed(RouteRequest("r", [], 16, "s1"), b)  # s1 moved to b
    assert pick("s9") == "a"
    ttft.placed(RouteRequest("r", [], 16, "s2"), a)
    ttft.placed(RouteRequest("r", [], 16, "s3"), a)  # s1 (on b) forgotten: a 2, b 0
    assert pick("s9") == "b"


def test_ttft_counts_a_slower_worker_s_requests_for_more_when_placing_a_new_session() -> None:
    ttft = policies.TTFTPolicy(RouterConfig(policy="ttft"))
    request = RouteRequest("r", list(range(100)), 16, "s1")  # a: 50 cached, cost 50; b: 200
    fast = Candidate("a", 0, 3, 50, 0, 1.0, 1000, 1000)  # 3 requests at full speed
    assert ttft.choose(request, [fast, Candidate("b", 1, 2, 0, 0, 0.5, 1000, 1000)]) == fast
    lighter = Candidate("b", 1, 1, 0, 0, 0.5, 1000, 1000)  # 1 at half speed: 2 < 3
    assert ttft.choose(request, [fast, lighter]) == lighter


def test_ttft_remembers_the_sessions_it_placed_not_those_it_only_picked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pick that the router does not act on (a held or queued request is picked again
    later) leaves the session new; the least recently placed sessions are forgotten first,
    past SESSION_MEMORY."""
    monkeypatch.setattr(policies, "SESSION_MEMORY", 2)
    ttft = policies.TTFTPolicy(RouterConfig(policy="ttft"))
    busy = Candidate("a", 0, 3, 512, 0, 1.0, 1000, 1000)  # cost 89: the cheapest
    idle = Candidate("b", 1, 0, 0, 0, 1.0, 1000, 1000)  # cost 601: within 1024, idle
    workers = [busy, idle]

    def pick(session: str) -> str:
        return ttft.choose(RouteRequest("r", list(range(601)), 16, session), workers).worker_id

    assert pick("s1") == "b" and pick("s1") == "b"  # picked twice, placed never: still new
    ttft.placed(RouteRequest("r", [], 16, "s1"), idle)
    assert pick("s1") == "a"  # placed: by cost from now on
    for key in ("s2", "s3"):
        ttft.placed(RouteRequest("r", [], 16, key), idle)
    assert pick("s1") == "b"  # the oldest of three, forgotten
    assert pick("s3") == "a"


def test_ttft_divides_the_cost_by_the_worker_s_observed_speed() -> None:
    c = Cluster("a", "b", policy="ttft", inflight_prefixes=False)
    c.report("a", queued_prefill_tokens=10)  # 10 + 17 = 27
    c.report("b", queued_prefill_tokens=20)  # 20 + 17 = 37
    assert c.router.route("r1", PROMPT, 100).worker_id == "a"
    c.router.finish("r1")  # no generated count: no speed sample
    assert c.router.worker("a").s_per_token is None
    assert c.router.route("r2", PROMPT, 100).worker_id == "a"
    c.clock.now += 4.0
    c.router.finish("r2", generated_tokens=100)  # 0.04 s per token
    c.report("a", queued_prefill_tokens=30)  # 47 > 37
    assert c.router.route("r3", PROMPT, 100).worker_id == "b"
    c.clock.now += 1.0
    c.router.finish("r3", generated_tokens=100)  # 0.01 s per token
    assert (c.router.worker("a").s_per_token, c.router.worker("b").s_per_token) == (0.04, 0.01)
    # a runs at a quarter of b's speed: 27 / 0.25 = 108 > 37.
    c.report("a", queued_prefill_tokens=10)
    assert c.router.route("r4", PROMPT, 100).worker_id == "b"
    c.router.check()


def test_ttft_counts_the_reported_queue_less_the_worker_s_recent_reuse() -> None:
    c = Cluster("a", "b", policy="ttft")
    c.report("a", prompt_tokens_total=0, cached_tokens_total=0)
    # a admitted 400 prompt tokens since, 300 of them from its cache: reuse 0.75, so of the
    # 80 waiting tokens it reports about 20 are still to compute: 20 + 17 < b's 30 + 17.
    c.report("a", queued_prefill_tokens=80, prompt_tokens_total=400, cached_tokens_total=300)
    c.report("b", queued_prefill_tokens=30)
    assert c.router.worker("a").reuse == 0.75
    assert c.router.worker("a").queued_prefill_tokens == 20
    assert c.router.route("r", PROMPT, 1).worker_id == "a"
    # A restart resets the counters: no sample, the reuse seen so far stays.
    c.report("a", instance="i1", queued_prefill_tokens=80)
    assert c.router.worker("a").reuse == 0.75


def _observe(c: Cluster, rid: str, worker: str, s_per_token: float) -> None:
    """Route `rid` to `worker` (the others report a long queue) and finish its 100 tokens
    after 100 × `s_per_token` seconds: a speed sample of `worker`."""
    for w in c.router.worker_ids:
        c.report(w, queued_prefill_tokens=0 if w == worker else 10_000)
    assert c.router.route(rid, PROMPT, 100).worker_id == worker
    c.clock.now += 100 * s_per_token
    c.router.finish(rid, generated_tokens=100)


def test_ttft_holds_a_request_for_a_faster_worker_that_lacks_room_for_max_hold_s() -> None:
    c = Cluster("a", "b", policy="ttft", inflight_prefixes=False, max_hold_s=0.05)
    _observe(c, "r1", "a", 0.04)
    _observe(c, "r2", "b", 0.01)  # b is 4x as fast
    # b has no SWA room now (it needs 17 + W + P); a has: a costs 17 / 0.25 = 68, b 17.
    c.report("a")
    c.report("b", swa_free_tokens=10)
    assert c.router.route("r3", PROMPT, 100).outcome == Outcome.QUEUED
    c.clock.now += 0.04
    assert c.router.poll() == []  # still within max_hold_s
    c.report("b", swa_free_tokens=100)  # b has room: r3 goes there
    assert [(d.request_id, d.worker_id) for d in c.router.poll()] == [("r3", "b")]
    c.report("b", swa_free_tokens=10)
    assert c.router.route("r4", PROMPT, 100).outcome == Outcome.QUEUED
    c.clock.now += 0.06  # held past max_hold_s: the worker with room takes it
    assert [(d.request_id, d.worker_id) for d in c.router.poll()] == [("r4", "a")]
    c.router.check()


def test_ttft_holds_only_for_a_worker_much_faster_that_could_fit_the_request() -> None:
    c = Cluster("a", "b", policy="ttft", inflight_prefixes=False)
    _observe(c, "r1", "a", 0.04)
    _observe(c, "r2", "b", 0.01)
    c.report("a")
    c.report("b", swa_free_tokens=10, swa_total_tokens=10)  # 17 + W + P never fits b
    assert c.router.route("r3", PROMPT, 100).worker_id == "a"
    # b less than 1.25x as fast as a: a takes it although b would be cheaper once it has room.
    c = Cluster("a", "b", policy="ttft", inflight_prefixes=False)
    _observe(c, "r1", "a", 0.012)
    _observe(c, "r2", "b", 0.01)
    c.report("a", queued_prefill_tokens=3)  # (3 + 17) / (0.01 / 0.012) = 24 > b's 17
    c.report("b", swa_free_tokens=10)
    assert c.router.route("r3", PROMPT, 100).worker_id == "a"
    c.router.check()


def test_ttft_counts_the_rest_of_the_prefills_under_way_whole() -> None:
    c = Cluster("a", "b", policy="ttft")
    c.report("a", prompt_tokens_total=0, cached_tokens_total=0)
    # a is mid-way through a long prefill (admitted, so not in its waiting queue): 50 tokens
    # left to compute before anything sent now, not discounted by a's reuse (0.75): they are
    # what remains after its cache match. 50 + 17 > b's 20 + 17.
    c.report(
        "a",
        prefilling_tokens=50,
        queued_prefill_tokens=0,
        prompt_tokens_total=400,
        cached_tokens_total=300,
    )
    c.report("b", queued_prefill_tokens=20)
    assert c.router.worker("a").queued_prefill_tokens == 50
    assert c.router.route("r1", PROMPT, 1).worker_id == "b"
    c.report("a", prefilling_tokens=0, prompt_tokens_total=400, cached_tokens_total=300)
    assert c.router.route("r2", PROMPT, 1).worker_id == "a"  # its prefill ended: 17 < 37 + 17
    c.router.check()


def test_ttft_scales_by_the_prefill_speed_the_reports_measure_before_any_finish() -> None:
    # First reports: each engine timed a prefill at start. 256 tokens tell a worker 10x
    # slower: blended with SPEED_PRIOR_TOKENS at the pooled speed, a runs at 0.72 of b,
    # 17 / 0.72 > 5 + 17.
    c = Cluster("a", "b", policy="ttft")
    c.report("a", prefill_tokens_total=256, prefill_s_total=0.1)
    c.report("b", prefill_tokens_total=256, prefill_s_total=0.01, queued_prefill_tokens=5)
    assert c.router.route("r0", PROMPT, 100).worker_id == "b"
    # ... not one 4x slower: that is within what a few stalled steps make of alike workers.
    c = Cluster("a", "b", policy="ttft")
    c.report("a", prefill_tokens_total=256, prefill_s_total=0.04)
    c.report("b", prefill_tokens_total=256, prefill_s_total=0.01, queued_prefill_tokens=5)
    assert c.router.route("r0", PROMPT, 100).worker_id == "a"
    c = Cluster("a", "b", policy="ttft")
    c.report("a")
    c.report("b")
    # Since their previous reports, a computed 1000 prompt tokens in 0.2 s, b in 0.05 s.
    c.report("a", prefill_tokens_total=1000, prefill_s_total=0.2)
    c.report("b", prefill_tokens_total=1000, prefill_s_total=0.05, queued_prefill_tokens=10)
    assert c.router.worker("a").s_per_prefill_token == 0.2 / 1000
    assert c.router.worker("a").s_per_token is None  # nothing finished yet
    # Blended, a runs at 0.54 of b's speed: 17 / 0.54 = 31 > 10 + 17.
    assert c.router.route("r1", PROMPT, 100).worker_id == "b"
    # A restarted instance's first report counts from its start, not from the old counters.
    c.report("a", instance="i1", prefill_tokens_total=100, prefill_s_total=0.02)
    assert c.router.worker("a").s_per_prefill_token == (0.9 * 0.2 + 0.02) / (0.9 * 1000 + 100)
    c.report("a", instance="i1", prefill_tokens_total=100, prefill_s_total=0.02)  # no growth
    assert c.router.worker("a").s_per_prefill_token == (0.9 * 0.2 + 0.02) / (0.9 * 1000 + 100)
    # A finish observed on b (slow: 0.1 s per generated token) does not outrank the
    # measured prefill speeds: b stays more than twice as fast as a.
    c.clock.now += 10.0
    c.router.finish("r1", generated_tokens=100)
    assert c.router.worker("b").s_per_token == 0.1
    c.report("b", prefill_tokens_total=1000, prefill_s_total=0.05, queued_prefill_tokens=10)
    assert c.router.route("r2", PROMPT, 100).worker_id == "b"
    c.router.check()


def test_ttft_keeps_a_turn_on_its_history_when_one_stalled_step_slowed_a_short_measure() -> None:
    """Two alike workers timed 256 tokens at start; then a computed a 48-token prompt in a step
    the host stalled for 0.3 s. On its own that measure makes a 15x slower than b and moves
    the next turn (48 of its 96 tokens cached on a) to b; blended with the pooled speed over
    SPEED_PRIOR_TOKENS, a runs at 0.70 of b: 48 / 0.70 < 96. Measured over many tokens, the
    gap measured over many tokens on both is real and moves the turn."""
    history = list(range(1, 49))
    turn = [*history, *range(100, 148)]
    for a, b, worker in (((48, 0.3), (0, 0.0), "a"), ((10_000, 5.0), (10_000, 0.8), "b")):
        c = Cluster("a", "b", policy="ttft", inflight_prefixes=False)
        c.report("a", [stored(history)], prefill_tokens_total=256, prefill_s_total=0.02)
        c.report("b", prefill_tokens_total=256, prefill_s_total=0.02)
        c.report("a", prefill_tokens_total=256 + a[0], prefill_s_total=0.02 + a[1])
        c.report("b", prefill_tokens_total=256 + b[0], prefill_s_total=0.02 + b[1])
        assert c.router.predict_hits(turn) == {"a": 48, "b": 0}
        assert c.router.route("r", turn, 4).worker_id == worker
        c.router.check()
