"""Every rule of ``mooncake-vllm check``, in one place.

Each :class:`Rule` has a stable ID (``MCV-E…`` blocks a deployment, ``MCV-W…``
warns; ``1xx`` IDs are ``--probe`` live checks), a one-line message, the why,
the fix and a reference into the project's reference notes
(``vllm §N`` = vllm-kv-connector-api.md, ``mooncake §N`` =
mooncake-store-api.md, ``peers §N`` = peers-and-anchors.md). Messages and fixes
are ``str.format`` templates filled by the rule's implementation. IDs are never
reused or renumbered; a retired rule keeps its ID.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ERROR", "OUR_MODULE_PATH", "RULES", "Rule", "WARNING", "rule"]

ERROR = "error"
WARNING = "warning"

#: ``kv_connector_module_path`` that selects mooncake-vllm's connector (compat/facade.py).
OUR_MODULE_PATH = "mooncake_vllm.compat.facade"


@dataclass(frozen=True)
class Rule:
    """One check: what it reports, why it matters, how to fix it, where it is documented."""

    id: str
    severity: str  # ERROR | WARNING
    name: str
    message: str  # template
    why: str
    fix: str  # template
    reference: str
    probe: bool = False


_ALL: tuple[Rule, ...] = (
    # ------------------------------------------------------------------ engine and connector
    Rule("MCV-E001", ERROR, "v0-requested-without-v0",
         "{what} asks for the V0 engine, but vLLM {target} has no V0 KV connectors (last release with V0: 0.10.0)",
         "vLLM 0.10.1 removed the V0 connectors and 0.11.0 the V0 engine; VLLM_USE_V1 was removed in 0.11.1, so "
         "the instance either fails to start or silently runs V1 without the settings you meant.",
         "drop {what} and run the V1 engine with the same kv-transfer-config (`mooncake-vllm check --fix OUTDIR "
         "--target-vllm {target}` writes the migrated launch script), or pin vllm==0.10.0",
         "vllm §2 Removal, §3 VLLM_USE_V1"),
    Rule("MCV-E002", ERROR, "v1-setup-on-v0-engine",
         "{what} needs the V1 engine, but this instance starts V0 on vLLM {target}",
         "MultiConnector and the V1 connectors exist only in the V1 engine; a V0 engine (vLLM <= 0.8.4 with "
         "--kv-transfer-config, or VLLM_USE_V1=0) cannot create them and the instance fails to start.",
         "target vLLM >= 0.9.0 with the V1 engine (unset VLLM_USE_V1), or use a single MooncakeStoreConnector "
         "with kv_producer/kv_consumer roles",
         "vllm §3, §6, §8"),
    Rule("MCV-E003", ERROR, "adaptor-mooncake-too-new",
         "vLLM {target} imports mooncake_vllm_adaptor, which Mooncake {mooncake} does not ship",
         "vLLM <= 0.8.4 imports the top-level module `mooncake_vllm_adaptor`; Mooncake stopped building it in "
         "0.3.4, and even older wheels hide it inside the mooncake package.",
         "pin mooncake-transfer-engine==0.3.3.post2 and build Mooncake from source, or move to vLLM >= 0.8.5 "
         "(imports mooncake.store)",
         "mooncake §10 mooncake_vllm_adaptor; Mooncake#13"),
    Rule("MCV-E004", ERROR, "mooncake-version-skew",
         "Mooncake releases differ across the deployment: {versions}",
         "Master and clients compare a constant protocol string, so mixed releases are not detected and fail "
         "silently with -900 (RPC_FAIL) and a 0% hit rate; maintainers call mixed versions unsupported.",
         "install one Mooncake release everywhere (master, holders, every vLLM node): "
         "pip install mooncake-transfer-engine=={newest}",
         "mooncake §6 Version handshake; Mooncake PR#2579, RFC#1920"),
    Rule("MCV-E005", ERROR, "etcd-on-http-only-wheel",
         "metadata_server {url!r} is etcd, but Mooncake {mooncake} wheels only support HTTP metadata",
         "Wheels 0.3.0-0.3.2.post1 were built without etcd; setup aborts with \"Unable to find metadata storage "
         "plugin etcd\".",
         "upgrade to mooncake-transfer-engine >= 0.3.3.post1, or use an HTTP metadata server "
         "(`mooncake-vllm metadata serve --port 8080`, metadata_server http://HOST:8080/metadata)",
         "mooncake §7 Compiled-in backends; Mooncake#375, #386"),
    Rule("MCV-E006", ERROR, "p2phandshake-on-old-store",
         "metadata_server P2PHANDSHAKE needs Mooncake >= 0.3.7 for the store, found {mooncake}",
         "Before 0.3.7 the store cannot exchange segment metadata over the Transfer Engine RPC port.",
         "upgrade Mooncake to >= 0.3.7, or use http or etcd metadata",
         "mooncake §7"),
    Rule("MCV-E007", ERROR, "kv-config-key-rejected",
         "--kv-transfer-config key {key!r} is rejected by vLLM {target}{detail}",
         "vLLM 0.9.0-0.10.1 build KVTransferConfig(**json) (TypeError on unknown keys), 0.16.0+ forbid extra "
         "keys, and 0.32.0 removed kv_buffer_size, kv_rank, kv_parallel_size and kv_ip: the instance does not start.",
         "remove {key!r}; keep private settings in kv_connector_extra_config or in the MOONCAKE_CONFIG_PATH JSON",
         "vllm §5 KVTransferConfig"),
    Rule("MCV-E008", ERROR, "kv-config-invalid",
         "--kv-transfer-config is invalid: {problem}",
         "vLLM parses the value as a JSON object and requires kv_connector and a kv_role of kv_producer, "
         "kv_consumer or kv_both.",
         "{fix}",
         "vllm §5"),
    Rule("MCV-E009", ERROR, "no-pool-memory",
         "every vLLM instance uses global_segment_size 0 and no process holds pool memory",
         "With segment 0 a client contributes no DRAM; without a holder (mooncake_client, `mooncake-vllm "
         "holder` or `mooncake-vllm up`) every put fails with -200 NO_AVAILABLE_HANDLE and nothing is cached.",
         "start a holder next to the master, e.g. `mooncake-vllm holder --config {config} --segment-size 4GB`, "
         "or give the instances a non-zero global_segment_size",
         "mooncake §2 global_segment_size, §4 -200; DESIGN.md Topology"),
    Rule("MCV-E010", ERROR, "config-path-missing",
         "{connector} is configured but MOONCAKE_CONFIG_PATH is not set for this instance",
         "Both the V0 and the V1 MooncakeStoreConnector read their settings only from the JSON file named by "
         "MOONCAKE_CONFIG_PATH and raise ValueError without it.",
         "set MOONCAKE_CONFIG_PATH=/path/to/mooncake_config.json in the instance's environment",
         "vllm §4 Config, §10 Config JSON"),
    Rule("MCV-E011", ERROR, "p2p-with-legacy-proxy",
         "{proxy} cannot drive the V1 P2P MooncakeConnector used by this deployment",
         "The V0-era proxy forwards plain completions; the V1 P2P connector needs kv_transfer_params "
         "(do_remote_decode/do_remote_prefill, bootstrap address, transfer_id) on every request, so decode "
         "instances never receive KV.",
         "replace it with `{proxy_fix}`",
         "vllm §9, §12"),
    Rule("MCV-E012", ERROR, "connector-unavailable",
         "connector {connector!r} is not available on the {engine} engine of vLLM {target}",
         "{why}",
         "{fix}",
         "vllm §6 Built-in names, §8, §9"),
    Rule("MCV-E013", ERROR, "several-mooncake-distributions",
         "several Mooncake distributions are installed: {dists}",
         "Every flavour (mooncake-transfer-engine, -non-cuda, -cuda13, ...) installs the same `mooncake` package, "
         "so the last one installed silently overwrote the others' files.",
         "pip uninstall all of them, then install exactly one: pip install {keep}",
         "mooncake §10 Distributions"),
    Rule("MCV-E016", ERROR, "ssd-tier-mooncake-too-old",
         "{what} asks for the pool's disk tier, but Mooncake {version} cannot serve it",
         "Pure clients read a value that lives only on a holder's disk through that holder's offload RPC server "
         "(mooncake_client --start_offload_rpc_server) and the multi-buffer get, both from Mooncake 0.3.11; "
         "setup() takes enable_ssd_offload from then on too. Older releases write values to disk but the "
         "connector's reads of them fail: every evicted prefix is a miss.",
         "install one Mooncake >= 0.3.11 everywhere (pip install mooncake-transfer-engine==0.3.13.post1), or "
         "drop the disk tier",
         "mooncake §2 (enable_ssd_offload 0.3.11), §6 --enable_offload; docs/ssd-tier.md"),
    Rule("MCV-E014", ERROR, "mooncake-config-invalid",
         "{field} {problem}",
         "The connector validates MOONCAKE_CONFIG_PATH before Mooncake's setup(); a missing key, a size it cannot "
         "parse or an unknown scheme stops the instance (Mooncake itself would raise TypeError or abort).",
         "{fix}",
         "mooncake §8 Config files; vllm §4 Config, §10 Config JSON"),
    # ------------------------------------------------------------------ warnings
    Rule("MCV-W001", WARNING, "metadata-without-scheme",
         "metadata_server {url!r} has no scheme and is treated as etcd endpoints",
         "Mooncake reads a bare host:port as etcd; an HTTP metadata server given this way is never reached.",
         "write the scheme explicitly: \"etcd://{url}\" or \"http://{url}/metadata\"",
         "mooncake §7 Metadata backends, §8 pipe variant"),
    Rule("MCV-W002", WARNING, "rdma-without-device",
         "protocol is rdma but device_name is empty",
         "Without a device list the Transfer Engine has to discover RDMA NICs itself; on hosts without RDMA (or "
         "with several NICs) setup fails or picks the wrong device.",
         "set device_name to your NICs (e.g. \"mlx5_0,mlx5_1\"; `ls /sys/class/infiniband`), or \"protocol\": "
         "\"tcp\" where there is no RDMA",
         "mooncake §2 rdma_devices"),
    Rule("MCV-W003", WARNING, "hash-seed-not-shared",
         "{count} engine processes on vLLM {target} without one shared PYTHONHASHSEED",
         "Before vLLM 0.29 every EngineCore (each instance and each DP rank) draws a random NONE_HASH unless "
         "PYTHONHASHSEED is set, so block-hash-keyed caches (in-tree MooncakeStoreConnector, LMCache, KV events) "
         "silently get 0 hits across processes. mooncake-vllm's own keys do not depend on it.",
         "export the same PYTHONHASHSEED (e.g. PYTHONHASHSEED=0) for every instance before it starts",
         "vllm §11 Consequences; vllm#51875"),
    Rule("MCV-W004", WARNING, "hash-seed-differs",
         "instances use different PYTHONHASHSEED values: {seeds}",
         "On vLLM < 0.29 block hashes derive from the seed; different seeds mean no shared prefix blocks "
         "between those instances.",
         "use one PYTHONHASHSEED value on every instance",
         "vllm §11"),
    Rule("MCV-W005", WARNING, "hash-seed-inverted",
         "PYTHONHASHSEED is set on vLLM {target}, where that makes V1 block hashes random",
         "vLLM 0.8.3-0.8.4 inverted the condition: NONE_HASH is os.urandom exactly when PYTHONHASHSEED is set.",
         "unset PYTHONHASHSEED on vLLM 0.8.3-0.8.4, or upgrade to >= 0.8.5",
         "vllm §11 V1 0.8.3-0.8.4"),
    Rule("MCV-W006", WARNING, "tp-size-differs",
         "instances use different tensor-parallel sizes: {sizes}",
         "KV blocks are stored per TP rank and layout; a block written with one TP size cannot be read with "
         "another, so instances with different TP sizes do not share the pool.",
         "use one --tensor-parallel-size for instances that should share KV",
         "DESIGN.md Stable keys; vllm §10 Key"),
    Rule("MCV-W007", WARNING, "chunked-prefill-with-v0-store",
         "chunked prefill is enabled on a V0 MooncakeStoreConnector instance",
         "The V0 store connector keys whole sequences; mixed prefill/decode batches make it recompute the whole "
         "batch (vLLM warns \"You should set --enable_chunked_prefill=False\").",
         "pass --no-enable-chunked-prefill (or --enable-chunked-prefill=False) to V0 instances, or move to V1",
         "vllm §4 Recv"),
    Rule("MCV-W008", WARNING, "connector-name-ambiguous",
         "MooncakeStoreConnector on vLLM {target} may resolve to vLLM's in-tree class, not mooncake-vllm's",
         "From 0.21.0 vLLM ships its own V1 MooncakeStoreConnector; which class runs depends on whether "
         "mooncake-vllm's plugin is installed in that environment. The in-tree class keys blocks by vLLM block "
         "hash and rejects global_segment_size 0 without \"mode\" from 0.22.0.",
         "add \"kv_connector_module_path\": \"" + OUR_MODULE_PATH + "\" to the kv-transfer-config (module path "
         "wins over the registry from 0.20.0)",
         "vllm §6 name table, §10"),
    Rule("MCV-W009", WARNING, "v0-v1-pools-disjoint",
         "{what}: V0 and V1 instances will not share cached KV",
         "vLLM's V0 store keys whole prompts (blake2b + local rank) and the V1 store keys blocks by block hash, "
         "so a V0-filled pool is cold for V1. Only mooncake-vllm's connector uses the same keys on both engines.",
         "run mooncake-vllm on both sides (\"kv_connector_module_path\": \"" + OUR_MODULE_PATH + "\"), or "
         "expect a cold pool after the switch",
         "vllm §4 Key, §11 V0 and V1 keys; peers §1.2"),
    Rule("MCV-W010", WARNING, "legacy-proxy",
         "{proxy} is a demo proxy from the V0 era / vLLM examples",
         "{why}",
         "run `{proxy_fix}` instead (health checks, safe admin API, store and p2p flows)",
         "vllm §12; peers §1.5"),
    Rule("MCV-W031", WARNING, "plain-store-beside-p2p-pairs",
         "{instance} runs MooncakeStoreConnector alone beside P2P + store pairs: its KV layout is NHD, theirs "
         "{layout}, so it never hits the blocks they save",
         "The pairs' MultiConnector asks vLLM for the P2P MooncakeConnector's KV layout ({layout}); the KV "
         "layout is part of the pool's key namespace, so blocks saved by the pairs and by a plain store instance "
         "never match (a silent 0% hit rate between them).",
         "start that instance with VLLM_KV_CACHE_LAYOUT={layout} (a layout it keys by too), or give it the "
         "pairs' MultiConnector config",
         "vllm §9 MooncakeConnector layout; keys.py namespace; issue 26"),
    Rule("MCV-W011", WARNING, "admin-api-without-key",
         "{proxy} exposes admin endpoints but ADMIN_API_KEY is not set",
         "The /instances/add endpoint answers 500 (demo proxy) or is disabled without a key; when set, it is the "
         "only thing protecting instance registration.",
         "export ADMIN_API_KEY=<a long random secret> in the proxy's environment",
         "vllm §12 disagg_proxy_demo.py Endpoints"),
    Rule("MCV-W012", WARNING, "redis-metadata-on-wheel",
         "metadata_server {url!r} uses redis://, which no published Mooncake wheel supports",
         "Wheels are built without the redis plugin: a plain Mooncake process (mooncake_client, in-tree "
         "connectors) aborts with exit code 134. mooncake-vllm's connector bridges redis:// automatically.",
         "serve the same redis through HTTP: `mooncake-vllm metadata serve --backend {url} --port 8080` and set "
         "metadata_server to http://HOST:8080/metadata",
         "mooncake §7 redis"),
    Rule("MCV-W013", WARNING, "kv-config-key-ignored",
         "--kv-transfer-config key {key!r} is unknown to vLLM {target} and silently ignored",
         "This release does not reject unknown keys, so a typo or a setting from another release has no effect.",
         "remove or fix {key!r}{suggestion}",
         "vllm §5"),
    Rule("MCV-W014", WARNING, "mooncake-unpinned",
         "{package} is installed without a version pin",
         "Nodes installed at different times get different Mooncake releases, and mixed master/client releases "
         "fail silently.",
         "pin one release everywhere: pip install {package}=={version}",
         "mooncake §6 Version handshake; llm-d#1826"),
    Rule("MCV-W015", WARNING, "adaptor-needs-source-build",
         "vLLM {target} imports the top-level mooncake_vllm_adaptor, which pip wheels do not provide",
         "Wheels up to 0.3.3.post2 place the adaptor at mooncake/mooncake_vllm_adaptor.so, so "
         "`import mooncake_vllm_adaptor` fails unless Mooncake is built from source.",
         "build Mooncake 0.3.3.post2 from source, or move to vLLM >= 0.8.5",
         "mooncake §10 mooncake_vllm_adaptor"),
    Rule("MCV-W016", WARNING, "client-ttl-short",
         "{what} sets client_ttl to {ttl} s: a busy holder can be declared dead and its whole segment dropped",
         "Clients ping the master once a second; a holder that misses pings for client_ttl seconds (a prefill "
         "saturating the CPU, a swap storm, a GC pause) is expired and its segment unmounted: every block it "
         "held is gone and in-flight puts fail with OBJECT_NOT_FOUND, so the next instance silently gets 0 hits.",
         "keep client_ttl at Mooncake's default 10 s or more ({fix_flag}); short values only for tests",
         "mooncake §6 --client_ttl, Dead clients; issue 13 item 5"),
    Rule("MCV-W017", WARNING, "pool-in-one-holder",
         "the whole pool lives in one holder process ({holder}): losing it loses every cached block",
         "vLLM instances here hold no pool memory (global_segment_size 0), so every stored block is in that one "
         "process. If it exits, crashes or misses heartbeats for client_ttl seconds, the master unmounts its "
         "segment: all cached KV is gone at once, in-flight puts fail and every instance recomputes (a silent "
         "0% hit rate) until the holder is back and the pool is refilled.",
         "run two or more holders (on different hosts) so one loss costs only its share, or give the instances "
         "a non-zero global_segment_size; if one holder is a deliberate choice, say so with --ignore MCV-W017",
         "mooncake §3 close() loses data, §6 Dead clients; running-on-cpu.md placement; issue 13 item 5"),
    Rule("MCV-W018", WARNING, "handoff-not-awaited",
         "a V1 MooncakeStoreConnector that loads KV ({role}) on vLLM {target} cannot wait for a prefill "
         "instance's saves",
         "In the proxy's store flow the decode request follows the prefill's answer at once, while the prefill's "
         "saves may still be on their way. mooncake-vllm defers such a request until the blocks the prefill "
         "named are committed (get_num_new_matched_tokens answers None, \"ask again later\"), which vLLM "
         "accepts from 0.10.2 on. Before that the decode looks up at once and may recompute the whole prompt "
         "(correct output, no pool benefit): the behaviour before hand-offs existed.",
         "run decode instances on vLLM >= 0.10.2 (prefill instances may stay older), or accept that XpYd "
         "decodes sometimes recompute",
         "vllm §7 0.10.2; DESIGN.md Hand-off"),
    Rule("MCV-W019", WARNING, "v1-loads-off",
         "a V1 MooncakeStoreConnector that should load KV ({role}) on vLLM {target} only saves: it loads "
         "nothing from the pool",
         "Before vLLM 0.11.1 nothing tells vLLM that a block the connector promised did not arrive (evicted "
         "after the lookup, corrupt, the pool gone mid-transfer): vLLM would attend to whatever the block held. "
         "So on those releases mooncake-vllm's V1 connector saves (the pool stays warm for upgraded instances) "
         "and never loads; every prompt is recomputed there (one warning line at start says so).",
         "run instances that should load on vLLM >= 0.11.1 (same pool and keys), or the V0 engine on <= 0.10.0 "
         "(VLLM_USE_V1=0: V0 recomputes a failed load)",
         "vllm §7 get_block_ids_with_load_errors 0.11.1; DESIGN.md Loads"),
    Rule("MCV-W021", WARNING, "ssd-tier-not-started",
         "{config} asks for the pool's disk tier ({field}), but {what} starts without it",
         "Mooncake offloads a value to the disk of the holder whose memory keeps it, and only when the master "
         "runs with --enable_offload: a pool started without the tier on either side silently evicts once DRAM "
         "is full, and every evicted prefix is recomputed.",
         "{fix}",
         "docs/ssd-tier.md; mooncake §6 --enable_offload; issue 30"),
    Rule("MCV-W040", WARNING, "pool-metrics-not-exported",
         "vLLM {target} has no connector-metrics hooks: the pool's counters are not in this server's /metrics"
         "{logged}",
         "vLLM asks a V1 connector for stats from 0.11.0 (get_kv_connector_stats, logged as 'KV Transfer "
         "metrics' lines) and exports them to Prometheus from 0.11.1 (build_prom_metrics); before that, pool "
         "lookups, hits, loads, saves, failures and the pool's state are not visible in vllm:mooncake_vllm_*.",
         "move to vLLM >= 0.11.1 to scrape vllm:mooncake_vllm_* from /metrics (until then the connector's "
         "warnings are the only signal), or accept it with --ignore MCV-W040",
         "vllm §7 (get_kv_connector_stats 0.11.0, build_prom_metrics 0.11.1); README Metrics and events"),
    Rule("MCV-W041", WARNING, "pool-kv-events-not-published",
         "--kv-events-config is set, but vLLM {target} carries no connector KV events: routers see vLLM's own "
         "blocks, never what the Mooncake pool holds",
         "Connector KV events (get_kv_connector_kv_cache_events, handed to the scheduler's publisher) arrive "
         "in vLLM 0.13.0; before that no BlockStored/BlockRemoved with medium MOONCAKE is published.",
         "move to vLLM >= 0.13.0 for pool events, or accept it with --ignore MCV-W041",
         "vllm §7 (get_kv_connector_kv_cache_events 0.13.0); README Metrics and events"),
    # ------------------------------------------------------------------ --probe
    Rule("MCV-E101", ERROR, "master-unreachable",
         "mooncake_master {address} is not reachable: {reason}", "Every client setup fails (-1) without the master.",
         "start mooncake_master on that address (--rpc_port) or fix master_server_address",
         "mooncake §6", probe=True),
    Rule("MCV-E102", ERROR, "metadata-unreachable",
         "metadata server {url} is not reachable: {reason}",
         "Transfer Engine setup needs the metadata service; HTTP metadata GETs time out after 3 s each.",
         "start the metadata service (`mooncake-vllm metadata serve`, etcd, ...) or fix metadata_server",
         "mooncake §7", probe=True),
    Rule("MCV-W101", WARNING, "stale-metadata",
         "{count} stale metadata segment(s) whose owner is gone: {segments}",
         "Before Mooncake 0.3.12 nobody removes ram/ and rpc_meta/ entries of crashed clients; peers keep "
         "trying to reach them.",
         "`mooncake-vllm metadata gc --metadata {url} --apply`",
         "mooncake §6 TE metadata, §11 #1078", probe=True),
    Rule("MCV-E103", ERROR, "rdma-device-missing",
         "protocol is rdma but {problem}",
         "The RDMA transport needs an InfiniBand/RoCE device listed under /sys/class/infiniband.",
         "use \"protocol\": \"tcp\" on this host, or set device_name to one of the present devices",
         "mooncake §2 protocol, rdma_devices", probe=True),
    Rule("MCV-E105", ERROR, "p2p-rdma-without-device",
         "{instance}: the P2P MooncakeConnector uses protocol rdma (its default), but this host has no RDMA "
         "device (/sys/class/infiniband is empty or missing)",
         "vLLM's P2P MooncakeConnector starts its own Transfer Engine with kv_connector_extra_config's "
         "mooncake_protocol, not the MOONCAKE_CONFIG_PATH protocol; with rdma and no NIC its worker fails at start "
         "(\"Mooncake Transfer Engine initialization failed\") and the instance never serves.",
         "{how}",
         "vllm §9 MooncakeConnector setup; issue 26", probe=True),
    Rule("MCV-E104", ERROR, "mooncake-libraries-missing",
         "{lib} of the Mooncake extension cannot find {missing}",
         "auditwheel leaves libibverbs, libnuma, libcurl and the CUDA runtime out of the wheels; "
         "`import mooncake.store` fails with ImportError.",
         "{fix}",
         "mooncake §10 System libraries", probe=True),
    Rule("MCV-W103", WARNING, "live-client-ttl-short",
         "the running mooncake_master {address} (pid {pid}) expires clients after {ttl} s",
         "A holder that misses heartbeats that long, e.g. while a prefill saturates the CPU, is declared dead: "
         "its segment and every block in it are dropped, and the next instance silently gets 0 hits.",
         "restart the master with --client_ttl=10 or more (Mooncake's default)",
         "mooncake §6 --client_ttl, Dead clients; issue 13 item 5", probe=True),
    Rule("MCV-W104", WARNING, "live-pool-in-one-holder",
         "mooncake_master {url} has exactly one mounted segment ({segment}): the whole pool is one process",
         "Every cached block lives in that process; if it exits or misses heartbeats for client_ttl seconds the "
         "master unmounts it and the whole pool is lost at once (a silent 0% hit rate until it is refilled).",
         "start a second holder (on another host), or accept the risk explicitly with --ignore MCV-W104",
         "mooncake §6 Dead clients; issue 13 item 5", probe=True),
    Rule("MCV-W105", WARNING, "live-namespaces-split",
         "pool of {url}: {split}",
         "Blocks are shared only inside one key namespace (model, dtype, KV layout, block size, TP size, tenant, "
         "cache_prefix). Instances whose namespaces differ in anything but tenant/cache_prefix keep saving while "
         "never hitting each other: a silent 0% hit rate between them.",
         "start every instance of a model with the same --block-size, --dtype, --kv-cache-dtype and "
         "--tensor-parallel-size (and the same model_id); `mooncake-vllm pool namespaces` lists them, "
         "`mooncake-vllm pool clear` removes a stale one",
         "keys.py namespace; issue 15 item 7", probe=True),
    Rule("MCV-W106", WARNING, "live-ssd-tier-missing",
         "{config} asks for the pool's disk tier, but the pool of {url} has none ({detail})",
         "The running master reports no disk capacity: it was started without --enable_offload, or no holder "
         "offloads (mooncake_client --enable_offload with MOONCAKE_OFFLOAD_FILE_STORAGE_PATH). Once DRAM is full "
         "values are evicted and their prefixes recomputed, although the config says they spill to disk.",
         "restart the pool with the tier (`mooncake-vllm up --ssd DIR`, or the flags in docs/ssd-tier.md), or "
         "remove enable_ssd_offload from the config",
         "docs/ssd-tier.md; mooncake §6 --enable_offload; issue 30", probe=True),
    Rule("MCV-W102", WARNING, "local-hostname-not-local",
         "local_hostname {host!r} is not an address of this host",
         "Peers connect to local_hostname; an address of another machine makes every transfer to this client fail.",
         "set local_hostname to this node's address (or leave it out to let mooncake-vllm pick one)",
         "mooncake §2 local_hostname", probe=True),
)

#: id -> Rule
RULES: dict[str, Rule] = {r.id: r for r in _ALL}
assert len(RULES) == len(_ALL), "duplicate rule id"


def rule(rule_id: str) -> Rule:
    """The rule with ``rule_id``; KeyError names the known IDs."""
    try:
        return RULES[rule_id]
    except KeyError:
        raise KeyError(f"unknown rule {rule_id!r}; known: {', '.join(RULES)}") from None
