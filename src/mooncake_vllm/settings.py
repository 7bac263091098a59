"""The connector's own settings, read once from vLLM's ``kv_transfer_config``.

Both engines build one frozen :class:`ConnectorSettings` per connector with
:meth:`ConnectorSettings.from_vllm_config` and pass it down as a value, the way
vLLM's ``KVTransferConfig`` keeps ``is_kv_producer`` / ``get_from_extra_config``
in one object. V0 and V1 validate ``kv_connector_extra_config`` the same way: a
key or value one engine rejects, the other rejects too, with one
:class:`~mooncake_vllm.errors.ConfigError` naming the field and the fix.

Every ``kv_connector_extra_config`` key is one :class:`ExtraKey` in :data:`KEYS`:
its default, how a value is read and refused, and its documentation, from which
the fields' defaults, the errors and the key table of docs/configuration.md
(``python scripts/config_doc.py``) come.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.errors import ConfigError, ConfigProblem
from mooncake_vllm.keys import model_id as _model_id

__all__ = ["EXTRA_KEYS", "GPU_PATHS", "KEYS", "LOAD_POLICIES", "MAX_HANDOFF_TIMEOUT", "MAX_STORE_CLIENTS",
           "ROLES", "ConnectorSettings", "ExtraKey", "auto_store_clients"]

#: the longest ``handoff_timeout`` accepted (seconds): longer is a typo, not a bound
MAX_HANDOFF_TIMEOUT = 600.0
#: vLLM's ``kv_role`` values and what each lets the connector do: (save, load)
ROLES = {"kv_both": (True, True), "kv_producer": (True, False), "kv_consumer": (False, True)}
_POLICIES = ("recompute", "fail")
#: ``gpu_path`` values (store.paths.choose_gpu_path picks the path)
GPU_PATHS = ("auto", "staged", "zero_copy")
#: ``load_policy`` values (v1.claims decides what ``auto`` claims)
LOAD_POLICIES = ("auto", "always", "never")
#: ``save_admission`` values (V1: v1.admission decides before the capture; V0: store.client after it)
SAVE_ADMISSIONS = ("all", "repeat")
#: the most store clients one worker opens (each is a transfer engine with its own threads)
MAX_STORE_CLIENTS = 16
_FIELD = "kv_connector_extra_config"
_MAX_PREFIX = 128


class _Refused(ValueError):
    """A value a key refuses: the problem text (never leaves this module: a ConfigProblem)."""


@dataclass(frozen=True)
class ExtraKey:
    """One ``kv_connector_extra_config`` key: what its absence means, how a value is read, its docs."""

    name: str
    default: Any  #: the value an absent key stands for
    read: Callable[[Any], Any]  #: a given value -> the setting (raises _Refused with the problem)
    fix: str  #: how to fix a refused value
    doc: str  #: what the key does (docs/configuration.md)
    shown: str = ""  #: the default as the docs show it ("" = the default itself, as JSON)

    def shown_default(self) -> str:
        """The default for the docs: ``shown`` or the default as JSON, in backticks."""
        if self.shown:
            return self.shown
        value = self.default
        return f"`{int(value) if isinstance(value, float) and value.is_integer() else json.dumps(value)}`"


def _choice(values: tuple[str, ...]) -> Callable[[Any], str]:
    def read(value: Any) -> str:
        if value not in values:
            raise _Refused(f"found {value!r}")
        return str(value)

    return read


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _positive(kind: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def read(value: Any) -> Any:
        if not _number(value) or value <= 0:
            raise _Refused(f"must be a positive number, found {value!r}")
        return kind(value)

    return read


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Refused(f"must be true or false, found {value!r}")
    return value


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _seconds_to_wait(value: Any) -> float:
    if not _number(value) or not 0 <= value <= MAX_HANDOFF_TIMEOUT:
        raise _Refused(f"must be a number of seconds from 0 to {MAX_HANDOFF_TIMEOUT:.0f}, found {value!r}")
    return float(value)


def _clients(value: Any) -> int:
    if value == "auto":
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STORE_CLIENTS:
        raise _Refused(f"must be \"auto\" or a whole number from 1 to {MAX_STORE_CLIENTS}, found {value!r}")
    return value


def _label(value: Any) -> str:
    value = "" if value is None else value
    if not isinstance(value, str) or "|" in value or len(value) > _MAX_PREFIX or not value.isprintable():
        raise _Refused(f"must be printable text without '|' of at most {_MAX_PREFIX} characters, "
                       f"found {value!r}")
    return value


#: THE ``kv_connector_extra_config`` keys, in the order their problems are reported
KEYS: tuple[ExtraKey, ...] = (
    ExtraKey("model_id", None, _text, "",
             "model name in the key namespace (set it when instances load the same weights from "
             "different paths)", shown="last path component of the model"),
    ExtraKey("mooncake_config_path", None, lambda v: _text(v) or None, "",
             "the Mooncake config file", shown="`$MOONCAKE_CONFIG_PATH`"),
    ExtraKey("load_failure_policy", "recompute", _choice(_POLICIES), 'use "recompute" or "fail"',
             '`"recompute"` (a failed load is recomputed) or `"fail"` (V1 only; V0 always recomputes)'),
    ExtraKey("load_async", True, _flag,
             "omit it (background loads where the release supports them) or set false",
             "load in the background where vLLM can recompute failed blocks (>= 0.11.1); `false`: "
             "before the forward pass (V1 only)"),
    ExtraKey("gpu_path", "auto", _choice(GPU_PATHS), 'use "auto", "staged" or "zero_copy"',
             'how a KV cache in CUDA memory moves: `"staged"` (through pinned host slots), '
             '`"zero_copy"` (Mooncake moves blocks straight between GPU memory and the pool, '
             "checksums computed on the GPU; needs a CUDA build of Mooncake, else staged with a "
             'warning) or `"auto"` (zero-copy over RDMA, staged over TCP, where it is measured '
             "faster: docs/gpu.md)"),
    ExtraKey("save_queue_size", 64, _positive(int), "omit it or set e.g. 64",
             "save jobs buffered per worker; a full queue drops the save (a future miss; V1 only)"),
    ExtraKey("connect_timeout", 5.0, _positive(float), "omit it or set e.g. 5.0",
             "seconds to reach the pool at start"),
    ExtraKey("layout_variant", None, _text, "", "override the predicted KV layout variant tag",
             shown="predicted"),
    ExtraKey("handoff_timeout", 5.0, _seconds_to_wait, "omit it (5 s) or set e.g. 5; 0 never waits",
             f"seconds (0 to {MAX_HANDOFF_TIMEOUT:.0f}; 0 = never wait) a decode instance defers a "
             "request whose prefill "
             "instance named, through the proxy's store flow, the blocks it is saving; then it loads "
             "what is there and vLLM recomputes the rest (V1, vLLM >= 0.10.2; `check` MCV-W018 "
             "flags older decodes); a prefill instance publishes its hand-off marker within half "
             "of its own handoff_timeout, with the blocks saved by then"),
    ExtraKey("load_policy", "auto", _choice(LOAD_POLICIES),
             'use "auto" (claim what loads faster than it recomputes), "always" or "never"',
             'which pool hits a V1 instance claims (vLLM >= 0.11.1): `"auto"` claims tokens only '
             "when this engine's measured pool rate loads them faster than its measured prefill "
             "recomputes them (a slow or degraded pool stops being claimed and is probed again now "
             "and then; declined claims are counted by reason, `vllm:mooncake_vllm_declined_tokens`), "
             '`"always"` claims every hit, `"never"` only saves'),
    ExtraKey("save_admission", "all", _choice(SAVE_ADMISSIONS),
             'use "all" (store every new block) or "repeat" (store a block the second time it is '
             "saved)",
             'which new blocks a worker stores: `"all"` every one (a prompt is in the pool after its '
             'first prefill, for every instance), `"repeat"` a block only once the pool has seen it '
             "saved before — its first save leaves a small mark (`mcv/<ns>/seen/<chunk>`), the next "
             "save of that block by any instance stores it. Unique suffixes (a RAG question, the "
             "last turn of a chat) then cost the pool a mark instead of their KV (~2 MiB a block "
             "on an 8B-class model); the price is that the second instance to compute a prefix "
             "recomputes it once. A decode hand-off's blocks and refills of vLLM's prefix cache "
             "are always stored. Deferred blocks are counted (`saves_first_seen`). V1 decides "
             "before capturing anything (one background query per request; a first sighting "
             "costs vLLM's thread and the GPU nothing: `scheduler_admission_*` counters), V0 on "
             "its save thread after the capture. V0 and V1"),
    ExtraKey("store_clients", "auto", _clients, 'omit it ("auto": one per 4 cores) or set e.g. 4',
             "store clients (Mooncake transfer engines) each worker stripes its loads and saves over, "
             f'1 to {MAX_STORE_CLIENTS}; `"auto"` = one per 4 cores, 1 to 4 (one client moves ~3 GB/s '
             "over TCP, four "
             "over four holders ~10 GB/s on a 16-core host: docs/gpu.md). The scheduler process "
             "keeps one"),
    ExtraKey("cache_prefix", "", _label, 'use a label such as "prod" or "weights-v2", or omit it',
             "a label that **joins the block key namespace** after `tenant_id` (same key as vLLM's "
             "in-tree store connector): sharing needs the same tenant AND the same prefix. Use it for "
             'a weights version (`"weights-v2"`: KV of old weights is never read after an update) or '
             f"a deployment. Printable, no `\\|`, ≤ {_MAX_PREFIX} characters; unset = keys as before",
             shown="none"),
)
_BY_NAME = {key.name: key for key in KEYS}
#: every key ``kv_connector_extra_config`` may hold
EXTRA_KEYS = tuple(sorted(_BY_NAME))


def _default(name: str) -> Any:
    """The setting an absent key gives (a field's default)."""
    key = _BY_NAME[name]
    return key.read(key.default)


@dataclass(frozen=True)
class ConnectorSettings:
    """Everything the connector takes from vLLM's ``kv_transfer_config``, validated."""

    kv_role: str = "kv_both"
    #: ``model_id`` resolved against the model path (:func:`~mooncake_vllm.keys.model_id`)
    model_id: str = ""
    mooncake_config_path: str | None = _default("mooncake_config_path")
    load_failure_policy: str = _default("load_failure_policy")
    save_queue_size: int = _default("save_queue_size")
    connect_timeout: float = _default("connect_timeout")
    layout_variant: str | None = _default("layout_variant")
    load_async: bool = _default("load_async")
    gpu_path: str = _default("gpu_path")
    handoff_timeout: float = _default("handoff_timeout")
    cache_prefix: str = _default("cache_prefix")
    load_policy: str = _default("load_policy")
    save_admission: str = _default("save_admission")
    #: store clients a worker stripes transfers over; 0 = ``"auto"`` (:func:`auto_store_clients`)
    store_clients: int = _default("store_clients")

    @property
    def can_save(self) -> bool:
        """The role stores KV (``kv_producer``, ``kv_both``)."""
        return ROLES.get(self.kv_role, (False, False))[0]

    @property
    def can_load(self) -> bool:
        """The role loads KV (``kv_consumer``, ``kv_both``)."""
        return ROLES.get(self.kv_role, (False, False))[1]

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> ConnectorSettings:
        """The settings of a ``VllmConfig`` (V0 or V1): its ``kv_transfer_config`` and model."""
        ktc = vllm_config.kv_transfer_config
        return cls.from_extra(getattr(ktc, "kv_connector_extra_config", None) or {},
                              kv_role=str(getattr(ktc, "kv_role", None) or "kv_both"),
                              model=str(vllm_config.model_config.model))

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], *, kv_role: str = "kv_both",
                   model: str = "") -> ConnectorSettings:
        """Validate ``kv_connector_extra_config``; one ConfigError lists every problem."""
        problems: list[ConfigProblem] = []
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            problems.append(ConfigProblem(_FIELD, f"unknown key(s) {unknown}",
                                          f"use only {sorted(EXTRA_KEYS)}"))
        if kv_role not in ROLES:
            problems.append(ConfigProblem("kv_role", f"found {kv_role!r}",
                                          f"use one of {', '.join(ROLES)}"))
        values: dict[str, Any] = {}
        for key in KEYS:
            try:
                values[key.name] = key.read(extra[key.name] if key.name in extra else key.default)
            except _Refused as exc:
                problems.append(ConfigProblem(f"{_FIELD}.{key.name}", str(exc), key.fix))
        if problems:
            raise ConfigError(_FIELD, problems)
        values["model_id"] = _model_id(model, values["model_id"])
        return cls(kv_role=kv_role, **values)

    def clients_for_worker(self) -> int:
        """How many store clients a worker opens (``"auto"`` resolved on this host)."""
        return self.store_clients or auto_store_clients()

    def marker_due(self) -> float:
        """Seconds after a hand-off's declaration by which a prefill worker publishes its
        marker, saves finished or not: half of ``handoff_timeout`` (of its default where 0),
        so the decode, waiting the same bound, always hears before it gives up."""
        return (self.handoff_timeout or float(_default("handoff_timeout"))) / 2


def auto_store_clients(cores: int | None = None) -> int:
    """One store client per 4 cores, 1 to 4: on a 16-core H200 host four clients over four
    holders moved 10.3 GB/s, one 2.8-3.2 and eight no more than four (docs/gpu.md)."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
    return max(1, min(4, cores // 4))
