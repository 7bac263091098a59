"""The connector's own settings, read once from vLLM's ``kv_transfer_config``.

Both engines build one frozen :class:`ConnectorSettings` per connector with
:meth:`ConnectorSettings.from_vllm_config` and pass it down as a value, the way
vLLM's ``KVTransferConfig`` keeps ``is_kv_producer`` / ``get_from_extra_config``
in one object. V0 and V1 validate ``kv_connector_extra_config`` the same way: a
key or value one engine rejects, the other rejects too, with one
:class:`~mooncake_vllm.errors.ConfigError` naming the field and the fix.

``kv_connector_extra_config`` keys:

``model_id``               key namespace model name (default: model dir basename)
``mooncake_config_path``   instead of ``$MOONCAKE_CONFIG_PATH``
``load_failure_policy``    ``"recompute"`` (default; sets vLLM's kv_load_failure_policy)
                           or ``"fail"`` (V1 only; V0 always recomputes)
``save_queue_size``        save jobs buffered per worker (default 64; full → dropped; V1 only)
``connect_timeout``        seconds to reach the pool at start (default 5)
``layout_variant``         override the predicted KV layout variant tag
``gpu_path``               how a KV cache in CUDA memory moves: ``"auto"`` (default:
                           zero-copy over RDMA, staged otherwise), ``"staged"`` (through
                           pinned slots) or ``"zero_copy"`` (straight from GPU memory,
                           checksums on the GPU; needs a CUDA build of Mooncake)
``cache_prefix``           a label joining the key namespace (e.g. a weights version or a
                           deployment); composes with the Mooncake config's ``tenant_id``
                           (both must match to share blocks). Same key as vLLM's in-tree
                           store connector; printable, no ``|``, at most 128 characters
``load_async``             ``true`` (default): load in the background where vLLM can
                           recompute failed blocks (>= 0.11.1); ``false``: before the
                           forward pass (V1 only; V0 always loads before it)
``handoff_timeout``        seconds a decode instance waits for the blocks a prefill
                           instance named in ``kv_transfer_params`` (the proxy's store
                           flow) before it recomputes (default 5, 0 = never wait, at most
                           600; V1 >= 0.10.2 only)
``load_policy``            ``"auto"`` (default): claim pool tokens only when this engine's
                           measured pool rate loads them faster than its measured prefill
                           recomputes them; ``"always"``: claim every hit; ``"never"``:
                           save only (V1 >= 0.11.1; elsewhere every hit is claimed)
``store_clients``          store clients (Mooncake transfer engines) a worker stripes its
                           loads and saves over: ``"auto"`` (default: one per 4 cores, 1
                           to 4) or 1 to 16
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.errors import ConfigError, ConfigProblem
from mooncake_vllm.keys import model_id as _model_id

__all__ = ["EXTRA_KEYS", "GPU_PATHS", "LOAD_POLICIES", "MAX_HANDOFF_TIMEOUT", "MAX_STORE_CLIENTS",
           "ROLES", "ConnectorSettings", "auto_store_clients"]

#: every key ``kv_connector_extra_config`` may hold
EXTRA_KEYS = ("cache_prefix", "connect_timeout", "gpu_path", "handoff_timeout", "layout_variant",
              "load_async", "load_failure_policy", "load_policy", "model_id",
              "mooncake_config_path", "save_queue_size", "store_clients")
#: the longest ``handoff_timeout`` accepted (seconds): longer is a typo, not a bound
MAX_HANDOFF_TIMEOUT = 600.0
#: vLLM's ``kv_role`` values and what each lets the connector do: (save, load)
ROLES = {"kv_both": (True, True), "kv_producer": (True, False), "kv_consumer": (False, True)}
_POLICIES = ("recompute", "fail")
#: ``gpu_path`` values (store.paths.choose_gpu_path picks the path)
GPU_PATHS = ("auto", "staged", "zero_copy")
#: ``load_policy`` values (v1.claims decides what ``auto`` claims)
LOAD_POLICIES = ("auto", "always", "never")
#: the most store clients one worker opens (each is a transfer engine with its own threads)
MAX_STORE_CLIENTS = 16
_FIELD = "kv_connector_extra_config"


@dataclass(frozen=True)
class ConnectorSettings:
    """Everything the connector takes from vLLM's ``kv_transfer_config``, validated."""

    kv_role: str = "kv_both"
    model_id: str = ""
    mooncake_config_path: str | None = None
    load_failure_policy: str = "recompute"
    save_queue_size: int = 64
    connect_timeout: float = 5.0
    layout_variant: str | None = None
    load_async: bool = True
    gpu_path: str = "auto"
    handoff_timeout: float = 5.0
    cache_prefix: str = ""
    load_policy: str = "auto"
    #: store clients a worker stripes transfers over; 0 = ``"auto"`` (:func:`auto_store_clients`)
    store_clients: int = 0

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
        policy = extra.get("load_failure_policy", "recompute")
        if policy not in _POLICIES:
            problems.append(ConfigProblem(f"{_FIELD}.load_failure_policy",
                                          f"found {policy!r}", 'use "recompute" or "fail"'))
        load_async = extra.get("load_async", True)
        if not isinstance(load_async, bool):
            problems.append(ConfigProblem(f"{_FIELD}.load_async",
                                          f"must be true or false, found {load_async!r}",
                                          "omit it (background loads where the release "
                                          "supports them) or set false"))
        gpu_path = extra.get("gpu_path", "auto")
        if gpu_path not in GPU_PATHS:
            problems.append(ConfigProblem(f"{_FIELD}.gpu_path", f"found {gpu_path!r}",
                                          'use "auto", "staged" or "zero_copy"'))
        numbers: dict[str, Any] = {}
        for name, default in (("save_queue_size", 64), ("connect_timeout", 5.0)):
            value = extra.get(name, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                problems.append(ConfigProblem(f"{_FIELD}.{name}",
                                              f"must be a positive number, found {value!r}",
                                              f"omit it or set e.g. {default}"))
            numbers[name] = value
        handoff = extra.get("handoff_timeout", 5.0)
        if (isinstance(handoff, bool) or not isinstance(handoff, (int, float))
                or not 0 <= handoff <= MAX_HANDOFF_TIMEOUT):
            problems.append(ConfigProblem(f"{_FIELD}.handoff_timeout",
                                          f"must be a number of seconds from 0 to "
                                          f"{MAX_HANDOFF_TIMEOUT:.0f}, found {handoff!r}",
                                          "omit it (5 s) or set e.g. 5; 0 never waits"))
        load_policy = extra.get("load_policy", "auto")
        if load_policy not in LOAD_POLICIES:
            problems.append(ConfigProblem(f"{_FIELD}.load_policy", f"found {load_policy!r}",
                                          'use "auto" (claim what loads faster than it '
                                          'recomputes), "always" or "never"'))
        clients = extra.get("store_clients", "auto")
        if clients != "auto" and (isinstance(clients, bool) or not isinstance(clients, int)
                                  or not 1 <= clients <= MAX_STORE_CLIENTS):
            problems.append(ConfigProblem(f"{_FIELD}.store_clients",
                                          f"must be \"auto\" or a whole number from 1 to "
                                          f"{MAX_STORE_CLIENTS}, found {clients!r}",
                                          'omit it ("auto": one per 4 cores) or set e.g. 4'))
        texts = {name: None if extra.get(name) is None else str(extra[name])
                 for name in ("model_id", "mooncake_config_path", "layout_variant")}
        cache_prefix = extra.get("cache_prefix", "")
        if cache_prefix is None:
            cache_prefix = ""
        if not isinstance(cache_prefix, str) or "|" in cache_prefix or len(cache_prefix) > 128 \
                or not cache_prefix.isprintable():
            problems.append(ConfigProblem(f"{_FIELD}.cache_prefix",
                                          f"must be printable text without '|' of at most 128 "
                                          f"characters, found {cache_prefix!r}",
                                          'use a label such as "prod" or "weights-v2", or omit it'))
        if problems:
            raise ConfigError(_FIELD, problems)
        return cls(kv_role=kv_role, model_id=_model_id(model, texts["model_id"]),
                   mooncake_config_path=texts["mooncake_config_path"] or None,
                   load_failure_policy=str(policy),
                   save_queue_size=int(numbers["save_queue_size"]),
                   connect_timeout=float(numbers["connect_timeout"]),
                   layout_variant=texts["layout_variant"], load_async=bool(load_async),
                   gpu_path=str(gpu_path), handoff_timeout=float(handoff),
                   cache_prefix=str(cache_prefix), load_policy=str(load_policy),
                   store_clients=0 if clients == "auto" else int(clients))

    def clients_for_worker(self) -> int:
        """How many store clients a worker opens (``"auto"`` resolved on this host)."""
        return self.store_clients or auto_store_clients()


def auto_store_clients(cores: int | None = None) -> int:
    """One store client per 4 cores, 1 to 4: on a 16-core H200 host four clients over four
    holders moved 10.3 GB/s, one 2.8-3.2 and eight no more than four (docs/gpu.md)."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
    return max(1, min(4, cores // 4))
