"""Shared deployment snippets for the checker tests (imported by name: tests/checker is on sys.path)."""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent / "data"

#: a valid V0-shaped Mooncake config on loopback
CONFIG = {"local_hostname": "127.0.0.1", "metadata_server": "http://127.0.0.1:8080/metadata",
          "master_server_address": "127.0.0.1:50051", "global_segment_size": 1073741824,
          "local_buffer_size": 1073741824, "protocol": "tcp", "device_name": ""}
STORE = '{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}'
OURS = ('{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both",'
        '"kv_connector_module_path":"mooncake_vllm.compat.facade"}')


def serve(kv: str | None = STORE, *, env: str = "MOONCAKE_CONFIG_PATH=mooncake.json", extra: str = "") -> str:
    """One ``vllm serve`` line."""
    cfg = f" --kv-transfer-config '{kv}'" if kv is not None else ""
    return f"{env} vllm serve m {extra}{cfg} &\n".lstrip()


def multi(role: str) -> str:
    """The seed's MultiConnector(MooncakeConnector + MooncakeStoreConnector) kv-transfer-config."""
    children = [{"kv_connector": "MooncakeConnector", "kv_role": role},
                {"kv_connector": "MooncakeStoreConnector", "kv_role": role}]
    return json.dumps({"kv_connector": "MultiConnector", "kv_role": role,
                       "kv_connector_extra_config": {"connectors": children}})


