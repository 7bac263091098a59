"""Run in a FRESH interpreter of a real vLLM env: register through vLLM's own plugin
loader, then resolve the seed's JSON through that release's real factory and
KVTransferConfig. Prints one JSON object (read by test_contract.py).

Usage: python probe_registration.py '<seed json>'   (MOONCAKE_CONFIG_PATH must be set)

With ``MOONCAKE_VLLM_DISABLE=1`` it probes the opt-out instead: the registry is
left alone, the plain name resolves to vLLM's own class, and
``kv_connector_module_path`` selects ours explicitly where the release honours it.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import traceback
from types import SimpleNamespace
from typing import Any

SEED = sys.argv[1] if len(sys.argv) > 1 else '{"kv_connector":"MooncakeStoreConnector","kv_role":"kv_both"}'
NAME = "MooncakeStoreConnector"
out: dict[str, Any] = {}

log_buffer = io.StringIO()


def _capture_our_log() -> None:
    """After ``import vllm``: a handler of our own on the package logger (register() leaves it)."""
    logger = logging.getLogger("mooncake_vllm")
    logger.addHandler(logging.StreamHandler(log_buffer))
    logger.setLevel(logging.INFO)


def _loader_target(loader: Any) -> list[str]:
    """(module_path, class_name) captured by vLLM's register_connector loader closure."""
    cells = [c.cell_contents for c in (loader.__closure__ or ()) if isinstance(c.cell_contents, str)]
    return sorted(cells)


def _describe(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _error(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc),
            "where": traceback.extract_tb(exc.__traceback__)[-1].filename}


def _cfg(ktc: Any, block_size: int = 16) -> Any:
    """A config with the parts both our connectors read (model facts for the V1 key namespace)."""
    import torch

    model = SimpleNamespace(model="/models/tiny-llama", dtype=torch.float32, use_mla=False,
                            get_head_size=lambda: 32, get_num_kv_heads=lambda _p: 2,
                            get_total_num_hidden_layers=lambda: 2)
    return SimpleNamespace(kv_transfer_config=ktc, model_config=model,
                           cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                                           data_parallel_size=1, data_parallel_rank=0),
                           scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True))


def _parse_cli(seed: str) -> Any:
    """The seed's JSON through vLLM's own --kv-transfer-config parsing."""
    from vllm.engine.arg_utils import EngineArgs

    parser_cls = None
    for where in ("vllm.utils.argparse_utils", "vllm.utils"):
        try:
            parser_cls = __import__(where, fromlist=["FlexibleArgumentParser"]).FlexibleArgumentParser
            break
        except (ImportError, AttributeError):
            continue
    parser = EngineArgs.add_cli_args(parser_cls())
    args = parser.parse_args(["--kv-transfer-config", seed])
    return EngineArgs.from_cli_args(args).kv_transfer_config


def disabled(F: Any, facts: Any) -> None:
    """The opt-out: what the plain name and the explicit module path resolve to."""
    from vllm.config import KVTransferConfig

    if NAME in F._registry:
        out["plain"] = _loader_target(F._registry[NAME])
    if hasattr(F, "get_connector_class"):
        ktc = KVTransferConfig(kv_connector=NAME, kv_role="kv_both",
                               kv_connector_module_path="mooncake_vllm.compat.facade")
        try:
            out["module_path"] = {"class": _describe(F.get_connector_class(ktc))}
        except Exception as exc:  # noqa: BLE001
            out["module_path"] = {"error": _error(exc)}


def main() -> None:
    from mooncake_vllm.compat import installed_vllm, vllm_facts

    version = installed_vllm().version
    facts = vllm_facts(version)
    out["vllm"] = version
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F

    _capture_our_log()

    out["before"] = _loader_target(F._registry[NAME]) if NAME in F._registry else None
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    loader = F._registry.get(NAME)
    out["after"] = _loader_target(loader) if loader else None
    from mooncake_vllm.compat.registration import register

    register()
    register()
    out["idempotent"] = F._registry.get(NAME) is loader
    out["log"] = log_buffer.getvalue().splitlines()
    if os.environ.get("MOONCAKE_VLLM_DISABLE") == "1":
        disabled(F, facts)
        return

    try:
        ktc = _parse_cli(SEED)
        out["cli"] = {"type": _describe(type(ktc)), "kv_connector": ktc.kv_connector, "kv_role": ktc.kv_role}
    except Exception as exc:  # noqa: BLE001 - recorded, asserted by the test
        out["cli"] = {"error": _error(exc)}
        from vllm.config import KVTransferConfig

        ktc = KVTransferConfig(**json.loads(SEED))

    engines: dict[str, Any] = {}
    if facts.v1_kv_connectors:
        os.environ["VLLM_USE_V1"] = "1"
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

            if hasattr(F, "create_connector_v1"):
                conn = F.create_connector_v1(_cfg(ktc), KVConnectorRole.WORKER)
                cls = type(conn)
            else:
                cls = F.get_connector_class(ktc)
                conn = cls(_cfg(ktc), KVConnectorRole.WORKER, None)
            engines["v1"] = {"class": _describe(cls), "instance": isinstance(conn, cls)}
            if getattr(conn, "shared", None) is not None:
                conn.shared.close()
        except Exception as exc:  # noqa: BLE001
            engines["v1"] = {"error": _error(exc)}
    if facts.v0_kv_connectors:
        os.environ["VLLM_USE_V1"] = "0"
        try:
            create = getattr(F, "create_connector_v0", None) or F.create_connector
            conn = create(0, 0, _cfg(ktc))
            engines["v0"] = {"class": _describe(type(conn))}
            conn.close()
        except Exception as exc:  # noqa: BLE001
            engines["v0"] = {"error": _error(exc)}
    else:  # a release without V0: asking for it must be one clear error
        os.environ["VLLM_USE_V1"] = "0"
        try:
            F._registry[NAME]()
            engines["v0"] = {"error": None}
        except Exception as exc:  # noqa: BLE001
            engines["v0"] = {"error": _error(exc)}
    os.environ.pop("VLLM_USE_V1", None)
    out["engines"] = engines


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:  # noqa: BLE001
        out["fatal"] = _error(exc)
        out["traceback"] = traceback.format_exc()
    print("PROBE-JSON " + json.dumps(out))
