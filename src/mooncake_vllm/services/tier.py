"""The pool's disk tier for the processes we start: what the master and each holder need.

Mooncake (>= 0.3.11, ``compat`` fact ``ssd_offload``) offloads a value to the disk of the
process whose memory holds it: the master runs with ``--enable_offload=true``; each
holder with ``--enable_offload=true`` (``mooncake_client``) or ``setup(...,
enable_ssd_offload=True, ssd_offload_path=DIR)`` (``mooncake-vllm holder``) and its own
directory. Values are written through at ``PutEnd`` (queued, one offload heartbeat later
on disk); once DRAM is full the master evicts values that are already on disk, so they
stay hits, read from disk through the holder's offload RPC server. Clients need nothing
but ``enable_ssd_offload: true`` in their config (it makes them retry puts that find DRAM
full of values not yet on disk, for about one heartbeat).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from mooncake_vllm.services.process import ServiceError
from mooncake_vllm.store.connect import OFFLOAD_ENV_DEFAULTS

__all__ = ["LEASE_MS", "MARKER", "DiskTier", "holder_env"]

#: the lease of a pool with a disk tier (ms; see DiskTier.master_args)
LEASE_MS = 1000
#: a holder directory we made (and may empty at the next start: the tier is a cache)
MARKER = ".mooncake-vllm-tier"


@dataclass(frozen=True)
class DiskTier:
    """A disk tier of ``size`` bytes under ``root``, split evenly over the holders."""

    root: Path
    size: int

    def __post_init__(self) -> None:
        if self.size < 16 << 20:
            raise ValueError(f"disk tier size: got {self.size} bytes, expected at least 16 MiB")

    @staticmethod
    def master_args() -> list[str]:
        """Flags of the master of a pool with a disk tier. The lease: the master evicts only values
        already on disk and not leased, and a value just put, offloaded or read is leased for
        ``default_kv_lease_ttl`` (10 s from Mooncake 0.3.12): measured on 0.3.13.post1, a full DRAM
        then refused every put for those 10 s (nothing evicted); with 1 s it frees room within
        about one offload heartbeat. A read still in flight after 1 s may find its value evicted:
        a miss (LEASE_EXPIRED), never wrong bytes."""
        return ["--enable_offload=true", f"--default_kv_lease_ttl={LEASE_MS}"]

    def holder_dir(self, name: str) -> Path:
        """Holder ``name``'s own directory, emptied (it is a cache; only a directory we marked
        is touched: an unmarked non-empty one is refused)."""
        path = Path(self.root).resolve() / name
        if path.is_dir() and any(path.iterdir()) and not (path / MARKER).exists():
            raise ServiceError(f"disk tier: {path} is not empty and not one of ours (no {MARKER}); "
                               f"give --ssd an empty or new directory")
        if path.is_dir():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        (path / MARKER).write_text("mooncake-vllm disk tier of one holder; emptied at its next start\n")
        return path


def holder_env(path: str | os.PathLike[str], share: int) -> dict[str, str]:
    """Environment of a holder offloading to ``path`` with ``share`` bytes of disk (the user's
    own MOONCAKE_OFFLOAD_* settings win, except the directory)."""
    env = {**OFFLOAD_ENV_DEFAULTS, "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(share)}
    env = {k: os.environ.get(k, v) for k, v in env.items()}
    env["MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"] = os.fspath(path)
    return env
