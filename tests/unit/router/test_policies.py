"""Each registered policy's choice among fitting workers, with exact picks."""

from __future__ import annotations

from collections import Counter

from router_scenario import Cluster, stored

from swaserve.router import POLICIES, Candidate, RouterConfig, RouteRequest
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


def test_ttft_takes_the_shortest_queue_plus_uncached_prefill() -> None:
    c = Cluster("a", "b", "c", policy="ttft")
    c.report("a", [stored(PROMPT)], queued_prefill_tokens=40)  # hit 16: 40 + 1
    c.report("b", [stored(PROMPT[:8])], queued_prefill_tokens=20)  # hit 8: 20 + 9
    c.report("c", queued_prefill_tokens=20)  # no hit: 20 + 17
    assert c.router.predict_hits(PROMPT[:-1]) == {"a": 16, "b": 8, "c": 0}
    assert c.router.route("r1", PROMPT, 1).worker_id == "b"
    # r1's 9 uncached tokens now queue on b (pending until a report lists it): b costs
    # 29 + 9 = 38, c 37.
    assert c.router.worker("b").queued_prefill_tokens == 29
    assert c.router.route("r2", PROMPT, 1).worker_id == "c"
    # A report that lists r1 replaces the estimate by what b says it still queues.
    c.report("b", [], admitted=["r1"], queued_prefill_tokens=0)
    assert c.router.worker("b").queued_prefill_tokens == 0
    assert c.router.route("r3", PROMPT, 1).worker_id == "b"  # 0 + 9
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
