"""Reading launch scripts, env files, JSON configs and directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake_vllm.checker.model import HOLDER, MASTER, METADATA, PIP, PROXY, VLLM
from mooncake_vllm.checker.parse import parse_config_text, parse_shell, read_deployment
from mooncake_vllm.errors import ConfigError


def test_continuations_multiline_quotes_and_prefixes() -> None:
    script = """# comment line
export MOONCAKE_CONFIG_PATH=/etc/mc.json   # trailing comment
SEED=7
export PYTHONHASHSEED=$SEED
CUDA_VISIBLE_DEVICES=1 VLLM_USE_V1=0 \\
  python3 -m vllm.entrypoints.openai.api_server \\
    --model org/model-a --port 8100 -tp 2 \\
    --kv-transfer-config '{
        "kv_connector": "MooncakeStoreConnector",
        "kv_role": "kv_producer"
    }' > log.txt 2>&1 &
"""
    (launch,) = parse_shell(script, "s.sh")
    assert launch.kind == VLLM and launch.model == "org/model-a" and launch.where.line == 5
    assert launch.prefix_env == {"CUDA_VISIBLE_DEVICES": "1", "VLLM_USE_V1": "0"}
    assert launch.env["MOONCAKE_CONFIG_PATH"] == "/etc/mc.json" and launch.env["PYTHONHASHSEED"] == "7"
    assert launch.options["--port"] == "8100" and launch.options["--tensor-parallel-size"] == "2"
    assert launch.kv_config == {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_producer"}
    assert launch.argv[-1] == launch.kv_config_raw and "log.txt" not in launch.argv  # redirections dropped


def test_unexported_variables_do_not_reach_commands() -> None:
    (launch,) = parse_shell("MOONCAKE_CONFIG_PATH=x.json\nvllm serve m\n", "s.sh")
    assert "MOONCAKE_CONFIG_PATH" not in launch.env
    (launch,) = parse_shell("MOONCAKE_CONFIG_PATH=x.json\nexport MOONCAKE_CONFIG_PATH\nvllm serve m\n", "s.sh")
    assert launch.env["MOONCAKE_CONFIG_PATH"] == "x.json"
    (launch,) = parse_shell("export A=1\nunset A\nvllm serve m\n", "s.sh")
    assert "A" not in launch.env


@pytest.mark.parametrize(
    ("line", "kind", "program"),
    [("vllm serve m --port 1", VLLM, "vllm serve"),
     ("nohup env VLLM_USE_V1=1 python3.11 -m vllm.entrypoints.openai.api_server --model m &", VLLM,
      "python -m vllm.entrypoints.openai.api_server"),
     ("sudo -E python -m vllm.entrypoints.cli.main serve m", VLLM, "vllm serve"),
     ("python3 examples/online_serving/disagg_examples/disagg_proxy_demo.py --model m", PROXY, "disagg_proxy_demo.py"),
     ("mooncake-vllm proxy --model m -p a:1 -d b:2", PROXY, "mooncake-vllm proxy"),
     ("mooncake_master --rpc_port=50051", MASTER, "mooncake_master"),
     ("mooncake_client --global_segment_size=1GB", HOLDER, "mooncake_client"),
     ("mooncake-vllm holder --config c.json", HOLDER, "mooncake-vllm holder"),
     ("mooncake_http_metadata_server --port 8080", METADATA, "mooncake_http_metadata_server"),
     ("etcd --listen-client-urls http://127.0.0.1:2379", METADATA, "etcd"),
     ("pip3 install -U mooncake-transfer-engine==0.3.5", PIP, "pip"),
     ("python3 -m pip install mooncake-transfer-engine", PIP, "pip")],
)  # fmt: skip
def test_commands_are_classified(line: str, kind: str, program: str) -> None:
    (launch,) = parse_shell(line + "\n", "s.sh")
    assert (launch.kind, launch.program) == (kind, program)


def test_vllm_in_docker_run() -> None:
    script = """export PYTHONHASHSEED=3
docker run --rm --gpus all -p 8100:8000 -e VLLM_USE_V1=0 --env MOONCAKE_CONFIG_PATH=/cfg/mooncake.json \\
  -e PYTHONHASHSEED -v /srv/cfg:/cfg --ipc=host vllm/vllm-openai:v0.9.2 \\
  --model org/m --kv-transfer-config '{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}'
podman run -d docker.io/library/vllm-cpu:latest vllm serve org/n --port 8200
docker run -d redis:7
"""
    first, second = parse_shell(script, "d.sh")
    assert first.kind == VLLM and first.model == "org/m" and first.kv_config["kv_role"] == "kv_both"
    assert first.env == {"VLLM_USE_V1": "0", "MOONCAKE_CONFIG_PATH": "/cfg/mooncake.json", "PYTHONHASHSEED": "3"}
    assert (second.program, second.model, second.options["--port"]) == ("vllm serve", "org/n", "8200")


def test_other_commands_are_ignored_and_separators_split() -> None:
    launches = parse_shell("cd vllm && vllm serve m; curl -s localhost:8000/v1/models | jq\necho hi\n", "s.sh")
    assert [launch.kind for launch in launches] == [VLLM]


def test_heredoc_bodies_are_skipped() -> None:
    script = "cat > x.sh <<'EOF'\nvllm serve inside\nEOF\nvllm serve outside\n"
    assert [launch.model for launch in parse_shell(script, "s.sh")] == ["outside"]


def test_proxy_multi_value_options() -> None:
    (proxy,) = parse_shell("python3 disagg_proxy_demo.py --model m --prefill a:1 b:2 --decode c:3 --port 8000\n", "s")
    assert proxy.options["--prefill"] == "a:1 b:2" and proxy.options["--decode"] == "c:3"


def test_bad_kv_json_is_kept_for_the_rule() -> None:
    (launch,) = parse_shell("vllm serve m --kv-transfer-config '{kv_connector: 1}'\n", "s.sh")
    assert launch.kv_config is None and "not valid JSON" in (launch.kv_config_error or "")
    (launch,) = parse_shell("vllm serve m --kv-transfer-config '[1]'\n", "s.sh")
    assert "not an object" in (launch.kv_config_error or "")


def test_unterminated_quote_is_an_error() -> None:
    with pytest.raises(ConfigError, match="unterminated ' quote"):
        parse_shell("vllm serve m --kv-transfer-config '{\n", "s.sh")


def test_config_lines_and_shapes() -> None:
    text = '{\n  "local_hostname": "h",\n  "metadata_server": "etcd://h:2379",\n  "global_segment_size": 1\n}'
    cfg = parse_config_text(text, "m.json")
    assert cfg.lines == {"local_hostname": 2, "metadata_server": 3, "global_segment_size": 4}
    assert cfg.shape == "v0" and str(cfg.where("metadata_server")) == "m.json:3"
    assert parse_config_text('{"metadata_server": "x", "global_segment_size": "0"}', "c").shape == "v1"
    assert parse_config_text('{"prefill_url": "a", "decode_url": "b"}', "c").shape == "v0-pipe"


@pytest.mark.parametrize("text", ['{"a": 1}', "[1, 2]", '"metadata_server"', "{,}"])
def test_not_a_mooncake_config(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_config_text(text, "c.json")


def test_directory_walk_env_files_and_filters(tmp_path: Path) -> None:
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "prod.env").write_text("MOONCAKE_CONFIG_PATH=/etc/mc.json\nPYTHONHASHSEED=0\n")
    (tmp_path / "deploy" / "run.sh").write_text("vllm serve m\n")
    (tmp_path / "deploy" / "mooncake_config.json").write_text(json.dumps({"metadata_server": "P2PHANDSHAKE"}))
    (tmp_path / "deploy" / "package.json").write_text("not json at all")  # not a Mooncake file: skipped
    (tmp_path / "deploy" / "notes.md").write_text("vllm serve ignored\n")
    (tmp_path / "deploy" / ".git").mkdir()
    (tmp_path / "deploy" / ".git" / "hook.sh").write_text("vllm serve hidden\n")
    dep = read_deployment([tmp_path / "deploy"])
    (launch,) = dep.launches
    assert launch.env["MOONCAKE_CONFIG_PATH"] == "/etc/mc.json" and launch.env["PYTHONHASHSEED"] == "0"
    assert [Path(c.path).name for c in dep.configs] == ["mooncake_config.json"]
    assert sorted(Path(s).name for s in dep.sources) == ["mooncake_config.json", "prod.env", "run.sh"]


def test_config_linking_by_file_name(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"metadata_server": "P2PHANDSHAKE"}))
    (tmp_path / "b.json").write_text(json.dumps({"metadata_server": "etcd://h:1"}))
    (tmp_path / "run.sh").write_text("MOONCAKE_CONFIG_PATH=./conf/b.json vllm serve m\nvllm serve n\n")
    dep = read_deployment([tmp_path / "a.json", tmp_path / "b.json", tmp_path / "run.sh"])
    first, second = dep.launches
    assert [Path(c.path).name for c in dep.configs_for(first)] == ["b.json"]
    assert len(dep.configs_for(second)) == 2  # no MOONCAKE_CONFIG_PATH: every config may apply


def test_environment_mode_reads_the_config_variable(tmp_path: Path) -> None:
    cfg = tmp_path / "mc.json"
    cfg.write_text(json.dumps({"metadata_server": "P2PHANDSHAKE"}))
    dep = read_deployment([], env={"MOONCAKE_CONFIG_PATH": str(cfg), "VLLM_USE_V1": "0"})
    assert dep.from_environment and dep.launches[0].kind == "environment" and len(dep.configs) == 1
    with pytest.raises(ConfigError) as err:
        read_deployment([], env={"MOONCAKE_CONFIG_PATH": str(tmp_path / "nope.json")})
    assert err.value.fields == ["MOONCAKE_CONFIG_PATH"]
