"""The plumbing every pool call goes through: store handles, time boxes, failure noting.

A :class:`Transport` owns what :class:`~mooncake_vllm.store.client.StoreClient`,
staged loads (:mod:`~mooncake_vllm.store.fetch`), zero-copy loads
(:mod:`~mooncake_vllm.store.direct`) and puts (:mod:`~mooncake_vllm.store.puts`)
share: the Mooncake store handles, the bounded worker pools with deadlines
(:mod:`~mooncake_vllm.store.timebox`), the pool's health (its breaker), the
counters and the rate-limited failure log. They all take it as a value and use
only its public names.

**Lanes.** One Mooncake client (one transfer engine) moves ~3 GB/s over TCP
however many threads call it; several clients in ONE process, each with its own
transfer engine, move more when the pool has several holders (measured on a
16-core H200 host: four clients over four holders 10.3 GB/s; docs/gpu.md). A
transport has one or more :class:`Lane` s: lane 0 is the client that connected
first (it answers lookups, markers and control calls and, with a
``global_segment_size``, holds the segment); more lanes are pure clients opened
by :meth:`Transport.add_lanes` that carry block transfers only. Every memory
region registered for transfers is registered with every lane.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_vllm.config import StoreConfig
from mooncake_vllm.errors import CallRejected, CallTimedOut
from mooncake_vllm.stats import StoreStats
from mooncake_vllm.store.codes import Code, call, describe, is_fatal
from mooncake_vllm.store.health import FailureLog, PoolHealth
from mooncake_vllm.store.holders import HolderGuard
from mooncake_vllm.store.timebox import STALL_GRACE, LateRelease, TimeBox

__all__ = ["FULL_WAITS", "MIN_RATE", "Lane", "Transport"]

log = logging.getLogger(__name__)

#: slowest transfer rate a put/get is allowed before it counts as hung (bytes/s)
MIN_RATE = 200e6
#: after "pool full", skip saves this long (backpressure, not an error storm)
FULL_BACKOFF = 5.0
#: with a disk tier (``enable_ssd_offload``) "full" means DRAM holds values not yet on disk,
#: which the holders write within one offload heartbeat (1 s as we start them), and the master
#: then evicts a few at a time: keys a put finds it so are put again after waits growing
#: from the first to the second value, until a retry stores none for the third (seconds);
#: saves pause only TIER_FULL_BACKOFF after one still refused
FULL_WAITS = (0.05, 0.4, 2.0)
TIER_FULL_BACKOFF = 1.0


class Lane:
    """One Mooncake store client and the worker pools its block transfers run on."""

    def __init__(self, store: Any, index: int) -> None:
        self.store = store
        self.index = index
        #: loads: two fetches in flight per lane (verifying one overlaps the next); two spare
        #: workers take over from fetches abandoned on a hung holder (HolderGuard), so the
        #: other holders' loads are not refused while it hangs
        self.transfers = TimeBox(f"transfer{index}", 2, spare=2, grace=STALL_GRACE)
        #: puts of the save thread, never competing with loads
        self.saves = TimeBox(f"save{index}", 1, grace=STALL_GRACE)

    def boxes(self) -> tuple[TimeBox, ...]:
        """The time boxes whose calls run in this lane's store client."""
        return self.transfers, self.saves

    def close(self) -> None:
        for box in self.boxes():
            box.close()


class Transport:
    """Store handles (:attr:`lanes`), time boxes, health, counters and failure lines."""

    def __init__(self, store: Any, config: StoreConfig, *, op_timeout: float = 5.0,
                 lookup_timeout: float = 1.0, cooldown: float = 3.0,
                 cleanup: Callable[[], None] | None = None) -> None:
        self.config = config
        self.stats = StoreStats()
        self.op_timeout = op_timeout
        #: existence queries sit on the scheduler's path
        self.lookup_timeout = min(lookup_timeout, op_timeout)
        self.lanes: list[Lane] = [Lane(store, 0)]
        # separate boxes: a save (on the save thread) never holds the worker a scheduler
        # lookup or a load needs, so neither waits behind it (nor is refused for it)
        self.lookups = TimeBox("lookup", 1)
        self.save_lookups = TimeBox("save-lookup", 1, grace=STALL_GRACE)
        #: the scheduler's audits of vLLM's own hits, from their own thread (v1/audits.py)
        self.audit_lookups = TimeBox("audit-lookup", 1)
        self.control = TimeBox("control", 1)
        #: hand-off markers, each box with one caller thread (a worker's save thread
        #: publishes, the scheduler's waiter reads), never competing with lookups
        self.publish = TimeBox("publish", 1, grace=STALL_GRACE)
        self.markers = TimeBox("markers", 1)
        self.health = PoolHealth(config.master_server_address, self.probe, self.stats,
                                 cooldown=cooldown)
        self.failures = FailureLog()
        #: per-holder time box: a hung holder costs its blocks, not the whole pool
        self.holders = HolderGuard(self, cooldown=cooldown)
        self.closed = False
        self.full_until = 0.0
        #: waits before retrying puts refused for a full pool: only with a disk tier (DRAM-only
        #: pools evict on their own and a refused save is dropped, as before)
        self.full_waits: tuple[float, float, float] | None = FULL_WAITS if config.ssd_offload else None
        self._cleanup = cleanup
        self._regions: list[tuple[int, int]] = []
        self._lanes_lock = threading.Lock()

    # ------------------------------------------------------------------ handles
    @property
    def store(self) -> Any:
        """Lane 0's ``MooncakeDistributedStore`` (lookups, values, markers, control)."""
        return self.lanes[0].store

    def admits(self) -> bool:
        """Whether a call may go to the pool now (open, breaker closed)."""
        return not self.closed and self.health.admit()

    def add_lanes(self, want: int, open_lane: Callable[[], Any]) -> int:
        """Open lanes until there are ``want`` (each ``open_lane()`` is bounded by its own
        timeout); registers every known region with each. Returns the lane count."""
        with self._lanes_lock:
            while len(self.lanes) < want and not self.closed:
                try:
                    store = open_lane()
                except (ConnectionError, OSError) as exc:
                    log.warning("mooncake-vllm: opened %d of %d store clients (%s); transfers "
                                "use %d", len(self.lanes), want, exc, len(self.lanes))
                    break
                if not all(_register(store, *r) for r in self._regions):
                    log.warning("mooncake-vllm: an extra store client could not register the "
                                "staging memory; transfers use %d client(s)", len(self.lanes))
                    call(store.close)
                    break
                self.lanes.append(Lane(store, len(self.lanes)))
            return len(self.lanes)

    def register(self, ptr: int, nbytes: int) -> bool:
        """Register ``[ptr, ptr + nbytes)`` for transfers with every lane."""
        ok = all(_register(lane.store, ptr, nbytes) for lane in self.lanes)
        if ok:
            self._regions.append((ptr, nbytes))
        return ok

    # ------------------------------------------------------------------ calls
    def run(self, box: TimeBox, timeout: float, fn: Callable[..., Any], *args: Any,
            late: LateRelease | None = None, breaker: bool = True) -> Any:
        """A time-boxed call (an exception comes back as the value); failures of the
        pool itself (deadline, refused, raised) open the breaker, unless ``breaker`` is
        false (a poll that will simply be asked again: its lateness is no outage)."""
        try:
            result = box.run(timeout, fn, *args,
                             on_done=late.returned if late is not None else None)
        except CallTimedOut as exc:
            self.timed_out(exc, late, breaker=breaker)
            return exc
        except CallRejected as exc:
            self.rejected(exc, breaker=breaker)
            return exc
        if isinstance(result, BaseException) and breaker:
            self.health.failed(f"{getattr(fn, '__name__', 'call')} raised {type(result).__name__}")
        return result

    def timed_out(self, exc: CallTimedOut, late: LateRelease | None = None, *,
                  breaker: bool = True) -> None:
        """Count a call abandoned at its deadline (its memory comes back when it returns)."""
        self.stats.add("timeouts")
        if late is not None:
            late.timed_out()
        if breaker:
            self.health.failed(str(exc))

    def rejected(self, exc: CallRejected, *, breaker: bool = True) -> None:
        """Count a call refused because every worker of its box is held."""
        self.stats.add("rejected")
        if breaker:
            self.health.failed(str(exc))

    def transfer_timeout(self, nbytes: int) -> float:
        """The deadline of a transfer of ``nbytes``: the op timeout plus :data:`MIN_RATE`."""
        return self.op_timeout + nbytes / MIN_RATE

    def probe(self) -> bool:
        """One real call: does the master answer an existence query in time?"""
        try:
            rc = self.control.run(self.op_timeout, self.store.is_exist, "mcv/probe")
        except (CallTimedOut, CallRejected):
            return False
        return not isinstance(rc, BaseException) and rc >= 0

    def batch_exist(self, keys: list[str]) -> list[int]:
        """Mooncake's existence codes of ``keys`` (1 present, 0 absent, < 0 error); unboxed."""
        if hasattr(self.store, "batch_is_exist"):
            return list(self.store.batch_is_exist(keys))
        return [self.store.is_exist(k) for k in keys]

    def remove(self, key: str) -> Any:
        """Remove ``key``, leases ignored where the release can (unboxed)."""
        try:
            return self.store.remove(key, True)
        except TypeError:  # releases before remove(force)
            return self.store.remove(key)

    def remove_matching(self, pattern: str) -> int | None:
        """Remove every key matching the regular expression ``pattern`` in one time-boxed
        call, leases ignored; the count removed, or ``None`` when the pool is away or has no
        ``remove_by_regex`` (Mooncake < 0.3.6)."""
        remove = getattr(self.store, "remove_by_regex", None)
        if remove is None or not self.admits():
            return None
        rc = self.run(self.control, self.op_timeout, remove, pattern, True)
        return rc if isinstance(rc, int) and not isinstance(rc, bool) and rc >= 0 else None

    def note_failures(self, op: str, codes: Sequence[Any]) -> list[int]:
        """Count, log (rate-limited, by cause) and react to failed codes of one batch."""
        failed = [c for c in codes if isinstance(c, int) and c < 0
                  and c not in (Code.OBJECT_ALREADY_EXISTS, Code.OBJECT_NOT_FOUND)]
        if op == "put":
            failed += [c for c in codes if c == Code.OBJECT_NOT_FOUND]
        for code in sorted(set(failed)):
            n = failed.count(code)
            self.stats.add(f"{op}_failed_{Code(code).name.lower()}" if code in Code._value2member_map_
                           else f"{op}_failed_other", n)
            self.failures.warn(f"{op}{code}", f"mooncake-vllm: {n} block {op}(s) failed with "
                               f"{describe(code)}")
            if code == Code.NO_AVAILABLE_HANDLE:
                backoff = TIER_FULL_BACKOFF if self.full_waits else FULL_BACKOFF
                self.full_until = time.monotonic() + backoff
        if any(is_fatal(c) for c in failed):
            self.health.failed(f"batch {op} returned {sorted(set(failed))}")
        return failed

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Stop every box and close every lane (a dead master must not hang shutdown)."""
        if self.closed:
            return
        self.closed = True
        self.health.close()
        self.holders.close()
        own = [self.lookups, self.save_lookups, self.audit_lookups, self.publish, self.markers,
               self.control]
        for box in own:
            box.close()
        for lane in self.lanes:
            lane.close()
        boxes = [*own, self.holders.box, *(box for lane in self.lanes for box in lane.boxes())]
        deadline = time.monotonic() + self.op_timeout
        # closing a store client under a call still running in it can crash the process (a
        # segfault in CI: a namespace registration's put beside a connector's close)
        if not all(box.drain(max(0.0, deadline - time.monotonic())) for box in boxes):
            log.info("mooncake-vllm: a call into the Mooncake pool is still running at close: "
                     "its store clients are left for the process's exit to close")
        else:
            closers = [threading.Thread(target=call, args=(lane.store.close,), daemon=True,
                                        name="mcv-close") for lane in self.lanes]
            for closer in closers:
                closer.start()
            for closer in closers:
                closer.join(max(0.0, deadline - time.monotonic()))
        if self._cleanup:
            self._cleanup()


def _register(store: Any, ptr: int, nbytes: int) -> bool:
    rc = call(store.register_buffer, ptr, nbytes)
    return isinstance(rc, int) and rc == 0
