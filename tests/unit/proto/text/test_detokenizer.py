"""`IncrementalDetokenizer` on the tiny models' byte-level tokenizer (one token per byte, so
every multi-byte character arrives in pieces): exact deltas, the join-equals-decode invariant
under random text and random push sizes, stop strings."""

from __future__ import annotations

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from swaserve.proto.text.detokenizer import IncrementalDetokenizer
from swaserve.worker.models.tiny import BOS_ID, EOS_ID, SPECIAL_TOKENS, write_byte_tokenizer

FFFD = "\ufffd"
# Any encodable character, with 1- to 4-byte ones and a ZWJ emoji sequence drawn often.
CHARS = st.one_of(st.characters(codec="utf-8"), st.sampled_from("aé€🙂中👩‍👩‍👧 \n"))


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return write_byte_tokenizer(tmp_path_factory.mktemp("byte-tokenizer"))


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def one_at_a_time(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push([i]) for i in ids]


def push_in_chunks(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    deltas, start = [], 0
    for size in sizes:
        deltas.append(detok.push(ids[start : start + size]))
        start += size
    deltas.append(detok.push(ids[start:]))
    return deltas


def test_byte_tokens_of_one_character_are_held_until_it_is_complete(tok: Tokenizer) -> None:
    ids = encode(tok, "a€b")
    assert ids == [97, 0xE2, 0x82, 0xAC, 98]
    detok = IncrementalDetokenizer(tok)
    assert one_at_a_time(detok, ids) == ["a", "", "", "€", "b"]
    assert detok.flush() == ""
    assert detok.text == "a€b"


@pytest.mark.parametrize("text", ["é", "€", "🙂", "中文", "naïve €5 🙂 中文 ok"])
def test_multi_byte_characters_fed_byte_by_byte_never_stream_fffd(
    tok: Tokenizer, text: str
) -> None:
    ids = encode(tok, text)
    assert len(ids) == len(text.encode())  # one token per byte
    detok = IncrementalDetokenizer(tok)
    deltas = one_at_a_time(detok, ids)
    assert not any(FFFD in d for d in deltas)
    assert "".join(deltas) == text
    assert detok.flush() == ""
    assert detok.text == text


def test_flush_emits_a_trailing_incomplete_character_as_decode_does(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    assert detok.push([104, 0xF0, 0x9F]) == "h"  # h, then 2 of 🙂's 4 bytes
    assert detok.flush() == FFFD
    assert detok.text == "h" + FFFD == tok.decode([104, 0xF0, 0x9F])


def test_invalid_bytes_mid_stream_are_emitted_once_later_text_follows(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    assert one_at_a_time(detok, [0xE2, 97, 0x80, 98]) == ["", FFFD + "a", "", FFFD + "b"]
    assert detok.text == tok.decode([0xE2, 97, 0x80, 98])


def test_special_tokens_are_skipped_or_kept_as_decode_does(tok: Tokenizer) -> None:
    ids = [BOS_ID, 104, 105, EOS_ID]
    skipping = IncrementalDetokenizer(tok)
    assert one_at_a_time(skipping, ids) == ["", "h", "i", ""]
    keeping = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert one_at_a_time(keeping, ids) == [SPECIAL_TOKENS[0], "h", "i", SPECIAL_TOKENS[1]]


def test_prompt_ids_give_the_first_token_its_leading_space() -> None:
    # A Metaspace decoder drops the space of the first token of a decode, so decoding a
    # suffix alone is not the suffix of the decode; the prompt seeds the window.
    vocab = {"▁Hello": 0, "▁world": 1, "!": 2, "<unk>": 3}
    metaspace = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    assert metaspace.decode([1]) == "world"

    seeded = IncrementalDetokenizer(metaspace, prompt_ids=[0])
    assert one_at_a_time(seeded, [1, 2]) == [" world", "!"]
    unseeded = IncrementalDetokenizer(metaspace)
    assert one_at_a_time(unseeded, [0, 1, 2]) == ["Hello", " world", "!"]
    assert unseeded.flush() == ""


def test_prompt_ending_mid_character_is_not_used_as_context(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, prompt_ids=[*encode(tok, "hi "), 0xE2])
    assert one_at_a_time(detok, [0x82, 0xAC, 97]) == ["", "", FFFD + FFFD + "a"]
    assert detok.text == tok.decode([0x82, 0xAC, 97])


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=CHARS, max_size=40),
    sizes=st.lists(st.integers(min_value=0, max_value=7), max_size=40),
    prompt=st.text(alphabet=CHARS, max_size=6),
)
@example(text=FFFD, sizes=[], prompt="")  # found by a full run: a real U+FFFD at the end
@example(text="a" + FFFD + FFFD, sizes=[1], prompt="")
def test_deltas_join_to_the_decode_for_any_text_and_push_sizes(
    tok: Tokenizer, text: str, sizes: list[int], prompt: str
) -> None:
    # A special token's text (e.g. "<|user|>") encodes to that token, which decoding skips.
    assume(not any(special in text + prompt for special in SPECIAL_TOKENS))
    ids = encode(tok, text)
    assert tok.decode(ids) == text
    detok = IncrementalDetokenizer(tok, prompt_ids=encode(tok, prompt))
    deltas = push_in_chunks(detok, ids, sizes)
    assert not any(FFFD in d for d in deltas if FFFD not in text)
    # A text that ends in a real U+FFFD looks like one cut mid-character until it ends: its
    # end is held for flush(); any other text comes out of the pushes whole.
    held = detok.flush()
    assert held == "" or (text.endswith(FFFD) and text.endswith(held) and held.endswith(FFFD))
    assert "".join(deltas) + held == text
    assert detok.text == text


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(min_value=0, max_value=255 + len(SPECIAL_TOKENS)), max_size=40),
    sizes=st.lists(st.integers(min_value=0, max_value=5), max_size=40),
    skip_special_tokens=st.booleans(),
)
def test_deltas_join_to_the_decode_for_any_ids_even_invalid_utf8(
    tok: Tokenizer, ids: list[int], sizes: list[int], skip_special_tokens: bool
) -> None:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    streamed = "".join(push_in_chunks(detok, ids, sizes)) + detok.flush()
    assert streamed == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_stop_string_spanning_tokens_ends_the_text_before_it(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["lo w"])
    deltas = one_at_a_time(detok, encode(tok, "hello world"))
    assert deltas == ["h", "e", "", "l", "", "", "", "", "", "", ""]
    assert detok.text == "hel"
    assert detok.stopped and detok.stop_reason == "lo w"
    assert detok.push(encode(tok, "more")) == ""
    assert detok.flush() == ""
    assert detok.text == "hel"


def test_stop_string_at_the_very_start(tok: Tokenizer) -> None:
    bytewise = IncrementalDetokenizer(tok, stop=["st"])
    assert one_at_a_time(bytewise, encode(tok, "stop")) == ["", "", "", ""]
    assert bytewise.stopped and bytewise.stop_reason == "st"
    at_once = IncrementalDetokenizer(tok, stop=["st"])
    assert at_once.push(encode(tok, "stop")) == ""
    assert at_once.stopped and at_once.text == ""


def test_stop_string_whose_start_repeats_before_it(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["ab"])
    assert one_at_a_time(detok, encode(tok, "aab")) == ["", "a", ""]
    assert detok.text == "a"
    assert detok.stop_reason == "ab"


def test_possible_stop_start_is_released_when_it_cannot_be_one(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["abc"])
    assert one_at_a_time(detok, encode(tok, "xabxab")) == ["x", "", "", "abx", "", ""]
    assert detok.flush() == "ab"  # the end of generation releases a held stop prefix
    assert not detok.stopped and detok.stop_reason is None
    assert detok.text == "xabxab"


def test_multi_byte_stop_string(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["€"])
    assert one_at_a_time(detok, encode(tok, "a€b")) == ["a", "", "", "", ""]
    assert detok.text == "a" and detok.stop_reason == "€"


@pytest.mark.parametrize("chunked", [False, True])
def test_two_stop_strings_the_one_completed_first_wins(tok: Tokenizer, chunked: bool) -> None:
    text = "one two\n\nthree</s>"
    detok = IncrementalDetokenizer(tok, stop=["</s>", "\n\n"])
    ids = encode(tok, text)
    deltas = [detok.push(ids)] if chunked else one_at_a_time(detok, ids)
    assert "".join(deltas) == detok.text == "one two"
    assert detok.stop_reason == "\n\n"
    # "bc" completes before "abcd", though "abcd" starts first.
    overlapping = IncrementalDetokenizer(tok, stop=["abcd", "bc"])
    assert overlapping.push(encode(tok, "xabcde")) == "xa"
    assert overlapping.stop_reason == "bc"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab€ ", max_size=30),
    stops=st.lists(st.text(alphabet="ab€ ", min_size=1, max_size=4), min_size=1, max_size=3),
    sizes=st.lists(st.integers(min_value=0, max_value=6), max_size=30),
)
def test_stop_strings_truncate_the_decode_whatever_the_push_sizes(
    tok: Tokenizer, text: str, stops: list[str], sizes: list[int]
) -> None:
    ids = encode(tok, text)
    bytewise = IncrementalDetokenizer(tok, stop=stops)
    one_at_a_time(bytewise, ids)
    bytewise.flush()
    chunked = IncrementalDetokenizer(tok, stop=stops)
    streamed = "".join(push_in_chunks(chunked, ids, sizes)) + chunked.flush()

    assert streamed == chunked.text == bytewise.text
    assert (chunked.stopped, chunked.stop_reason) == (bytewise.stopped, bytewise.stop_reason)
    if len(stops) == 1:
        found = text.find(stops[0])
        assert streamed == (text if found < 0 else text[:found])
        assert chunked.stopped == (found >= 0)
    if not chunked.stopped:
        assert streamed == text
    else:
        assert chunked.stop_reason in stops
        assert text.startswith(streamed + chunked.stop_reason)
        assert not any(stop in streamed for stop in stops)


def test_stop_strings_are_validated(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, stop=["x", ""])
    with pytest.raises(TypeError, match="not one string"):
        IncrementalDetokenizer(tok, stop="x")


def test_special_token_ids_match_the_tiny_tokenizer(tok: Tokenizer) -> None:
    assert tok.token_to_id(SPECIAL_TOKENS[0]) == BOS_ID
    assert tok.token_to_id(SPECIAL_TOKENS[1]) == EOS_ID
