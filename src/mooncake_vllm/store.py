"""The one Mooncake store client both engines use.

What it adds over ``mooncake.store.MooncakeDistributedStore``:

* **fail fast** — a dead, wrong or hung master is a :class:`StoreUnavailableError`
  within ``timeout`` seconds (the raw client retries for ~90 s or hangs);
* **version-adaptive calls** — feature detection (``hasattr``) picks the multi-buffer
  zero-copy API (Mooncake ≥0.3.7) or a registered staging buffer; ``rc != 0`` is a
  failure whatever the release's sign convention;
* **integrity** — every value carries a :mod:`~mooncake_vllm.codec` header, so a
  truncated, foreign or corrupt value is a miss, never KV;
* **never stall the engine** — a circuit breaker stops calling a pool that just
  failed, and re-arms only once the master accepts TCP again;
* **counters** — :class:`~mooncake_vllm.stats.StoreStats`.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import xxhash

from mooncake_vllm import codec
from mooncake_vllm.config import StoreConfig
from mooncake_vllm.errors import ConfigError, ConfigProblem, StoreUnavailableError
from mooncake_vllm.layout import BlockLayout
from mooncake_vllm.stats import StoreStats

__all__ = ["CLIENT_ENV_DEFAULTS", "StoreClient", "page_aligned_buffer", "pick_local_hostname"]

log = logging.getLogger(__name__)

#: Environment the Mooncake C++ client reads; set only where the user has not.
CLIENT_ENV_DEFAULTS = {
    "MC_STORE_CLIENT_SETUP_RETRIES": "1",  # default 20 → ~90 s to fail on a wrong master
    "MC_RPC_TIMEOUT_MS": "2000",  # default 30000 → 30 s per RPC on a hung master
    "MC_LOG_LEVEL": "ERROR",
}
_FATAL_CODES = {-1, -900, -901}  # internal error, RPC failure/timeout: the pool is away
_EXISTS = -705
_VALUE_LAYOUT = codec.digest16("mooncake-vllm/value")
_STAGING_BYTES = 64 << 20
_MAX_BATCH = 256


def pick_local_hostname(master_host: str) -> str:
    """The local address that routes to the master (loopback for a local master)."""
    if master_host in ("127.0.0.1", "localhost", "::1", ""):
        return "127.0.0.1"
    try:  # a UDP "connect" sends nothing; it only asks the kernel for a route
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _tcp_reachable(host: str, port: int, timeout: float) -> str | None:
    """``None`` if something accepts TCP at host:port, else the reason."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.timeout:
        return f"no answer within {timeout:.1f} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def _metadata_endpoint(url: str, scheme: str) -> tuple[str, int] | None:
    if scheme == "http":
        hostport = url.split("://", 1)[1].split("/", 1)[0]
    elif scheme == "etcd":
        hostport = url.split("://", 1)[-1].split(",")[0]
    else:
        return None
    host, _, port = hostport.rpartition(":")
    return (host.strip("[]"), int(port)) if port.isdigit() else None


def page_aligned_buffer(nbytes: int) -> tuple[mmap.mmap, int]:
    """Anonymous memory on pages of its own, and its address.

    Mooncake refuses to register two regions that share a page ("does not support
    overlapped memory region"), so buffers we register never come from malloc.
    """
    buf = mmap.mmap(-1, max(nbytes, 1))
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


class _Staging:
    """A registered scratch buffer: header slots, plus block room for the copy path."""

    def __init__(self, nbytes: int) -> None:
        self.buf, self.ptr = page_aligned_buffer(nbytes)
        self.nbytes = nbytes
        self.lock = threading.Lock()

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.buf)[offset:offset + nbytes]


class StoreClient:
    """A connected Mooncake store client; use :meth:`connect`."""

    def __init__(self, store: Any, config: StoreConfig, *, op_timeout: float = 5.0,
                 lookup_timeout: float = 1.0, cooldown: float = 3.0,
                 cleanup: Callable[[], None] | None = None) -> None:
        self._store = store
        self.config = config
        self.stats = StoreStats()
        self._op_timeout = op_timeout
        #: existence queries sit on the scheduler's path: a hung master may cost one
        #: lookup this long before the circuit breaker opens
        self._lookup_timeout = min(lookup_timeout, op_timeout)
        self._cooldown = cooldown
        self._cleanup = cleanup
        self._open_until = 0.0
        self._warned = False
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mcv-lookup")
        self._multi = hasattr(store, "batch_put_from_multi_buffers")
        self._registered: set[tuple[int, int]] = set()
        self._zero_copy: dict[int, bool] = {}
        self._put_stage = self._new_staging()
        self._get_stage = self._new_staging()
        self._closed = False

    # ------------------------------------------------------------------ connect
    @classmethod
    def connect(cls, config: StoreConfig, *, timeout: float = 5.0,
                store_factory: Callable[[], Any] | None = None) -> StoreClient:
        """Set up a client, or raise :class:`StoreUnavailableError` within ``timeout``."""
        for name, value in CLIENT_ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        metadata, cleanup = cls._resolve_metadata(config)
        host, port = config.master_host_port
        hostname = config.local_hostname or pick_local_hostname(host)
        if not config.master_server_address.startswith("etcd://"):
            reason = _tcp_reachable(host, port, min(timeout, 2.0))
            if reason:
                raise StoreUnavailableError(
                    f"no Mooncake master at {config.master_server_address} ({reason}); "
                    f"start one (`mooncake_master --rpc_port={port}` or `mooncake-vllm up`) "
                    f"or fix master_server_address in {config.source}")
        endpoint = _metadata_endpoint(metadata, config.metadata_scheme)
        if endpoint:
            reason = _tcp_reachable(*endpoint, min(timeout, 2.0))
            if reason:
                raise StoreUnavailableError(
                    f"no metadata server at {metadata} ({reason}); start it or fix "
                    f"metadata_server in {config.source}")
        if store_factory is None:
            from mooncake.store import MooncakeDistributedStore as store_factory  # noqa: N813
        store = store_factory()
        args = (hostname, metadata, config.global_segment_size, config.local_buffer_size,
                config.protocol, config.device_name, config.master_server_address)
        result: list[Any] = []
        worker = threading.Thread(target=lambda: result.append(_call(store.setup, *args)),
                                  name="mcv-setup", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            raise StoreUnavailableError(
                f"Mooncake setup against master {config.master_server_address} did not finish "
                f"within {timeout:.0f} s: the port answers but the master does not; check that "
                f"it is a mooncake_master of the same release as this client")
        rc = result[0] if result else None
        if isinstance(rc, BaseException) or rc != 0:
            raise StoreUnavailableError(
                f"Mooncake setup failed (returned {rc!r}) for master "
                f"{config.master_server_address}, metadata {metadata}, protocol "
                f"{config.protocol}; check that master and client are the same Mooncake "
                f"release and that local_hostname {hostname!r} is an address of this host")
        log.debug("connected to Mooncake master %s as %s", config.master_server_address, hostname)
        return cls(store, config, op_timeout=timeout, cleanup=cleanup)

    @staticmethod
    def _resolve_metadata(config: StoreConfig) -> tuple[str, Callable[[], None] | None]:
        if config.metadata_scheme != "redis":
            return config.metadata_server, None
        try:
            from mooncake_vllm.metadata.bridge import mooncake_supports_redis, resolve_metadata_url
        except ImportError:  # pragma: no cover - the bridge ships with the package
            raise ConfigError(config.source, [ConfigProblem(
                "metadata_server", "redis:// is not compiled into published Mooncake wheels "
                "(the process would abort with exit code 134)",
                'use "http://host:port/metadata" or run `mooncake-vllm metadata serve '
                '--backend redis://...`')]) from None
        return resolve_metadata_url(config.metadata_server, supports_redis=mooncake_supports_redis())

    def _new_staging(self) -> _Staging:
        stage = _Staging(_STAGING_BYTES if self._multi is False else _MAX_BATCH * codec.HEADER_SIZE)
        rc = _call(self._store.register_buffer, stage.ptr, stage.nbytes)
        if rc != 0:
            log.debug("register_buffer(staging) returned %s", rc)
        return stage

    # ------------------------------------------------------------------ health
    def _available(self) -> bool:
        if self._closed:
            return False
        if time.monotonic() < self._open_until:
            return False
        if self._open_until:  # half-open: call again only if the master accepts TCP
            host, port = self.config.master_host_port
            if _tcp_reachable(host, port, 0.2):
                self._open_until = time.monotonic() + self._cooldown
                return False
            self._open_until = 0.0
            log.warning("Mooncake pool reachable again at %s", self.config.master_server_address)
            self._warned = False
        return True

    def _trip(self, why: str) -> None:
        self._open_until = time.monotonic() + self._cooldown
        self.stats.add("circuit_open")
        if not self._warned:
            self._warned = True
            log.warning("Mooncake pool unavailable (%s): serving misses and skipping saves; "
                        "vLLM recomputes until %s answers again", why,
                        self.config.master_server_address)

    @property
    def healthy(self) -> bool:
        """Whether the client will currently talk to the pool."""
        return self._available()

    # ------------------------------------------------------------------ queries
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Presence of every key, in one batched query; all ``False`` if the pool is away."""
        if not keys:
            return []
        self.stats.add("lookups")
        if not self._available():
            return [False] * len(keys)
        start = time.perf_counter()
        fut = self._pool.submit(_call, self._batch_exist, list(keys))
        try:
            codes = fut.result(timeout=self._lookup_timeout)
        except FutureTimeout:
            self._trip(f"existence query took over {self._lookup_timeout:.1f} s")
            return [False] * len(keys)
        self.stats.observe("exists", time.perf_counter() - start)
        if isinstance(codes, BaseException) or (codes and all(c < 0 for c in codes)):
            self._trip(f"batch_is_exist failed: {codes!r}")
            return [False] * len(keys)
        return [c == 1 for c in codes]

    def _batch_exist(self, keys: list[str]) -> list[int]:
        if hasattr(self._store, "batch_is_exist"):
            return list(self._store.batch_is_exist(keys))
        return [self._store.is_exist(k) for k in keys]

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are all present in the pool."""
        count = 0
        for present in self.exists(keys):
            if not present:
                break
            count += 1
        hits = count
        self.stats.add("hits", hits)
        self.stats.add("misses", len(keys) - hits)
        return count

    # ------------------------------------------------------------------ blocks
    def register_layout(self, layout: BlockLayout) -> None:
        """Register the KV cache memory so blocks move without a copy."""
        ok = True
        for region in layout.regions():
            if region in self._registered:
                continue
            rc = _call(self._store.register_buffer, *region)
            if rc == 0:
                self._registered.add(region)
            else:
                ok = False
        self._zero_copy[id(layout)] = ok and self._multi
        if not self._zero_copy[id(layout)]:
            log.info("KV cache memory not registered with Mooncake (%s): using a staging copy",
                     "no multi-buffer API" if not self._multi else "register_buffer failed")
            if self._multi:  # copy path needs block room in staging
                self._put_stage, self._get_stage = (_Staging(_STAGING_BYTES),
                                                    _Staging(_STAGING_BYTES))
                for stage in (self._put_stage, self._get_stage):
                    _call(self._store.register_buffer, stage.ptr, stage.nbytes)
                self._multi = False

    def put_blocks(self, keys: Sequence[str], layout: BlockLayout,
                   block_ids: Sequence[int]) -> int:
        """Store blocks under ``keys`` (existing keys are skipped); returns how many were new."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        if not keys or not self._available():
            return 0
        present = self.exists(keys)
        todo = [(k, b) for k, b, p in zip(keys, block_ids, present) if not p]
        self.stats.add("skipped_existing", len(keys) - len(todo))
        stored = 0
        step = self._batch_size(layout)
        for i in range(0, len(todo), step):
            stored += self._put_batch(todo[i:i + step], layout)
        return stored

    def get_blocks(self, keys: Sequence[str], layout: BlockLayout,
                   block_ids: Sequence[int]) -> list[bool]:
        """Load blocks into the KV cache; ``True`` where loaded and verified."""
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks")
        if not keys:
            return []
        if not self._available():
            return [False] * len(keys)
        out: list[bool] = []
        step = self._batch_size(layout)
        pairs = list(zip(keys, block_ids))
        for i in range(0, len(pairs), step):
            out += self._get_batch(pairs[i:i + step], layout)
        return out

    def _batch_size(self, layout: BlockLayout) -> int:
        if self._multi:
            return _MAX_BATCH
        return max(1, min(_MAX_BATCH, _STAGING_BYTES // (layout.block_nbytes + codec.HEADER_SIZE)))

    def _put_batch(self, batch: list[tuple[str, int]], layout: BlockLayout) -> int:
        layout_digest = codec.digest16(layout.fingerprint)
        stage = self._put_stage
        with stage.lock:
            ptrs: list[Any] = []
            sizes: list[Any] = []
            slot = 0
            for key, block in batch:
                segs = layout.segments(block)
                header = codec.pack_header(layout.block_nbytes, codec.checksum_segments(segs),
                                           layout_digest, codec.digest16(key))
                if self._multi:
                    off = slot * codec.HEADER_SIZE
                    stage.view(off, codec.HEADER_SIZE)[:] = header
                    ptrs.append([stage.ptr + off] + [p for p, _ in segs])
                    sizes.append([codec.HEADER_SIZE] + [n for _, n in segs])
                    slot += 1
                else:
                    off = slot
                    stage.view(off, codec.HEADER_SIZE)[:] = header
                    pos = off + codec.HEADER_SIZE
                    for p, n in segs:
                        ctypes.memmove(stage.ptr + pos, p, n)
                        pos += n
                    ptrs.append(stage.ptr + off)
                    sizes.append(pos - off)
                    slot = pos
            keys = [k for k, _ in batch]
            start = time.perf_counter()
            if self._multi:
                codes = _call(self._store.batch_put_from_multi_buffers, keys, ptrs, sizes)
            else:
                codes = _call(self._store.batch_put_from, keys, ptrs, sizes)
            self.stats.observe("put", time.perf_counter() - start)
        if isinstance(codes, BaseException):
            self._trip(f"batch put raised {codes!r}")
            return 0
        ok = sum(1 for c in codes if c == 0 or c == _EXISTS)
        self.stats.add("blocks_put", ok)
        self.stats.add("bytes_put", ok * layout.block_nbytes)
        failed = [c for c in codes if c not in (0, _EXISTS)]
        if failed:
            self.stats.add("errors", len(failed))
            if any(c in _FATAL_CODES for c in failed):
                self._trip(f"batch put returned {sorted(set(failed))}")
        return ok

    def _get_batch(self, batch: list[tuple[str, int]], layout: BlockLayout) -> list[bool]:
        layout_digest = codec.digest16(layout.fingerprint)
        stage = self._get_stage
        total = layout.block_nbytes + codec.HEADER_SIZE
        with stage.lock:
            seg_lists = [layout.segments(b) for _, b in batch]
            keys = [k for k, _ in batch]
            start = time.perf_counter()
            if self._multi:
                ptrs = [[stage.ptr + i * codec.HEADER_SIZE] + [p for p, _ in segs]
                        for i, segs in enumerate(seg_lists)]
                sizes = [[codec.HEADER_SIZE] + [n for _, n in segs] for segs in seg_lists]
                codes = _call(self._store.batch_get_into_multi_buffers, keys, ptrs, sizes)
            else:
                ptrs = [stage.ptr + i * total for i in range(len(batch))]
                codes = _call(self._store.batch_get_into, keys, ptrs, [total] * len(batch))
            self.stats.observe("get", time.perf_counter() - start)
            if isinstance(codes, BaseException):
                self._trip(f"batch get raised {codes!r}")
                return [False] * len(batch)
            out: list[bool] = []
            for i, (key, segs) in enumerate(zip(keys, seg_lists)):
                if codes[i] != total:
                    out.append(False)
                    if codes[i] == -704 or codes[i] == 0:
                        self.stats.add("misses")
                    else:
                        self.stats.add("corrupt" if codes[i] > 0 or codes[i] == -600 else "errors")
                    continue
                if self._multi:
                    header = stage.view(i * codec.HEADER_SIZE, codec.HEADER_SIZE)
                    check = segs
                else:
                    header = stage.view(i * total, codec.HEADER_SIZE)
                    check = [(stage.ptr + i * total + codec.HEADER_SIZE, layout.block_nbytes)]
                reason = codec.verify(header, check, layout_digest=layout_digest,
                                      key_digest=codec.digest16(key))
                if reason:
                    log.warning("ignoring stored block %s: %s", key, reason)
                    self.stats.add("corrupt")
                    out.append(False)
                    continue
                if not self._multi:
                    pos = stage.ptr + i * total + codec.HEADER_SIZE
                    for p, n in segs:
                        ctypes.memmove(p, pos, n)
                        pos += n
                out.append(True)
            failed = [c for c in codes if c < 0 and c != -704]
            if any(c in _FATAL_CODES for c in failed):
                self._trip(f"batch get returned {sorted(set(failed))}")
        got = sum(out)
        self.stats.add("blocks_got", got)
        self.stats.add("bytes_got", got * layout.block_nbytes)
        return out

    # ------------------------------------------------------------------ values
    def put_value(self, key: str, data: bytes | memoryview) -> bool:
        """Store a small framed value (e.g. a V0 prompt tail); ``False`` on failure."""
        if not self._available():
            return False
        payload = bytes(data)
        header = codec.pack_header(len(payload), xxhash.xxh3_64_intdigest(payload),
                                   _VALUE_LAYOUT, codec.digest16(key))
        rc = _call(self._store.put, key, header + payload)
        if rc not in (0, _EXISTS):
            self.stats.add("errors")
            if isinstance(rc, BaseException) or rc in _FATAL_CODES:
                self._trip(f"put returned {rc!r}")
            return False
        return True

    def get_value(self, key: str) -> bytes | None:
        """A value stored with :meth:`put_value`, or ``None`` if missing or damaged."""
        if not self._available():
            return None
        raw = _call(self._store.get, key)
        if isinstance(raw, BaseException) or not raw:
            return None
        header = codec.unpack_header(raw)
        payload = bytes(raw[codec.HEADER_SIZE:])
        if (header is None or header.layout_digest != _VALUE_LAYOUT
                or header.key_digest != codec.digest16(key) or header.payload_len != len(payload)
                or header.checksum != xxhash.xxh3_64_intdigest(payload)):
            self.stats.add("corrupt")
            return None
        return payload

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Close the client (its segment, if any, is unmounted by Mooncake)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        closer = threading.Thread(target=_call, args=(self._store.close,), daemon=True,
                                  name="mcv-close")
        closer.start()
        closer.join(self._op_timeout)  # a dead master must not hang shutdown
        if self._cleanup:
            self._cleanup()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """Call into Mooncake; an exception becomes the returned value (never raised)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - pybind raises TypeError/RuntimeError
        return exc
