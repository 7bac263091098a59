"""addresses: host:port and metadata URLs parsed in one place."""

from __future__ import annotations

import pytest

from mooncake_vllm.addresses import HostPort, MetadataURL
from mooncake_vllm.errors import ConfigError


@pytest.mark.parametrize(("text", "host", "port"), [
    ("127.0.0.1:50051", "127.0.0.1", 50051), ("[::1]:8100", "::1", 8100), ("h.svc:1", "h.svc", 1),
    (" ::1:50051 ", "::1", 50051),  # lenient: the last colon splits
])
def test_host_port(text: str, host: str, port: int) -> None:
    hp = HostPort.parse(text)
    assert (hp.host, hp.port) == (host, port)
    assert HostPort.parse(hp.netloc) == hp


@pytest.mark.parametrize(("text", "problem"), [
    ("", "empty address"), ("host", "no port"), ("h:0", "1..65535"), ("h:x", "1..65535"), (":5", "no host"),
    ("[::1]8100", "']:port'"),
])
def test_host_port_errors_name_field_and_value(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        HostPort.parse(text, field="master_server_address")
    assert info.value.fields == ["master_server_address"] and problem in str(info.value)
    assert HostPort.try_parse(text) is None


def test_strict_host_port_and_default_host() -> None:
    with pytest.raises(ConfigError, match="brackets"):
        HostPort.parse("::1:8100", strict=True)
    with pytest.raises(ConfigError, match="neither an IP address nor a DNS name"):
        HostPort.parse("bad_host!:80", strict=True)
    assert HostPort.parse("LocalHost:80", strict=True).host == "localhost"
    assert HostPort.try_parse(":5", default_host="127.0.0.1") == HostPort("127.0.0.1", 5)


@pytest.mark.parametrize(("text", "kind", "bare"), [
    ("http://h:8080/metadata", "http", False), ("HTTPS://h/metadata", "http", False),
    ("etcd://h:2379", "etcd", False), ("10.0.0.1:2379", "etcd", True), ("P2PHANDSHAKE", "p2p", False),
    ("redis://h:6379", "redis", False), ("rediss://h", "rediss", False), ("ftp://h", "ftp", False),
])
def test_metadata_url_kinds(text: str, kind: str, bare: bool) -> None:
    url = MetadataURL.parse(text)
    assert (url.kind, url.bare) == (kind, bare)


def test_etcd_endpoints_and_probe_address() -> None:
    assert MetadataURL.parse("etcd://a:1,b:2").etcd_endpoints() == ["http://a:1", "http://b:2"]
    assert MetadataURL.parse("a:1;https://b:2").etcd_endpoints() == ["http://a:1", "https://b:2"]
    with pytest.raises(ConfigError, match="is not host:port"):
        MetadataURL.parse("etcd://a").etcd_endpoints()
    with pytest.raises(ConfigError, match="no etcd endpoint"):
        MetadataURL.parse("etcd://").etcd_endpoints()
    assert MetadataURL.parse("http://u:pw@h:8080/metadata").probe_address() == HostPort("h", 8080)
    assert MetadataURL.parse("etcd://a:1,b:2").probe_address() == HostPort("a", 1)
    assert MetadataURL.parse("https://h/metadata").probe_address() is None
    assert MetadataURL.parse("P2PHANDSHAKE").probe_address() is None
