"""bench/cluster_load.py --simulate: fit bench/cluster_sim.py to the cluster's runs, replay the
same workload and policies on it, and set its predictions beside the measurements."""

from __future__ import annotations

import argparse
from typing import Any

from cluster_sim import simulate_median
from sim_calibration import Calibration, StepCost


def calibrate(runs: list[dict]) -> Calibration:
    """The simulator's calibration from every run: the step cost fitted to all the workers'
    step logs, and the hops of all the requests (the same for every policy: what differs
    between policies must come from the simulated engines and router)."""
    logs = [log for run in runs for log in run["steps"].values()]
    return Calibration(StepCost.fit(logs), tuple(h for run in runs for h in run["hops"]))


def predict(runs: list[dict], model_dir: str, work: Any, args: argparse.Namespace) -> dict:
    """The simulator, calibrated on `runs`, on the same workload (the first run's answers)
    and policies: per policy, the median of `--sim-repeats` simulations, and the calibration
    and workload to rerun it (`bench/cluster_sim.py --calibration`)."""
    calibration = calibrate(runs)
    first = runs[0]  # greedy: every run's answers are its (cluster_load checks)
    answers = first["answers"]
    logs = [log for run in runs for log in run["steps"].values()]
    out: dict = {
        "calibration": calibration.to_json(),
        "step_logs": {f"{run['round']}/{run['policy']}": run["steps"] for run in runs},
        "step_cost_error": calibration.cost.error(logs),
        "policies": {},
    }
    for policy in args.policies:
        out["policies"][policy] = simulate_median(
            args.sim_repeats,
            policy=policy,
            router_config=args.router_config if policy != args.policies[0] else {},
            model_dir=model_dir,
            max_total_tokens=args.max_total_tokens,
            system=work.system,
            users=work.users,
            answers=answers,
            concurrency=args.concurrency,
            calibration=calibration,
            replicas=args.replicas,
        )
    out["workload"] = {
        "system": work.system,
        "users": work.users,
        "answers": [[s, t, list(a)] for (s, t), a in answers.items()],
    }
    return out


PREDICTED = ("ttft_p50_ms", "ttft_p99_ms", "tok_s")


def prediction_errors(median: dict[str, dict], predicted: dict) -> dict[str, dict[str, float]]:
    """Per policy and figure: predicted / measured - 1."""
    return {
        policy: {k: predicted["policies"][policy][k] / median[policy][k] - 1 for k in PREDICTED}
        for policy in median
    }


def print_predictions(median: dict[str, dict], predicted: dict) -> None:
    cost = predicted["calibration"]["cost"]
    print(
        "simulator (bench/cluster_sim.py), calibrated on these runs: step = "
        f"{1e3 * cost['fixed_s']:.2f} ms + {1e3 * cost['decode_row_s']:.3f} ms/decode row + "
        f"{1e3 * cost['prefill_request_s']:.2f} ms/prefill + "
        f"{1e6 * cost['prefill_token_s']:.0f} us/prompt token + "
        f"{1e6 * cost['context_s']:.1f} us/token/1k context; loop {1e3 * cost['loop_s']:.2f} "
        f"ms between steps (median error per step {predicted['step_cost_error']:.0%})"
    )
    print(f"{'policy':<12} {'':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s':>7} {'cached':>7}")
    errors = prediction_errors(median, predicted)
    for policy, measured in median.items():
        sim = predicted["policies"][policy]
        for label, row in (("measured", measured), ("simulated", sim)):
            print(
                f"{policy:<12} {label:>9} {row['ttft_p50_ms']:>7.0f}ms {row['ttft_p99_ms']:>7.0f}ms"
                f" {row['tok_s']:>7.1f} {row['cached_share']:>7.3f}"
            )
        err = errors[policy]
        print(
            f"{policy:<12} {'error':>9} {err['ttft_p50_ms']:>+8.0%} {err['ttft_p99_ms']:>+8.0%}"
            f" {err['tok_s']:>+7.0%}"
        )
