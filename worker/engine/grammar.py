"""Grammar-constrained decoding on the host: compiled grammars (cached, compiled off the step
loop) and one matcher per constrained request.

    add_request ─► GrammarCompiler.submit(spec) ─► a thread compiles (llguidance) ─► cache
                    the request waits outside the scheduler until its grammar is ready
    each step   ─► GrammarMatcher.fill(bitmask row)  (the allowed next tokens, 1 bit each)
                    the sampler masks that row's logits on its device (`runner.logits`)
    each token  ─► GrammarMatcher.accept(token): the grammar advances; when it can take
                    nothing more the request finishes with "stop"

A compiled grammar is a pristine `llguidance.LLMatcher`: every request of that grammar starts
from a copy (`deep_copy`, microseconds), so a schema is compiled once however many requests
use it. The matcher only advances on tokens the request keeps: a retracted request keeps its
output tokens (its re-prefill recomputes their KV), so its matcher's state stays right;
`rollback` undoes tokens for a caller that discards them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from swaserve.proto.grammar import GrammarError, check_grammar
from swaserve.proto.sampling_params import StructuredOutputs

CACHE_SIZE = 256
"""Compiled grammars kept (least recently used goes first)."""

COMPILE_THREADS = 2


def bitmask_width(vocab_size: int) -> int:
    """int32 words of a row's bitmask: one bit per token id."""
    return (vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles grammars for one tokenizer on its own threads, cached by `StructuredOutputs.key`.

    `check(spec)` is synchronous and cheap (llguidance validates without the tokenizer): a
    bad grammar is refused at `add_request`. `submit(spec)` returns a future of the compiled
    grammar; the build with the tokenizer (up to seconds for a deep schema) runs off the
    engine's step loop."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids or None
        )
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()
        self.compiled = 0  # grammars built (cache misses)
        self.compile_s = 0.0  # seconds spent building them

    def check(self, spec: StructuredOutputs) -> None:
        """Raise `GrammarError` naming the problem when `spec` cannot compile."""
        check_grammar(spec)

    def submit(self, spec: StructuredOutputs) -> Future[llguidance.LLMatcher]:
        """The compiled grammar of `spec` (cached, or being compiled on a thread)."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return future

    def _compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(self._tokenizer, check_grammar(spec), log_level=0)
        if matcher.is_error():
            with self._lock:
                self._cache.pop(spec.key, None)
            raise GrammarError(f"structured_outputs.{spec.kind}: {matcher.get_error()}")
        self.compile_s += time.perf_counter() - start
        self.compiled += 1
        return matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarMatcher:
    """One request's place in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, compiled: llguidance.LLMatcher) -> None:
        self._matcher = compiled.deep_copy()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` ([B, words] int32, on the
        host, contiguous)."""
        v = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept(self, token: int) -> None:
        """Advance past a sampled token (one the mask allowed)."""
        self._matcher.consume_token(token)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    @property
    def done(self) -> bool:
        """The grammar is complete and takes no more tokens (but EOS)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""
