"""Find and remove Transfer Engine metadata whose owner process is gone.

Before Mooncake v0.3.12 nobody deletes ``mooncake/ram/<seg>`` and
``mooncake/rpc_meta/<seg>`` when a client crashes, and tutorials say "restart
mooncake_master". Instead, :func:`collect_garbage` probes each segment's
owner and deletes the entries of segments nobody answers for.

Which address is probed (observed on 0.3.13.post1: the port in the segment
name is *not* listened on; the owner listens on ``rpc_meta.rpc_port`` and on
the descriptor's ``tcp_data_port``):

* ``rpc_meta`` → ``ip_or_host_name:rpc_port``; ``ram`` → ``tcp_data_host`` (or
  the segment's host) ``:tcp_data_port``. These are *authoritative*.
* the segment name's ``host:port`` as a last resort (older releases listen there).

Deleting a living client's entries breaks every transfer to it, so the evidence
for "dead" is strict:

* the master is asked first when its HTTP address is given (``master=``): a
  segment it lists as mounted (``/get_all_segments``: its owner heartbeats
  within ``client_ttl``) is ``alive`` whatever TCP says;
* only a *refused* connection on every authoritative address is evidence of
  death. A timeout (an overloaded owner whose accept queue is full), an
  unreachable network or any other error is ``unknown``, never dead;
* with ``apply=True`` a dead segment is observed dead ``rounds`` times spread
  over ``grace`` seconds, then, immediately before each delete, the master and
  the owner are asked once more and the entry must still hold the value that
  was probed. After the delete the owner is probed again: if it answers (it
  restarted with identical values in between) the entry is put back.
"""

from __future__ import annotations

import errno
import json
import socket
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from mooncake_vllm.errors import StoreError, StoreUnavailableError
from mooncake_vllm.metadata.backends import MetadataBackend
from mooncake_vllm.metadata.entries import KIND_RAM, KIND_RPC_META, ROOT, EntryKey, parse_key, rpc_address

__all__ = ["ALIVE", "DEAD", "DEFAULT_GRACE", "DEFAULT_ROUNDS", "UNKNOWN", "GcReport", "SegmentStatus",
           "collect_garbage", "master_segments", "probe", "probe_state", "scan"]

ALIVE, DEAD, UNKNOWN = "alive", "dead", "unknown"
#: seconds over which a dead segment must stay dead before ``--apply`` deletes it (Mooncake's default client_ttl)
DEFAULT_GRACE = 10.0
#: observations (all "refused") needed within the grace period
DEFAULT_ROUNDS = 3
#: largest /get_all_segments answer read from the master
_MAX_MASTER_BYTES = 4 << 20


@dataclass(frozen=True)
class SegmentStatus:
    """One segment's entries and what probing its owner found."""

    segment: str
    cluster_id: str | None
    keys: tuple[str, ...]
    addresses: tuple[str, ...]  # "host:port" probed, authoritative first
    state: str  # ALIVE | DEAD | UNKNOWN
    reason: str


@dataclass
class GcReport:
    """What :func:`collect_garbage` found and did."""

    backend: str
    applied: bool
    segments: list[SegmentStatus] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # dead at first, but alive/changed/unknown later
    kept_why: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    master: str | None = None  # the master's HTTP address asked, if any

    @property
    def stale(self) -> list[SegmentStatus]:
        return [s for s in self.segments if s.state == DEAD]

    def keep(self, key: str, why: str) -> None:
        if key not in self.kept_why:
            self.kept.append(key)
        self.kept_why[key] = why

    def to_dict(self) -> dict:
        return {
            "backend": self.backend,
            "applied": self.applied,
            "master": self.master,
            "segments": [asdict(s) for s in self.segments],
            "stale_keys": [k for s in self.stale for k in s.keys],
            "deleted": list(self.deleted),
            "kept": list(self.kept),
            "kept_why": dict(self.kept_why),
            "errors": list(self.errors),
        }


def probe(host: str, port: int, timeout: float) -> str | None:
    """None when ``host:port`` accepts a TCP connection within ``timeout``, else why not."""
    return probe_state(host, port, timeout)[1] or None


def probe_state(host: str, port: int, timeout: float) -> tuple[str, str]:
    """``(ALIVE, "")`` when ``host:port`` accepts; ``(DEAD, why)`` only when the connection is *refused*
    (nothing listens there); ``(UNKNOWN, why)`` for a timeout, an unreachable host or anything else."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return ALIVE, ""
    except ConnectionRefusedError as exc:
        return DEAD, exc.strerror or "Connection refused"
    except TimeoutError:
        return UNKNOWN, f"no answer within {timeout:g} s (busy or unreachable, not proof of death)"
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:  # Defensive: always ConnectionRefusedError on CPython
            return DEAD, exc.strerror or "Connection refused"
        return UNKNOWN, f"{exc.strerror or type(exc).__name__} (not proof of death)"


def master_segments(url: str, timeout: float) -> set[str]:
    """Segments the master lists as mounted (``GET {url}/get_all_segments``, one name a line).

    ``url`` is the master's HTTP (metrics) address, e.g. ``http://127.0.0.1:9003``.
    Raises :class:`StoreUnavailableError` when it does not answer 200.
    """
    base = url.rstrip("/")
    if "://" not in base:
        base = "http://" + base
    try:
        with urllib.request.urlopen(f"{base}/get_all_segments", timeout=timeout) as resp:  # noqa: S310 - http(s)
            body = resp.read(_MAX_MASTER_BYTES + 1)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise StoreUnavailableError(f"mooncake_master at {base} did not list its segments "
                                    f"(GET /get_all_segments): {exc}") from None
    if len(body) > _MAX_MASTER_BYTES:
        raise StoreUnavailableError(f"mooncake_master at {base}: /get_all_segments answer larger than "
                                    f"{_MAX_MASTER_BYTES} bytes")
    return {line.strip() for line in body.decode("utf-8", "replace").splitlines() if line.strip()}


def _addresses(entries: dict[str, tuple[EntryKey, bytes]]) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(authoritative, fallback) addresses of one segment's owner."""
    auth: list[tuple[str, int]] = []
    fallback: list[tuple[str, int]] = []
    for parsed, value in entries.values():
        if parsed.kind == KIND_RPC_META:
            addr = rpc_address(value)
            if addr:
                auth.append(addr)
        elif parsed.kind == KIND_RAM:
            try:
                doc = json.loads(value)
                port = int(doc.get("tcp_data_port") or 0)
                host = str(doc.get("tcp_data_host") or parsed.host)
            except (ValueError, TypeError, AttributeError):
                continue
            if 0 < port < 65536:
                auth.append((host, port))
        if parsed.port:
            fallback.append((parsed.host, parsed.port))
    dedup = list(dict.fromkeys(auth))
    return dedup, [a for a in dict.fromkeys(fallback) if a not in dedup]


def _judge(segment: str, entries: dict[str, tuple[EntryKey, bytes]], timeout: float,
           mounted: set[str] | None = None) -> SegmentStatus:
    auth, fallback = _addresses(entries)
    first = next(iter(entries.values()))[0]
    addresses = tuple(f"{h}:{p}" for h, p in auth + fallback)

    def status(state: str, reason: str) -> SegmentStatus:
        return SegmentStatus(segment=segment, cluster_id=first.cluster_id, keys=tuple(sorted(entries)),
                             addresses=addresses, state=state, reason=reason)

    if mounted is not None and segment in mounted:
        return status(ALIVE, "mounted on the master (its owner heartbeats within client_ttl)")
    results: list[str] = []
    refused_auth = 0
    for i, (host, port) in enumerate(auth + fallback):
        state, why = probe_state(host, port, timeout)
        if state == ALIVE:
            results.append(f"{host}:{port} accepts connections")
            return status(ALIVE, "; ".join(results))
        results.append(f"{host}:{port} {why}")
        if state == DEAD and i < len(auth):
            refused_auth += 1
    if not results:
        results.append("no probeable address in the entries")
    # dead only when every authoritative address actively refused (and the master, if asked, lists it not)
    state = DEAD if auth and refused_auth == len(auth) else UNKNOWN
    return status(state, "; ".join(results))


def scan(backend: MetadataBackend, *, timeout: float = 1.0, prefix: str = ROOT,
         master: str | None = None) -> list[SegmentStatus]:
    """Group ``ram``/``rpc_meta`` entries by segment and probe each owner (concurrently).

    With ``master`` (its HTTP address), segments it lists as mounted are alive.
    """
    mounted = master_segments(master, timeout) if master else None
    return _scan(backend, timeout, prefix, mounted)[0]


Groups = dict[tuple[str | None, str], dict[str, tuple[EntryKey, bytes]]]


def _read(backend: MetadataBackend, prefix: str) -> Groups:
    groups: Groups = defaultdict(dict)
    for key in backend.list(prefix):
        parsed = parse_key(key)
        if parsed is None:
            continue
        value = backend.get(key)
        if value is None:  # deleted meanwhile
            continue
        groups[(parsed.cluster_id, parsed.segment)][key] = (parsed, value)
    return groups


def _judge_all(groups: Groups, timeout: float, mounted: set[str] | None) -> list[SegmentStatus]:
    if not groups:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(groups))) as pool:
        statuses = list(pool.map(lambda item: _judge(item[0][1], item[1], timeout, mounted), groups.items()))
    return sorted(statuses, key=lambda s: (s.cluster_id or "", s.segment))


def _scan(backend: MetadataBackend, timeout: float, prefix: str,
          mounted: set[str] | None) -> tuple[list[SegmentStatus], Groups]:
    groups = _read(backend, prefix)
    return _judge_all(groups, timeout, mounted), groups


def collect_garbage(backend: MetadataBackend, *, apply: bool = False, timeout: float = 1.0,
                    prefix: str = ROOT, master: str | None = None, grace: float = DEFAULT_GRACE,
                    rounds: int = DEFAULT_ROUNDS, sleep: Callable[[float], None] = time.sleep) -> GcReport:
    """Report (and with ``apply=True`` delete) entries of segments whose owner is gone.

    ``master`` is the mooncake_master's HTTP address (``http://host:metrics_port``);
    when given it is asked first, and an unanswering master means nothing is deleted.
    With ``apply`` a segment must be observed dead ``rounds`` times over ``grace``
    seconds before its entries are deleted (see the module doc).
    """
    report = GcReport(backend=backend.url, applied=apply, master=master)
    mounted: set[str] | None = None
    if master:
        try:
            mounted = master_segments(master, timeout)
        except StoreUnavailableError as exc:
            report.errors.append(f"{exc}; nothing is deleted without the master's view")
            apply = False
    segments, groups = _scan(backend, timeout, prefix, mounted)
    report.segments = segments
    if not apply:
        return report
    by_name = {(s.cluster_id, s.segment): s for s in report.stale}
    candidates: Groups = {k: v for k, v in groups.items() if k in by_name}
    rounds = max(1, int(rounds))
    for _ in range(rounds - 1):  # repeated evidence over the grace period
        if not candidates:
            break
        sleep(max(0.0, grace) / max(1, rounds - 1))
        candidates = _still_dead(backend, candidates, timeout, master, report)
    for (_cluster, segment), entries in candidates.items():
        _delete_segment(backend, segment, entries, timeout, master, report)
    return report


def _fresh_mounted(master: str | None, timeout: float, report: GcReport) -> tuple[bool, set[str] | None]:
    """(usable, mounted): the master's view now; unusable when it was given and does not answer."""
    if not master:
        return True, None
    try:
        return True, master_segments(master, timeout)
    except StoreUnavailableError as exc:
        report.errors.append(str(exc))
        return False, None


def _still_dead(backend: MetadataBackend, candidates: Groups, timeout: float, master: str | None,
                report: GcReport) -> Groups:
    """The candidates whose values are unchanged and whose owner is still dead."""
    usable, mounted = _fresh_mounted(master, timeout, report)
    survivors: Groups = {}
    for name, entries in candidates.items():
        if not usable:
            for key in entries:
                report.keep(key, "the master stopped answering during the grace period")
            continue
        try:
            changed = [k for k, (_, v) in entries.items() if backend.get(k) != v]
        except (StoreError, StoreUnavailableError) as exc:
            report.errors.append(f"{name[1]}: {exc}")
            changed = list(entries)
        if changed:
            for key in entries:
                report.keep(key, "re-registered since the first probe")
            continue
        status = _judge(name[1], entries, timeout, mounted)
        if status.state != DEAD:
            for key in entries:
                report.keep(key, f"{status.state} on a later probe: {status.reason}")
            continue
        survivors[name] = entries
    return survivors


def _delete_segment(backend: MetadataBackend, segment: str, entries: dict[str, tuple[EntryKey, bytes]],
                    timeout: float, master: str | None, report: GcReport) -> None:
    for key, (_, value) in sorted(entries.items()):
        try:
            if backend.get(key) != value:
                report.keep(key, "re-registered since the probe")
                continue
            # immediately before the delete: the master and the owner once more
            usable, mounted = _fresh_mounted(master, timeout, report)
            status = _judge(segment, entries, timeout, mounted) if usable else None
            if status is None or status.state != DEAD:
                report.keep(key, f"{status.state} when re-probed before the delete: {status.reason}"
                            if status else "the master did not answer before the delete")
                continue
            backend.delete(key)
            # a restart with identical values between that probe and the delete: put the entry back
            after = _judge(segment, entries, timeout, None)
            if after.state == ALIVE:
                if backend.get(key) is None:
                    backend.put(key, value)
                report.keep(key, f"its owner answered right after the delete ({after.reason}); entry restored")
                continue
            report.deleted.append(key)
        except (StoreError, StoreUnavailableError) as exc:
            report.errors.append(f"{key}: {exc}")
