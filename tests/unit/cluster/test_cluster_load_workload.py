"""bench/cluster_load.py's two ways of sending the workload, against a stand-in server (no
Ray): a closed loop of --concurrency clients, and the open loop of --session-rate, whose
sessions start on a seeded Poisson schedule however many are in flight."""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import AsyncIterator

import cluster_load
import multiturn
import pytest

from swaserve.proto.swaserve.v1 import inference_pb2 as pb

ANSWER = [5, 6, 7]
HANG_S = 60.0  # a run that cannot end fails after this instead of hanging


def drive(server: Server, work: cluster_load.Workload, concurrency: int) -> list:
    run = cluster_load.drive(server, work, concurrency)
    results, _ = asyncio.run(asyncio.wait_for(run, HANG_S))
    return results


def args_of(*argv: str) -> argparse.Namespace:
    return cluster_load.parse_args(["--sessions=6", "--turns=2", "--user-tokens=8", *argv])


class Server:
    """Answers every Generate with ANSWER; the first turns are held until `hold` of them are
    in flight together, so a run that never has that many at once cannot end."""

    def __init__(self, hold: int, *, full_answers: bool = False) -> None:
        self.hold = hold
        self.full_answers = full_answers  # answer max_new_tokens tokens instead of ANSWER
        self.max_new_tokens: dict[str, int] = {}
        self.in_flight = 0
        self.most_in_flight = 0
        self.first_turns = 0
        self.all_started = asyncio.Event()
        self.prompts: dict[str, list[int]] = {}

    def Generate(self, request: pb.GenerateRequest, timeout: float) -> AsyncIterator:
        return self._stream(request)

    async def _stream(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        self.prompts[request.request_id] = list(request.token_ids)
        self.max_new_tokens[request.request_id] = request.sampling_params.max_new_tokens
        answer = [7] * request.sampling_params.max_new_tokens if self.full_answers else ANSWER
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if request.request_id.endswith("-t0"):
                self.first_turns += 1
                if self.first_turns == self.hold:
                    self.all_started.set()
                await self.all_started.wait()
            yield pb.GenerateResponse(token_ids=answer)
            yield pb.GenerateResponse(
                finish_reason="length",
                usage=pb.Usage(prompt_tokens=len(request.token_ids)),
                worker_id="worker-0",
            )
        finally:
            self.in_flight -= 1


def test_the_open_loop_draws_its_schedule_from_the_seed_and_keeps_the_text() -> None:
    closed = cluster_load.make_workload(args_of("--seed=3"))
    rate = cluster_load.make_workload(args_of("--seed=3", "--session-rate=4"))
    again = cluster_load.make_workload(args_of("--seed=3", "--session-rate=4"))
    other = cluster_load.make_workload(args_of("--seed=4", "--session-rate=4"))
    assert closed.arrivals is None
    assert (rate.system, rate.users) == (closed.system, closed.users)  # the same text
    assert rate.arrivals == again.arrivals != other.arrivals
    assert rate.arrivals is not None and rate.arrivals[0] == 0.0
    assert list(rate.arrivals) == sorted(rate.arrivals) and len(rate.arrivals) == 6
    many = cluster_load.make_workload(
        cluster_load.parse_args(["--sessions=400", "--turns=1", "--session-rate=4"])
    )
    assert many.arrivals is not None
    gaps = [b - a for a, b in zip(many.arrivals, many.arrivals[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.2)  # 1 / rate


def test_answer_lengths_are_drawn_per_turn_from_the_seed_and_sent_as_max_new_tokens() -> None:
    argv = ("--seed=3", "--sessions=40", "--turns=3", "--max-new-tokens=16")
    work = cluster_load.make_workload(args_of(*argv))
    again = cluster_load.make_workload(args_of(*argv))
    fixed = cluster_load.make_workload(args_of(*argv, "--fixed-answers"))
    lengths = [n for turns in work.answers for n in turns]
    assert work.answers == again.answers
    assert (fixed.system, fixed.users) == (work.system, work.users)  # the same text
    assert fixed.answers == [[16] * 3] * 40
    assert min(lengths) >= 8 and max(lengths) <= 24 and len(set(lengths)) > 8
    assert statistics.mean(lengths) == pytest.approx(16, rel=0.15)
    server = Server(hold=1, full_answers=True)
    results = drive(server, work, concurrency=4)
    for r in results:
        assert server.max_new_tokens[r.request_id] == work.answers[r.session][r.turn]
        assert len(r.answer) == work.answers[r.session][r.turn]
    assert sum(map(len, server.prompts.values())) == work.prompt_tokens


def test_the_open_loop_does_not_wait_for_a_client() -> None:
    """Every session's first turn is in flight at once, with --concurrency 2."""
    args = args_of("--concurrency=2", "--session-rate=1e6")
    work = cluster_load.make_workload(args)
    server = Server(hold=6)
    results = drive(server, work, args.concurrency)
    assert server.most_in_flight == 6
    assert len(results) == 12
    for r in results:  # turn 2 carries turn 1 and its answer
        prompt = server.prompts[r.request_id]
        history = list(work.system) + work.users[r.session][0]
        assert prompt[: len(history)] == history
        if r.turn == 1:
            assert prompt[len(history) : len(history) + len(ANSWER)] == ANSWER


def test_the_closed_loop_keeps_to_its_clients() -> None:
    args = args_of("--concurrency=2")
    work = cluster_load.make_workload(args)
    server = Server(hold=2)  # the first two sessions' turns meet; the rest never wait
    results = drive(server, work, args.concurrency)
    assert server.most_in_flight == 2
    assert sorted((r.session, r.turn) for r in results) == [
        (s, t) for s in range(6) for t in (0, 1)
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--session-rate=0"], "--session-rate must be above 0"),
        (["--session-rate=2", "--simulate"], "--simulate replays the closed loop"),
    ],
)
def test_bad_open_loop_options_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cluster_load.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_round_ratios_span_each_rounds_candidate_over_its_baseline() -> None:
    """The spread printed beside the ratio of the medians pairs the runs of one round: the
    candidate of round 1 over the baseline of round 1, never over another round's."""

    def run(round_: int, policy: str, p50: float, tok_s: float) -> dict:
        return {
            "round": round_,
            "policy": policy,
            "ttft_p50_ms": p50,
            "ttft_p99_ms": 2 * p50,
            "tok_s": tok_s,
            "wall_s": 1.0,
            "cached_share": 0.5,
        }

    runs = [
        run(1, "round_robin", 100.0, 200.0),
        run(1, "ttft", 80.0, 300.0),
        run(2, "round_robin", 50.0, 100.0),
        run(2, "ttft", 45.0, 110.0),
    ]
    spread = multiturn.round_ratios(runs, "policy", "round_robin", "ttft")
    assert spread["ttft_p50"] == pytest.approx([0.8, 0.9])  # 80/100 and 45/50, not 45/100
    assert spread["tok_s"] == pytest.approx([1.1, 1.5])
    assert spread["cached_share"] == pytest.approx([1.0, 1.0])
    text = multiturn.round_ratios_text(spread)
    assert "TTFT p50 0.80-0.90x" in text and "throughput 1.10-1.50x" in text
    with pytest.raises(ValueError, match="no round ran both"):
        multiturn.round_ratios(runs[:1] + runs[3:], "policy", "round_robin", "ttft")


def turn(prompt_tokens: int, cached_tokens: int, ttft_ms: float) -> cluster_load.TurnResult:
    return cluster_load.TurnResult(
        0, 0, "r", prompt_tokens, cached_tokens, (), "length", "worker-0", ttft_ms / 1e3, 1.0
    )


def test_requests_are_compared_by_the_prompt_tokens_they_computed() -> None:
    args = args_of("--max-new-tokens=16")  # user messages of 4-12 tokens, answers of 8-24
    classes = cluster_load.size_classes(args)
    assert classes == (("a message", 13), ("+1 turn", 2 * 12 + 24 + 1))
    work = cluster_load.make_workload(args_of("--max-new-tokens=16", "--sessions=40"))
    longest = max(len(user) for turns in work.users for user in turns)
    assert longest + 1 <= classes[0][1]  # a turn that found its history: its message (+ 1)
    results = [turn(100, 87, 10.0), turn(100, 86, 30.0), turn(100, 51, 20.0), turn(60, 10, 50.0)]
    sizes = cluster_load.ttft_by_size(results, classes)
    assert sizes == {
        "a message": {"requests": 1, "p50_ms": 10.0},  # 13 computed
        "+1 turn": {"requests": 2, "p50_ms": 30.0},  # 14 and 49
        "more": {"requests": 1, "p50_ms": 50.0},  # 50
    }
    empty = cluster_load.ttft_by_size(results[:1], classes)
    assert empty["more"] == {"requests": 0, "p50_ms": None}
    runs = [
        {"policy": "a", "ttft_by_size": sizes, "cpu_ms_per_request": {"engines": 4.0}},
        {"policy": "a", "ttft_by_size": empty, "cpu_ms_per_request": {"engines": 2.0}},
        {"policy": "a", "ttft_by_size": sizes, "cpu_ms_per_request": None},  # no /proc
    ]
    alike = cluster_load.like_for_like(runs, ("a",))["a"]
    assert alike["ttft_p50_ms_by_size"] == {"a message": 10.0, "+1 turn": 30.0, "more": 50.0}
    assert alike["requests_by_size"] == {"a message": 3, "+1 turn": 4, "more": 2}
    assert alike["cpu_ms_per_request"] == {"engines": 3.0}  # the median of the rounds that read it
