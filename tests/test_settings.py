"""ConnectorSettings: vLLM's kv_transfer_config read and validated once, the same for V0 and V1."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest

from mooncake_vllm.errors import ConfigError
from mooncake_vllm.settings import EXTRA_KEYS, KEYS, ConnectorSettings, auto_store_clients


def _vllm_config(role: str = "kv_both", model: str = "/models/org/tiny-llama/", **extra: object):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role, kv_connector_extra_config=dict(extra)),
        model_config=SimpleNamespace(model=model))


def test_defaults_and_role_flags() -> None:
    s = ConnectorSettings.from_vllm_config(_vllm_config())
    assert (s.model_id, s.load_failure_policy, s.save_queue_size, s.connect_timeout) == (
        "tiny-llama", "recompute", 64, 5.0)
    assert s.mooncake_config_path is None and s.layout_variant is None
    flags = {role: (ConnectorSettings(kv_role=role).can_save, ConnectorSettings(kv_role=role).can_load)
             for role in ("kv_both", "kv_producer", "kv_consumer")}
    assert flags == {"kv_both": (True, True), "kv_producer": (True, False), "kv_consumer": (False, True)}


def test_every_documented_key_is_read() -> None:
    s = ConnectorSettings.from_vllm_config(_vllm_config(
        "kv_consumer", model_id="shared", mooncake_config_path="/etc/mc.json",
        load_failure_policy="fail", save_queue_size=8, connect_timeout=2, layout_variant="amx",
        load_async=False, gpu_path="zero_copy", handoff_timeout=0, cache_prefix="weights-v2",
        load_policy="never", store_clients=3, save_admission="repeat"))
    assert s == ConnectorSettings(kv_role="kv_consumer", model_id="shared",
                                  mooncake_config_path="/etc/mc.json", load_failure_policy="fail",
                                  save_queue_size=8, connect_timeout=2.0, layout_variant="amx",
                                  load_async=False, gpu_path="zero_copy", handoff_timeout=0.0,
                                  cache_prefix="weights-v2", load_policy="never",
                                  store_clients=3, save_admission="repeat")
    assert s.clients_for_worker() == 3
    assert ConnectorSettings.from_vllm_config(_vllm_config()).handoff_timeout == 5.0
    with pytest.raises(AttributeError):
        s.kv_role = "kv_both"  # type: ignore[misc]  # frozen


def test_each_key_is_declared_once_and_is_a_field_with_its_default() -> None:
    names = [key.name for key in KEYS]
    assert len(set(names)) == len(names) and EXTRA_KEYS == tuple(sorted(names))
    assert {f.name for f in fields(ConnectorSettings)} == {"kv_role", *names}
    # an empty extra config gives the fields' defaults (model_id: resolved from the model path)
    assert ConnectorSettings.from_extra({}, model="/models/tiny-llama") == ConnectorSettings(model_id="tiny-llama")


def test_every_problem_in_one_error_naming_field_and_fix() -> None:
    with pytest.raises(ConfigError) as info:
        ConnectorSettings.from_vllm_config(_vllm_config(
            model_idd="x", load_failure_policy="ignore", save_queue_size=True, connect_timeout=-1,
            gpu_path="gpudirect"))
    err = info.value
    assert err.fields == ["kv_connector_extra_config",
                          "kv_connector_extra_config.load_failure_policy",
                          "kv_connector_extra_config.gpu_path",
                          "kv_connector_extra_config.save_queue_size",
                          "kv_connector_extra_config.connect_timeout"]
    assert "model_idd" in str(err) and "use only" in str(err) and '"recompute" or "fail"' in str(err)
    assert "'gpudirect'" in str(err) and '"auto", "staged" or "zero_copy"' in str(err)


@pytest.mark.parametrize("value", [-1, 601, True, "5", None])
def test_handoff_timeout_is_a_bounded_number_of_seconds(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        ConnectorSettings.from_vllm_config(_vllm_config(handoff_timeout=value))
    assert info.value.fields == ["kv_connector_extra_config.handoff_timeout"]
    assert "from 0 to 600" in str(info.value) and "0 never waits" in str(info.value)


def test_unknown_role_is_refused() -> None:
    with pytest.raises(ConfigError, match="kv_role"):
        ConnectorSettings.from_vllm_config(_vllm_config("kv_everything"))


@pytest.mark.parametrize("bad", ["a|b", "x" * 129, 7, "line\nbreak"])
def test_bad_cache_prefix_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        ConnectorSettings.from_vllm_config(_vllm_config(cache_prefix=bad))
    assert info.value.fields == ["kv_connector_extra_config.cache_prefix"]
    assert "weights-v2" in str(info.value)  # the fix names a usable value


@pytest.mark.parametrize("key,value,says", [
    ("load_policy", "sometimes", '"auto"'),
    ("load_policy", None, '"always" or "never"'),
    ("save_admission", "twice", '"repeat"'),
    ("save_admission", True, '"all"'),
    ("store_clients", 0, "from 1 to 16"),
    ("store_clients", 17, "from 1 to 16"),
    ("store_clients", True, "whole number"),
    ("store_clients", 2.0, "whole number"),
    ("store_clients", "4", "whole number"),
])
def test_striping_and_claim_settings_refuse_bad_values(key: str, value: object, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        ConnectorSettings.from_vllm_config(_vllm_config(**{key: value}))
    assert info.value.fields == [f"kv_connector_extra_config.{key}"]
    assert says in str(info.value) and repr(value) in str(info.value)


def test_store_clients_auto_is_one_per_four_cores() -> None:
    s = ConnectorSettings.from_vllm_config(_vllm_config())
    assert (s.load_policy, s.store_clients) == ("auto", 0)
    assert [auto_store_clients(c) for c in (1, 2, 4, 7, 8, 16, 64)] == [1, 1, 1, 1, 2, 4, 4]
    assert s.clients_for_worker() == auto_store_clients()
