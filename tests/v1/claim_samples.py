"""Made-up measurements and a fake clock for the claim policy's tests."""

from __future__ import annotations

__all__ = ["BS", "Clock", "loads", "prefill_steps"]

BS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def prefill_steps(c0: float = 0.01, c1: float = 2e-5,
                  c2: float = 1e-9) -> list[tuple[float, float, float, float]]:
    """Steps of a GPU-like engine: one request prefilling ``m`` tokens from position ``p``."""
    out = []
    for p, m in [(0, 2048), (0, 8192), (2048, 2048), (0, 512), (8192, 8192), (0, 4096),
                 (16384, 16384)]:
        work = m * (p + m / 2)
        out.append((float(m), work, float(p + m), c0 + c1 * m + c2 * work))
    out.append((1.0, 5000.0, 5000.0, c0))  # a decode step: the fixed cost, not a prefill sample
    return out


def loads(rate: float, l0: float = 0.005) -> list[tuple[float, float]]:
    return [(float(t), l0 + t / rate) for t in (512, 2048, 8192, 16384)]
