"""Launch sizing shared by the Triton kernels of ops/ (warps per block width)."""
from __future__ import annotations


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))
