"""Each registered policy's choice among fitting workers, with exact picks."""

from __future__ import annotations

from collections import Counter

from router_scenario import Cluster, stored

from swaserve.router import POLICIES, Candidate, RouterConfig, RouteRequest
from swaserve.router.policies import PowerOfTwoPolicy, SessionPolicy

PROMPT = list(range(1, 18))


def test_registry_names() -> None:
    assert sorted(POLICIES) == ["least_load", "power_of_two", "prefix", "round_robin", "session"]


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
