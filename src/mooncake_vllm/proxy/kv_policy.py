"""``--scheduling kv_aware``: route each request to the instance where its prompt's KV is cheapest.

Per request the proxy tokenizes the prompt with the least loaded instance's own
``POST /tokenize`` (time-boxed; the instance's exact tokenizer and chat template,
nothing to load or keep in step on the proxy; its time is counted), hashes its full
blocks like vLLM (:mod:`.kv_hashes`), and asks every instance's index
(:mod:`.kv_index`, fed by :mod:`.kv_events`) how long a prefix it holds in its own
cache; the pool's (medium ``MOONCAKE``) counts the same for all, at the cost the
instances' own counters show it has (:meth:`KvRouter.calibrate`: a declined load is
a recompute). The least prefill work (times the delay it imposes on the requests in flight
there, :attr:`.kv_index.CostWeights.social`) plus the work queued before it wins
(:meth:`KvRouter.queued`: work routed there, not at its first token nor computed since at
the instance's measured rate, decode
shares, requests its engine reports beyond ours via :mod:`.engine_load`), each over the
instance's measured prefill speed (:mod:`.kv_speed`). Before any instance published a
block nothing is cached anywhere as far as the proxy knows: the same cost with no hits.
Without a usable prediction (an instance that publishes nothing, unpredictable hashes,
tokenize failed, the stream lost) it routes like ``prefix`` and counts why.

An instance that leaves rotation (unhealthy, removed through the admin API) loses
its index: a restarted vLLM starts empty, and its sequence numbers restart too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from mooncake_vllm.proxy import engine_load
from mooncake_vllm.proxy.instances import Instance
from mooncake_vllm.proxy.kv_events import EventSubscriber, ReplayClient, parse_replay, vllm_args
from mooncake_vllm.proxy.kv_hashes import PromptHasher, detect, hasher_for
from mooncake_vllm.proxy.kv_index import LOCAL, POOL, BlockIndex, CostWeights, choose
from mooncake_vllm.proxy.kv_sessions import SessionTails
from mooncake_vllm.proxy.kv_speed import Backlog, SpeedTracker
from mooncake_vllm.proxy.scheduling import KvAwarePolicy, RoutingKey, check_queue_cap


class ProxyServer(Protocol):
    """What this module reads of ``proxy.server.ProxyServer`` (no import back up)."""

    pool: Any
    session: Any
    config: Any
    kv: Any
    policies: Any

__all__ = ["KvRouter", "PromptKey", "attach", "parse_replay", "start"]

log = logging.getLogger(__name__)

@dataclass(eq=False)
class PromptKey:
    """A routing key that knows the prompt's tokens (None: not predictable)."""

    prefix: bytes
    tokens: list[int] | None
    hashes: dict[int, list[int]] = field(default_factory=dict)  # block size -> normalised hashes
    predicted: dict[str, int] = field(default_factory=dict)  # instance kind -> predicted hit tokens
    charged: dict[str, tuple[str, float]] = field(default_factory=dict)  # kind -> (instance, queued work)
    unheard: dict[str, str] = field(default_factory=dict)  # kind -> instance not heard yet when routed there


class KvRouter:
    """The shared state of both kinds' ``kv_aware`` policies: indexes, hasher, counters."""

    def __init__(self, endpoint: str, weights: CostWeights = CostWeights(), capacity: int = 1 << 17,
                 replay: dict[str, str] | None = None, sync_interval: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.weights = weights
        self.capacity = capacity
        self._lock = threading.Lock()
        self.indexes: dict[str, BlockIndex] = {}
        self.counters: dict[tuple[str, ...], int] = defaultdict(int)
        self.hashers: list[PromptHasher] = []
        self.hasher: PromptHasher | None = None
        self.disabled = ""  # why predictions are off for good
        self.lost = ""  # why the event stream is down (cleared by the next batch)
        self.mean_prompt = 0.0
        self.heard: set[str] = set()  # instances whose events (live or replayed) arrived since they joined
        self.unheard_requests: dict[str, int] = defaultdict(int)  # full-block prefills done on one not heard
        self.silent_after = 3  # that many, and an instance not heard is taken for one that publishes nothing
        self.mean_work = 0.0  # predicted prefill work per routed request (recomputed-token units)
        #: the share of predicted pool tokens the instances really loaded (their own counters): they
        #: recompute what their load policy declines, so a pool token costs this much of ``weights.pool``
        #: and the rest of a recompute
        self.pool_realized = 1.0
        self.speeds = SpeedTracker()  # each instance's measured prefill rate (its engine's counters)
        self.backlog = Backlog(self.speeds, clock)  # routed prefill work not at its first token, drained
        self.sessions = SessionTails()  # the prompts routed to each instance, for holder()
        self._pool_predicted = 0  # pool tokens predicted for routed requests, ever
        self._pool_base: tuple[int, float] | None = None  # (predicted, the engines' pool hits) last time
        self._in_rotation: dict[str, set[str]] = {}
        self._logged: set[str] = set()
        self._samples: deque[dict[str, Any]] = deque(maxlen=8)  # first blocks of prompts, for _detect
        self.subscriber = EventSubscriber(endpoint, self.on_batch, on_lost=self._on_lost)
        self.replay = dict(replay or {})  # topic (instance key) -> its replay endpoint
        self.sync_interval = sync_interval
        self._live_last: dict[str, int] = {}  # last seq the live stream gave, per topic
        self._pending: dict[str, list[tuple[int, list[Any]]]] = {}  # live batches past a gap, until replayed
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._replayer: threading.Thread | None = None

    # ---- events (subscriber and replay threads) ------------------------------------

    def on_batch(self, topic: str, seq: int, events: list[Any]) -> None:
        """One live batch. Past a gap (or a stream first heard after its start) it waits
        for the replay of what is missing when the instance has a replay socket."""
        with self._lock:
            self.lost = ""
            self.heard.add(topic)
            idx = self._index(topic)
            live_last, self._live_last[topic] = self._live_last.get(topic), seq
            last = idx.last_seq
            if last is not None and seq <= last and (live_last is None or seq > live_last):
                return  # the replay gave it already
            if topic in self.replay and (seq > last + 1 if last is not None else seq > 0):
                pending = self._pending.setdefault(topic, [])
                if len(pending) < 1024:  # bounded; beyond that the gap drops the index as without replay
                    pending.append((seq, events))
                    self._wake.set()
                    self._sample(events)
                    return
            self._apply(topic, idx, seq, events)

    def _index(self, topic: str) -> BlockIndex:
        idx = self.indexes.get(topic)
        if idx is None:
            idx = self.indexes[topic] = BlockIndex(self.capacity)
        return idx

    def _apply(self, topic: str, idx: BlockIndex, seq: int, events: list[Any]) -> None:
        dropped = idx.apply(seq, events)
        if dropped:
            self.counters[("index_drops", dropped)] += 1
        self._sample(events)

    def _sample(self, events: list[Any]) -> None:
        """Keep first blocks until the hash algorithm is detected (caller holds the lock)."""
        if self.hasher is None and not self.disabled:
            for ev in events:
                if isinstance(ev, dict) and ev.get("type") == "BlockStored" and ev.get("parent_block_hash") is None:
                    self._samples.append(ev)  # bounded: kept until the hashers are known
                    if self.hashers:
                        self._detect(ev)

    def catch_up(self, topic: str, client: ReplayClient) -> bool:
        """Fetch what ``topic``'s index misses from its replay socket, then apply the live
        batches that waited for it (after a partial replay that got somewhere they wait on: the
        rest is asked for at once); False when the replay did not answer (counted)."""
        with self._lock:
            idx = self.indexes.get(topic)
            start = idx.last_seq + 1 if idx is not None and idx.last_seq is not None else 0
        answer = client.fetch(start)
        with self._lock:
            idx = self._index(topic)
            if answer is None:
                self.counters[("replays", "failed")] += 1
            else:  # partial: what came in sequence before time, bound or answers ran out
                self.counters[("replays", "ok" if answer.complete else "partial")] += 1
                self.counters[("replay_asks",)] += answer.asks
                self.heard.add(topic)  # its publisher answers: it publishes, maybe nothing yet
                self.counters[("replayed_batches",)] += len(answer.batches)
            more = answer is not None and not answer.complete and bool(answer.batches)
            waiting = [] if more else self._pending.pop(topic, [])
            for seq, events in [*(answer.batches if answer else ()), *waiting]:
                if idx.last_seq is None or seq > idx.last_seq:
                    self._apply(topic, idx, seq, events)
        if more:
            self._wake.set()
        if answer is None:
            self._log_once(f"replay:{topic}", "kv_aware: the replay socket %s of %s did not answer in %.1f s; "
                           "batches its stream lost stay lost (counted in index drops)",
                           client.endpoint, topic, client.timeout)
        return answer is not None

    def _replay_loop(self) -> None:
        clients: dict[str, ReplayClient] = {}
        try:
            while not self._stop.is_set():
                with self._lock:
                    want = dict(self.replay)
                for topic in [t for t, c in clients.items() if want.get(t) != c.endpoint]:
                    clients.pop(topic).close()
                for topic, ep in want.items():
                    if self._stop.is_set():
                        break
                    client = clients.get(topic) or clients.setdefault(topic, ReplayClient(ep, cancel=self._stop))
                    self.catch_up(topic, client)
                self._wake.wait(self.sync_interval)
                self._wake.clear()
        finally:
            for client in clients.values():
                client.close()

    def set_replay(self, topic: str, endpoint: str | None) -> None:
        """Fetch ``topic``'s missed batches from ``endpoint`` from now on (None: stop); an
        instance added through the admin API gets its replay socket here."""
        with self._lock:
            if endpoint:
                self.replay[topic] = endpoint
            else:
                self.replay.pop(topic, None)
                self._pending.pop(topic, None)
        if endpoint and self._replayer is None and self.subscriber.running:
            self._start_replayer()
        self._wake.set()

    def _start_replayer(self) -> None:
        self._replayer = threading.Thread(target=self._replay_loop, name="kv-replay", daemon=True)
        self._replayer.start()

    def start(self) -> None:
        """Start the subscriber and, for instances with a replay socket, the catch-up thread."""
        self.subscriber.start()
        if self.replay:
            self._start_replayer()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        self.subscriber.stop(timeout)
        if self._replayer is not None:
            self._replayer.join(timeout)

    def _detect(self, event: dict[str, Any]) -> None:
        if self.hasher is not None or self.disabled:
            return
        found = detect(self.hashers, event)
        if found is False:
            self.disabled = ("no hash algorithm the facts table allows reproduces the instances' block "
                             "hashes (another --prefix-caching-hash-algo or PYTHONHASHSEED than the proxy's?)")
            self._log_once("hash", "kv_aware routes like prefix: %s", self.disabled)
        elif found is not None:
            self.hasher = found
            log.info("kv_aware: instances hash blocks with %s", found.algorithm)

    def _on_lost(self, why: str) -> None:
        with self._lock:
            self.lost = why
            self.counters[("stream_lost",)] += 1
        self._log_once("lost", "kv_aware routes like prefix until events flow again: %s", why)

    def _log_once(self, what: str, fmt: str, *args: Any) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(fmt, *args)

    # ---- setup ---------------------------------------------------------------------

    def configure(self, vllm_version: str, env: Any = None) -> None:
        """Pick the candidate hashers for the instances' release (says why if none)."""
        hashers, why = hasher_for(vllm_version, os.environ if env is None else env)
        with self._lock:
            self.hashers = hashers
            if not hashers:
                self.disabled = why
            for ev in self._samples:
                self._detect(ev)
        if not hashers:
            self._log_once("hash", "kv_aware routes like prefix: %s", why)

    # ---- routing (event loop) ------------------------------------------------------

    def sync(self, kind: str, instances: Sequence[Instance]) -> None:
        """Drop the index of every ``kind`` instance that left rotation since the last call."""
        now = {i.key for i in instances if i.available}
        gone = self._in_rotation.get(kind, set()) - now
        self._in_rotation[kind] = now
        if gone:
            with self._lock:
                for key in gone:
                    if (idx := self.indexes.get(key)) is not None:
                        if len(idx):
                            idx.drop("left_rotation")
                            self.counters[("index_drops", "left_rotation")] += 1
                        idx.last_seq = None  # a restarted instance counts from 0 again
                        self._live_last.pop(key, None)
                    self.heard.discard(key)
                    self.unheard_requests.pop(key, None)
                    self.speeds.forget(key)
                    self.sessions.forget(key)

    def fallback_reason(self, key: RoutingKey) -> str:
        """Why ``key`` cannot be routed by prediction ("" if it can)."""
        if self.disabled:
            return "unpredictable_hashes"
        if not self.hashers:
            return "version_unknown"
        if self.lost:
            return "stream_lost"
        if not isinstance(key, PromptKey) or key.tokens is None:
            return "no_tokens"
        return ""

    def block_size(self) -> int | None:
        """The instances' block size, from their first ``BlockStored``; None before any."""
        with self._lock:
            return next((i.block_size for i in self.indexes.values() if i.block_size), None)

    def decide(self, kind: str, candidates: Sequence[Instance], key: PromptKey, start: int) -> Instance | None:
        """The cheapest candidate (no hits anywhere before any block is published); None when a
        candidate publishes no events (``no_events``: its empty index would read as "holds nothing")."""
        assert key.tokens is not None
        size = self.block_size()
        with self._lock:
            silent = [c.key for c in candidates
                      if c.key not in self.heard and self.unheard_requests.get(c.key, 0) >= self.silent_after]
        if silent:
            self._log_once(f"silent:{silent[0]}", "kv_aware routes like prefix: instance %s published no KV "
                           "events after %d prefills of full blocks; start it with --kv-events-config (see "
                           "--kv-events) or remove it", silent[0], self.unheard_requests.get(silent[0], 0))
            return None
        local, pool = self._hits(candidates, key, size)
        with self._lock:
            speeds = self.speeds.relative([c.key for c in candidates])
        n = len(key.tokens)
        self.mean_prompt = n if not self.mean_prompt else 0.9 * self.mean_prompt + 0.1 * n
        self.settle(kind, key)  # a retry: the first pick's work is not queued there any more
        pick = choose(n, local, pool, [self.queued(c) for c in candidates], self.effective_weights(), start, speeds,
                      [c.load for c in candidates])
        chosen = candidates[pick.index]
        self.mean_work = pick.work if not self.mean_work else 0.9 * self.mean_work + 0.1 * pick.work
        self.backlog.add(chosen.key, pick.work)
        key.charged[kind] = (chosen.key, pick.work)
        key.predicted[kind] = pick.local_tokens + pick.pool_tokens
        where = "local" if pick.local_tokens else "pool" if pick.pool_tokens else "cold"
        self.counters[("decisions", kind, where)] += 1
        self.counters[("predicted_local_tokens", kind)] += pick.local_tokens
        self.counters[("predicted_pool_tokens", kind)] += pick.pool_tokens
        self._pool_predicted += pick.pool_tokens
        self.counters[("prompt_tokens", kind)] += n
        return chosen

    def _hashes(self, key: PromptKey, size: int) -> list[int]:
        hashes = key.hashes.get(size)
        if hashes is None:
            assert key.tokens is not None
            hashes = key.hashes[size] = (self.hasher or self.hashers[0]).block_hashes(key.tokens, size)
        return hashes

    def _hits(self, candidates: Sequence[Instance], key: PromptKey, size: int | None) -> tuple[list[int], int]:
        """Prompt tokens each candidate holds in its own cache, and those the pool holds."""
        if size is None or key.tokens is None:
            return [0] * len(candidates), 0
        hashes = self._hashes(key, size)
        with self._lock:
            empty = BlockIndex(0)
            local = [(self.indexes.get(c.key) or empty).prefix_blocks(hashes, LOCAL) * size for c in candidates]
            pool = max((i.prefix_blocks(hashes, POOL) for i in self.indexes.values()), default=0) * size
        return local, pool

    def holder(self, candidates: Sequence[Instance], key: RoutingKey) -> Instance | None:
        """The one candidate whose own cache holds the longest prefix of ``key``'s prompt, when
        that covers at least half of it and continues an earlier prompt routed there (a session's
        next turn, :mod:`.kv_sessions`); None otherwise (a new prompt on a shared document, a
        shared system prompt), or when ``key`` cannot be predicted."""
        size = self.block_size()
        if self.fallback_reason(key) or not candidates or size is None:
            return None
        local, _ = self._hits(candidates, key, size)
        best = max(local)
        if not best or 2 * best < len(key.tokens) or local.count(best) > 1:
            return None
        held = candidates[local.index(best)]
        return held if self.sessions.continues(held.key, self._hashes(key, size), best // size) else None

    def effective_weights(self) -> CostWeights:
        """``weights`` with the pool's cost as realized: a declined load is a recompute."""
        r = self.pool_realized
        return replace(self.weights, pool=r * self.weights.pool + (1.0 - r))

    def calibrate(self, instances: Sequence[Instance], min_tokens: int = 256) -> None:
        """Feed each instance's prefill counters to ``speeds``; compare the pool tokens the
        instances report loaded (``engine_load``) with those predicted since the last time, once
        ``min_tokens`` were predicted; a restarted engine (its counter went back) starts again."""
        engines = [i.engine for i in instances if i.engine is not None]
        with self._lock:
            for i in instances:
                if (e := i.engine) is not None:
                    self.speeds.update(i.key, e.prefill_tokens, e.prefill_seconds, e.at, e.running,
                                       requests=e.prefill_requests)
        if not engines:
            return
        got = sum(e.pool_hit_tokens for e in engines)
        base = self._pool_base
        if base is None or got < base[1]:
            self._pool_base = (self._pool_predicted, got)
            return
        predicted = self._pool_predicted - base[0]
        if predicted < min_tokens:
            return
        ratio = min(1.0, max(0.0, (got - base[1]) / predicted))
        self.pool_realized = 0.7 * self.pool_realized + 0.3 * ratio
        self._pool_base = (self._pool_predicted, got)

    def queued(self, inst: Instance) -> float:
        """Work ahead of a new request on ``inst`` (recomputed-token units): the prefill work
        routed there and not computed yet (:class:`.kv_speed.Backlog`), a share of the mean prompt per request in flight
        (decode steps), and the mean work of each request its engine reports beyond ours."""
        others = max(0, inst.load - inst.in_flight)
        per_request = self.weights.per_request * self.mean_prompt
        return self.backlog.left(inst.key) + per_request * (inst.in_flight + others) \
            + self.mean_work * others

    def routed(self, inst: Instance, key: RoutingKey, kind: str) -> None:
        """``key``'s ``kind`` request went to ``inst`` (by prediction or fallback): if the prompt
        has a full block (vLLM publishes nothing for less) and ``inst`` was not heard yet, its
        prefill will count against it once done (:meth:`settle`); remember its last full block
        there (:attr:`sessions`)."""
        size = self.block_size()
        if not isinstance(key, PromptKey) or key.tokens is None or size is None or len(key.tokens) < size:
            return
        if inst.key not in self.heard:
            key.unheard[kind] = inst.key
        self.sessions.record(inst.key, self._hashes(key, size))

    def settle(self, kind: str, key: RoutingKey) -> None:
        """The prefill of ``key``'s ``kind`` request is done (first token back, or it ended): its
        work no longer queues, and an instance still not heard has one more prefill without events
        (counted here, not when routed: on a slow fleet three prompts reach an instance before its
        first prefill ends). Idempotent."""
        if not isinstance(key, PromptKey):
            return
        charge = key.charged.pop(kind, None)
        if charge is not None:
            self.backlog.remove(*charge)
        unheard = key.unheard.pop(kind, None)
        if unheard is not None and unheard not in self.heard:
            self.unheard_requests[unheard] += 1

    def observe(self, kind: str, key: RoutingKey, answer: Any) -> None:
        """Count what the instance reports it served from cache (``usage.prompt_tokens_details``)."""
        if not isinstance(key, PromptKey) or kind not in key.predicted or not isinstance(answer, dict):
            return
        details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
        got = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(got, int):
            self.counters[("got_cached_tokens", kind)] += got
            self.counters[("observed_predicted_tokens", kind)] += key.predicted[kind]
            self.counters[("observed", kind)] += 1

    def render(self) -> str:
        """``mooncake_proxy_kv_aware_*`` lines for the proxy's /metrics."""
        out: list[str] = []
        with self._lock:
            items = sorted(self.counters.items())
            blocks = {k: len(i) for k, i in self.indexes.items()}
            out += self.speeds.render()
        seen: set[str] = set()
        for (name, *labels), n in items:
            metric = f"mooncake_proxy_kv_aware_{name}_total"
            if metric not in seen:
                seen.add(metric)
                out.append(f"# TYPE {metric} counter")
            lab = dict(zip(_LABELS.get(name, ()), labels))
            text = ",".join(f'{k}="{v}"' for k, v in lab.items())
            out.append(f"{metric}{{{text}}} {n}" if text else f"{metric} {n}")
        out.append("# TYPE mooncake_proxy_kv_aware_pool_realized gauge")
        out.append(f"mooncake_proxy_kv_aware_pool_realized {self.pool_realized:.3f}")
        out.append("# TYPE mooncake_proxy_kv_aware_index_blocks gauge")
        out += [f'mooncake_proxy_kv_aware_index_blocks{{instance="{k}"}} {n}' for k, n in sorted(blocks.items())]
        return "\n".join(out) + "\n"


_LABELS: dict[str, tuple[str, ...]] = {
    "index_drops": ("reason",), "fallbacks": ("kind", "reason"), "decisions": ("kind", "outcome"),
    "predicted_local_tokens": ("kind",), "predicted_pool_tokens": ("kind",), "prompt_tokens": ("kind",),
    "got_cached_tokens": ("kind",), "observed_predicted_tokens": ("kind",), "observed": ("kind",),
    "replays": ("outcome",), "bounded": ("kind",), "capped": ("kind",), "cap_held": ("kind",),
    "select_microseconds": ("kind",),
}


async def start(server: ProxyServer) -> None:
    """Start the event subscriber, say where it listens (and the flags an instance needs)."""
    assert server.kv is not None
    sub = server.kv.subscriber
    server.kv.start()
    insts = [i for k in ("prefill", "decode") for i in server.pool.available(k)]
    if server.session is not None and server.config.engine_metrics_interval > 0:  # the speeds' baseline
        await asyncio.gather(*(engine_load.scrape(server.session, i, server.config.health_timeout,
                                                  3 * server.config.engine_metrics_interval) for i in insts))
        server.kv.calibrate(insts)
    if await asyncio.to_thread(sub.bound.wait, 5.0):
        log.info("kv_aware: KV events on %s; start each instance with %s", sub.bound_endpoint,
                 " ".join(shlex.quote(a) for a in vllm_args(str(sub.bound_endpoint), "<its host:port>")))


def attach(server: ProxyServer) -> KvRouter | None:
    """Give the server's ``kv_aware`` policies one shared router (and ``kv_queue_cap``, checked);
    None for other policies."""
    cap = check_queue_cap(server.config.kv_queue_cap, server.config.scheduling)
    policies = [p for p in server.policies.values() if isinstance(p, KvAwarePolicy)]
    if not policies:
        return None
    router = KvRouter(server.config.kv_events, replay=dict(server.config.kv_replay))
    for kind, p in server.policies.items():
        if isinstance(p, KvAwarePolicy):
            p.router, p.kind, p.queue_cap = router, kind, cap
    return router
