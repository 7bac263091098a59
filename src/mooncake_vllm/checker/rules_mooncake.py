"""Rules about Mooncake: releases, metadata backends, transport settings."""

from __future__ import annotations

import os
from collections.abc import Iterable

from mooncake_vllm.checker.catalogue import Rule
from mooncake_vllm.checker.context import Context, check
from mooncake_vllm.checker.model import HOLDER, MASTER, Finding, Launch, MooncakeConfigFile, Where, pip_pins
from mooncake_vllm.compat.versions import mooncake_facts, pep440_version
from mooncake_vllm.errors import ConfigError

__all__ = ["metadata_urls", "tier_configs"]


def metadata_urls(ctx: Context) -> list[tuple[str, Where]]:
    """Every metadata_server in the configs (and in mooncake_client flags / the environment)."""
    found = [(str(c.data["metadata_server"]), c.where("metadata_server"))
             for c in ctx.deployment.configs if isinstance(c.data.get("metadata_server"), str)]
    for launch in ctx.deployment.launches:
        url = launch.option("--metadata-server", "--metadata")
        if url:
            found.append((url, launch.where))
        if launch.kind == "environment" and launch.env.get("MOONCAKE_TE_META_DATA_SERVER"):
            found.append((launch.env["MOONCAKE_TE_META_DATA_SERVER"], launch.where))
    return found


def _scheme(url: str) -> str:
    if url == "P2PHANDSHAKE":
        return "p2p"
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep else "bare"


def _adaptor_ceiling(ctx: Context) -> str | None:
    """The newest usable Mooncake when the target imports mooncake_vllm_adaptor and a store is in play."""
    ceiling = ctx.vllm.max_mooncake if ctx.vllm else None
    store = any(launch.uses_store() or launch.kind == "environment" for launch in ctx.deployment.instances)
    return ceiling if store else None


@check("MCV-E003")
def adaptor_mooncake_too_new(ctx: Context, rule: Rule) -> Iterable[Finding]:
    ceiling = _adaptor_ceiling(ctx)
    if ceiling is None:
        return
    for version, where in ctx.mooncake_versions():
        if pep440_version(version) > pep440_version(ceiling):
            yield ctx.finding(rule, where, mooncake=version)


@check("MCV-W015")
def adaptor_needs_source_build(ctx: Context, rule: Rule) -> Iterable[Finding]:
    ceiling = _adaptor_ceiling(ctx)
    if ceiling is None:
        return
    for version, where in ctx.mooncake_versions():
        if pep440_version(version) <= pep440_version(ceiling):
            yield ctx.finding(rule, where)
            return


@check("MCV-E004")
def mooncake_version_skew(ctx: Context, rule: Rule) -> Iterable[Finding]:
    versions = {v: w for v, w in reversed(ctx.mooncake_versions()) if w is not None or ctx.mooncake_explicit}
    if len(versions) > 1:
        ordered = sorted(versions, key=pep440_version)
        where = next((w for w in versions.values() if w is not None), None)
        listing = ", ".join(f"{v} ({versions[v] or '--target-mooncake'})" for v in ordered)
        yield ctx.finding(rule, where, versions=listing, newest=ordered[-1])


@check("MCV-W014")
def mooncake_unpinned(ctx: Context, rule: Rule) -> Iterable[Finding]:
    version = ctx.mooncake.version if ctx.mooncake else "X.Y.Z"
    for package, pinned, where in pip_pins(ctx.deployment):
        if pinned is None:
            yield ctx.finding(rule, where, package=package, version=version)


def _unsupported_scheme(ctx: Context, rule: Rule, scheme: str, schemes: tuple[str, ...]) -> Iterable[Finding]:
    """Findings for metadata URLs in ``schemes`` when a Mooncake in play lacks ``scheme`` support."""
    for version, _ in ctx.mooncake_versions():
        if scheme not in mooncake_facts(version).metadata_schemes:
            for url, where in metadata_urls(ctx):
                if _scheme(url) in schemes:
                    yield ctx.finding(rule, where, url=url, mooncake=version)
            return


@check("MCV-E005")
def etcd_on_http_only_wheel(ctx: Context, rule: Rule) -> Iterable[Finding]:
    return _unsupported_scheme(ctx, rule, "etcd", ("etcd", "bare"))


@check("MCV-E006")
def p2phandshake_on_old_store(ctx: Context, rule: Rule) -> Iterable[Finding]:
    return _unsupported_scheme(ctx, rule, "p2p", ("p2p",))


@check("MCV-E013")
def several_mooncake_distributions(ctx: Context, rule: Rule) -> Iterable[Finding]:
    dists = ctx.installed_mooncake
    if len(dists) > 1:
        yield ctx.finding(rule, None, dists=", ".join(str(d) for d in dists), keep=dists[-1].name)


@check("MCV-E014")
def mooncake_config_invalid(ctx: Context, rule: Rule) -> Iterable[Finding]:
    from mooncake_vllm.config import load_store_config

    for config in ctx.deployment.configs:
        if config.shape == "v0-pipe":
            continue  # the V0 P2P pipe connector's file, not a store config
        try:
            load_store_config(config.data, env={})
        except ConfigError as exc:
            for p in exc.problems:
                yield ctx.finding(rule, config.where(p.field), field=p.field, problem=p.problem, fix=p.fix)


@check("MCV-W001")
def metadata_without_scheme(ctx: Context, rule: Rule) -> Iterable[Finding]:
    for url, where in metadata_urls(ctx):
        if _scheme(url) == "bare" and url.strip():
            yield ctx.finding(rule, where, url=url)


@check("MCV-W012")
def redis_metadata_on_wheel(ctx: Context, rule: Rule) -> Iterable[Finding]:
    if ctx.mooncake is not None and ctx.mooncake.redis_in_wheels:  # Defensive: never true for wheels
        return
    for url, where in metadata_urls(ctx):
        if _scheme(url) in ("redis", "rediss"):
            yield ctx.finding(rule, where, url=url)


@check("MCV-W002")
def rdma_without_device(ctx: Context, rule: Rule) -> Iterable[Finding]:
    for config in ctx.deployment.configs:
        if str(config.data.get("protocol", "")).lower() == "rdma" and not str(config.data.get("device_name") or ""):
            yield ctx.finding(rule, config.where("device_name" if "device_name" in config.data else "protocol"))


def segment_size(value: object) -> int | None:
    """``global_segment_size`` in bytes, None when absent or unparsable (config.py reports those)."""
    if value is None:
        return None
    from mooncake_vllm.config import parse_size

    try:
        return parse_size(value, field="global_segment_size")
    except (ValueError, ConfigError):
        return None


# ------------------------------------------------------------------ the disk tier
def tier_configs(ctx: Context) -> list[tuple[MooncakeConfigFile, str]]:
    """Store configs asking for the pool's disk tier, with the key that does."""
    from mooncake_vllm.config import TIER_SWITCHES

    found = []
    for config in ctx.deployment.configs:
        key = next((k for k in TIER_SWITCHES if str(config.data.get(k)).strip().lower() in ("true", "1")), None)
        if key is not None and config.shape != "v0-pipe":
            found.append((config, key))
    return found


def _offloads(launch: Launch) -> bool | None:
    """Whether a master/holder launch runs with the disk tier; None = cannot tell from its line."""
    if launch.program == "mooncake-vllm holder":
        return True if launch.option("--ssd") is not None else None  # --config may carry the tier
    if launch.program.startswith("mooncake-vllm"):  # up, demo
        return launch.option("--ssd") is not None
    if launch.kind == MASTER or os.path.basename(launch.argv[0]) == "mooncake_client":
        value = launch.option("--enable-offload")
        return value is not None and value.strip().lower() in ("", "true", "1", "yes")
    return None


@check("MCV-E016")
def ssd_tier_mooncake_too_old(ctx: Context, rule: Rule) -> Iterable[Finding]:
    asked = [(f"{c.path} ({key})", c.where(key)) for c, key in tier_configs(ctx)]
    asked += [(launch.program or launch.argv[0], launch.where)
              for launch in ctx.deployment.of_kind(MASTER, HOLDER) if _offloads(launch)]
    if not asked:
        return
    for version, where in ctx.mooncake_versions():
        if not mooncake_facts(version).ssd_offload:
            what, at = asked[0]
            yield ctx.finding(rule, where or at, what=what, version=version)
            return


@check("MCV-W021")
def ssd_tier_not_started(ctx: Context, rule: Rule) -> Iterable[Finding]:
    configs = tier_configs(ctx)
    if not configs:
        return
    config, key = configs[0]
    for launch in ctx.deployment.of_kind(MASTER, HOLDER):
        if _offloads(launch) is False:
            name = launch.program or launch.argv[0]
            if launch.program.startswith("mooncake-vllm"):
                fix = f"add --ssd DIR (and --ssd-size) to `{name}`"
            elif launch.kind == MASTER:
                fix = "start mooncake_master with --enable_offload=true (docs/ssd-tier.md: and a 1 s lease)"
            else:
                fix = ("start mooncake_client with --enable_offload=true and MOONCAKE_OFFLOAD_FILE_STORAGE_PATH=DIR "
                       "in its environment")
            yield ctx.finding(rule, launch.where, config=config.path, field=key, what=name, fix=fix)
