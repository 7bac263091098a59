"""Tests of mooncake_vllm.services against real processes (master, holders, etcd, redis, vLLM)."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from mooncake_vllm.services import (
    SETUP_HINT,
    LocalStack,
    ManagedProcess,
    Placement,
    ServiceError,
    clean_dev_shm,
    client_env,
    find_binary,
    free_port,
    port_is_free,
    running,
    start_holder,
    start_http_metadata,
    start_master,
    start_redis,
    start_vllm_server,
    watch_dev_shm,
)
from tests.conftest import TEST_HOLDERS
from tests.v1.instances import vllm_source_contains

PY = sys.executable

# A pure Mooncake client (global segment 0) in its own process: put or get one key.
CLIENT = textwrap.dedent("""
    import hashlib, json, os, sys
    from mooncake.store import MooncakeDistributedStore
    cfg = json.load(open(os.environ["MOONCAKE_CONFIG_PATH"]))
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", cfg["metadata_server"], 0, 64 << 20, "tcp", "", cfg["master_server_address"])
    assert rc == 0, f"setup returned {rc}"
    op, key = sys.argv[1], sys.argv[2]
    if op == "put":
        data = hashlib.sha256(key.encode()).digest() * (1 << 15)  # 1 MiB, derived from the key
        print(json.dumps({"rc": s.put(key, data), "sha": hashlib.sha256(data).hexdigest()}))
    else:
        v = s.get(key)
        print(json.dumps({"len": len(v), "sha": hashlib.sha256(v).hexdigest()}))
    s.close()
""")


def run_client(stack: LocalStack, op: str, key: str) -> dict:
    env = {**os.environ, **stack.env()}
    out = subprocess.run([PY, "-c", CLIENT, op, key], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"client {op} failed ({out.returncode}):\n{out.stdout}\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def forking_script(leader_exit_after: float | None) -> str:
    """A leader that forks a long-sleeping child into its group, says READY-OK, then sleeps or exits 7."""
    end = "time.sleep(300)" if leader_exit_after is None else f"time.sleep({leader_exit_after}); sys.exit(7)"
    return ("import os, sys, time\nif os.fork() == 0:\n    time.sleep(300)\n"
            f"print('READY' + '-OK', flush=True)\n{end}\n")


def listen_addresses(pid: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}


# -- ManagedProcess ------------------------------------------------------------------
def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536 and port_is_free(port)


def test_stop_ends_the_whole_process_group(workdir: Path) -> None:
    # The leader forks a grandchild into the same group; stop() must end both.
    proc = ManagedProcess("sleeper", [PY, "-c", forking_script(leader_exit_after=None)], workdir=workdir).start()
    proc.wait_ready(lambda: "READY-OK" in proc.log_tail(), 10)
    deadline = time.monotonic() + 5
    while len(psutil.Process(proc.pid).children()) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    child = psutil.Process(proc.pid).children()[0].pid
    assert proc in running()
    rc = proc.stop(grace=5)
    assert rc == -signal.SIGTERM
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert proc not in running() and not proc.alive()
    assert proc.stop() == rc  # idempotent


def test_stop_escalates_to_sigkill(workdir: Path) -> None:
    code = textwrap.dedent("""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print('READY' + '-OK', flush=True)
        time.sleep(300)
    """)
    proc = ManagedProcess("stubborn", [PY, "-c", code], workdir=workdir).start()
    proc.wait_ready(lambda: "READY-OK" in proc.log_tail(), 10)
    t0 = time.monotonic()
    assert proc.stop(grace=1.0) == -signal.SIGKILL
    assert time.monotonic() - t0 < 5


def test_death_before_ready_names_component_and_log(workdir: Path) -> None:
    argv = [PY, "-c", "import sys; print('boom: cannot bind'); sys.exit(3)"]
    proc = ManagedProcess("widget", argv, workdir=workdir).start()
    with pytest.raises(ServiceError) as err:
        proc.wait_ready(lambda: False, 10, "serving")
    text = str(err.value)
    assert "widget exited with code 3 before it was serving" in text
    assert "boom: cannot bind" in text and str(proc.log_path) in text


def test_timeout_names_component_and_stops_it(workdir: Path) -> None:
    proc = ManagedProcess("slowpoke", [PY, "-c", "import time; print('hello'); time.sleep(60)"],
                          workdir=workdir).start()
    with pytest.raises(ServiceError, match=r"slowpoke was not ready within 1 s") as err:
        proc.wait_ready(lambda: False, 1.0)
    assert "hello" in str(err.value)
    assert not proc.alive()


def test_missing_binary_names_the_setup_command() -> None:
    with pytest.raises(ServiceError) as err:
        find_binary("no-such-mooncake-binary", "frobnicator")
    assert "frobnicator" in str(err.value) and SETUP_HINT in str(err.value)


@pytest.mark.parametrize("how", ["exit", "sigterm", "sigkill"])
def test_nothing_survives_the_interpreter_that_started_it(workdir: Path, how: str) -> None:
    # A child interpreter starts a master and then exits normally, gets SIGTERM, or is SIGKILLed.
    script = textwrap.dedent(f"""
        import sys, time
        from mooncake_vllm.services import start_master
        m = start_master({str(workdir)!r})
        print(m.pid, flush=True)
        if {how!r} == "exit":
            sys.exit(0)
        time.sleep(120)
    """)
    parent = subprocess.Popen([PY, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        master_pid = int(parent.stdout.readline())
        assert psutil.pid_exists(master_pid)
        if how != "exit":
            parent.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + 15
        while psutil.pid_exists(master_pid) and time.monotonic() < deadline:
            if psutil.Process(master_pid).status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.1)
        alive = psutil.pid_exists(master_pid) and psutil.Process(master_pid).status() != psutil.STATUS_ZOMBIE
        assert not alive, f"mooncake_master pid {master_pid} survived its parent ({how})"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_clean_dev_shm_removes_only_unused_new_mooncake_files(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    before = set(os.listdir(shm))
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    stale, held, other = (shm / f"mooncake-test-{tag}", shm / f"mooncake-held-{tag}", shm / f"unrelated-{tag}")
    for f in (stale, held, other):
        f.write_bytes(b"x")
    keep_open = open(held, "rb")  # noqa: SIM115 - a live user of the file
    try:
        removed = clean_dev_shm(before)
        assert removed == [stale.name]
        assert not stale.exists() and held.exists() and other.exists()
    finally:
        keep_open.close()
        for f in (stale, held, other):
            f.unlink(missing_ok=True)


def test_clean_dev_shm_never_touches_another_users_file() -> None:
    """Another user's process may map a file we cannot see it use: only our own files are candidates."""
    shm = Path("/dev/shm")
    before = set(os.listdir(shm))
    theirs = shm / f"mooncake-theirs-{os.getpid()}-{time.monotonic_ns()}"
    theirs.write_bytes(b"x")
    try:
        os.chown(theirs, 65534, 65534)  # nobody (the tests run as root here)
        assert clean_dev_shm(before) == []
        assert theirs.exists()
    finally:
        theirs.unlink(missing_ok=True)


def test_sigkilled_process_leaves_no_dev_shm_file(workdir: Path) -> None:
    name = f"mooncake-test-{os.getpid()}-{time.monotonic_ns()}"
    code = (f"import time; f = open('/dev/shm/{name}', 'wb'); f.write(b'x' * 4096); f.flush(); "
            "print('READY' + '-OK', flush=True); time.sleep(300)")
    proc = watch_dev_shm(ManagedProcess("shm-user", [PY, "-c", code], workdir=workdir)).start()
    try:
        proc.wait_ready(lambda: "READY-OK" in proc.log_tail(), 10)
        assert (Path("/dev/shm") / name).exists()
        proc.kill()  # SIGKILL: the file is left behind, then cleaned by the stop hook
        assert not (Path("/dev/shm") / name).exists()
    finally:
        (Path("/dev/shm") / name).unlink(missing_ok=True)


# -- Mooncake services ----------------------------------------------------------------
def test_master_binds_loopback_and_serves_metrics(mooncake_master: ManagedProcess) -> None:
    assert listen_addresses(mooncake_master.pid) == {"127.0.0.1"}
    with urllib.request.urlopen(f"{mooncake_master.url}/metrics/summary", timeout=5) as resp:
        assert b"service_ready=true" in resp.read()


def test_mooncake_metadata_server_round_trip(metadata_server: ManagedProcess, metadata_url: str) -> None:
    assert listen_addresses(metadata_server.pid) == {"127.0.0.1"}
    url = f"{metadata_url}?key=mooncake%2Fram%2Ftest"
    req = urllib.request.Request(url, data=b'{"a": 1}', method="PUT", headers={"Content-Type": "application/json"})
    assert urllib.request.urlopen(req, timeout=5).status == 200
    assert urllib.request.urlopen(url, timeout=5).read() == b'{"a": 1}'


def test_embedded_metadata_server_starts(workdir: Path) -> None:
    proc = start_http_metadata(workdir, "embedded")
    assert listen_addresses(proc.pid) == {"127.0.0.1"}
    try:
        url = f"{proc.url}?key=mooncake%2Fram%2Ftest"
        req = urllib.request.Request(url, data=b'{"b": 2}', method="PUT")
        assert urllib.request.urlopen(req, timeout=5).status == 200
        assert urllib.request.urlopen(url, timeout=5).read() == b'{"b": 2}'
    finally:
        proc.stop()


def test_pool_holder_fixture_mounts_memory(mooncake_master: ManagedProcess, pool_holder: ManagedProcess) -> None:
    with urllib.request.urlopen(f"{mooncake_master.url}/metrics/summary", timeout=5) as resp:
        summary = resp.read().decode()
    assert "/ 256.00 MB" in summary, summary[:300]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"metadata": "zookeeper"}, "metadata: got 'zookeeper'"),
    ({"holder": "memcached"}, "holder: got 'memcached'"),
    ({"segment_size": 0}, "segment_size: got 0"),
    ({"local_buffer_size": -1}, "local_buffer_size: got -1"),
])
def test_bad_stack_parameters_name_the_field(workdir: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LocalStack(workdir, **kwargs)


@pytest.mark.parametrize(("holder", "metadata"), [
    ("mooncake_client", "mooncake"), ("python", "mooncake"), ("mooncake_client", "p2p")])
def test_data_lives_in_the_holder(workdir: Path, holder: str, metadata: str) -> None:
    """A pure client puts and exits; a third process reads it back; killing the holder loses it."""
    with LocalStack(workdir, holder=holder, metadata=metadata) as stack:
        cfg = json.loads(stack.config_path.read_text())
        assert cfg == {"metadata_server": stack.metadata_url, "master_server_address": stack.master_address,
                       "global_segment_size": "0", "local_buffer_size": str(64 << 20),
                       "protocol": "tcp", "device_name": ""}
        assert (cfg["metadata_server"] == "P2PHANDSHAKE") == (metadata == "p2p")
        put = run_client(stack, "put", "k-shared")
        assert put["rc"] == 0
        got = run_client(stack, "get", "k-shared")  # the putting process has exited
        assert got == {"len": 1 << 20, "sha": put["sha"]}
        assert stack.holder is not None
        stack.holder.kill()  # the data lived in the holder: now it is gone
        deadline = time.monotonic() + 30  # client_ttl=2: the master drops the dead segment
        while run_client(stack, "get", "k-shared")["len"] != 0:
            assert time.monotonic() < deadline, "the master kept the dead holder's segment"
            time.sleep(0.5)
    assert not any(p.alive() for p in stack.processes)
    assert not stack.config_path.exists()  # it pointed at dead ports: removed on stop


def test_local_stack_env_and_failure_names_component(workdir: Path) -> None:
    env = LocalStack(workdir).env()
    assert env["MOONCAKE_CONFIG_PATH"].endswith("mooncake_config.json")
    assert {k: env[k] for k in client_env()} == client_env()
    # A taken master port: the master dies, the error names it and nothing is left behind.
    blocker = start_redis(workdir)
    try:
        stack = LocalStack(workdir / "bad", master_port=blocker.port)
        with pytest.raises(ServiceError, match="mooncake_master"):
            stack.start()
        assert not any(p.alive() for p in stack.processes)
        assert not stack.config_path.exists()
    finally:
        blocker.stop()


def test_holder_with_dead_master_fails_clearly(workdir: Path, metadata_url: str) -> None:
    with pytest.raises(ServiceError, match="pool_holder"):
        start_holder(workdir, f"127.0.0.1:{free_port()}", metadata_url, 64 << 20, 16 << 20, timeout=20)


# -- etcd / redis -------------------------------------------------------------------------
def test_etcd_server_fixture(etcd_server: str) -> None:
    host, port = etcd_server.split(":")
    assert host == "127.0.0.1"
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    def call(path: str, body: dict) -> dict:
        req = urllib.request.Request(f"http://{etcd_server}/v3/{path}", data=json.dumps(body).encode())
        return json.loads(urllib.request.urlopen(req, timeout=5).read())
    call("kv/put", {"key": b64("mooncake/ram/x"), "value": b64("hello")})
    kvs = call("kv/range", {"key": b64("mooncake/ram/x")})["kvs"]
    assert base64.b64decode(kvs[0]["value"]) == b"hello"


def test_redis_server_fixture(redis_server: str) -> None:
    import redis

    assert redis_server.startswith("redis://127.0.0.1:")
    r = redis.Redis.from_url(redis_server)
    r.set("mooncake/ram/x", b"hi")
    assert r.get("mooncake/ram/x") == b"hi"
    assert r.config_get("save")["save"] == ""


# -- vLLM --------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_server_on_tiny_model(tiny_model: Path, workdir: Path) -> None:
    proc = start_vllm_server(tiny_model, None, workdir, None, {})
    try:
        assert listen_addresses(proc.pid) <= {"127.0.0.1"}
        models = json.loads(urllib.request.urlopen(f"{proc.url}/v1/models", timeout=10).read())
        assert models["data"][0]["id"] == str(tiny_model)
        body = json.dumps({"model": str(tiny_model), "prompt": "def main():", "max_tokens": 4,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{proc.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert out["usage"]["completion_tokens"] == 4
        assert len(proc.group_pids()) >= 2  # api server + engine core
        # vLLM's model-class inspection is cached where every later start finds it (a cold
        # cache costs each start a subprocess that imports vLLM again)
        infos = proc.workdir / "vllm-cache" / "modelinfos"
        if vllm_source_contains("model_executor/models/registry.py", "modelinfos"):  # (not 0.10.0 and older)
            assert infos.is_symlink() and list(infos.glob("*LlamaForCausalLM.json"))
    finally:
        proc.stop()
    assert _live_group(proc.pid) == []


def _live_group(pgid: int) -> list[str]:
    """Non-zombie processes in process group ``pgid`` (zombies are dead, only unreaped)."""
    out = []
    for p in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:100]}")
        except OSError:
            pass
    return out


def test_children_of_a_crashed_leader_are_stopped(workdir: Path) -> None:
    # The leader exits by itself, leaving a child in its group: stop() still ends the child.
    proc = ManagedProcess("crasher", [PY, "-c", forking_script(leader_exit_after=0.5)], workdir=workdir).start()
    proc.wait_ready(lambda: "READY-OK" in proc.log_tail(), 10)
    child = next(pid for pid in proc.group_pids() if pid != proc.pid)
    deadline = time.monotonic() + 10
    while proc.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.returncode == 7 and _live_group(proc.pid) != []
    assert proc.stop(grace=2) == 7
    assert _live_group(proc.pid) == [], f"child {child} survived"


SESSION_TEST = """
import json, os, time
def test_hold(local_stack, redis_server):
    pids = [p.pid for p in local_stack.processes]
    with open(os.environ["PIDS_FILE"] + ".tmp", "w") as f:
        json.dump(pids, f)
    os.rename(os.environ["PIDS_FILE"] + ".tmp", os.environ["PIDS_FILE"])
    time.sleep(300)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupted_pytest_session_leaves_nothing_running(tmp_path: Path, sig: int) -> None:
    """The fixtures' processes die with an interrupted pytest session (Ctrl-C or SIGTERM)."""
    (tmp_path / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    (tmp_path / "test_hold.py").write_text(SESSION_TEST)
    pids_file = tmp_path / "pids.json"
    env = {**os.environ, "PIDS_FILE": str(pids_file)}
    session = subprocess.Popen([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                                str(tmp_path / "test_hold.py")], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               # a user's pytest has the default Ctrl-C disposition; an ignored
                               # SIGINT left in this process by earlier tests would be inherited
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not pids_file.exists():
            assert session.poll() is None and time.monotonic() < deadline, session.stdout.read()
            time.sleep(0.1)
        pids = json.loads(pids_file.read_text())
        assert len(pids) == 2 + TEST_HOLDERS and all(psutil.pid_exists(p) for p in pids)
        session.send_signal(sig)
        session.communicate(timeout=60)

        def left() -> list[int]:
            out = []
            for p in pids:
                try:
                    if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                        out.append(p)
                except psutil.NoSuchProcess:
                    pass
            return out

        deadline = time.monotonic() + 10  # the session reaped them; /proc may lag a moment
        while left() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left() == [], f"still running after {signal.Signals(sig).name}: {left()}"
    finally:
        if session.poll() is None:
            session.kill()
            session.wait()


def _netns_or_skip(name: str, addr: str) -> Placement:
    """A bare namespace (our soak prefix and subnet) with ``addr`` on a veth to the root one."""
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        pytest.skip("network namespaces cannot be made here (needs root and iproute2)")
    veth = name[:9] + "-v"
    for cmd in (["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name],
                ["ip", "addr", "add", "10.231.7.249/30", "dev", veth], ["ip", "link", "set", veth, "up"],
                ["ip", "-n", name, "addr", "add", f"{addr}/30", "dev", "eth0"],
                ["ip", "-n", name, "link", "set", "eth0", "up"], ["ip", "-n", name, "link", "set", "lo", "up"]):
        subprocess.run(cmd, check=True, capture_output=True)
    return Placement(addr, name)


def test_services_placed_in_a_network_namespace(workdir: Path) -> None:
    """Master, metadata and holder run inside a namespace on its address: readiness is seen
    there (its own socket table), they are reached from here, and stop by PID as usual."""
    where = _netns_or_skip("mvsoak-test", "10.231.7.250")
    try:
        master = start_master(workdir, placement=where)
        meta = start_http_metadata(workdir, "embedded", placement=where)
        holder = start_holder(workdir, str(master.address), str(meta.url), 32 << 20, placement=where)
        assert master.address is not None and master.address.startswith("10.231.7.250:")
        assert holder.argv[1:4] == ["netns", "exec", "mvsoak-test"]
        with urllib.request.urlopen(f"{master.url}/metrics/summary", timeout=5) as resp:
            assert "/ 32.00 MB" in resp.read().decode()  # the holder mounted its segment
        for proc in (holder, meta, master):
            proc.stop()
            assert not proc.alive()
    finally:
        subprocess.run(["ip", "netns", "del", "mvsoak-test"], capture_output=True)
