"""The proxy's subscriber to vLLM's KV event streams (ZMQ, msgpack ``KVEventBatch``).

The proxy BINDS one SUB socket on loopback (``--kv-events``, default
``tcp://127.0.0.1:5557``; ``auto`` = a free port, kept across re-binds, so several
proxies on one host need no ports chosen by hand: the proxy logs it, with the flags
each instance needs, and ``/status`` shows it) and every instance publishes to it with
``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://127.0.0.1:5557", "topic": "<the instance's host:port>"}'``:
vLLM connects (rather than binds) to any endpoint without ``*``, so no instance
opens a port, instances added later need nothing new, and a restarted instance
simply connects again. The topic names the instance; each message is
``(topic, seq: 8-byte big-endian, payload)``.

The live stream alone can lose batches without telling: a ZMQ PUB drops what it
sends before it has learnt the SUB's subscription (the "slow joiner"), which for a
connecting PUB is one reconnect interval (100-200 ms) after the proxy binds, so an
instance started before the proxy loses its first batches, and vLLM publishes
nothing more until its next step. Where the instance also binds vLLM's replay
ROUTER (``replay_endpoint``, one loopback port per instance, told to the proxy
with ``--kv-replay``), :class:`ReplayClient` fetches what the stream missed: from 0
for a stream not heard yet, from the last batch on after a gap, and every
``sync_interval`` seconds to close the join window.

Bounded: at most ``hwm`` messages wait in ZMQ (beyond that ZMQ drops them, and
the sequence gap drops that instance's index). Runs on its own daemon thread;
a failing socket is reopened after ``retry`` seconds and counted. A replay takes at
most ``max_batches`` batches and ``max_seconds`` (its receive queue is unbounded: vLLM's
buffer bounds it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from mooncake_vllm.errors import ConfigError, ConfigProblem
from mooncake_vllm.proxy.instances import parse_endpoint

__all__ = ["AUTO", "END_SEQ", "EventSubscriber", "ReplayAnswer", "ReplayClient", "decode_batch", "missing_modules",
           "parse_replay", "vllm_args"]

log = logging.getLogger(__name__)

#: ``on_batch(topic, seq, events)``; events as msgpack decodes vLLM's tagged structs (dicts)
BatchHandler = Callable[[str, int, list[Any]], None]

#: ``--kv-events auto``: bind this (ZMQ picks a free port; ``EventSubscriber.bound_endpoint`` says which)
AUTO = "tcp://127.0.0.1:*"

#: the sequence number of vLLM's end-of-replay marker (-1 as a signed 8-byte big-endian)
END_SEQ = (1 << 64) - 1


#: what reading vLLM's KV events takes (both come with vLLM; a proxy-only host may lack them)
NEEDS = {"zmq": "pyzmq", "msgspec": "msgspec"}


def missing_modules() -> list[str]:
    """The packages (pip names) ``kv_aware`` needs that this Python cannot import."""
    import importlib.util

    return [pip for mod, pip in NEEDS.items() if importlib.util.find_spec(mod) is None]


def vllm_args(endpoint: str, instance: str, replay: str | None = None) -> tuple[str, ...]:
    """The ``vllm serve`` flags that make the instance at ``instance`` (``host:port``, as the
    proxy names it) publish to the proxy's ``endpoint`` (and, with ``replay``, bind its
    replay socket there: give the proxy the same with ``--kv-replay``) and report cached
    prompt tokens."""
    import json

    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": instance}
    if replay:
        cfg["replay_endpoint"] = replay
    return ("--kv-events-config", json.dumps(cfg), "--enable-prompt-tokens-details")


def decode_batch(payload: bytes) -> list[Any]:
    """The events of one msgpack ``KVEventBatch`` (``[ts, events, dp_rank]``, array-like);
    ``ValueError`` when it is not one."""
    import msgspec

    try:
        doc = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a msgpack KV event batch: {exc}") from None
    if not isinstance(doc, list) or len(doc) < 2 or not isinstance(doc[1], list):
        raise ValueError("not a KV event batch: expected [ts, events, ...]")
    return doc[1]


class EventSubscriber:
    """One bound SUB socket on its own thread, handing each batch to ``on_batch``."""

    def __init__(self, endpoint: str, on_batch: BatchHandler, *, on_lost: Callable[[str], None] | None = None,
                 hwm: int = 10_000, retry: float = 1.0) -> None:
        self.endpoint = AUTO if endpoint == "auto" else endpoint
        self.bound_endpoint: str | None = None  # what was bound (the port ``auto`` got)
        self.on_batch = on_batch
        self.on_lost = on_lost or (lambda _why: None)
        self.hwm = hwm
        self.retry = retry
        self.bad_messages = 0
        self.socket_failures = 0
        self.bound = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """Started and not stopped."""
        return self._thread is not None and not self._stop.is_set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        while not self._stop.is_set():
            sock = ctx.socket(zmq.SUB)
            try:
                sock.setsockopt(zmq.RCVHWM, self.hwm)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.bind(self.bound_endpoint or self.endpoint)  # auto: the same port again on a re-bind
                self.bound_endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
                self.bound.set()
                self._serve(sock, zmq)
            except zmq.ZMQError as exc:
                self.socket_failures += 1
                self.bound.clear()
                self.on_lost(f"KV event socket {self.endpoint} failed: {exc}")
                self._stop.wait(self.retry)
            finally:
                sock.close(linger=0)

    def _serve(self, sock: Any, zmq: Any) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            frames = sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or len(frames[1]) != 8:
                self.bad_messages += 1
                continue
            try:
                events = decode_batch(frames[2])
            except ValueError:
                self.bad_messages += 1
                continue
            topic = frames[0].decode("utf-8", "replace")
            try:
                self.on_batch(topic, int.from_bytes(frames[1], "big"), events)
            except Exception:  # Defensive: a handler bug must not end the stream
                log.exception("KV event handler failed for topic %r", topic)
                time.sleep(0.01)


class ReplayAnswer(NamedTuple):
    """What a :meth:`ReplayClient.fetch` got: ``batches`` ``(seq, events)`` in sequence, no holes;
    ``complete``: they reach the end of the instance's buffer; ``asks``: requests it took."""

    batches: list[tuple[int, list[Any]]]
    complete: bool
    asks: int


class ReplayClient:
    """One instance's replay ROUTER: the batches it still buffers from a sequence number on.

    vLLM's ROUTER sends its whole buffer from the asked sequence number in one burst and drops,
    without a word, what overflows its send queue (1000 messages by default): a replay of a few
    thousand batches (a proxy started beside instances that have served for a while) arrives
    with holes, sometimes without its end marker (measured with vLLM's own publisher: 7697 of
    8000 batches). So a fetch keeps what came in sequence and asks again from the first batch
    missing, until an answer ends with nothing missing. Between two messages of an answer it
    waits ``timeout`` s, a fetch at most ``max_seconds``. An answer that stops short of its end
    marker replaces the socket, so a late message never mixes into the next answer; so does one
    cut at ``max_batches``. ``cancel`` set (the proxy stopping) ends a fetch within 0.25 s. Used
    from one thread only (a ZMQ socket is not thread-safe).
    """

    def __init__(self, endpoint: str, timeout: float = 1.0, max_batches: int = 20_000,
                 max_seconds: float = 10.0, cancel: threading.Event | None = None) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.max_batches = max_batches
        self.max_seconds = max_seconds
        self.cancel = cancel or threading.Event()
        self._sock: Any = None

    def fetch(self, start: int) -> ReplayAnswer | None:
        """Every buffered batch with ``seq >= start``, in order, as far as it came without a
        hole (the first may be past ``start``: what the buffer no longer holds is gone);
        None when the socket did not answer at all."""
        got: list[tuple[int, list[Any]]] = []
        want, asks = max(start, 0), 0
        ends = time.monotonic() + self.max_seconds
        while True:
            asks += 1
            answer = self._ask(want, ends, self.max_batches - len(got))
            if answer is None:
                return ReplayAnswer(got, False, asks) if got else None
            batches, ended = answer
            fresh = _in_sequence(batches, want, first=not got)
            got += fresh
            complete = ended and len(fresh) == len(batches)
            if (complete or not fresh or len(got) >= self.max_batches or time.monotonic() >= ends
                    or self.cancel.is_set()):
                return ReplayAnswer(got, complete, asks)
            want = fresh[-1][0] + 1

    def _ask(self, start: int, ends: float, limit: int) -> tuple[list[tuple[int, list[Any]]], bool] | None:
        """One request: at most ``limit`` batches of its answer as they came and whether its end
        marker came (never when cut at ``limit``); None when nothing came within ``timeout``."""
        import zmq

        if self._sock is None:
            self._sock = zmq.Context.instance().socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVHWM, 0)  # ours never drops: bounded by vLLM's buffer
            self._sock.connect(self.endpoint)
        sock = self._sock
        out: list[tuple[int, list[Any]]] = []
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")), zmq.NOBLOCK)
            quiet_until = time.monotonic() + self.timeout
            while len(out) < limit and not self.cancel.is_set():
                left = min(quiet_until, ends) - time.monotonic()
                if left <= 0:
                    break
                if not sock.poll(int(min(left, 0.25) * 1000) + 1):
                    continue
                quiet_until = time.monotonic() + self.timeout
                frames = sock.recv_multipart(zmq.NOBLOCK)
                if len(frames) != 4 or len(frames[2]) != 8:
                    continue
                seq = int.from_bytes(frames[2], "big")
                if seq == END_SEQ:
                    return out, True
                try:
                    out.append((seq, decode_batch(frames[3])))
                except ValueError:
                    continue
        except zmq.ZMQError:
            pass
        self.close()
        return (out, False) if out else None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


def _in_sequence(batches: list[tuple[int, list[Any]]], want: int,
                 first: bool) -> list[tuple[int, list[Any]]]:
    """The leading batches of an answer with consecutive sequence numbers from ``want`` (the
    first answer of a fetch: from its first batch at or past ``want``)."""
    out: list[tuple[int, list[Any]]] = []
    expect = None if first else want
    for seq, events in batches:
        if seq < want:
            continue
        if expect is not None and seq != expect:
            break
        out.append((seq, events))
        expect = seq + 1
    return out


_REPLAY_FIX = ("give each as HOST:PORT=tcp://HOST:PORT (the instance as the proxy names it = the "
               "replay_endpoint in its --kv-events-config), e.g. 127.0.0.1:8100=tcp://127.0.0.1:5600")


def parse_replay(value: dict[str, str] | Sequence[str]) -> dict[str, str]:
    """``--kv-replay`` (``HOST:PORT=ENDPOINT`` items, or a mapping) keyed by canonical instance
    key; one ``ConfigError`` naming the field and every bad item."""
    items = list(value.items()) if isinstance(value, dict) else [tuple(v.split("=", 1)) if "=" in v else (v, "")
                                                                  for v in value]
    out: dict[str, str] = {}
    problems: list[ConfigProblem] = []
    for inst, ep in items:
        if not str(ep).startswith(("tcp://", "ipc://")) or str(ep).endswith(":"):
            problems.append(ConfigProblem("--kv-replay", f"{inst}={ep}: the endpoint is not tcp://HOST:PORT or "
                                          "ipc://PATH", _REPLAY_FIX))
            continue
        try:
            out[parse_endpoint(str(inst), field_name="--kv-replay").key] = str(ep)
        except ConfigError as exc:
            problems += [ConfigProblem("--kv-replay", f"{inst}={ep}: {p.problem}", _REPLAY_FIX) for p in exc.problems]
    if problems:
        raise ConfigError("--kv-replay", problems)
    return out
