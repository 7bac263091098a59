"""docs/configuration.md's key table is generated from settings.KEYS (scripts/config_doc.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncake_vllm.settings import KEYS
from tests.scripts._load import load_script

ROOT = Path(__file__).resolve().parents[2]
doc = load_script("scripts/config_doc.py")


def test_the_page_is_up_to_date() -> None:
    page = doc.PAGE.read_text()
    assert doc.rewrite(page) == page, "docs/configuration.md is stale: run `python scripts/config_doc.py`"
    assert doc.main(["--check"]) == 0


def test_every_key_has_one_row_with_its_default_and_doc() -> None:
    rows = [line for line in doc.render().splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == [k.name for k in KEYS]
    assert all(k.doc in r and k.shown_default() in r for k, r in zip(KEYS, rows))


def test_a_stale_page_is_found_and_rewritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "configuration.md"
    fresh = doc.PAGE.read_text()
    stale.write_text(fresh.replace("| `gpu_path` |", "| `gpu_pathh` |"))
    monkeypatch.setattr(doc, "PAGE", stale)
    assert doc.main(["--check"]) == 1 and "run `python scripts/config_doc.py`" in capsys.readouterr().err
    assert doc.main([]) == 0 and stale.read_text() == fresh


def test_a_page_without_the_block_is_refused() -> None:
    with pytest.raises(SystemExit, match="no generated block"):
        doc.rewrite("# Configuration reference\n")
