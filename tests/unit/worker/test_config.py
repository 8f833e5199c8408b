from __future__ import annotations

import pytest
from pydantic import ValidationError

from swaserve.worker.config import EngineConfig


def test_defaults_and_kv_config() -> None:
    cfg = EngineConfig(model="m", max_total_tokens=4096, page_size=4, chunked_prefill_size=256)
    kv = cfg.kv_memory_config()
    assert (kv.max_total_tokens, kv.kv_cache_bytes, kv.page_size) == (4096, None, 4)
    cfg = EngineConfig(model="m")
    assert cfg.kv_memory_config(kv_cache_bytes=123).kv_cache_bytes == 123


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_cache_bytes": 10, "max_total_tokens": 10}, "not both"),
        ({"swa_full_tokens_ratio": "auto"}, "expected_seq_len"),
        (
            {"swa_full_tokens_ratio": "auto", "expected_seq_len": 100, "max_total_tokens": 64},
            "use kv_cache_bytes",
        ),
        ({"swa_full_tokens_ratio": 1.5}, r"\(0, 1\]"),
        ({"swa_full_tokens_ratio": 0.0}, r"\(0, 1\]"),
        ({"page_size": 4, "max_total_tokens": 10}, "multiple of page_size"),
        ({"page_size": 16, "chunked_prefill_size": 100}, "multiple of page_size"),
        ({"chunked_prefill_size": 4096, "max_prefill_tokens": 1024}, "exceeds max_prefill_tokens"),
        ({"device": "tpu"}, "device must be"),
        ({"device": "cpu", "attention_backend": "flash"}, "CUDA"),
        ({"page_size": 0}, "greater than or equal to 1"),
        ({"tp_size": 0}, "greater than or equal to 1"),
        ({"dtype": "int8"}, "dtype"),
        ({"no_such_knob": 1}, "Extra inputs"),
    ],
)
def test_invalid_configs_have_clear_messages(kwargs: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EngineConfig(model="m", **kwargs)
