"""Every exception mooncake-vllm raises.

Each subclasses a builtin so callers can catch what they already expect
(``ValueError`` for bad input, ``ConnectionError`` for an unreachable peer), and
each message says what was found, what was expected and how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "CallRejected",
    "CallTimedOut",
    "ConfigError",
    "ConfigProblem",
    "JsonBodyError",
    "MetadataFullError",
    "NotRegularFileError",
    "ProxyError",
    "ServiceError",
    "StoreError",
    "StoreUnavailableError",
    "TooLargeError",
    "UndeclaredCounterError",
    "UnsafeHashingError",
    "UnsupportedModelError",
    "UnsupportedVersionError",
]


@dataclass(frozen=True)
class ConfigProblem:
    """One problem in a configuration: which field, what is wrong, how to fix it."""

    field: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}: {self.problem} (fix: {self.fix})"


class ConfigError(ValueError):
    """A configuration is invalid; ``problems`` lists every problem found at once."""

    def __init__(self, source: str, problems: list[ConfigProblem]) -> None:
        self.source = source
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        count = len(self.problems)
        super().__init__(
            f"invalid Mooncake configuration in {source}: "
            f"{count} problem{'s' if count != 1 else ''}\n{lines}"
        )

    @property
    def fields(self) -> list[str]:
        return [p.field for p in self.problems]


class ServiceError(RuntimeError):
    """A local service (master, metadata, holder, etcd, redis, vLLM) could not be found,
    did not come up, or died."""


class StoreUnavailableError(ConnectionError):
    """The Mooncake master or metadata service cannot be reached in time."""


class StoreError(RuntimeError):
    """A Transfer Engine metadata store (etcd, redis, an HTTP metadata server) answered a
    request with an error; ``code`` is the HTTP status or backend code when there is one.

    The Mooncake data path never raises it: a failed pool call is a miss, counted
    in :class:`~mooncake_vllm.stats.StoreStats`.
    """

    def __init__(self, message: str, code: int | None = None) -> None:
        self.code = code
        super().__init__(message if code is None else f"{message} (Mooncake error code {code})")


class MetadataFullError(StoreError):
    """A put the in-process metadata store refuses: its total size or key count cap would be exceeded."""


class NotRegularFileError(OSError):
    """The path is a FIFO, device, socket or directory."""


class TooLargeError(OSError):
    """The file holds more than the limit (``size`` is what was seen: st_size, or limit + 1 read)."""

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size


class JsonBodyError(ValueError):
    """A body that is not acceptable JSON; ``str`` is the reason for the 400."""


class ProxyError(RuntimeError):
    """An error answer of the proxy to its client: HTTP status, OpenAI-style type, message;
    ``reason`` names it in the proxy's error counters."""

    def __init__(self, status: int, message: str, kind: str = "upstream_error", *, reason: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.reason = reason or kind

    def body(self) -> dict[str, Any]:
        """The OpenAI-style error body."""
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}

    def headers(self) -> dict[str, str] | None:
        """Headers of the answer: a 503 asks the client to retry in a second."""
        return {"Retry-After": "1"} if self.status == 503 else None


class UnsafeHashingError(RuntimeError):
    """vLLM's own block hashes would differ between processes in this setup."""


class UnsupportedVersionError(RuntimeError):
    """The installed vLLM or Mooncake cannot do what the configuration asks."""


class UnsupportedModelError(RuntimeError):
    """The model's KV cache is of a kind the connector cannot store or load safely
    (a hybrid model's sliding-window or Mamba groups); raised at start."""


class CallTimedOut(TimeoutError):
    """A Mooncake call did not return within its deadline (it keeps its worker until it does)."""


class CallRejected(ConnectionError):
    """A Mooncake call was refused: every worker of its box is busy with unanswered calls."""


class UndeclaredCounterError(KeyError):
    """A counter name its counters never declared (raised only when counters are strict:
    ``$MOONCAKE_VLLM_STRICT_COUNTERS``, which the test suite sets)."""
