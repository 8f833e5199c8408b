"""bench/decode.py end to end (--quick: GPT-OSS, batches 1 and 8, in a subprocess with its own
inductor cache): the compiled, the eager and the default (compiled in the background) decode
step give the same greedy tokens, every figure is there, and the compile's start-up cost is
measured cold and cached; `--against`'s worktree and probes. No timing asserts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import decode
import pytest
from bench_subprocess import run_bench_script

from swaserve.worker.models.tiny import make_tiny_model


@pytest.mark.slow
def test_decode_bench_compiled_equals_eager() -> None:
    data = run_bench_script("decode", ["--quick"])
    result = data["results"]["gpt-oss"]
    assert set(result["batches"]) == {"1", "8"}
    for batch in result["batches"].values():
        assert batch["same_tokens"] is True
        assert batch["default_ratio"] > 0
        for side in ("eager", "compiled", "default"):
            assert set(batch[side]) == {"decode_step_ms", "decode_tok_s", "prefill_tok_s"}
            assert all(v > 0 for v in batch[side].values())
    assert result["compile_cold_s"] > 0 and result["compile_cached_s"] > 0
    assert result["background_s"] > 0


@pytest.mark.slow
def test_against_runs_the_revisions_code_in_a_worktree_it_removes(tmp_path: Path) -> None:
    """`--against REV`'s plumbing, eager on a tiny model: the probe on REV (HEAD here) imports
    the engine from REV's worktree, this tree's from this tree, the two give the same tokens,
    and the worktree is gone after."""
    model = make_tiny_model(
        tmp_path / "model", "gpt-oss", num_layers=2, sliding_window_size=4, vocab_size=1024
    )  # the probe's prompts draw ids below 1000
    probe = {"threads": 1, "batch": 2, "rounds": 1, "compile_": False}
    caches = [tmp_path / "rev-cache", tmp_path / "tree-cache"]
    for cache in caches:
        cache.mkdir()
    with decode.checkout("HEAD", tmp_path / "against") as path:
        tree = tmp_path / "against" / "tree"
        theirs = decode.probe_step(model, caches[0], path, **probe)
    ours = decode.probe_step(model, caches[1], None, **probe)
    assert Path(theirs["engine_file"]).is_relative_to(path)
    assert Path(theirs["engine_file"]).resolve().is_relative_to(tree)
    assert Path(ours["engine_file"]).resolve().is_relative_to(decode.ROOT)
    assert theirs["tokens"] == ours["tokens"]
    assert theirs["step_ms"] > 0 and ours["step_ms"] > 0
    assert not tree.exists()
    listed = subprocess.run(
        ["git", "-C", str(decode.ROOT), "worktree", "list"], capture_output=True, text=True
    )
    assert str(tree) not in listed.stdout


def test_against_refuses_a_revision_that_names_no_commit() -> None:
    assert decode.is_commit("HEAD")
    assert not decode.is_commit("no-such-revision-here")
    done = subprocess.run(
        [sys.executable, str(decode.ROOT / "bench" / "decode.py"), "--against", "no-such-rev"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "--against: 'no-such-rev' names no commit of this repository" in done.stderr
