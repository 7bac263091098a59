"""The end-to-end demo and its offline tiny model (``tiny_model.build_tiny_model``)."""

from __future__ import annotations

__all__: list[str] = []
