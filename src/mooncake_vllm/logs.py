"""Our log lines inside a vLLM process: vLLM's handler, format, stream and level.

Every module logs to ``logging.getLogger(__name__)`` (``mooncake_vllm.*``) and the
library installs no handler of its own. vLLM configures only its ``vllm`` logger
(a handler, ``propagate=False``); a logger outside ``vllm.`` would print nothing
below WARNING. So where vLLM loads us (the plugin entry point, each connector),
:func:`follow_vllm_logging` lets the ``mooncake_vllm`` logger use the handlers the
``vllm`` logger has at that moment — the operator's ``VLLM_LOGGING_LEVEL``,
``VLLM_LOGGING_STREAM`` or ``VLLM_LOGGING_CONFIG_PATH`` then apply to our lines too.

It changes nothing when the operator has decided for us:

* the ``mooncake_vllm`` logger already has a handler, a level or ``propagate=False``
  (e.g. a ``"mooncake_vllm"`` entry in the ``VLLM_LOGGING_CONFIG_PATH`` file, or the
  application's own ``dictConfig``): that configuration wins;
* ``VLLM_CONFIGURE_LOGGING=0`` (the ``vllm`` logger has no handler): our records
  propagate to the root logger like any library's.
"""

from __future__ import annotations

import logging

__all__ = ["PACKAGE_LOGGER", "follow_vllm_logging"]

PACKAGE_LOGGER = "mooncake_vllm"
_VLLM_LOGGER = "vllm"


#: the vLLM handlers we attached (so a later call can tell them from the operator's own)
_shared: list[logging.Handler] = []


def follow_vllm_logging() -> bool:
    """Share the ``vllm`` logger's handlers and level with ours; True if this call did.

    Called again after vLLM reconfigured its logging (each engine process does at
    start), it swaps the handlers it attached before for the current ones.
    """
    ours = logging.getLogger(PACKAGE_LOGGER)
    vllm_logger = logging.getLogger(_VLLM_LOGGER)
    ours_by_us = bool(_shared) and ours.handlers == _shared
    configured = ours.handlers or ours.level != logging.NOTSET or not ours.propagate
    if (configured and not ours_by_us) or not vllm_logger.handlers:
        return False
    if ours_by_us and ours.handlers == vllm_logger.handlers and ours.level == vllm_logger.level:
        return False
    for handler in list(ours.handlers):
        ours.removeHandler(handler)
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    _shared[:] = ours.handlers
    ours.setLevel(vllm_logger.level)
    ours.propagate = False  # the shared handler prints each line once
    return True
