"""RequestLimits: each rule at its boundary, the field it blames, and the room it leaves."""

from __future__ import annotations

import pytest

from swaserve.proto.kv_rules import max_swa_extend_tokens
from swaserve.proto.request_limits import RequestLimits, RequestRefused

# L = 100, F = 64 full tokens, P = 4, W = 8: the pool, not the model, bounds prompt + max_new.
LIMITS = RequestLimits(max_model_len=100, full_pool_tokens=64, page_size=4, sliding_window_size=8)
# An unchunked two-pool worker: an extend of n tokens needs n + W + P SWA tokens and a page for
# the decode after it, so an SWA pool of 40 takes prompts of 40 - 8 - 4 - 4 = 24 tokens.
UNCHUNKED = RequestLimits(
    max_model_len=1000, full_pool_tokens=512, page_size=4, sliding_window_size=8, swa_pool_tokens=40
)


def test_a_prompt_one_short_of_max_model_len_is_taken_and_one_at_it_is_refused() -> None:
    roomy = RequestLimits(max_model_len=100, full_pool_tokens=1024, page_size=1)
    assert roomy.check(99, 1) is None
    assert roomy.check(100, 1) == RequestRefused(
        "prompt", "the prompt has 100 tokens; the model's limit is 100 in all"
    )


def test_prompt_plus_max_new_may_reach_max_model_len_not_pass_it() -> None:
    roomy = RequestLimits(max_model_len=100, full_pool_tokens=1024, page_size=1)
    assert roomy.check(60, 40) is None
    assert roomy.check(60, 41) == RequestRefused(
        "max_new_tokens",
        "prompt (60 tokens) + max_new_tokens (41) exceeds the model's limit of 100 tokens",
    )


def test_the_engine_cuts_at_max_model_len_instead() -> None:
    roomy = RequestLimits(max_model_len=100, full_pool_tokens=1024, page_size=1)
    assert roomy.check(60, 10_000, cut_at_model_len=True) is None  # ends at 100, "length"
    assert roomy.check(100, 1, cut_at_model_len=True) is not None  # no position left
    # Cut to what is left of the model, the request must still fit the full pool.
    small = RequestLimits(max_model_len=100, full_pool_tokens=64, page_size=4)
    refused = small.check(60, 10_000, cut_at_model_len=True)
    assert refused == RequestRefused(
        "max_new_tokens",
        "prompt (60 tokens) + max_new_tokens (40) needs 100 KV tokens; the full pool holds 64",
    )


def test_prompt_plus_max_new_fits_the_full_pool_exactly_and_not_one_over() -> None:
    assert LIMITS.check(50, 14) is None  # 64 tokens: exactly the pool
    assert LIMITS.check(50, 15) == RequestRefused(
        "max_new_tokens",
        "prompt (50 tokens) + max_new_tokens (15) needs 68 KV tokens; the full pool holds 64",
    )


def test_the_pool_rule_blames_the_prompt_when_it_leaves_no_room_at_all() -> None:
    assert LIMITS.check(63, 1) is None
    refused = LIMITS.check(64, 1)
    assert refused is not None and refused.field == "prompt"
    assert refused.message.endswith("needs 68 KV tokens; the full pool holds 64")


def test_the_message_names_max_new_tokens_as_the_caller_does() -> None:
    refused = LIMITS.check(50, 15, max_new_name="max_completion_tokens")
    assert refused is not None
    assert refused.message.startswith("prompt (50 tokens) + max_completion_tokens (15) needs")


def test_an_unchunked_prompt_over_the_swa_extend_limit_is_refused() -> None:
    assert UNCHUNKED.max_unchunked_prompt_tokens == 24
    assert UNCHUNKED.max_unchunked_prompt_tokens == max_swa_extend_tokens(40, 8, 4)
    assert UNCHUNKED.check(24, 100) is None
    refused = UNCHUNKED.check(25, 100)
    assert refused == RequestRefused(
        "prompt",
        "a prompt of 25 tokens does not fit the SWA pool without chunked prefill: it needs 41 "
        "SWA tokens, the pool holds 40 (at most 24 prompt tokens); enable chunked_prefill_size",
    )


@pytest.mark.parametrize(
    "limits",
    [
        RequestLimits(1000, 512, 4, 8, swa_pool_tokens=40, chunked_prefill_size=16),  # chunked
        RequestLimits(1000, 512, 4, 8, swa_pool_tokens=0),  # one pool
        RequestLimits(1000, 512, 4, 0),  # no SWA layers
    ],
)
def test_no_swa_extend_limit_with_chunked_prefill_or_one_pool(limits: RequestLimits) -> None:
    assert limits.max_unchunked_prompt_tokens is None
    assert limits.check(400, 100) is None


def test_rules_apply_in_order_model_length_first() -> None:
    refused = UNCHUNKED.check(1000, 1)  # over the model, the pool and the SWA limit at once
    assert refused is not None and refused.message.startswith("the prompt has 1000 tokens")


def test_the_room_is_exactly_what_check_accepts() -> None:
    for limits in (LIMITS, RequestLimits(max_model_len=50, full_pool_tokens=64, page_size=4)):
        for n in range(1, 70):
            room = limits.max_new_tokens_room(n)
            if room >= 1:
                assert limits.check(n, room) is None, (limits, n)
            assert limits.check(n, max(1, room + 1)) is not None, (limits, n)
    assert LIMITS.max_new_tokens_room(10) == 54  # page_floor(64, 4) - 10
    assert RequestLimits(50, 64, 4).max_new_tokens_room(10) == 40  # the model bounds it


def test_a_chunked_model_prefills_any_prompt_one_chunk_at_a_time() -> None:
    """Without chunked prefill a windowed model's whole prompt is one extend, so the SWA pool
    bounds it; a chunked model's extends stop at every multiple of C, so a pool that takes
    one chunk takes any prompt."""
    windowed = RequestLimits(4096, 4096, 1, sliding_window_size=31, swa_pool_tokens=128)
    assert windowed.max_unchunked_prompt_tokens == 128 - 31 - 1 - 1
    assert windowed.check(500, 10) is not None
    chunked = RequestLimits(
        4096, 4096, 1, sliding_window_size=31, swa_pool_tokens=128, attention_chunk_size=32
    )
    assert chunked.max_unchunked_prompt_tokens is None and chunked.check(500, 10) is None
    tight = RequestLimits(
        4096, 4096, 1, sliding_window_size=31, swa_pool_tokens=64, attention_chunk_size=32
    )
    assert tight.max_unchunked_prompt_tokens == 64 - 31 - 1 - 1  # a chunk does not fit
