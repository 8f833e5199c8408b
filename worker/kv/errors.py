"""Typed errors of the KV memory layer."""

from __future__ import annotations


class KVError(Exception):
    """Base class of KV memory errors."""


class InvalidFree(KVError, ValueError):
    """A free of slots that are out of range, padding, or already free. Nothing was freed."""


class AllocatorCorrupted(KVError, AssertionError):
    """`check()` found a broken allocator invariant (leak, double free, double ownership)."""
