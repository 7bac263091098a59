"""PoolAudit (v1/refill.py): which local-hit chunks are due for a check of the pool."""

from __future__ import annotations

from mooncake_vllm.v1.refill import PoolAudit


class Clock:
    now = 50.0

    def __call__(self) -> float:
        return self.now


def test_chunks_found_recently_are_not_due_and_turn_due_after_the_interval() -> None:
    clock = Clock()
    audit = PoolAudit(interval=10.0, clock=clock)
    assert audit.due_from(["a", "b", "c"]) == 0
    audit.found(["a", "b"])
    assert audit.due_from(["a", "b", "c"]) == 2
    assert audit.due_from(["a", "b"]) is None
    clock.now += 9.9
    assert audit.due_from(["a", "b"]) is None
    clock.now += 0.1
    assert audit.due_from(["a", "b"]) == 0


def test_the_least_recently_found_are_forgotten_first() -> None:
    clock = Clock()
    audit = PoolAudit(interval=10.0, capacity=2, clock=clock)
    audit.found(["a", "b"])
    audit.found(["a"])  # a found again: b is now the oldest
    audit.found(["c"])
    assert audit.due_from(["a"]) is None and audit.due_from(["c"]) is None
    assert audit.due_from(["b"]) == 0


def test_forget_makes_every_chunk_due() -> None:
    audit = PoolAudit(interval=10.0, clock=Clock())
    audit.found(["a", "b"])
    audit.forget()
    assert audit.due_from(["a", "b"]) == 0
