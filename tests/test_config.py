"""Config loading: both shapes, every problem reported at once, sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake_vllm.config import CONFIG_ENV, load_store_config, metadata_scheme, parse_size
from mooncake_vllm.errors import ConfigError

SEED = Path(__file__).parent / "data" / "seed"


def test_seed_v1_shape_loads_unchanged() -> None:
    cfg = load_store_config(SEED / "v1_mooncake_config.json")
    assert cfg.global_segment_size == 0
    assert cfg.local_buffer_size == 2147483648
    assert cfg.protocol == "rdma" and cfg.device_name == ""
    assert cfg.metadata_scheme == "http"
    assert cfg.local_hostname == ""  # chosen at connect time


@pytest.mark.parametrize("name", ["v0_mooncake-tcp.json", "v0_mooncake-rdma.json"])
def test_seed_v0_shapes_load_unchanged(name: str) -> None:
    cfg = load_store_config(SEED / name)
    assert cfg.local_hostname == "192.168.0.137"
    assert cfg.metadata_scheme == "etcd"
    assert cfg.master_server_address == "192.168.0.137:50001"
    assert cfg.global_segment_size == 3355443200  # vLLM V0's default


def test_reads_env_variable(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"metadata_server": "P2PHANDSHAKE",
                                "master_server_address": "127.0.0.1:5"}))
    cfg = load_store_config(env={CONFIG_ENV: str(path)})
    assert cfg.metadata_scheme == "p2p" and cfg.source.startswith(CONFIG_ENV)


def test_missing_env_names_variable_and_example() -> None:
    with pytest.raises(ConfigError) as err:
        load_store_config(env={})
    assert CONFIG_ENV in str(err.value) and "master_server_address" in str(err.value)


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_store_config(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_store_config(bad)
    junk = tmp_path / "junk.json"
    junk.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_store_config(junk)
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_store_config(arr)


@pytest.mark.timeout(30)  # before the fix a FIFO blocked open() forever
def test_config_path_that_is_no_regular_file_is_an_error_not_a_hang(tmp_path: Path) -> None:
    """MOONCAKE_CONFIG_PATH at a FIFO, at /dev/zero, or at an endless /proc file: a ConfigError."""
    import os

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    for path in (fifo, zero):
        with pytest.raises(ConfigError, match="not a regular file"):
            load_store_config(path, env={})
    big = tmp_path / "big.json"
    big.write_text('{"x": "' + "a" * (2 << 20) + '"}')
    with pytest.raises(ConfigError, match="more than"):
        load_store_config(big, env={})


def test_every_problem_reported_together() -> None:
    with pytest.raises(ConfigError) as err:
        load_store_config({
            "metadata_server": "zk://h:1", "master_server_address": "nohostport",
            "global_segment_size": -5, "local_buffer_size": "4 bananas", "protocol": "TCP",
            "device_nmae": "x",
        })
    fields = set(err.value.fields)
    assert fields == {"metadata_server", "master_server_address", "global_segment_size",
                      "local_buffer_size", "protocol", "device_nmae"}
    text = str(err.value)
    assert "6 problems" in text and "rename it to \"device_name\"" in text
    assert 'did you mean "tcp"' in text and "fix:" in text
    assert isinstance(err.value, ValueError)


def test_missing_required_and_wrong_types() -> None:
    with pytest.raises(ConfigError) as err:
        load_store_config({"global_segment_size": True, "protocol": 5})
    assert set(err.value.fields) == {"metadata_server", "master_server_address",
                                     "global_segment_size", "protocol"}


@pytest.mark.parametrize(("value", "expected"), [
    (0, 0), ("0", 0), ("2147483648", 2147483648), ("2GB", 2 << 30), ("2 gb", 2 << 30),
    ("512MB", 512 << 20), ("1.5 GiB", 3 << 29), ("64k", 64 << 10), (1024.0, 1024),
])
def test_parse_size(value: object, expected: int) -> None:
    assert parse_size(value, field="x") == expected


@pytest.mark.parametrize("value", ["-1", -1, "50%", "4 bananas", None, [1], "2PB", 1 << 60, True])
def test_parse_size_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="global_segment_size"):
        parse_size(value, field="global_segment_size")


@pytest.mark.parametrize(("url", "scheme"), [
    ("http://127.0.0.1:8080/metadata", "http"), ("https://h/metadata", "http"),
    ("etcd://h:2379", "etcd"), ("10.0.0.1:2379", "etcd"), ("P2PHANDSHAKE", "p2p"),
    ("redis://h:6379", "redis"),
])
def test_metadata_scheme(url: str, scheme: str) -> None:
    assert metadata_scheme(url) == scheme


_MIN = {"metadata_server": "P2PHANDSHAKE", "master_server_address": "127.0.0.1:5"}


def test_tenant_id_is_kept_for_the_key_namespace() -> None:
    assert load_store_config(_MIN).tenant_id == ""
    assert load_store_config({**_MIN, "tenant_id": " team-a "}).tenant_id == "team-a"
    assert load_store_config({**_MIN, "tenant_id": 7}).tenant_id == "7"
    with pytest.raises(ConfigError) as info:
        load_store_config({**_MIN, "tenant_id": ["a"]})
    assert info.value.fields == ["tenant_id"]
    with pytest.raises(ConfigError, match="without '\\|'") as info:  # the namespace separator
        load_store_config({**_MIN, "tenant_id": "a|prefix=b"})
    assert info.value.fields == ["tenant_id"]


def test_accepted_and_ignored_keys_are_documented_and_none_is_isolation() -> None:
    from mooncake_vllm.config import IGNORED_KEYS

    load_store_config({**_MIN, **{key: "x" for key in IGNORED_KEYS}})  # accepted
    docs = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    for key, what in IGNORED_KEYS.items():
        assert f"`{key}`" in docs and what, key
    assert "tenant_id" not in IGNORED_KEYS
    with pytest.raises(ConfigError, match="tenant_id"):  # a near miss is not silently ignored
        load_store_config({**_MIN, "tenant": "a"})


def test_the_disk_tier_keys_are_honoured_or_refused_naming_the_field_and_the_fix() -> None:
    assert not load_store_config(_MIN).ssd_offload
    for switch in ("enable_ssd_offload", "enable_offload"):  # Mooncake's spelling and vLLM's
        assert load_store_config({**_MIN, "global_segment_size": "0", switch: True}).ssd_offload
    assert load_store_config({**_MIN, "global_segment_size": "0", "enable_offload": "false"}).ssd_offload is False
    holder = load_store_config({**_MIN, "global_segment_size": "1GB", "enable_ssd_offload": True,
                                "ssd_offload_path": "/mnt/nvme/mc"})
    assert holder.ssd_offload and holder.ssd_offload_path == "/mnt/nvme/mc"
    embedded = {**_MIN, "global_segment_size": "1GB", "enable_offload": True}  # vLLM's embedded mode
    assert load_store_config(embedded, env={"MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": "/d"}).ssd_offload_path == "/d"
    refused = [
        ({"global_segment_size": "0", "enable_ssd_offload": True, "ssd_offload_path": "/d"}, "mooncake-vllm up --ssd"),
        ({"global_segment_size": "1GB", "enable_ssd_offload": True}, "ssd_offload_path"),
        ({"global_segment_size": "1GB", "ssd_offload_path": "/d"}, "enable_ssd_offload\": true"),
        ({"global_segment_size": "1GB", "enable_ssd_offload": True, "ssd_offload_path": "rel"}, "absolute"),
        ({"enable_ssd_offload": "yes"}, "true or false"),
        ({"enable_ssd_offload": True, "enable_offload": False, "global_segment_size": "0"}, "keep one"),
    ]
    for extra, fix in refused:
        with pytest.raises(ConfigError) as info:
            load_store_config({**_MIN, **extra})
        assert fix in str(info.value), (extra, str(info.value))
        assert set(info.value.fields) & {"ssd_offload_path", "enable_ssd_offload", "enable_offload"}
