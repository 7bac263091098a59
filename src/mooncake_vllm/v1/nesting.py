"""Our connector as a child of vLLM's ``MultiConnector`` (the seed's P2P + store recipe).

``MultiConnector`` builds each child with a shallow copy of the engine's config whose
``kv_transfer_config`` is that child's own entry. What the engine then reads comes
from the PARENT's config, not the child's:

* ``kv_load_failure_policy``: the scheduler reads the parent's right after building
  the connector; a pool load that fails must be recomputed, so ours sets the
  parent's to ``recompute`` (:func:`adopt_failure_policy`);
* the KV layout: vLLM asks the parent class for ``get_required_kvcache_layout``, and
  the P2P ``MooncakeConnector`` beside us asks for HND (0.13-0.28, ``LBHNC`` later), so
  the layout we key blocks by is predicted from the parent (:func:`required_layout`);
* stats: the parent files each child's stats under the child's class NAME and, in
  another process, rebuilds them through vLLM's registry by that name; the name
  must resolve to our class (:func:`check_stats_name`).

The parent's config is found on the constructor's caller frames: the child is built
inside ``MultiConnector.__init__``, whose ``self._vllm_config`` is the parent's.
"""

from __future__ import annotations

import logging
import sys
from types import FrameType
from typing import Any

from mooncake_vllm.errors import ConfigError, ConfigProblem

__all__ = ["adopt_failure_policy", "check_stats_name", "parent_config", "required_layout"]

log = logging.getLogger(__name__)

#: vLLM's composite connector; a subclass counts too
PARENT_CLASS = "MultiConnector"


def _is_parent(obj: Any) -> bool:
    return any(c.__name__ == PARENT_CLASS for c in type(obj).__mro__)


def parent_config(vllm_config: Any, *, depth: int = 64) -> Any | None:
    """The outermost enclosing ``MultiConnector``'s config, or None when we are not nested.

    Call it from the connector's constructor (the frames above it are vLLM's)."""
    found = None
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "__init__" and owner is not None and _is_parent(owner):
            parent = getattr(owner, "_vllm_config", None) or frame.f_locals.get("vllm_config")
            if parent is not None and parent is not vllm_config:
                found = parent
        frame = frame.f_back
    return found


def adopt_failure_policy(parent: Any | None, policy: str) -> None:
    """Give the parent our ``kv_load_failure_policy`` (vLLM >= 0.13 reads the parent's)."""
    ktc = getattr(parent, "kv_transfer_config", None)
    current = getattr(ktc, "kv_load_failure_policy", None)
    if ktc is None or current is None or current == policy:
        return
    ktc.kv_load_failure_policy = policy
    log.info("mooncake-vllm: MultiConnector's kv_load_failure_policy %s -> %s (a pool load that "
             "fails is recomputed; set load_failure_policy in our kv_connector_extra_config to "
             "keep %s)", current, policy, current)


def required_layout(vllm_config: Any) -> str | None:
    """The KV layout the configured connector (a ``MultiConnector``: any child) asks vLLM for;
    None where it asks for none or this vLLM has no such hook (< 0.10.1)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None:
        return None
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        cls = KVConnectorFactory.get_connector_class(ktc)
        hook = getattr(cls, "get_required_kvcache_layout", None)
        return None if hook is None else hook(vllm_config)
    except Exception as exc:  # noqa: BLE001 - a child vLLM cannot resolve here is its own error
        log.debug("mooncake-vllm: no required KV layout from %s: %s", ktc.kv_connector, exc)
        return None


def check_stats_name(our_class: type, name: str) -> None:
    """Refuse to run nested where vLLM's registry maps ``name`` to another class (the plugin
    off: ``MOONCAKE_VLLM_DISABLE=1``, ``VLLM_PLUGINS`` without us, our class reached only
    through ``kv_connector_module_path``): ``MultiConnector`` would rebuild our stats with
    that class's code in the frontend process."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # pragma: no cover - no vLLM
        return
    lookup = getattr(KVConnectorFactory, "get_connector_class_by_name", None)
    if lookup is None:  # releases whose MultiConnector does not rebuild stats by name
        return
    try:
        registered: Any = lookup(name)
    except Exception as exc:  # noqa: BLE001 - not registered at all
        registered = exc
    if isinstance(registered, type) and issubclass(registered, our_class):
        return
    found = (f"vLLM's {registered.__module__}.{registered.__qualname__}"
             if isinstance(registered, type) else f"nothing ({registered})")
    raise ConfigError("kv_connector_extra_config.connectors", [ConfigProblem(
        field=f"connectors[kv_connector={name!r}]",
        problem=(f"mooncake-vllm's {name} runs inside MultiConnector, but vLLM's registry "
                 f"resolves the name {name!r} to {found}: MultiConnector files each child's "
                 f"stats under its class name and rebuilds them by that name in the API "
                 f"process, so ours would be read by other code (the mooncake-vllm plugin is "
                 f"off: MOONCAKE_VLLM_DISABLE=1 or VLLM_PLUGINS without it)"),
        fix=("turn the plugin on (unset MOONCAKE_VLLM_DISABLE; VLLM_PLUGINS must list "
             "mooncake_vllm), or drop kv_connector_module_path from that child to run "
             "vLLM's own connector of that name"))])
