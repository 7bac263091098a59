"""Rules about the engine each instance starts and its --kv-transfer-config."""

from __future__ import annotations

from collections.abc import Iterable

from mooncake_vllm.checker.catalogue import Rule
from mooncake_vllm.checker.context import Context, check
from mooncake_vllm.checker.model import Finding, Launch
from mooncake_vllm.config import CONFIG_ENV

__all__ = ["V0_ONLY_FLAGS", "V1_ONLY_CONNECTORS"]

#: flags only the V0 engine understands (multi-step scheduling, the V0 block manager/scheduler)
V0_ONLY_FLAGS = ("--num-scheduler-steps", "--use-v2-block-manager", "--preemption-mode",
                 "--multi-step-stream-outputs")
#: connectors that exist only on the V1 path (vllm §6 Built-in names)
V1_ONLY_CONNECTORS = ("MultiConnector", "NixlConnector", "LMCacheConnectorV1", "SharedStorageConnector",
                      "ExampleConnector", "OffloadingConnector", "P2pNcclConnector", "LMCacheMPConnector")
_ROLES = ("kv_producer", "kv_consumer", "kv_both")


def _v0_request(ctx: Context, launch: Launch) -> str | None:
    if ctx.wants_v0(launch):
        return f"VLLM_USE_V1={launch.env.get('VLLM_USE_V1')}"
    flags = [f for f in V0_ONLY_FLAGS if f in launch.options]
    return f"the V0-only flag {flags[0]}" if flags else None


@check("MCV-E001")
def v0_requested_without_v0(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if ctx.vllm is None:
        return
    for launch in ctx.deployment.instances:
        what = _v0_request(ctx, launch)
        kv = launch.kv_config is not None or launch.kind == "environment"
        has_v0 = ctx.vllm.v0_kv_connectors if kv else ctx.vllm.has_v0_engine
        if what and not has_v0:
            yield ctx.finding(rule, launch.where, what=what)


@check("MCV-E002")
def v1_setup_on_v0_engine(ctx: Context, rule: Rule) -> Iterable[Finding]:
    for launch in ctx.deployment.instances:
        if ctx.engine(launch) != "v0":
            continue
        names = launch.connector_names()
        v1_only = [n for n in names if n in V1_ONLY_CONNECTORS]
        if len(names) > 1 and "MooncakeConnector" in names[1:]:
            v1_only.append("MooncakeConnector (P2P)")
        if v1_only:
            yield ctx.finding(rule, launch.where, what=", ".join(dict.fromkeys(v1_only)))


@check("MCV-E007")
def kv_config_key_rejected(ctx: Context, rule: Rule) -> Iterable[Finding]:
    for launch, key, removed in _unknown_keys(ctx):
        if removed:
            yield ctx.finding(rule, launch.where, key=key, detail=" (removed in vLLM 0.32.0)")
        elif ctx.vllm is not None and ctx.vllm.rejects_unknown_kv_keys:
            yield ctx.finding(rule, launch.where, key=key, detail=" (unknown keys are rejected)")


@check("MCV-W013")
def kv_config_key_ignored(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if ctx.vllm is None or ctx.vllm.rejects_unknown_kv_keys:
        return
    import difflib

    for launch, key, removed in _unknown_keys(ctx):
        if not removed:
            close = difflib.get_close_matches(key, sorted(ctx.vllm.kv_config_fields), n=1)
            yield ctx.finding(rule, launch.where, key=key, suggestion=f" (did you mean {close[0]!r}?)" if close else "")


def _unknown_keys(ctx: Context) -> Iterable[tuple[Launch, str, bool]]:
    if ctx.vllm is None:
        return
    for launch in ctx.deployment.instances:
        for connector in launch.connectors():
            for key in connector:
                if key not in ctx.vllm.kv_config_fields:
                    yield launch, key, key in ctx.vllm.removed_kv_fields


@check("MCV-E008")
def kv_config_invalid(ctx: Context, rule: Rule) -> Iterable[Finding]:
    for launch in ctx.deployment.instances:
        if launch.kv_config_error:
            yield ctx.finding(rule, launch.where, problem=launch.kv_config_error,
                              fix="quote the JSON in single quotes: --kv-transfer-config "
                                  "'{\"kv_connector\":\"MooncakeStoreConnector\",\"kv_role\":\"kv_both\"}'")
            continue
        for i, connector in enumerate(launch.connectors()):
            label = "kv_transfer_config" if i == 0 else f"connectors[{i - 1}]"
            if not connector.get("kv_connector"):
                yield ctx.finding(rule, launch.where, problem=f"{label} has no kv_connector",
                                  fix=f"add \"kv_connector\": \"MooncakeStoreConnector\" to {label}")
            role = connector.get("kv_role")
            if role not in _ROLES:
                found = "no kv_role" if role is None else f"kv_role {role!r}"
                yield ctx.finding(rule, launch.where, problem=f"{label} has {found}",
                                  fix=f"set kv_role in {label} to one of {', '.join(_ROLES)}")


@check("MCV-E010")
def config_path_missing(ctx: Context, rule: Rule) -> Iterable[Finding]:
    for launch in ctx.deployment.instances:
        if launch.uses_store() and not launch.env.get(CONFIG_ENV):
            yield ctx.finding(rule, launch.where, connector="MooncakeStoreConnector")


@check("MCV-E012")
def connector_unavailable(ctx: Context, rule: Rule) -> Iterable[Finding]:
    facts = ctx.vllm
    if facts is None:
        return
    for launch in ctx.deployment.instances:
        engine = ctx.engine(launch)
        if engine is None:
            continue
        for name in dict.fromkeys(launch.connector_names()):
            why = fix = ""
            if name == "MultiConnector" and not facts.multi_connector:
                why, fix = "MultiConnector arrives in vLLM 0.9.0.", "target vLLM >= 0.9.0"
            elif name == "MooncakeConnector" and engine == "v1" and facts.in_tree_mooncake_connector != "v1-p2p":
                why = ("The V1 P2P MooncakeConnector arrives in vLLM 0.13.0; before that the name is the V0 "
                       "pipe connector (or absent).")
                fix = "target vLLM >= 0.13.0, or drop MooncakeConnector and use MooncakeStoreConnector alone"
            elif name == "SharedStorageConnector" and facts.in_tree_mooncake_connector == "v1-p2p":
                why = "vLLM 0.13.0 renamed SharedStorageConnector to ExampleConnector without an alias."
                fix = "use \"kv_connector\": \"ExampleConnector\""
            if why:
                finding = ctx.finding(rule, launch.where, connector=name, engine=engine.upper(), why=why, fix=fix)
                yield finding


@check("MCV-W007")
def chunked_prefill_with_v0_store(ctx: Context, rule: Rule) -> Iterable[Finding]:
    for launch in ctx.deployment.instances:
        value = launch.option("--enable-chunked-prefill")
        enabled = value is not None and value.lower() in ("", "true", "1", "yes")
        if enabled and launch.uses_store() and ctx.engine(launch) == "v0":
            yield ctx.finding(rule, launch.where)


@check("MCV-W008")
def connector_name_ambiguous(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if ctx.vllm is None or not ctx.vllm.in_tree_v1_store:
        return
    for launch in ctx.deployment.instances:
        if launch.uses_store() and not launch.uses_mooncake_vllm() and ctx.engine(launch) == "v1":
            yield ctx.finding(rule, launch.where)


@check("MCV-W009")
def v0_v1_pools_disjoint(ctx: Context, rule: Rule) -> Iterable[Finding]:
    stores = [launch for launch in ctx.deployment.instances if launch.uses_store()]
    if ctx.vllm is None or not stores or all(launch.uses_mooncake_vllm() for launch in stores):
        return
    v0 = [launch for launch in stores if ctx.wants_v0(launch) or ctx.engine(launch) == "v0"]
    v1 = [launch for launch in stores if launch not in v0]
    if v0 and v1:
        yield ctx.finding(rule, v0[0].where, what=f"{len(v0)} V0 and {len(v1)} V1 instances share one pool")
    elif v0 and not ctx.vllm.v0_kv_connectors:
        yield ctx.finding(rule, v0[0].where,
                          what=f"after moving these {len(v0)} V0 instances to vLLM {ctx.vllm.release} (V1)")


def _loading_v1_findings(ctx: Context, rule: Rule, lacks: bool) -> Iterable[Finding]:
    """``rule`` for every V1 store instance that loads KV, where the target vLLM ``lacks``
    what loading needs (and the connector is ours)."""
    if ctx.vllm is None or not lacks or not ctx.vllm.our_v1_connector:
        return
    for launch in ctx.deployment.instances:
        loads = launch.roles() & {"kv_consumer", "kv_both"}
        if ctx.engine(launch) == "v1" and launch.uses_store() and loads:
            yield ctx.finding(rule, launch.where, role=sorted(loads)[0])


@check("MCV-W018")
def handoff_not_awaited(ctx: Context, rule: Rule) -> Iterable[Finding]:
    return _loading_v1_findings(ctx, rule, ctx.vllm is not None and not ctx.vllm.deferred_lookup)


@check("MCV-W019")
def v1_loads_off(ctx: Context, rule: Rule) -> Iterable[Finding]:
    return _loading_v1_findings(ctx, rule, ctx.vllm is not None and not ctx.vllm.load_error_reporting)


def _our_v1_instances(ctx: Context) -> Iterable[Launch]:
    """Instances whose MooncakeStoreConnector is mooncake-vllm's, on the V1 engine."""
    if ctx.vllm is None or not ctx.vllm.our_v1_connector:
        return
    for launch in ctx.deployment.instances:
        named = launch.uses_mooncake_vllm() or not ctx.vllm.in_tree_v1_store
        if launch.uses_store() and named and ctx.engine(launch) == "v1":
            yield launch


@check("MCV-W040")
def pool_metrics_not_exported(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if ctx.vllm is None or ctx.vllm.connector_metrics == "prometheus":
        return
    logged = " (it logs them as 'KV Transfer metrics' lines)" if ctx.vllm.connector_metrics == "log" else ""
    for launch in _our_v1_instances(ctx):
        yield ctx.finding(rule, launch.where, logged=logged)


@check("MCV-W041")
def pool_kv_events_not_published(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if ctx.vllm is None or ctx.vllm.connector_kv_events:
        return
    for launch in _our_v1_instances(ctx):
        if launch.option("--kv-events-config") is not None:
            yield ctx.finding(rule, launch.where)
