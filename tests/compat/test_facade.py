"""The facade module vLLM imports for the name: a real class per engine, clear errors."""

from __future__ import annotations

import importlib
import json

import pytest

from mooncake_vllm.compat import facade, installed_vllm, vllm_facts
from mooncake_vllm.compat.detect import LAST_V0_RELEASE
from mooncake_vllm.errors import UnsupportedVersionError

FACTS = vllm_facts(installed_vllm().version)


@pytest.fixture
def config_env(tmp_path) -> dict[str, str]:
    path = tmp_path / "mooncake_config.json"
    path.write_text(json.dumps({"metadata_server": "http://127.0.0.1:1/metadata",
                                "master_server_address": "127.0.0.1:1",
                                "global_segment_size": "0", "protocol": "tcp"}))
    return {"MOONCAKE_CONFIG_PATH": str(path)}


def _cls(engine: str) -> type:
    module, name = facade.CLASS_PATHS[engine]
    return getattr(importlib.import_module(module), name)


def test_default_engine_gets_its_real_class(config_env) -> None:
    cls = facade.resolve(config_env)
    assert isinstance(cls, type)
    assert cls is _cls(FACTS.default_engine if FACTS.v1_kv_connectors else "v0")


def test_use_v1_0_picks_v0_or_fails_with_the_migration_command(config_env) -> None:
    env = {**config_env, "VLLM_USE_V1": "0"}
    if FACTS.v0_kv_connectors:
        assert facade.resolve(env) is _cls("v0")
        return
    with pytest.raises(UnsupportedVersionError) as info:
        facade.resolve(env)
    msg = str(info.value)
    assert LAST_V0_RELEASE in msg and "mooncake-vllm check" in msg and "VLLM_USE_V1" in msg


def test_resolving_needs_no_config_file() -> None:
    """The config is the connector's business (it may come from kv_connector_extra_config)."""
    assert isinstance(facade.resolve({}), type)


def test_module_attribute_is_pep562(config_env, monkeypatch) -> None:
    for key, value in config_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("VLLM_USE_V1", raising=False)
    cls = importlib.import_module("mooncake_vllm.compat.facade").MooncakeStoreConnector
    assert isinstance(cls, type) and cls.__name__ == "MooncakeStoreConnector"
    with pytest.raises(AttributeError):
        facade.NoSuchConnector  # noqa: B018


def test_engine_from_stack_reads_the_factory_method() -> None:
    code = compile("def create_connector_v0():\n    return probe()\n",
                   "/x/vllm/distributed/kv_transfer/kv_connector/factory.py", "exec")
    scope: dict = {"probe": lambda: facade.engine_from_stack()}
    exec(code, scope)  # noqa: S102 - a frame with the factory's name and file
    assert scope["create_connector_v0"]() == "v0"
    assert facade.engine_from_stack() is None
