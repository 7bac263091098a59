"""Make ``"kv_connector": "MooncakeStoreConnector"`` select OUR connector on every vLLM.

This is the ``vllm.general_plugins`` entry point (``pyproject.toml``), so
``pip install mooncake-vllm`` is all a user does: vLLM calls :func:`register`
in every process that parses engine arguments or builds workers.

How the name is claimed is read from the version table
(:func:`~mooncake_vllm.compat.versions.vllm_facts`, fields ``v0_name`` /
``v1_name`` / ``v0_claim`` / ``v1_claim``):

==================  ==========================================================
vLLM                what :func:`register` does
==================  ==========================================================
0.8.3 – 0.10.0      the name is taken by vLLM's own V0 connector: the registry
                    entry is replaced (one log line says so); the entry loads
                    :mod:`mooncake_vllm.compat.facade`, which hands the V0 class
                    to ``create_connector_v0`` and the V1 class to
                    ``create_connector_v1``
0.10.1 – 0.20.x     the name is free: ``KVConnectorFactory.register_connector``
0.21 +              the name is taken by vLLM's in-tree V1 connector: the entry
                    is replaced (one log line says so)
==================  ==========================================================

Alternatives, documented for users:

* explicit, no plugin needed (vLLM ≥ 0.10.1; on 0.20+ it beats the registry)::

      --kv-transfer-config '{"kv_connector": "MooncakeStoreConnector",
                             "kv_connector_module_path": "mooncake_vllm.compat.facade",
                             "kv_role": "kv_both"}'

* keep vLLM's own connector for the name: ``MOONCAKE_VLLM_DISABLE=1`` (or list
  only other plugins in ``VLLM_PLUGINS``).

:func:`register` is idempotent, imports only vLLM's connector factory (no CUDA),
and never raises: on internals it does not recognise it logs and leaves vLLM
untouched.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncake_vllm.compat.detect import check_mooncake_for_vllm, installed_mooncake
from mooncake_vllm.compat.facts import installed_facts
from mooncake_vllm.compat.versions import VllmFacts
from mooncake_vllm.logs import follow_vllm_logging

__all__ = [
    "CONNECTOR_NAME",
    "DISABLE_ENV",
    "FACADE_MODULE",
    "FACTORY_MODULE",
    "Plan",
    "claim_name",
    "plan_for",
    "register",
]

# register() first lets our package logger use vLLM's handler (mooncake_vllm.logs),
# so the one override line shows up in vLLM's own log.
log = logging.getLogger(__name__)

CONNECTOR_NAME = "MooncakeStoreConnector"
FACADE_MODULE = "mooncake_vllm.compat.facade"
FACTORY_MODULE = "vllm.distributed.kv_transfer.kv_connector.factory"
DISABLE_ENV = "MOONCAKE_VLLM_DISABLE"

#: The loader we installed in each factory's registry (identity = idempotence).
_installed: dict[int, Any] = {}


@dataclass(frozen=True)
class Plan:
    """What registration does on one vLLM release, derived from its facts."""

    vllm_version: str
    action: str  #: "register" (name free) | "override" (name taken in-tree) | "skip"
    reason: str

    @property
    def acts(self) -> bool:
        return self.action != "skip"


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def plan_for(facts: VllmFacts, env: Mapping[str, str] | None = None) -> Plan:
    """Decide how to claim the name on the release described by ``facts``."""
    env = os.environ if env is None else env
    if _truthy(env.get(DISABLE_ENV)):
        return Plan(facts.version, "skip", f"{DISABLE_ENV} is set: vLLM's own connectors keep their names")
    paths = [(facts.v0_name, facts.v0_claim)] if facts.v0_kv_connectors else []
    paths += [(facts.v1_name, facts.v1_claim)] if facts.v1_kv_connectors else []
    claims = [claim for _name, claim in paths if claim]
    if not claims:
        return Plan(facts.version, "skip", f"vLLM {facts.version} has no KV-connector path we support")
    if "monkeypatch" in claims:
        return Plan(facts.version, "skip", f"vLLM {facts.version} has no connector registry")
    if any(name == "taken" for name, _claim in paths):
        return Plan(facts.version, "override",
                    f"vLLM {facts.release} ships its own {CONNECTOR_NAME}")
    return Plan(facts.version, "register", f"the name is free on vLLM {facts.release}")


def claim_name(factory: Any, plan: Plan) -> bool:
    """Point ``factory``'s registry entry for our name at the facade; True if it does now.

    Uses vLLM's own ``register_connector`` (so the loader has that release's
    shape), after removing a built-in entry when ``plan`` says the name is taken.
    """
    registry = getattr(factory, "_registry", None)
    register_connector = getattr(factory, "register_connector", None)
    if not isinstance(registry, dict) or not callable(register_connector):
        log.warning("mooncake-vllm: vLLM %s's KVConnectorFactory has no _registry/register_connector; "
                    "not registering %s (use kv_connector_module_path=%s instead)",
                    plan.vllm_version, CONNECTOR_NAME, FACADE_MODULE)
        return False
    current = registry.get(CONNECTOR_NAME)
    if current is not None and current is _installed.get(id(factory)):
        return True  # already ours: idempotent
    if current is not None:
        previous = registry.pop(CONNECTOR_NAME)
        if plan.action == "override":
            log.info("mooncake-vllm: replacing vLLM %s's built-in %s with mooncake_vllm's "
                     "(set %s=1 to keep the built-in one)",
                     plan.vllm_version, CONNECTOR_NAME, DISABLE_ENV)
        else:
            log.warning("mooncake-vllm: %s was already registered by someone else on vLLM %s; "
                        "replacing it with mooncake_vllm's (set %s=1 to keep it)",
                        CONNECTOR_NAME, plan.vllm_version, DISABLE_ENV)
    else:
        previous = None
    try:
        register_connector(CONNECTOR_NAME, FACADE_MODULE, CONNECTOR_NAME)
    except Exception:  # noqa: BLE001 - leave vLLM as it was
        if previous is not None:
            registry[CONNECTOR_NAME] = previous
        log.warning("mooncake-vllm: register_connector failed on vLLM %s; left untouched",
                    plan.vllm_version, exc_info=True)
        return False
    _installed[id(factory)] = registry.get(CONNECTOR_NAME)
    return True


def _warn_in_tree_mooncake(version: str) -> None:
    """When the user keeps vLLM's own V0 connector, say early if its Mooncake import will fail."""
    for dist in installed_mooncake():
        try:
            check_mooncake_for_vllm(version, dist.version)
        except Exception as exc:  # noqa: BLE001 - UnsupportedVersionError or a bad version string
            log.error("mooncake-vllm: %s", exc)


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Never raises."""
    try:
        # the process's cores, noted before vLLM's CPU backend pins a worker thread: the
        # pool's threads never leave them (placement.py)
        import mooncake_vllm.placement  # noqa: F401
        follow_vllm_logging()
        try:
            if installed_facts() is None:
                log.debug("mooncake-vllm: no vLLM distribution found; nothing to register")
                return
            facts = installed_facts(strict=True)
        except Exception as exc:  # noqa: BLE001 - unsupported or unparsable version
            log.warning("mooncake-vllm: not registering %s: %s", CONNECTOR_NAME, exc)
            return
        plan = plan_for(facts)
        if not plan.acts:
            log.debug("mooncake-vllm: not registering: %s", plan.reason)
            if facts.in_tree_v0_store and facts.max_mooncake:
                _warn_in_tree_mooncake(facts.version)
            return
        import importlib

        factory_module = importlib.import_module(FACTORY_MODULE)
        factory = getattr(factory_module, "KVConnectorFactory", None)
        if factory is None:
            log.warning("mooncake-vllm: %s has no KVConnectorFactory; not registering", FACTORY_MODULE)
            return
        claim_name(factory, plan)
        from mooncake_vllm.compat.vllm_fixes import apply

        apply(facts)
    except Exception:  # noqa: BLE001 - a plugin must never break vLLM start-up
        log.warning("mooncake-vllm: registration failed; vLLM left untouched", exc_info=True)
