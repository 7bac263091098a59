"""Every exception mooncake-vllm raises.

Each subclasses a builtin so callers can catch what they already expect
(``ValueError`` for bad input, ``ConnectionError`` for an unreachable peer), and
each message says what was found, what was expected and how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CallRejected",
    "CallTimedOut",
    "ConfigError",
    "ConfigProblem",
    "ServiceError",
    "StoreError",
    "StoreUnavailableError",
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
