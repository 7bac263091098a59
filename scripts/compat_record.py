"""The vocabulary of docs/compatibility.json that recording (``compat_table.py``) and
rendering (``compat_render.py``) share: the levels, the markers, the facts columns."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

from mooncake_vllm.compat.versions import vllm_facts  # noqa: E402

__all__ = ["COMMAND", "LEVELS", "MARKERS", "REPO", "UNVERIFIED", "facts_summary"]

COMMAND = "python scripts/compat_table.py"
#: Level -> what a run at that level shows; strongest first (see the module docstring).
LEVELS = {
    "gpu": "ran on a CUDA GPU, and a `gpu` or `vllm` test ran there",
    "e2e": "a `vllm` test ran: the real V1 engine served requests through a real Mooncake pool",
    "contract": "a `contract` test ran and no `vllm` test did: the real release's modules (base "
                "classes, factory, KVTransferConfig, facade; `v0` tests where the release has V0) "
                "without the engine",
    "unit": "none of the above ran",
    "blocked": "the release cannot run here: its env could not be built; the record keeps the "
               "builder's exact error (scripts/compat_blocked.py)",
}
MARKERS = ("vllm", "contract", "gpu", "v0")
UNVERIFIED = "unverified (recorded before provenance)"


def facts_summary(version: str) -> dict[str, Any]:
    """The facts-table columns of one release: KV-connector engine paths and our claim per path."""
    f = vllm_facts(version, strict=False)
    paths = [p for p, on in (("V0", f.v0_kv_connectors), ("V1", f.v1_kv_connectors)) if on]
    name = {"free": "name free", "taken": "in-tree name taken"}
    claims = {p: f"{getattr(f, p.lower() + '_claim')} ({name[getattr(f, p.lower() + '_name')]})" for p in paths}
    if "V1" in paths and not getattr(f, "our_v1_connector", True):
        claims["V1"] = "none: our V1 connector refuses this V1 API (needs vLLM >= 0.9.0)"
    return {"paths": paths, "claims": claims}
