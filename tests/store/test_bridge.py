"""The redis bridge: redis:// works with wheels that have no redis plugin."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mooncake_vllm.config import load_store_config
from mooncake_vllm.errors import StoreUnavailableError
from mooncake_vllm.metadata.backends import backend_for, http_request
from mooncake_vllm.store import StoreClient, bridge
from mooncake_vllm.store.bridge import mooncake_supports_redis, resolve_metadata_url
from tests.md_services import HERE, child_env, free_port, readline, stop
from tests.store.configs import client_config


def test_supports_redis_only_when_told() -> None:
    assert mooncake_supports_redis({}) is False
    assert mooncake_supports_redis({"MOONCAKE_VLLM_ASSUME_REDIS": "1"}) is True
    assert mooncake_supports_redis({"MOONCAKE_VLLM_ASSUME_REDIS": "0"}) is False


@pytest.mark.parametrize("url", ["http://127.0.0.1:1/metadata", "etcd://127.0.0.1:2379", "127.0.0.1:2379",
                                 "P2PHANDSHAKE"])
def test_other_urls_pass_through(url: str) -> None:
    assert resolve_metadata_url(url, supports_redis=False) == (url, None)


def test_redis_kept_when_the_build_supports_it(md_redis_url: str) -> None:
    assert resolve_metadata_url(md_redis_url, supports_redis=True) == (md_redis_url, None)


def test_rewrite_warns_once_reuses_and_cleans_up(md_redis_url: str, unique: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    url = md_redis_url + "/7"
    with caplog.at_level(logging.WARNING, logger="mooncake_vllm.store.bridge"):
        http1, cleanup1 = resolve_metadata_url(url, supports_redis=False)
        http2, cleanup2 = resolve_metadata_url(url, supports_redis=False)
    warnings = [r for r in caplog.records if "no redis plugin" in r.getMessage()]
    assert len(warnings) == 1 and http1 in warnings[0].getMessage()
    assert http1 == http2 and http1.startswith("http://127.0.0.1:") and http1.endswith("/metadata")
    proc = bridge._bridges[url].proc
    assert url not in " ".join(proc.args)  # the URL (maybe with a password) goes by environment, not argv
    # entries written through the bridge land in redis under Mooncake's plain keys
    key = f"mooncake/{unique}/rpc_meta/127.0.0.1:1"
    backend_for(http1).put(key, b'{"ip_or_host_name":"127.0.0.1","rpc_port":1}')
    direct = backend_for(url)
    assert direct.get(key) == b'{"ip_or_host_name":"127.0.0.1","rpc_port":1}'
    direct.delete(key)
    assert cleanup1 is not None and cleanup2 is not None
    cleanup1()
    cleanup1()  # idempotent: does not drop the second user's reference
    assert proc.poll() is None
    cleanup2()
    assert proc.wait(10) == 0  # stopped cleanly by SIGTERM


def test_dead_redis_gives_a_clear_error() -> None:
    port = free_port()
    with pytest.raises(StoreUnavailableError, match=f"redis://127.0.0.1:{port}.*check that redis runs"):
        resolve_metadata_url(f"redis://127.0.0.1:{port}", supports_redis=False)


def test_password_is_redacted_from_errors(md_redis_url: str) -> None:
    url = md_redis_url.replace("redis://", "redis://:s3cret@") + "/8"  # this redis has no password: AUTH fails
    with pytest.raises(StoreUnavailableError) as info:
        resolve_metadata_url(url, supports_redis=False)
    assert "s3cret" not in str(info.value)


def test_redis_url_works_end_to_end_in_a_real_mooncake_client(
    md_clients, md_master: str, md_redis_url: str, unique: str
) -> None:
    """A user config saying redis:// (fatal for the wheel) works: two clients, put in one, get in the other."""
    url = md_redis_url + "/9"
    assert not mooncake_supports_redis()  # the PyPI wheel: redis:// alone would abort with exit code 134
    writer = md_clients(url, md_master, segment_mb=32, resolve=True)
    reader = md_clients(url, md_master, segment_mb=0, resolve=True)
    assert writer.info["metadata"].startswith("http://127.0.0.1:")
    assert writer.call("put", unique, 10) == 10
    assert reader.call("get", unique, 10) == 10
    keys = backend_for(url).list("mooncake/")
    assert f"mooncake/rpc_meta/{writer.hostname}" in keys and f"mooncake/ram/{reader.hostname}" in keys
    assert writer.proc.poll() is None  # not aborted with exit code 134
    log = writer.log.read_text()
    assert log.count("no redis plugin") == 1
    reader.quit()
    assert writer.quit() == 0


def test_without_the_bridge_the_wheel_aborts_on_redis(md_master: str, md_redis_url: str, tmp_path) -> None:
    """The premise: the installed wheel dies with SIGABRT (exit 134 / -6) when handed redis:// directly."""

    proc = subprocess.run(
        [sys.executable, str(HERE / "mc_client.py"), "--metadata", md_redis_url, "--master", md_master],
        stdin=subprocess.DEVNULL, capture_output=True, env=child_env(), timeout=60,
    )
    assert proc.returncode in (134, -6), proc.stderr[-500:]
    assert b"ready" not in proc.stdout


def test_bridge_dies_with_its_parent(md_redis_url: str) -> None:
    """No orphan: when the process that started the bridge is SIGKILLed, the bridge exits by itself."""

    code = ("import time; from mooncake_vllm.store.bridge import bridge_redis_url; "
            f"print(bridge_redis_url({md_redis_url + '/10'!r}), flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=child_env(),
                              start_new_session=True)
    try:
        url = readline(parent, 30)
        assert url.startswith("http://127.0.0.1:"), url
        status, body = http_request("GET", url.replace("/metadata", "/health"))
        bridge_pid = json.loads(body)["pid"]
        assert status == 200 and bridge_pid != parent.pid
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(bridge_pid):
            time.sleep(0.1)
        assert not _alive(bridge_pid)
    finally:
        stop(parent, sig=signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_forked_child_leaves_the_parents_bridge_alone(md_redis_url: str) -> None:
    """vLLM forks workers: a child's exit hooks must not stop the bridge its parent started."""
    url = md_redis_url + "/14"
    http_url = bridge.bridge_redis_url(url)
    proc = bridge._bridges[url].proc
    try:
        pid = os.fork()
        if pid == 0:  # child: run the exit hook and a release, as a dying worker would
            bridge._stop_all()
            bridge.release_bridge(url)
            os._exit(0)
        os.waitpid(pid, 0)
        assert proc.poll() is None
        assert http_request("GET", http_url.replace("/metadata", "/health"))[0] == 200
    finally:
        bridge.release_bridge(url)
    assert proc.wait(10) == 0


def test_redis_metadata_goes_through_the_bridge(
        mooncake_master, redis_server: str, workdir: Path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    """A seed-style config with redis:// metadata works with the PyPI wheel (no exit 134)."""
    holder_cfg = client_config(workdir, mooncake_master.address, redis_server)
    data = json.loads(holder_cfg.read_text()) | {"global_segment_size": "64MB"}
    holder_cfg.write_text(json.dumps(data))
    with caplog.at_level("WARNING"):
        holder = StoreClient.connect(load_store_config(holder_cfg))
    assert any("redis" in r.getMessage() for r in caplog.records)
    try:
        assert holder.put_value("mcv-test/redis", b"via the bridge")
        reader = StoreClient.connect(load_store_config(client_config(
            workdir, mooncake_master.address, redis_server)))
        assert reader.get_value("mcv-test/redis") == b"via the bridge"
        reader.close()
        import redis as redis_lib

        keys = redis_lib.Redis.from_url(redis_server).keys("mooncake/*")
        assert any(k.startswith(b"mooncake/ram/") for k in keys)  # entries live in redis
    finally:
        holder.close()
