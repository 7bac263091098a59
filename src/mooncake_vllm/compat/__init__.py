"""The only place that knows vLLM and Mooncake versions.

``facts_table`` holds the facts as data, ``versions`` folds them per release,
``detect`` reads installed versions from package metadata, ``facts.installed_facts``
is the installed vLLM's facts (cached). Importing this package never imports
``vllm`` or ``mooncake`` (the ``vllm.general_plugins`` entry point loads
``compat.registration`` through it inside every vLLM process).
"""

from __future__ import annotations

from mooncake_vllm.compat.detect import (
    InstalledDistribution,
    check_mooncake_for_vllm,
    detect_engine,
    installed_mooncake,
    installed_vllm,
)
from mooncake_vllm.compat.facts import installed_facts
from mooncake_vllm.compat.facts_table import (
    KNOWN_MOONCAKE_RELEASES,
    KNOWN_VLLM_RELEASES,
    LAST_V0_RELEASE,
    MIN_SUPPORTED_VLLM,
)
from mooncake_vllm.compat.versions import (
    MooncakeFacts,
    VllmFacts,
    mooncake_facts,
    pep440_version,
    vllm_facts,
)

__all__ = [
    "KNOWN_MOONCAKE_RELEASES",
    "KNOWN_VLLM_RELEASES",
    "LAST_V0_RELEASE",
    "MIN_SUPPORTED_VLLM",
    "InstalledDistribution",
    "MooncakeFacts",
    "VllmFacts",
    "check_mooncake_for_vllm",
    "detect_engine",
    "installed_facts",
    "installed_mooncake",
    "installed_vllm",
    "mooncake_facts",
    "pep440_version",
    "vllm_facts",
]
