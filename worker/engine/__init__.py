"""The host side of one engine (architecture §4): the engine's step and request API, the serving
loop that drives it, the scheduler, the KV manager, requests, the decode batch and stats. It
holds host state only: no CUDA call, no model or attention code (those are `runner/`'s)."""
