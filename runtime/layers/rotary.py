"""Rotary position embeddings: neox (rotate_half) layout, and mRoPE with interleaved (Qwen3-VL) or
blocked (Qwen2-VL) frequency sections."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from xllm_gen.runtime import ops

ROTARY_KINDS = ("neox", "mrope_interleaved", "mrope_blocked")


def mrope_axis_map(kind: str, sections: Sequence[int], half: int) -> torch.Tensor:
    """[half] int32: which position axis (0=t, 1=h, 2=w) drives each frequency slot.

    interleaved (HF Qwen3-VL apply_interleaved_mrope): slot j takes h when j % 3 == 1 and j < 3 * s_h,
    w when j % 3 == 2 and j < 3 * s_w, else t.  blocked (Qwen2-VL): t for the first s_t slots, then h, then w.
    """
    if len(sections) != 3 or sum(sections) != half:
        raise ValueError(f"mrope_section {list(sections)} must have 3 entries summing to head_dim/2 = {half}")
    axis = torch.zeros(half, dtype=torch.int32)
    if kind == "mrope_interleaved":
        for dim, offset in ((1, 1), (2, 2)):
            axis[offset: sections[dim] * 3: 3] = dim
    elif kind == "mrope_blocked":
        axis[sections[0]: sections[0] + sections[1]] = 1
        axis[sections[0] + sections[1]:] = 2
    else:
        raise ValueError(f"not an mrope kind: {kind!r}")
    return axis


_TABLES: dict = {}


def _rope_tables(head_dim: int, theta: float, max_position: int, device: torch.device):
    """(inv_freq [D/2], cos|sin [max_position, D]) in float32, built once per (shape, theta, device) and
    shared by every layer: a 262k-position table is 134 MB, too much to hold once per layer."""
    key = (head_dim, theta, max_position, str(device))
    if key not in _TABLES:
        cpu = _TABLES.get((head_dim, theta, max_position, "cpu"))
        if cpu is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
            freqs = torch.arange(max_position, dtype=torch.float, device="cpu")[:, None] * inv_freq[None, :]
            cpu = _TABLES[(head_dim, theta, max_position, "cpu")] = (inv_freq, torch.cat((freqs.cos(), freqs.sin()), -1))
        _TABLES[key] = tuple(t.to(device) for t in cpu)
    return _TABLES[key]


class Rotary(nn.Module):
    """forward(positions, q [N, H, D], k [N, Hk, D]) -> (q, k).

    positions: [N] for kind "neox", [3, N] (t, h, w) for the mrope kinds. Frequencies follow HF's default
    rope init: inv_freq = 1 / theta ** (arange(0, D, 2) / D) in float32; the CPU path computes cos/sin from
    positions exactly as HF does, the CUDA kernel reads a float32 [max_position, D] cos|sin table.
    The tables are plain attributes (not buffers): they stay float32 whatever the model is cast to, and
    follow the inputs' device on first use.
    """

    def __init__(self, head_dim: int, theta: float, max_position: int, kind: str = "neox",
                 mrope_section: Optional[Sequence[int]] = None):
        super().__init__()
        if kind not in ROTARY_KINDS:
            raise ValueError(f"rotary kind must be one of {ROTARY_KINDS}, not {kind!r}")
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.theta = float(theta)
        self.max_position = max_position
        self.kind = kind
        self.mrope_section = list(mrope_section) if mrope_section is not None else None
        half = head_dim // 2
        self.inv_freq, self.cos_sin_cache = _rope_tables(head_dim, self.theta, max_position, torch.device("cpu"))
        if kind == "neox":
            if mrope_section is not None:
                raise ValueError("mrope_section is only for the mrope kinds")
            self.axis_map = None
        else:
            if mrope_section is None:
                raise ValueError(f"rotary kind {kind!r} needs mrope_section")
            self.axis_map = mrope_axis_map(kind, self.mrope_section, half)

    def _to(self, device: torch.device) -> None:
        if self.inv_freq.device != device:
            self.inv_freq, self.cos_sin_cache = _rope_tables(self.head_dim, self.theta, self.max_position, device)
            if self.axis_map is not None:
                self.axis_map = self.axis_map.to(device)

    def _check_positions(self, positions: torch.Tensor) -> None:
        want = 1 if self.kind == "neox" else 2
        if positions.dim() != want:
            raise ValueError(f"rotary {self.kind!r} expects positions of {want} dims, got {tuple(positions.shape)}")

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        self._check_positions(positions)
        self._to(q.device)
        return ops.rope(q, k, positions, self.inv_freq, self.cos_sin_cache, self.axis_map)

    def extra_repr(self) -> str:
        s = f"head_dim={self.head_dim}, theta={self.theta}, max_position={self.max_position}, kind={self.kind!r}"
        return s + (f", mrope_section={self.mrope_section}" if self.mrope_section else "")


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm, k_norm, rotary: Rotary):
    """Per-head RMSNorm of q [N, H, D] and k [N, Hk, D] (q_norm/k_norm: RMSNorm(head_dim) modules or None),
    then rotary. One fused Triton kernel on CUDA; the HF-exact reference composition on CPU."""
    rotary._check_positions(positions)
    rotary._to(q.device)
    qw = q_norm.weight if q_norm is not None else None
    kw = k_norm.weight if k_norm is not None else None
    eps = q_norm.eps if q_norm is not None else (k_norm.eps if k_norm is not None else 0.0)
    if q_norm is not None and k_norm is not None and q_norm.eps != k_norm.eps:
        q = q_norm(q)
        k = k_norm(k)
        return rotary(positions, q, k)
    return ops.qk_norm_rope(q, k, qw, kw, eps, positions, rotary.inv_freq, rotary.cos_sin_cache, rotary.axis_map)
