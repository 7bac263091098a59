"""Mooncake's return codes by name, what each means, and the one way we call the binding."""

from __future__ import annotations

import pytest

from mooncake_vllm.store.codes import Code, call, describe, is_fatal


def test_describe_names_the_code_and_says_the_fix() -> None:
    assert describe(-200).startswith("NO_AVAILABLE_HANDLE (-200): the pool is full")
    assert "global_segment_size" in describe(Code.NO_AVAILABLE_HANDLE)
    assert describe(-705) == "OBJECT_ALREADY_EXISTS (-705)"  # no cause to add
    assert describe(-12345) == "code -12345"


@pytest.mark.parametrize("code", list(Code))
def test_only_a_master_away_is_fatal(code: Code) -> None:
    assert is_fatal(code) is (code in (Code.INTERNAL_ERROR, Code.RPC_FAIL, Code.RPC_TIMEOUT))


def test_call_returns_what_the_binding_raises_instead_of_raising() -> None:
    assert call(lambda a, b: a + b, 2, 3) == 5

    def broken() -> None:
        raise RuntimeError("pybind said no")

    exc = call(broken)
    assert isinstance(exc, RuntimeError) and str(exc) == "pybind said no"
