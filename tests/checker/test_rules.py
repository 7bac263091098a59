"""Every offline rule of the catalogue: one failing and one passing deployment each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from checker_cases import CONFIG, OURS, STORE, multi, serve

from mooncake_vllm.checker import build_context, run_rules
from mooncake_vllm.checker.catalogue import RULES
from mooncake_vllm.checker.model import Deployment

SEED = "python3 -m vllm.entrypoints.openai.api_server --model m --port {port} --kv-transfer-config '{kv}' &\n"
HOLDER = "mooncake-vllm holder --config mooncake.json &\n"
SEG0 = {**CONFIG, "global_segment_size": "0"}
_EVENTS = """--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq"}'"""


def _c(**changes: Any) -> dict[str, Any]:
    return {**CONFIG, **changes}


def _two(kv: str = STORE, env1: str = "", env2: str = "", extra1: str = "", extra2: str = "") -> str:
    base = "MOONCAKE_CONFIG_PATH=mooncake.json"
    return (serve(kv, env=f"{base} {env1}".strip(), extra=f"--port 8100 {extra1}")
            + serve(kv, env=f"{base} {env2}".strip(), extra=f"--port 8200 {extra2}"))


# rule id -> (failing case, passing case); each case = kwargs of check_ids
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "MCV-E001": (dict(script=serve(env="MOONCAKE_CONFIG_PATH=mooncake.json VLLM_USE_V1=0"), config=CONFIG),
                 dict(script=serve(env="MOONCAKE_CONFIG_PATH=mooncake.json VLLM_USE_V1=0"), config=CONFIG,
                      target_vllm="0.10.0")),
    "MCV-E002": (dict(script=serve(multi("kv_producer"), env="MOONCAKE_CONFIG_PATH=m.json VLLM_USE_V1=0"),
                      target_vllm="0.10.0"),
                 dict(script=serve(multi("kv_producer")), target_vllm="0.10.0")),
    "MCV-E003": (dict(script=serve(), config=CONFIG, target_vllm="0.8.4", target_mooncake="0.3.5"),
                 dict(script=serve(), config=CONFIG, target_vllm="0.8.4", target_mooncake="0.3.3.post2")),
    "MCV-E004": (dict(script="pip install mooncake-transfer-engine==0.3.5\n"
                             "pip3 install mooncake-transfer-engine==0.3.6\n"),
                 dict(script="pip install mooncake-transfer-engine==0.3.13.post1\n")),
    "MCV-E005": (dict(config=_c(metadata_server="etcd://127.0.0.1:2379"), target_mooncake="0.3.2.post1"),
                 dict(config=_c(metadata_server="etcd://127.0.0.1:2379"), target_mooncake="0.3.3.post1")),
    "MCV-E006": (dict(config=_c(metadata_server="P2PHANDSHAKE"), target_mooncake="0.3.6"),
                 dict(config=_c(metadata_server="P2PHANDSHAKE"), target_mooncake="0.3.7")),
    "MCV-E007": (dict(script=serve('{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both","kv_ip":"1.2.3.4"}')),
                 dict(script=serve('{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both","kv_ip":"1.2.3.4"}'),
                      target_vllm="0.31.0")),
    "MCV-E008": (dict(script=serve('{"kv_connector": MooncakeStoreConnector}')), dict(script=serve())),
    "MCV-E009": (dict(script=serve(), config=SEG0), dict(script=serve() + HOLDER, config=SEG0)),
    "MCV-E010": (dict(script=serve(env="")), dict(script=serve())),
    "MCV-E011": (dict(script=serve(multi("kv_producer")) + serve(multi("kv_consumer"))
                      + "python3 disagg_proxy_demo.py --model m --prefill localhost:8100 --decode localhost:8200\n"),
                 dict(script=serve(multi("kv_producer")) + serve(multi("kv_consumer"))
                      + "mooncake-vllm proxy --model m --prefill localhost:8100 --decode localhost:8200 --flow p2p\n")),
    "MCV-E012": (dict(script=serve(multi("kv_producer")), target_vllm="0.8.5"),
                 dict(script=serve(multi("kv_producer")), target_vllm="0.13.0")),
    "MCV-E014": (dict(config=_c(protocol="udp", master_server_address="h")), dict(config=CONFIG)),
    "MCV-W001": (dict(config=_c(metadata_server="127.0.0.1:2379")), dict(config=_c(metadata_server="etcd://127.0.0.1:2379"))),
    "MCV-W002": (dict(config=_c(protocol="rdma", device_name="")),
                 dict(config=_c(protocol="rdma", device_name="mlx5_0"))),
    "MCV-W003": (dict(script=_two(), target_vllm="0.28.0"),
                 dict(script=_two(env1="PYTHONHASHSEED=0", env2="PYTHONHASHSEED=0"), target_vllm="0.28.0")),
    "MCV-W004": (dict(script=_two(env1="PYTHONHASHSEED=0", env2="PYTHONHASHSEED=1"), target_vllm="0.28.0"),
                 dict(script=_two(env1="PYTHONHASHSEED=1", env2="PYTHONHASHSEED=1"), target_vllm="0.28.0")),
    "MCV-W005": (dict(script=serve(None, env="PYTHONHASHSEED=0"), target_vllm="0.8.4"),
                 dict(script=serve(None, env=""), target_vllm="0.8.4")),
    "MCV-W006": (dict(script=_two(extra1="-tp 2", extra2="--tensor-parallel-size 1")),
                 dict(script=_two(extra1="-tp 2", extra2="--tensor-parallel-size=2"))),
    "MCV-W007": (dict(script=serve(env="MOONCAKE_CONFIG_PATH=m.json VLLM_USE_V1=0", extra="--enable-chunked-prefill"),
                      target_vllm="0.10.0"),
                 dict(script=serve(env="MOONCAKE_CONFIG_PATH=m.json VLLM_USE_V1=0",
                                   extra="--enable-chunked-prefill=False"), target_vllm="0.10.0")),
    "MCV-W008": (dict(script=serve()), dict(script=serve(OURS))),
    "MCV-W009": (dict(script=_two(env1="VLLM_USE_V1=0"), target_vllm="0.10.0"),
                 dict(script=_two(OURS, env1="VLLM_USE_V1=0"), target_vllm="0.10.0")),
    "MCV-W010": (dict(script=serve() + "python3 disagg_proxy_demo.py --model m -p localhost:8100 -d localhost:8200\n"),
                 dict(script=serve(env="MOONCAKE_CONFIG_PATH=m.json VLLM_USE_V1=0")
                      + "python3 disagg_proxy_demo.py --model m -p localhost:8100 -d localhost:8200\n",
                      target_vllm="0.10.0")),
    "MCV-W011": (dict(script="python3 disagg_proxy_demo.py --model m -p h:1 -d h:2\n"),
                 dict(script="export ADMIN_API_KEY=s3cret\npython3 disagg_proxy_demo.py --model m -p h:1 -d h:2\n")),
    "MCV-W012": (dict(config=_c(metadata_server="redis://127.0.0.1:6379")), dict(config=CONFIG)),
    "MCV-W013": (dict(script=serve('{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both","kv_rol":"x"}'),
                      target_vllm="0.10.2"),
                 dict(script=serve(), target_vllm="0.10.2")),
    "MCV-W014": (dict(script="pip3 install mooncake-transfer-engine\n"),
                 dict(script="pip3 install 'mooncake-transfer-engine-non-cuda==0.3.13.post1'\n")),
    "MCV-W016": (dict(script="mooncake_master --rpc_port 50051 --client_ttl=2 &\n"),
                 dict(script="mooncake_master --rpc_port 50051 --client_ttl=30 &\nmooncake_master --port 50052 &\n")),
    "MCV-W017": (dict(script=serve() + HOLDER, config=SEG0), dict(script=serve() + HOLDER + HOLDER, config=SEG0)),
    "MCV-W018": (dict(script=serve(OURS), target_vllm="0.10.1"), dict(script=serve(OURS), target_vllm="0.10.2")),
    "MCV-W019": (dict(script=serve(OURS), target_vllm="0.11.0"), dict(script=serve(OURS), target_vllm="0.11.1")),
    "MCV-E016": (dict(config={**SEG0, "enable_ssd_offload": True}, target_mooncake="0.3.10.post2"),
                 dict(config={**SEG0, "enable_ssd_offload": True}, target_mooncake="0.3.11")),
    "MCV-W021": (dict(script=serve() + "mooncake_master --rpc_port 50051 &\n" + HOLDER,
                      config={**SEG0, "enable_offload": True}),
                 dict(script=serve() + "mooncake_master --rpc_port 50051 --enable_offload=true &\n"
                      + "mooncake_client --enable_offload --global_segment_size=1GB &\n",
                      config={**SEG0, "enable_offload": True})),
    "MCV-W040": (dict(script=serve(OURS), target_vllm="0.10.2"), dict(script=serve(OURS), target_vllm="0.11.1")),
    "MCV-W041": (dict(script=serve(OURS, extra=_EVENTS), target_vllm="0.12.0"),
                 dict(script=serve(OURS, extra=_EVENTS), target_vllm="0.13.0")),
    "MCV-W031": (dict(script=serve(multi("kv_producer")) + serve(multi("kv_consumer")) + serve()),
                 dict(script=serve(multi("kv_producer")) + serve(multi("kv_consumer"))
                      + serve(env="MOONCAKE_CONFIG_PATH=mooncake.json VLLM_KV_CACHE_LAYOUT=HND"))),
    "MCV-W015": (dict(script=serve(), config=CONFIG, target_vllm="0.8.4", target_mooncake="0.3.3.post2"),
                 dict(script=serve(), config=CONFIG, target_vllm="0.8.5", target_mooncake="0.3.3.post2")),
}


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_fails_then_passes(rule_id: str, check_ids) -> None:  # noqa: ANN001
    failing, passing = CASES[rule_id]
    assert rule_id in check_ids(**failing), f"{rule_id} should fire"
    assert rule_id not in check_ids(**passing), f"{rule_id} should stay quiet"


def test_every_offline_rule_has_cases() -> None:
    offline = {r.id for r in RULES.values() if not r.probe} - {"MCV-E013"}  # E013: test below
    assert offline == set(CASES)


def _dist(site: Path, name: str, version: str) -> None:
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n")


def test_e013_several_mooncake_distributions(tmp_path: Path) -> None:
    _dist(tmp_path / "two", "mooncake_transfer_engine", "0.3.5")
    _dist(tmp_path / "two", "mooncake_transfer_engine_non_cuda", "0.3.7.post1")
    _dist(tmp_path / "one", "mooncake_transfer_engine_non_cuda", "0.3.7.post1")
    two = build_context(Deployment(), target_vllm="0.32.0", site_path=[str(tmp_path / "two")])
    one = build_context(Deployment(), target_vllm="0.32.0", site_path=[str(tmp_path / "one")])
    assert "MCV-E013" in {f.id for f in run_rules(two)}
    assert "MCV-E013" not in {f.id for f in run_rules(one)}


def test_v0_only_flag_counts_as_a_v0_request(check_ids) -> None:  # noqa: ANN001
    assert "MCV-E001" in check_ids(script=serve(extra="--num-scheduler-steps 8"))
    assert "MCV-E001" not in check_ids(script=serve(extra="--num-scheduler-steps 8"), target_vllm="0.10.0")


def test_data_parallel_ranks_count_as_engines(check_ids) -> None:  # noqa: ANN001
    one_dp2 = serve(extra="--data-parallel-size 2")
    assert "MCV-W003" in check_ids(script=one_dp2, target_vllm="0.28.0")
    assert "MCV-W003" not in check_ids(script=serve(), target_vllm="0.28.0")  # one engine: nothing to share with
    assert "MCV-W003" not in check_ids(script=one_dp2, target_vllm="0.29.0")  # deterministic from 0.29


def test_pinned_release_differs_from_the_target(check_ids) -> None:  # noqa: ANN001
    pinned = "pip install mooncake-transfer-engine==0.3.5\n"
    assert "MCV-E004" in check_ids(script=pinned, target_mooncake="0.3.13.post1")
    assert "MCV-E004" not in check_ids(script=pinned, target_mooncake="0.3.5")


def test_removed_and_rejected_keys(check_ids) -> None:  # noqa: ANN001
    unknown = serve('{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both","bogus":1}')
    assert "MCV-E007" in check_ids(script=unknown, target_vllm="0.16.0")
    assert "MCV-E007" in check_ids(script=unknown, target_vllm="0.9.0")  # dataclass TypeError
    ids = check_ids(script=unknown, target_vllm="0.15.1")
    assert "MCV-W013" in ids and "MCV-E007" not in ids


def test_no_target_skips_version_rules(check_ids, tmp_path: Path) -> None:  # noqa: ANN001
    ids = check_ids(script=serve(env="MOONCAKE_CONFIG_PATH=m.json VLLM_USE_V1=0"), target_vllm="0.10.0")
    assert "MCV-E001" not in ids


def test_e009_needs_every_instance_on_segment_zero(check_ids, tmp_path: Path) -> None:  # noqa: ANN001
    assert "MCV-E009" not in check_ids(script=serve(), config=CONFIG)
    assert "MCV-E009" not in check_ids(script="", config=SEG0)  # no instance: nothing to judge


def test_w016_up_and_w017_needs_segment_zero(check_ids) -> None:  # noqa: ANN001
    """`mooncake-vllm up --client-ttl 2` starts a master with that TTL; instances with their own segment
    share the pool with the holder, so losing it is not losing everything."""
    assert "MCV-W016" in check_ids(script="mooncake-vllm up --client-ttl 2 &\n")
    assert "MCV-W016" not in check_ids(script="mooncake-vllm up &\n")  # default 10 s
    assert "MCV-W017" not in check_ids(script=serve() + HOLDER, config=CONFIG)
    assert "MCV-W017" not in check_ids(script=serve() + HOLDER, config=SEG0, ignore=["MCV-W017"])


def test_metrics_rule_names_the_log_only_release_and_events_need_the_flag(tmp_path: Path) -> None:
    from mooncake_vllm.checker import run_check

    (tmp_path / "launch.sh").write_text(serve(OURS))
    result, _ = run_check([tmp_path], target_vllm="0.11.0", target_mooncake="0.3.13.post1")
    (w040,) = [f for f in result.findings if f.id == "MCV-W040"]
    assert "KV Transfer metrics" in w040.message
    assert "MCV-W041" not in {f.id for f in result.findings}  # no --kv-events-config: nothing to miss


def test_p2p_proxy_command_names_each_prefills_bootstrap_port(tmp_path: Path) -> None:
    """The suggested proxy line carries ``host:port@bootstrap``: the seed sets 50052."""
    from mooncake_vllm.checker import run_check

    script = (serve(multi("kv_producer"), env="MOONCAKE_CONFIG_PATH=m.json VLLM_MOONCAKE_BOOTSTRAP_PORT=50052")
              + serve(multi("kv_producer"), env="MOONCAKE_CONFIG_PATH=m.json")
              + serve(multi("kv_consumer"))
              + "python3 disagg_proxy_demo.py --model m --prefill h1:8100 h2:8101 --decode h3:8200\n")
    (tmp_path / "launch.sh").write_text(script)
    result, _ = run_check([tmp_path], target_vllm="0.24.0", target_mooncake="0.3.13.post1")
    fix = next(f for f in result.findings if f.id == "MCV-E011").fix
    assert "--prefill h1:8100@50052 h2:8101@8998 --decode h3:8200" in fix
    assert "--flow p2p --target-vllm 0.24.0" in fix


def test_the_disk_tier_rules_name_each_launch_without_it(check_ids, tmp_path: Path) -> None:  # noqa: ANN001
    from mooncake_vllm.checker import run_check

    d = tmp_path / "tier"
    d.mkdir()
    (d / "mooncake.json").write_text(json.dumps({**SEG0, "enable_ssd_offload": True}))
    (d / "launch.sh").write_text(serve() + "mooncake-vllm up --segment-size 8GB &\nmooncake_client --port 1 &\n"
                                 + "mooncake-vllm up --ssd /nvme &\n")
    result, _ = run_check([d], target_vllm="0.32.0", target_mooncake="0.3.13.post1")
    fixes = sorted(f.fix for f in result.findings if f.id == "MCV-W021")
    assert len(fixes) == 2 and "--ssd DIR" in fixes[0] and "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH" in fixes[1]
    # a holder flag alone asks for the tier too: too old a Mooncake is an error
    assert "MCV-E016" in check_ids(script="mooncake_client --enable_offload=true &\n", target_mooncake="0.3.10")
