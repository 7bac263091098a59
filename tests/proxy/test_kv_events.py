"""The proxy's replay client (``kv_events.ReplayClient``) against vLLM's own publisher and a ROUTER
that drops what a test says; the subscriber and the policy over real sockets are test_kv_policy."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from mooncake_vllm.proxy.kv_events import END_SEQ, ReplayClient, _in_sequence
from mooncake_vllm.services import free_port

vllm_events = pytest.importorskip("vllm.distributed.kv_events")
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")


def _batch(i: int) -> Any:
    return vllm_events.KVEventBatch(ts=time.time(), events=[vllm_events.BlockStored(
        block_hashes=[i], parent_block_hash=None, token_ids=list(range(128)), block_size=128,
        lora_id=None, medium="GPU", lora_name=None)])


@contextmanager
def _vllm_publisher(batches: int, buffer_steps: int = 10_000) -> Iterator[str]:
    """vLLM's ZmqEventPublisher with ``batches`` published (its replay socket's endpoint)."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    pub = vllm_events.ZmqEventPublisher(0, endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=replay,
                                        buffer_steps=buffer_steps, topic="127.0.0.1:8100")
    try:
        for i in range(batches):
            pub.publish(_batch(i))
        deadline = time.monotonic() + 30
        while pub._event_queue.unfinished_tasks and time.monotonic() < deadline:  # all in its buffer
            time.sleep(0.02)
        yield replay
    finally:
        pub.shutdown()


def test_a_replay_longer_than_vllms_send_queue_comes_whole() -> None:
    """vLLM's ROUTER drops what overflows its send queue (1000 messages): 8000 buffered batches
    came as 7396-7697 with holes, in 0.6-3.2 s, before a fetch asked again from each hole."""
    with _vllm_publisher(8000) as replay:
        client = ReplayClient(replay)
        try:
            answer = client.fetch(0)
        finally:
            client.close()
    assert answer is not None and answer.complete
    assert [seq for seq, _ in answer.batches] == list(range(8000))
    assert answer.batches[-1][1][0]["block_hashes"] == [7999]  # decoded, in order


def test_what_the_buffer_no_longer_holds_is_gone_and_the_rest_comes() -> None:
    with _vllm_publisher(3000, buffer_steps=1000) as replay:
        client = ReplayClient(replay)
        try:
            answer = client.fetch(0)
            later = client.fetch(2990)  # the next sync, from the index's last batch + 1
        finally:
            client.close()
    assert answer is not None and answer.complete
    assert [seq for seq, _ in answer.batches] == list(range(2000, 3000))
    assert later is not None and [seq for seq, _ in later.batches] == list(range(2990, 3000))


class _DroppingRouter:
    """A replay ROUTER like vLLM's (``[id, "", topic, seq, payload]``, then the end marker) that
    leaves out the sequence numbers ``drop`` names in its first answer, and its end marker there
    when ``drop_end``; later answers are whole. ``gap``: seconds between two batches; ``end``:
    False never sends an end marker. Records each request's start."""

    def __init__(self, buffered: int, drop: frozenset[int] = frozenset(), drop_end: bool = False,
                 gap: float = 0.0, end: bool = True) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.buffered, self.drop, self.drop_end, self.gap, self.end = buffered, drop, drop_end, gap, end
        self.asked: list[int] = []
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.bind(self.endpoint)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        payloads = {i: msgspec.msgpack.encode(_batch(i)) for i in range(self.buffered)}
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            ident, _, start = self._sock.recv_multipart()
            first = not self.asked
            self.asked.append(int.from_bytes(start, "big"))
            for seq in range(self.asked[-1], self.buffered):
                if self._stop.is_set():
                    return
                if not (first and seq in self.drop):
                    self._sock.send_multipart((ident, b"", b"t", seq.to_bytes(8, "big"), payloads[seq]))
                if self.gap:
                    time.sleep(self.gap)
            if self.end and not (first and self.drop_end):
                self._sock.send_multipart((ident, b"", b"", END_SEQ.to_bytes(8, "big"), b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)


@pytest.mark.parametrize("drop_end", [False, True])
def test_a_fetch_asks_again_from_the_first_batch_missing(drop_end: bool) -> None:
    router = _DroppingRouter(50, drop=frozenset({20, 21, 40}), drop_end=drop_end)
    # without its end marker the first answer ends after ``timeout`` of quiet
    client = ReplayClient(router.endpoint, timeout=1.0 if drop_end else 5.0)
    try:
        answer = client.fetch(0)
    finally:
        client.close()
        router.close()
    assert answer is not None and answer.complete and answer.asks == 2
    assert [seq for seq, _ in answer.batches] == list(range(50))
    assert router.asked == [0, 20]  # the first answer's batches after its hole were not kept


def test_a_silent_socket_is_no_answer() -> None:
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    silent.bind(endpoint)
    client = ReplayClient(endpoint, timeout=0.2)
    try:
        t0 = time.monotonic()
        assert client.fetch(0) is None
        assert time.monotonic() - t0 < 2.0
    finally:
        client.close()
        silent.close(linger=0)


def test_a_fetch_is_bounded_in_time_in_batches_and_by_its_cancel_event() -> None:
    trickles = [_DroppingRouter(1000, gap=0.02, end=False) for _ in range(2)]  # never end, never quiet for 1 s
    whole = _DroppingRouter(150)
    cancel = threading.Event()
    clients = [ReplayClient(trickles[0].endpoint, max_seconds=0.6), ReplayClient(whole.endpoint, max_batches=100),
               ReplayClient(trickles[1].endpoint, cancel=cancel)]
    try:
        t0 = time.monotonic()
        timed = clients[0].fetch(0)
        assert time.monotonic() - t0 < 3.0
        assert timed is not None and not timed.complete and 0 < len(timed.batches) < 1000
        cut = clients[1].fetch(0)  # cut at its bound: partial, though the answer came whole
        assert cut is not None and not cut.complete and [seq for seq, _ in cut.batches] == list(range(100))
        threading.Timer(0.3, cancel.set).start()
        t0 = time.monotonic()
        cancelled = clients[2].fetch(0)
        assert time.monotonic() - t0 < 3.0  # max_seconds is 10
        assert cancelled is not None and not cancelled.complete
    finally:
        for client in clients:
            client.close()
        for router in (*trickles, whole):
            router.close()


def test_a_batch_run_is_kept_up_to_its_first_hole() -> None:
    b = [(5, ["a"]), (6, ["b"]), (8, ["c"]), (9, ["d"])]
    assert _in_sequence(b, 0, first=True) == [(5, ["a"]), (6, ["b"])]  # 0-4: gone from the buffer
    assert _in_sequence(b, 5, first=False) == [(5, ["a"]), (6, ["b"])]
    assert _in_sequence(b, 4, first=False) == []  # a re-ask whose first batch is missing: no progress
    assert _in_sequence([(3, ["x"]), *b], 5, first=True) == [(5, ["a"]), (6, ["b"])]  # not asked for
