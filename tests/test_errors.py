"""Every exception lives in ``errors.py`` and subclasses a builtin (docs/DESIGN.md)."""

from __future__ import annotations

import builtins
import inspect

import pytest

from mooncake_vllm import errors
from tests.package_modules import import_or_skip, module_names

_GENERIC = (BaseException, Exception)
_BUILTIN = {c for c in vars(builtins).values() if isinstance(c, type) and issubclass(c, BaseException)}


@pytest.mark.parametrize("name", module_names())
def test_public_exceptions_are_defined_in_errors(name: str) -> None:
    module = import_or_skip(name)
    if module is errors:
        return
    defined = [f"{name}.{n}" for n, obj in vars(module).items()
               if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name
               and not n.startswith("_")]
    assert not defined, f"exceptions outside mooncake_vllm/errors.py: {defined}; move them there"


@pytest.mark.parametrize("name", [n for n in errors.__all__ if issubclass(getattr(errors, n), BaseException)])
def test_each_exception_subclasses_a_specific_builtin(name: str) -> None:
    cls = getattr(errors, name)
    bases = [c for c in cls.__mro__[1:] if c in _BUILTIN and c not in _GENERIC]
    assert bases, f"errors.{name} subclasses no builtin but Exception; pick the one callers catch"


def test_every_exception_is_exported() -> None:
    defined = {n for n, obj in vars(errors).items()
               if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__}
    assert defined <= set(errors.__all__), f"not in errors.__all__: {defined - set(errors.__all__)}"
