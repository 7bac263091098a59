"""The issue-25 carry: pieces checked and unpacked on the GPU machine, and the V0 -> V1 table.

scripts/gpu/v0_take.sh and carry_tool.py's ``unpack-stream`` run here on real files (a small
archive split into pieces, carried over several "calls"); bench_gpu_ttft.py's ``--summarize-v0``
on the JSON its runs write. The GPU sitting itself is recorded in docs/gpu.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.scripts._load import load_script

ROOT = Path(__file__).resolve().parents[2]
TAKE = ROOT / "scripts" / "gpu" / "v0_take.sh"


sys.path.insert(0, str(ROOT / "scripts" / "gpu"))  # its worker processes import it by name
import carry_tool  # noqa: E402

bench = load_script("bench/bench_gpu_ttft.py")


def _archive(tmp_path: Path) -> tuple[bytes, bytes]:
    payload = os.urandom(300_000)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tf:
        info = tarfile.TarInfo("pkg/data.bin")
        info.size = len(payload)
        tf.addfile(info, io.BytesIO(payload))
    return buf.getvalue(), payload


def _pieces(tmp_path: Path, blob: bytes, size: int) -> list[Path]:
    out = []
    for i in range(0, len(blob), size):
        p = tmp_path / f"g.part.{i // size:02d}"
        p.write_bytes(blob[i:i + size])
        out.append(p)
    return out


def test_unpack_stream_writes_done_only_when_the_whole_archive_matches(tmp_path: Path) -> None:
    blob, payload = _archive(tmp_path)
    parts = [str(p) for p in _pieces(tmp_path, blob, 100_000)]
    dest, done = tmp_path / "site", tmp_path / "site" / ".g-done"
    good = hashlib.sha256(blob).hexdigest()
    assert carry_tool.unpack_stream(str(dest), "0" * 64, str(done), parts) == 1
    assert not done.exists()
    assert carry_tool.unpack_stream(str(dest), good, str(done), parts) == 0
    assert done.exists() and (dest / "pkg" / "data.bin").read_bytes() == payload


def _wheel(path: Path, files: dict[str, tuple[bytes, int]]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, (data, mode) in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            zf.writestr(info, data)
    return path


def test_wheels_travel_in_a_plain_tar_and_install_as_pip_target_would(tmp_path: Path) -> None:
    """Two wheels sharing a namespace folder, a .data/purelib file, an executable kept executable."""
    wheels = tmp_path / "w"
    wheels.mkdir()
    _wheel(wheels / "a-1-py3-none-any.whl", {"ns/__init__.py": (b"", 0o644),
                                             "ns/a/tool": (b"#!/bin/sh\n", 0o755),
                                             "a-1.dist-info/METADATA": (b"Name: a", 0o644)})
    _wheel(wheels / "b-1-py3-none-any.whl", {"ns/__init__.py": (b"", 0o644),
                                             "b-1.data/purelib/ns/b.py": (b"B = 1\n", 0o644),
                                             "b-1.data/headers/x.h": (b"", 0o644)})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(wheels, arcname=".")
    blob = buf.getvalue()
    parts = [str(p) for p in _pieces(tmp_path, blob, 700)]
    site, done = tmp_path / "site", tmp_path / "site" / ".wheels-done"
    assert carry_tool.unpack_stream(str(tmp_path / "unpacked"), hashlib.sha256(blob).hexdigest(),
                                    str(done), parts, str(site)) == 0
    assert done.exists()
    assert (site / "ns" / "b.py").read_text() == "B = 1\n"
    assert os.access(site / "ns" / "a" / "tool", os.X_OK)
    assert (site / "a-1.dist-info" / "METADATA").exists() and not (site / "x.h").exists()


def _carried(repo: Path, blob: bytes) -> None:
    """.carry/v0p00/MANIFEST + one folder per piece, as make_v0_engine_bundle.sh writes them."""
    manifest = [f"archive g.tar.xz {hashlib.sha256(blob).hexdigest()} {len(blob)}"]
    for n, piece in enumerate(_pieces(repo, blob, 120_000), start=1):
        folder = repo / ".carry" / f"v0p{n:02d}"
        folder.mkdir(parents=True)
        piece.rename(folder / piece.name)
        manifest.append(f"piece {folder.name} {piece.name} "
                        f"{hashlib.sha256((folder / piece.name).read_bytes()).hexdigest()}")
    (repo / ".carry" / "v0p00").mkdir()
    (repo / ".carry" / "v0p00" / "MANIFEST").write_text("\n".join(manifest) + "\n")


@pytest.mark.skipif(sys.platform != "linux", reason="bash + setsid")
def test_take_keeps_checked_pieces_over_calls_and_unpacks_once_complete(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    blob, payload = _archive(tmp_path)
    _carried(repo, blob)
    env = {**os.environ, "V0_PARTS": str(tmp_path / "parts"), "V0_SITE": str(tmp_path / "site")}
    held = repo / "held"
    held.mkdir()
    (repo / ".carry" / "v0p02").rename(held / "v0p02")  # this call did not carry piece 2

    def take() -> str:
        run = subprocess.run(["bash", str(TAKE)], cwd=repo, env=env, capture_output=True,
                             text=True, timeout=60)
        return run.stdout

    first = take()
    assert "kept 2 of 3 pieces; missing: 1 (first g.part.01)" in first, first
    # a corrupt piece is refused and named, and nothing unpacks
    corrupt = repo / ".carry" / "v0p02"
    (held / "v0p02").rename(corrupt)
    good = (corrupt / "g.part.01").read_bytes()
    (corrupt / "g.part.01").write_bytes(b"x" + good[1:])
    assert "g.part.01: sha256 MISMATCH" in take()
    assert not (tmp_path / "site" / ".g-done").exists()
    (corrupt / "g.part.01").write_bytes(good)
    assert "kept 3 of 3 pieces; missing: 0" in take()
    for _ in range(100):  # the unpack runs in its own session
        if (tmp_path / "site" / ".g-done").exists():
            break
        subprocess.run(["sleep", "0.1"], check=True)
    assert (tmp_path / "site" / "pkg" / "data.bin").read_bytes() == payload
    assert "done: g" in take()


def _runs(path: Path, runs: list[dict], **extra: object) -> None:
    path.write_text(json.dumps({"runs": runs, "block_size": 16, **extra}))


def test_summarize_v0_compares_each_pool_hit_with_the_in_hbm_hit(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    def run(label: str, ttft: float, tokens: list[int], **kw: object) -> dict:
        return {"label": label, "n": 2048, "ttft_s": ttft, "cached": kw.pop("cached", 0),
                "tokens": tokens, **kw}

    _runs(tmp_path / "v0_A.json", [run("L2048", 0.2, [1, 2]), run("L2048-again", 0.05, [1, 2])])
    _runs(tmp_path / "v0_B.json", [run("L2048", 0.08, [1, 2], ours={"blocks_got": 128})])
    _runs(tmp_path / "v1_C.json", [run("L2048", 0.09, [1, 3], cached=2048),
                                   run("L2048-again", 0.04, [1, 2], cached=2047)])
    bench.summarize_v0(str(tmp_path))
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 2048")]
    assert row == ["| 2048 | 200 | 50 | 80 | 128 / 128 | True / True | 90 | 2048 | 40 | False |"]


def test_ttft_reads_v1_latency_or_v0_timestamps() -> None:
    class V1:
        first_token_latency = 0.123456

    class V0:
        first_token_time, arrival_time = 10.5, 10.25

    assert bench._ttft(V1()) == 0.12346
    assert bench._ttft(V0()) == 0.25
    assert bench._ttft(None) is None
