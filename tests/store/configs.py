"""Mooncake client configs the store tests write (a pure client of a given master)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["client_config"]


def client_config(tmp_path: Path, master: str, metadata: str) -> Path:
    """A V0-shape ``mooncake.json`` in ``tmp_path``: a pure client (no segment) over TCP."""
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"metadata_server": metadata, "master_server_address": master,
                                "global_segment_size": "0", "local_buffer_size": "16MB",
                                "protocol": "tcp", "device_name": ""}))
    return path
