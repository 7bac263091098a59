"""Rules about the fleet as a whole: pool memory, hash seeds, TP sizes, proxies."""

from __future__ import annotations

from collections.abc import Iterable

from mooncake_vllm.checker.catalogue import Rule
from mooncake_vllm.checker.context import Context, check
from mooncake_vllm.checker.model import HOLDER, MASTER, PROXY, Finding, Launch
from mooncake_vllm.checker.rules_mooncake import segment_size

__all__ = ["ADMIN_PROXIES", "BOOTSTRAP_PORT", "DEFAULT_CLIENT_TTL", "MIN_CLIENT_TTL", "P2P_LAYOUT", "V0_DEMO_PROXIES",
           "bootstrap_ports", "proxy_command"]

#: the V0-era demo proxies (plain completions, no kv_transfer_params)
V0_DEMO_PROXIES = {"disagg_proxy_demo.py", "disagg_demo.py", "proxy_demo.py", "disagg_prefill_proxy_server.py"}
#: proxies whose /instances/add admin API is open (500) or unguarded without ADMIN_API_KEY
#: (``mooncake-vllm proxy`` keeps its admin API off without a key)
ADMIN_PROXIES = {"disagg_proxy_demo.py", "disagg_demo.py", "proxy_demo.py"}
#: mooncake_master's default --client_ttl (seconds), and the shortest the checker accepts without a warning
DEFAULT_CLIENT_TTL = 10
MIN_CLIENT_TTL = 10
#: VLLM_MOONCAKE_BOOTSTRAP_PORT's default (vllm §9)
BOOTSTRAP_PORT = 8998
#: the layout the P2P MooncakeConnector asks vLLM for (0.32: LBHNC, the same bytes)
P2P_LAYOUT = "HND"


def _model(ctx: Context) -> str | None:
    return next((launch.model for launch in ctx.deployment.instances if launch.model), None)


def _uses_p2p(ctx: Context) -> bool:
    return any("MooncakeConnector" in launch.connector_names() for launch in ctx.deployment.instances)


def bootstrap_ports(ctx: Context) -> list[str]:
    """The P2P bootstrap port of each prefill (kv_producer) instance, in order."""
    return [launch.env.get("VLLM_MOONCAKE_BOOTSTRAP_PORT") or str(BOOTSTRAP_PORT)
            for launch in ctx.deployment.instances
            if "kv_producer" in launch.roles() and "MooncakeConnector" in launch.connector_names()]


def proxy_command(launch: Launch | None, *, p2p: bool, model: str | None = None,
                  bootstraps: list[str] | None = None, target: str | None = None) -> str:
    """The ``mooncake-vllm proxy`` line replacing ``launch`` (a seed/example proxy); with ``p2p``
    each prefill names its bootstrap port (``host:port@bootstrap``, from ``bootstraps``)."""
    opts = launch.options if launch else {}
    model = opts.get("--model") or model or "MODEL"

    def hosts(value: str | None, ports: list[str] = []) -> str:  # noqa: B006 - read only
        found = [h.split("://", 1)[-1] for h in (value or "HOST:PORT").split()]
        return " ".join(f"{h}@{ports[i]}" if i < len(ports) and "@" not in h else h
                        for i, h in enumerate(found))
    line = f"mooncake-vllm proxy --model {model} --prefill {hosts(opts.get('--prefill'), bootstraps or [])} " \
           f"--decode {hosts(opts.get('--decode'))} --port {opts.get('--port') or 8000}"
    if p2p:
        line += " --flow p2p" + (f" --target-vllm {target}" if target else "")
    return line


def _pool_configs(ctx: Context) -> list:
    """The configs of the store instances when every one of them holds no pool memory (segment 0), else []."""
    stores = [launch for launch in ctx.deployment.instances if launch.uses_store() and launch.kind != "environment"]
    used = {id(c): c for launch in stores for c in ctx.deployment.configs_for(launch)}
    if used and all(segment_size(c.data.get("global_segment_size")) == 0 for c in used.values()):
        return list(used.values())
    return []


@check("MCV-E009")
def no_pool_memory(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if ctx.deployment.of_kind(HOLDER):
        return
    configs = _pool_configs(ctx)
    if configs:
        yield ctx.finding(rule, configs[0].where("global_segment_size"), config=configs[0].path)


@check("MCV-W017")
def pool_in_one_holder(ctx: Context, rule: Rule) -> Iterable[Finding]:
    holders = ctx.deployment.of_kind(HOLDER)
    if len(holders) == 1 and _pool_configs(ctx):
        yield ctx.finding(rule, holders[0].where, holder=holders[0].program)


@check("MCV-W016")
def client_ttl_short(ctx: Context, rule: Rule) -> Iterable[Finding]:
    for launch in ctx.deployment.of_kind(MASTER, HOLDER):
        if launch.kind == HOLDER and launch.program != "mooncake-vllm up":
            continue  # only the master (and `up`, which starts one) has a client_ttl
        value = launch.option("--client-ttl")
        try:
            ttl = float(value) if value not in (None, "") else DEFAULT_CLIENT_TTL
        except ValueError:
            continue
        if ttl < MIN_CLIENT_TTL:
            flag = "--client-ttl" if launch.kind == HOLDER else "--client_ttl"
            yield ctx.finding(rule, launch.where, what=launch.program, ttl=f"{ttl:g}",
                              fix_flag=f"{flag}={DEFAULT_CLIENT_TTL}")


@check("MCV-E011")
def p2p_with_legacy_proxy(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if not _uses_p2p(ctx):
        return
    for proxy in ctx.deployment.of_kind(PROXY):
        if proxy.program in V0_DEMO_PROXIES:
            yield ctx.finding(rule, proxy.where, proxy=proxy.program,
                              proxy_fix=proxy_command(proxy, p2p=True, model=_model(ctx),
                                                      bootstraps=bootstrap_ports(ctx),
                                                      target=ctx.vllm.release if ctx.vllm else None))


@check("MCV-W010")
def legacy_proxy(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if ctx.vllm is None or not ctx.vllm.v1_kv_connectors:
        return
    v1_flow = not ctx.vllm.v0_kv_connectors or any(ctx.engine(i) == "v1" for i in ctx.deployment.instances)
    if not v1_flow:
        return
    for proxy in ctx.deployment.of_kind(PROXY):
        if proxy.program == "mooncake-vllm proxy":
            continue
        if proxy.program in V0_DEMO_PROXIES:
            why = ("The V0 demo proxy has no health checks, logs the rejected API key in plain text, rebuilds the "
                   "wrong list on removal, breaks on IPv6/DNS names and swallows upstream errors; it is slated "
                   "for removal.")
        elif ctx.vllm.rejects_unknown_kv_keys and ctx.vllm.in_tree_mooncake_connector == "v1-p2p":
            why = ("The example P2P proxy never sends transfer_id, which the P2P MooncakeConnector needs from "
                   "vLLM 0.16.0 (\"Missing transfer_id ... from router!\").")
        else:
            why = "The example proxy has no health checks, no admin API and no store-only flow."
        yield ctx.finding(rule, proxy.where, proxy=proxy.program, why=why,
                          proxy_fix=proxy_command(proxy, p2p=_uses_p2p(ctx), model=_model(ctx),
                                                  bootstraps=bootstrap_ports(ctx), target=ctx.vllm.release))


@check("MCV-W031")
def plain_store_beside_p2p_pairs(ctx: Context, rule: Rule) -> Iterable[Finding]:
    """The pairs' KV is HND (their MultiConnector asks for the P2P child's layout), a plain store
    instance's is NHD unless told: different layouts are different key namespaces."""
    instances = [launch for launch in ctx.deployment.instances if launch.kind != "environment"]
    pairs = [launch for launch in instances
             if launch.uses_store() and "MooncakeConnector" in launch.connector_names()]
    if not pairs:
        return
    for launch in instances:
        if not launch.uses_store() or launch in pairs:
            continue
        if launch.env.get("VLLM_KV_CACHE_LAYOUT", "").upper() in (P2P_LAYOUT, "LBHNC"):
            continue
        yield ctx.finding(rule, launch.where, instance=launch.model or launch.program, layout=P2P_LAYOUT)


@check("MCV-W011")
def admin_api_without_key(ctx: Context, rule: Rule) -> Iterable[Finding]:
    for proxy in ctx.deployment.of_kind(PROXY):
        if proxy.program in ADMIN_PROXIES and not proxy.env.get("ADMIN_API_KEY"):
            yield ctx.finding(rule, proxy.where, proxy=proxy.program)


def _v1_instances(ctx: Context) -> list[Launch]:
    return [launch for launch in ctx.deployment.instances
            if launch.kind != "environment" and ctx.engine(launch) == "v1"]


@check("MCV-W003")
def hash_seed_not_shared(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if ctx.vllm is None or not ctx.vllm.needs_shared_hash_seed:
        return
    instances = _v1_instances(ctx)
    processes = sum(max(1, launch.int_option("--data-parallel-size")) for launch in instances)
    missing = [launch for launch in instances if not launch.env.get("PYTHONHASHSEED")]
    if processes > 1 and missing:
        yield ctx.finding(rule, missing[0].where, count=processes)


@check("MCV-W004")
def hash_seed_differs(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if ctx.vllm is None or not ctx.vllm.needs_shared_hash_seed:
        return
    seeds: dict[str, Launch] = {}
    for launch in _v1_instances(ctx):
        seed = launch.env.get("PYTHONHASHSEED")
        if seed:
            seeds.setdefault(seed, launch)
    if len(seeds) > 1:
        listing = ", ".join(f"{seed} ({launch.where})" for seed, launch in seeds.items())
        yield ctx.finding(rule, next(iter(seeds.values())).where, seeds=listing)


@check("MCV-W005")
def hash_seed_inverted(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if ctx.vllm is None or ctx.vllm.v1_hash_seed != "inverted":
        return
    for launch in ctx.deployment.instances:
        if launch.env.get("PYTHONHASHSEED") and ctx.engine(launch) == "v1":
            yield ctx.finding(rule, launch.where)


@check("MCV-W006")
def tp_size_differs(ctx: Context, rule: Rule) -> Iterable[Finding]:
    sizes: dict[int, Launch] = {}
    for launch in ctx.deployment.instances:
        if launch.uses_store():
            sizes.setdefault(launch.int_option("--tensor-parallel-size"), launch)
    if len(sizes) > 1:
        listing = ", ".join(f"{size} ({launch.where})" for size, launch in sorted(sizes.items()))
        yield ctx.finding(rule, next(iter(sizes.values())).where, sizes=listing)
