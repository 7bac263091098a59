"""Contract tests: real vLLM modules of whatever release this env holds."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "contract: asserts the version table against the installed REAL vLLM")
