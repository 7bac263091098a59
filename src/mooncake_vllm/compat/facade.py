"""The module vLLM imports for the name ``MooncakeStoreConnector``.

vLLM's registry loader (and ``kv_connector_module_path``) does
``getattr(import_module("mooncake_vllm.compat.facade"), "MooncakeStoreConnector")``.
This module answers through PEP 562 ``__getattr__`` with a REAL class: the V0
connector (:mod:`mooncake_vllm.v0`) when vLLM's V0 engine is creating it, the V1
connector (:mod:`mooncake_vllm.v1`) otherwise. The engine is read from the
factory method on the call stack (``create_connector_v0`` /
``create_connector_v1`` on vLLM 0.8.5-0.10.0) and, where the stack does not say,
from the installed release and ``VLLM_USE_V1``
(:func:`~mooncake_vllm.compat.detect.detect_engine`).

Bad input fails here, before vLLM builds anything, with one clear error:
``VLLM_USE_V1=0`` on a release without V0, or a Mooncake the connector cannot
use. A missing or unreadable ``MOONCAKE_CONFIG_PATH`` is reported by the
connector's constructor (:func:`~mooncake_vllm.config.load_store_config`: names
the variable and shows a working file), because the V1 connector also accepts
``kv_connector_extra_config["mooncake_config_path"]``, which only it can see.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

from mooncake_vllm.compat.detect import detect_engine, installed_mooncake
from mooncake_vllm.compat.facts import installed_facts
from mooncake_vllm.compat.versions import mooncake_facts
from mooncake_vllm.errors import UnsupportedVersionError

__all__ = ["CLASS_PATHS", "MooncakeStoreConnector", "engine_from_stack", "resolve"]  # noqa: F822 (PEP 562 __getattr__)

CONNECTOR_NAME = "MooncakeStoreConnector"
#: Where each engine's class lives.
CLASS_PATHS = {
    "v0": ("mooncake_vllm.v0.connector", "MooncakeStoreConnector"),
    "v1": ("mooncake_vllm.v1.connector", "MooncakeStoreConnector"),
}
#: vLLM factory methods that say which engine is creating the connector.
_FACTORY_FRAMES = {"create_connector_v0": "v0", "create_connector_v1": "v1"}
#: The Mooncake we test with; named in errors about a missing or unusable Mooncake.
MOONCAKE_PIN = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
_STACK_DEPTH = 12


def engine_from_stack(frame: FrameType | None = None, depth: int = _STACK_DEPTH) -> str | None:
    """``"v0"``/``"v1"`` if a vLLM factory method for one engine is on the call stack."""
    f: FrameType | None = frame if frame is not None else sys._getframe(1)
    for _ in range(depth):
        if f is None:
            break
        engine = _FACTORY_FRAMES.get(f.f_code.co_name)
        if engine and "kv_connector" in f.f_code.co_filename.replace(os.sep, "/"):
            return engine
        f = f.f_back
    return None


def _check_mooncake() -> None:
    dists = installed_mooncake()
    if not dists:
        raise UnsupportedVersionError(
            f"{CONNECTOR_NAME} (mooncake-vllm) needs Mooncake's Python package, but none is "
            f"installed. Fix: pip install {MOONCAKE_PIN} (or mooncake-transfer-engine for CUDA hosts)")
    if len(dists) > 1:
        raise UnsupportedVersionError(
            f"several Mooncake distributions are installed ({', '.join(map(str, dists))}); they "
            f"overwrite each other's `mooncake` package. Fix: pip uninstall all but one of them")
    facts = mooncake_facts(dists[0].version)
    if not facts.batch_zero_copy:
        raise UnsupportedVersionError(
            f"{dists[0]} is too old for mooncake-vllm (it needs batch_put_from / batch_get_into, "
            f"Mooncake >= 0.3.5). Fix: pip install {MOONCAKE_PIN}. mooncake-vllm does not import "
            f"mooncake_vllm_adaptor, so vLLM <= 0.8.4 does not need an old Mooncake with it")


def resolve(env: Mapping[str, str] | None = None, *, engine: str | None = None,
            check_mooncake: bool = True) -> type:
    """The connector class for the engine that is starting; raises on bad input."""
    env = os.environ if env is None else env
    facts = installed_facts(strict=True)
    if engine is None:
        if facts.v0_kv_connectors and facts.v1_kv_connectors:
            engine = engine_from_stack(sys._getframe(1)) or detect_engine(facts.version, env)
        else:
            # one engine path only; detect_engine still raises the clear errors
            # (VLLM_USE_V1=0 on a release without V0, VLLM_USE_V1=1 without V1 connectors)
            engine = detect_engine(facts.version, env)
    if check_mooncake:
        _check_mooncake()
    module_name, class_name = CLASS_PATHS[engine]
    return getattr(importlib.import_module(module_name), class_name)


def __getattr__(name: str) -> Any:
    if name == CONNECTOR_NAME:
        return resolve()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
