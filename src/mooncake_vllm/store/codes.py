"""Mooncake's return codes, by name, and the one way we call into the binding."""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum
from typing import Any

__all__ = ["Code", "call", "describe", "is_fatal"]


class Code(IntEnum):
    """The codes ``mooncake.store`` calls return (``mooncake-store-api.md``)."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    NO_AVAILABLE_HANDLE = -200
    INVALID_VERSION = -300
    INVALID_PARAMS = -600
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    RPC_TIMEOUT = -901


#: the pool is away: stop calling it for a while
_FATAL = {Code.INTERNAL_ERROR, Code.RPC_FAIL, Code.RPC_TIMEOUT}

#: what each failure means for an operator, and what fixes it
_CAUSES = {
    Code.NO_AVAILABLE_HANDLE: "the pool is full (raise the holder's global_segment_size or "
                              "let the master evict: --eviction_high_watermark_ratio)",
    Code.OBJECT_NOT_FOUND: "the object is gone: its segment was unmounted (a holder died or "
                           "missed its heartbeats: raise the master's --client_ttl) or it "
                           "was evicted",
    Code.LEASE_EXPIRED: "the object's lease expired mid-read (treated as a miss)",
    Code.TRANSFER_FAIL: "the segment holding the object is unreachable (its holder died)",
    Code.SEGMENT_NOT_FOUND: "the segment is gone (a holder stopped or was declared dead)",
    Code.RPC_FAIL: "the master is unreachable or runs another Mooncake release",
    Code.RPC_TIMEOUT: "the master did not answer in time",
    Code.INVALID_PARAMS: "the value does not fit the client's buffer",
}


def describe(code: int) -> str:
    """``NAME (-N): cause`` for a return code."""
    try:
        name = Code(code)
    except ValueError:
        return f"code {code}"
    cause = _CAUSES.get(name)
    return f"{name.name} ({int(code)})" + (f": {cause}" if cause else "")


def is_fatal(code: int) -> bool:
    """Whether ``code`` says the pool itself is away (not just this object)."""
    return code in _FATAL


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """Call into Mooncake; an exception becomes the returned value (never raised)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - pybind raises TypeError/RuntimeError
        return exc
