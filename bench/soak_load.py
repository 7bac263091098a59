"""The soak's load: closed-loop clients whose every answer is checked against a reference.

* :class:`StoreLoad` — clients of the pool itself (our ``StoreClient``, as a vLLM worker
  uses it): each request is a shared document of ``doc_blocks`` blocks plus one unique
  block; it looks up, loads the hit, checks every loaded block byte for byte against the
  reference bytes of its key and "recomputes" the rest; its saves go to the client's save
  thread (its own ``StoreClient``, a bounded queue: full = dropped, as vLLM's worker
  does), never in the request's path. The CI soak uses it.
* :class:`HttpLoad` — clients of vLLM through the proxies: a prompt is one of the shared
  documents (token ids) plus a unique question, greedy, ``max_tokens`` tokens, streamed
  (TTFT); the reference answer of the same prompt comes from the no-connector instance.
* :class:`Sampler` — every ``interval`` s: each vLLM's pool counters and every service's
  RSS and open descriptors.

Each request is one :class:`Sample` row; the report turns them into hit rate over time.
"""

from __future__ import annotations

import hashlib
import json
import queue
import random
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["HttpLoad", "Sample", "Sampler", "StoreLoad"]


@dataclass
class Sample:
    """One request: when (driver clock, s after t0), how long, pool blocks/tokens hit out of
    those the pool could have had, wrong (answer differs from the reference), failed."""

    t: float
    client: int
    target: str
    seconds: float
    hit: int = 0
    possible: int = 0
    wrong: bool = False
    failed: str = ""
    ttft: float | None = None

    def row(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Loop:
    clients: int
    seconds: float
    samples: list[Sample] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    #: seconds after ``t0`` the load must last at least (a fault still running or recovering)
    hold: Callable[[], float] = lambda: 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, t0: float, one: Callable[[int, random.Random, float], Sample]) -> list[Sample]:
        """``clients`` threads calling ``one`` back to back until ``seconds`` after ``t0``, or
        later while :attr:`hold` says so."""

        def client(i: int) -> None:
            rng = random.Random(i)
            while not self.stop.is_set() and \
                    time.monotonic() - t0 < max(self.seconds, self.hold()):
                s = one(i, rng, t0)
                with self._lock:
                    self.samples.append(s)

        threads = [threading.Thread(target=client, args=(i,), name=f"soak-client{i}", daemon=True)
                   for i in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.samples


def reference_block(key: str, shape: tuple[int, ...]) -> np.ndarray:
    """The bytes a block of ``key`` must hold (what its recompute would produce)."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


class StoreLoad(_Loop):
    """Pool clients (one ``StoreClient`` each) over ``docs`` shared documents."""

    def __init__(self, config_path: str, clients: int, seconds: float, *, docs: int = 16,
                 doc_blocks: int = 8, flooding: Callable[[], bool] = lambda: False) -> None:
        super().__init__(clients, seconds)
        self.config_path = config_path
        self.docs, self.doc_blocks = docs, doc_blocks
        self.flooding = flooding
        self._unique = 0
        self.dropped_saves = 0

    def run_load(self, t0: float) -> list[Sample]:
        from mooncake_vllm.config import load_store_config
        from mooncake_vllm.keys import KeyNamespace, chunk_keys
        from mooncake_vllm.layout import BlockLayout
        from mooncake_vllm.store import StoreClient

        n = self.doc_blocks + 1
        states, savers = [], []

        def open_client() -> tuple[Any, list[np.ndarray], Any]:
            client = StoreClient.connect(load_store_config(self.config_path))  # time boxes as vLLM's
            kv = [np.zeros((n, 2, 16, 64), dtype=np.float32) for _ in range(2)]
            layout = BlockLayout.from_kv_caches(kv)
            client.register_layout(layout)
            return client, kv, layout

        def save_loop(todo: queue.Queue[list[str] | None], client: Any, kv: list[np.ndarray],
                      layout: Any) -> None:
            while (keys := todo.get()) is not None:
                for j, key in enumerate(keys):  # what the recompute wrote, from the key alone
                    ref = reference_block(key, kv[0].shape[1:])
                    for layer in kv:
                        layer[j] = ref
                try:
                    client.put_blocks(keys, layout, list(range(len(keys))))
                except Exception:  # noqa: BLE001 - a failed save is a later miss, not an error
                    pass

        for _ in range(self.clients):
            client, kv, layout = open_client()
            ns = KeyNamespace("soak", "float32", layout.fingerprint, 16)
            todo: queue.Queue[list[str] | None] = queue.Queue(maxsize=8)
            own = open_client()
            saver = threading.Thread(target=save_loop, args=(todo, *own), daemon=True)
            saver.start()
            savers.append((todo, saver, own[0]))
            states.append((client, kv, layout, ns, todo))

        def one(i: int, rng: random.Random, t0: float) -> Sample:
            client, kv, layout, ns, todo = states[i]
            with self._lock:
                self._unique += 1
                unique = self._unique
            flood = self.flooding()
            doc = 10_000 + unique if flood else rng.randrange(self.docs)
            tokens = [doc * 1000 + j for j in range(self.doc_blocks * 16)] + [-unique - j for j in range(16)]
            keys = chunk_keys(ns, tokens)
            start = time.monotonic()
            s = Sample(round(start - t0, 3), i, "pool", 0.0, possible=self.doc_blocks)
            try:
                for layer in kv:
                    layer.fill(np.nan)  # whatever a load leaves unwritten can never pass the check
                hit = client.longest_prefix(keys)
                ok = client.get_blocks(keys[:hit], layout, list(range(hit))) if hit else []
                served = next((j for j, good in enumerate(ok) if not good), len(ok))
                shape = kv[0].shape[1:]
                for j in range(served):
                    ref = reference_block(keys[j], shape)
                    if not all(np.array_equal(layer[j], ref) for layer in kv):
                        s.wrong = True
                for j in range(served, n):  # the recompute
                    ref = reference_block(keys[j], shape)
                    for layer in kv:
                        layer[j] = ref
                if served < n:
                    try:
                        todo.put_nowait(keys[served:])
                    except queue.Full:
                        self.dropped_saves += 1
                s.hit = min(served, self.doc_blocks)
                if flood:
                    s.possible = 0  # a unique document: nothing the pool could have had
            except Exception as exc:  # noqa: BLE001 - a failed request is a result
                s.failed = f"{type(exc).__name__}: {exc}"
            s.seconds = round(time.monotonic() - start, 4)
            return s

        try:
            return self.run(t0, one)
        finally:
            for todo, saver, saving in savers:
                todo.put(None)
                saver.join(30)
                saving.close()
            for client, *_ in states:
                client.close()


class HttpLoad(_Loop):
    """vLLM clients: ``targets`` (name -> completions base URL) taken in turn per client."""

    def __init__(self, targets: dict[str, str], reference: str, model: str, clients: int,
                 seconds: float, *, documents: list[list[int]], vocab: int, max_tokens: int = 16,
                 flooding: Callable[[], bool] = lambda: False) -> None:
        super().__init__(clients, seconds)
        self.targets, self.reference, self.model = targets, reference, model
        self.documents, self.vocab, self.max_tokens = documents, vocab, max_tokens
        self.flooding = flooding

    def _complete(self, url: str, prompt: list[int], stream: bool) -> tuple[list[int], float | None]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "return_token_ids": True, "stream": stream}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        start, ttft, tokens = time.monotonic(), None, []
        with urllib.request.urlopen(req, timeout=300) as resp:  # noqa: S310 - our services
            if not stream:
                return list(json.loads(resp.read())["choices"][0]["token_ids"]), None
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if not event.get("choices"):  # the proxy's error event: the upstream failed mid-stream
                    raise RuntimeError(f"error event: {line[5:205].strip()}")
                ttft = ttft if ttft is not None else time.monotonic() - start
                tokens += event["choices"][0].get("token_ids") or []
        return tokens, ttft

    def run_load(self, t0: float) -> list[Sample]:
        names = sorted(self.targets)

        def one(i: int, rng: random.Random, t0: float) -> Sample:
            flood = self.flooding()
            doc = ([rng.randrange(10, self.vocab - 1) for _ in range(1024)] if flood
                   else self.documents[rng.randrange(len(self.documents))])
            prompt = doc + [rng.randrange(10, self.vocab - 1) for _ in range(24)]
            target = names[(i + len(self.samples)) % len(names)]
            start = time.monotonic()
            s = Sample(round(start - t0, 3), i, target, 0.0, possible=0 if flood else len(doc))
            try:
                got, s.ttft = self._complete(self.targets[target], prompt, stream=True)
                want, _ = self._complete(self.reference, prompt, stream=False)
                s.wrong = got != want
            except Exception as exc:  # noqa: BLE001 - a failed request is a result
                s.failed = f"{type(exc).__name__}: {exc}"
            s.seconds = round(time.monotonic() - start, 4)
            return s

        return self.run(t0, one)


_SERIES = ("vllm:mooncake_vllm_hit_tokens_total", "vllm:prompt_tokens_total",
           "vllm:mooncake_vllm_miss_causes_total", "vllm:kv_cache_usage_perc",
           "vllm:mooncake_vllm_declined_tokens_total", "vllm:mooncake_vllm_lookups_total")


def scrape(url: str) -> dict[str, float]:
    """The soak's series from one vLLM's /metrics (labels folded in: ``name{cause=x}``)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()  # noqa: S310
    out: dict[str, float] = {}
    for m in re.finditer(r"^([a-z_:]+)(\{[^}]*\})? (\S+)$", text, re.M):
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if name not in _SERIES:
            continue
        cause = re.search(r'cause="([a-z_]+)"', labels)
        key = f"{name}{{cause={cause.group(1)}}}" if cause else name
        out[key] = out.get(key, 0.0) + float(value)
    return out


@dataclass
class Sampler:
    """Every ``interval`` s: ``metrics`` (name -> URL) scraped and ``usage()`` recorded."""

    metrics: Callable[[], dict[str, str]]
    usage: Callable[[], dict[str, tuple[int, int, int]]]
    interval: float = 2.0
    rows: list[dict[str, Any]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self, t0: float) -> threading.Thread:
        def loop() -> None:
            while not self.stop.wait(self.interval):
                row: dict[str, Any] = {"t": round(time.monotonic() - t0, 2), "metrics": {}, "usage": {}}
                for name, url in self.metrics().items():
                    try:
                        row["metrics"][name] = scrape(url)
                    except Exception:  # noqa: BLE001 - down during a fault
                        pass
                row["usage"] = {k: list(v) for k, v in self.usage().items()}
                self.rows.append(row)

        thread = threading.Thread(target=loop, name="soak-sampler", daemon=True)
        thread.start()
        return thread
