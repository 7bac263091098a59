"""Our lines in a REAL vLLM process: vLLM's handler and format, no handler of our own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

_SCRIPT = textwrap.dedent("""
    import json, logging, sys
    import vllm.logger
    try:  # vLLM >= 0.32 configures logging per process from a LoggingConfig (as `vllm serve` does)
        from vllm.config.logging import LoggingConfig
        vllm.logger.configure_logging(LoggingConfig())
    except ImportError:  # older releases configure it when vllm.logger is imported
        pass
    import mooncake_vllm.v1, mooncake_vllm.keys, mooncake_vllm.config  # importing adds nothing
    ours = logging.getLogger("mooncake_vllm")
    before = len(ours.handlers)
    if sys.argv[1] == "user":  # the operator configured our logger (dictConfig / logging config file)
        ours.addHandler(logging.StreamHandler(sys.stdout)); ours.setLevel(logging.INFO)
    from mooncake_vllm.logs import follow_vllm_logging
    did = follow_vllm_logging()
    follow_vllm_logging()  # idempotent
    logging.getLogger("mooncake_vllm.v1.connector").info("hello from the connector")
    vllm_handlers = logging.getLogger("vllm").handlers
    print(json.dumps({"before": before, "did": did, "count": len(ours.handlers),
                      "shared": bool(ours.handlers) and ours.handlers[0] in vllm_handlers}))
""")


#: the runs the tests read: (mode, extra environment)
_RUNS = {"default": ("default", {}), "user": ("user", {}),
         "not-configured": ("default", {"VLLM_CONFIGURE_LOGGING": "0"})}


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, tuple[dict, str]]]:
    """Every run of _RUNS, side by side (each imports vLLM: ~10 s of one core): its state, its output."""
    procs = {name: subprocess.Popen([sys.executable, "-c", _SCRIPT, mode], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stderr", **env})
             for name, (mode, env) in _RUNS.items()}
    try:
        out = {}
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{name}: rc {proc.returncode}\n{stderr[-3000:]}"
            out[name] = (json.loads(stdout.strip().splitlines()[-1]), stderr + stdout)
        yield out
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_info_lines_show_in_vllms_format_without_a_handler_of_ours(runs: dict[str, tuple[dict, str]]) -> None:
    state, out = runs["default"]
    assert state == {"before": 0, "did": True, "count": 1, "shared": True}
    line = next(ln for ln in out.splitlines() if "hello from the connector" in ln)
    assert "INFO" in line and line != "hello from the connector"  # vLLM's format, not a bare message
    assert out.count("hello from the connector") == 1  # printed once, not twice


def test_operator_configuration_wins(runs: dict[str, tuple[dict, str]]) -> None:
    state, out = runs["user"]
    assert state["did"] is False and not state["shared"]
    assert out.count("hello from the connector") == 1
    state, out = runs["not-configured"]
    assert state == {"before": 0, "did": False, "count": 0, "shared": False}
