"""bench/soak.py, short: the pool's fleet on simulated hosts (network namespaces), two faults.

CI's soak: master, embedded metadata and two holders each in its own namespace on our
subnet (10.231.7.0/24, names ``mvsoak-*``), two pool clients checking every loaded block
byte for byte against its reference, a holder SIGKILLed and restarted, then a holder's
link cut for 5 s. Nothing wrong, nothing failed, the hit rate back within 30 s of each
fault, the dead holder's misses counted by cause. About 70 s; the vLLM fleet (two
kv_both instances behind the proxy, a 1P1D pair, nine faults, 15 minutes) is the bench
(``bench/soak.py``), not CI.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # soak.py's neighbours import each other by name
_spec = importlib.util.spec_from_file_location("soak", ROOT / "bench" / "soak.py")
assert _spec is not None and _spec.loader is not None
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_schedule_spreads_every_fault_after_warmup_and_leaves_time_to_recover() -> None:
    from soak_faults import schedule

    faults = schedule(["holder_kill", "link_down"], 120, 30, repeat=2, settle=20)
    assert [f.kind for f in faults] == ["holder_kill", "link_down"] * 2
    assert faults[0].at == 30 and faults[-1].at < 120 - 20
    with pytest.raises(ValueError, match="unknown fault kinds"):
        schedule(["meteor"], 60, 10)


def test_recovery_is_the_time_back_to_80_percent_of_the_pre_fault_rate() -> None:
    from soak_report import recovery

    series = [(float(t), 1.0 if t < 10 or t >= 17 else 0.2) for t in range(30)]
    assert recovery(series, 10.0, 12.0) == {"pre": 1.0, "low": 0.2, "recovery_s": 5.0, "met": True}
    assert recovery([(float(t), 1.0) for t in range(30)], 10.0, 12.0)["recovery_s"] == 0.0


def test_short_soak_in_namespaces(tmp_path: Path) -> None:
    result = soak.run(tmp_path, seconds=50, clients=2, kinds=["holder_kill", "link_down"],
                      warmup=15, segment_size=32 << 20)
    rows = {f["kind"]: f for f in result["faults"]}
    summary = {k: result[k] for k in ("hosts", "requests", "wrong", "failed", "failures")}
    assert result["requests"] > 100 and result["wrong"] == 0 and result["failed"] == 0, summary
    assert set(rows) == {"holder_kill", "link_down"} and not any(f["error"] for f in rows.values()), rows
    for f in rows.values():
        assert f["met"], f"{f['kind']}: hit rate not back to 80 % within 30 s: {f}"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0:
        assert result["hosts"] == "namespaces"
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "mvsoak-" not in left  # cleaned up
