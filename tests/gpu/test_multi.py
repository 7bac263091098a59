"""Issue 26 on a CUDA GPU (skipped without one): the seed's MultiConnector(MooncakeConnector +
MooncakeStoreConnector) XpYd through ``mooncake-vllm proxy --flow p2p``.

A small random bf16 Llama; bench/bench_gpu_multi.py's ``single`` and ``p2p_store`` modes
against the running pool of scripts/gpu/mc_up.sh (``$MOONCAKE_CONFIG_PATH``): the answers
equal a single instance's, the decode's prompt KV comes by P2P (vLLM counts external hits,
ours loads nothing there), ours saves it through the MultiConnector on the prefill, and a
fresh instance with the plain seed JSON gets the prompts from the pool. The prompt is 125
blocks of 16 plus one token: the P2P decode, the prefix hit and the pool load all compute
only its last token, so the bf16 answers compare (bench_gpu_multi's docstring). The 8B-class TTFT
and ITL comparison is the bench itself (scripts/gpu/multi.sh).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - CI has no GPU
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_gpu_multi import main as bench  # noqa: E402
from tests.gpu.test_engine import _model  # noqa: E402


def test_seed_multiconnector_xpyd_through_the_proxy(tmp_path: Path) -> None:
    if not Path(os.environ.get("MOONCAKE_CONFIG_PATH", "/tmp/mc/config.json")).exists():
        pytest.skip("needs the pool of scripts/gpu/mc_up.sh")
    model = _model(tmp_path / "model")
    out = tmp_path / "multi.json"
    rc = bench(["--model", str(model), "--modes", "single,p2p_store", "--lengths", "2001",
                "--per-length", "2", "--max-tokens", "16", "--gpu-util", "0.2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0, result["errors"]
    run = result["modes"]["p2p_store"]
    assert run["equal_to_single"], run["mismatches"]
    assert run["decode_external_hit_tokens"] > 0  # the decode did not compute the prompt...
    assert not run["decode_ours_loaded_blocks"]  # ...and ours loaded none of it: it came by P2P
    assert run["prefill_ours_saved_blocks"] > 0  # ours saved it, inside the MultiConnector
    third = run["third"]
    assert third["equal_to_single"]
    assert third["third_external_hit_tokens"] >= 0.9 * third["full_block_tokens"]
