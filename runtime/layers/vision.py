"""Vision-tower building blocks (a ViT with 2-D rotary, interpolated learned positions and m x m patch merging),
composed by generated code.

Input layout (what the HF image/video processors produce): `pixel_values [P, C*tp*p*p]`, one row per
patch, rows of each image / video in the order (t, h/m, w/m, m, m) -- i.e. every m x m merge block is 4
consecutive rows ("merge order") -- and each row flattened as (C, tp, p, p). `grid_thw [n, 3]` gives the
patch grid of each item (t = temporal patches, h, w = patches before merging). Attention is bidirectional
within one image or one video *frame* (temporal patch) and never across them.

Parameter names follow the HF checkpoint (`patch_embed.proj.weight`, `pos_embed.weight`,
`blocks.{i}.attn.qkv.*`, `merger.*`, `deepstack_merger_list.{j}.*`), so weight rules are one-to-one.
TP: attention heads are split over ranks when `num_heads % tp == 0` (qkv column-parallel in q/k/v segments,
proj row-parallel), else the block is replicated; the MLP the same with its intermediate size; patch
embedding, position table and mergers are replicated. The layers decide this and load accordingly (each
parameter's `weight_loader`), so a weight plan names only tensors: the checkpoint's fused `attn.qkv` is one
source (q | k | v stacked), split into q/k/v by the attention's qkv loader before sharding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from xllm_gen.runtime import ops
from xllm_gen.runtime.executor.distributed import get_tp_size
from xllm_gen.runtime.layers.activation import GELU
from xllm_gen.runtime.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from xllm_gen.runtime.layers.norm import LayerNorm

GridLike = Union[torch.Tensor, Sequence[Sequence[int]]]


def _grid_list(grid_thw: GridLike) -> list[tuple[int, int, int]]:
    if isinstance(grid_thw, torch.Tensor):
        grid_thw = grid_thw.reshape(-1, 3).tolist()
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw]


def vision_tp_sharded(num_units: int, tp: Optional[int] = None) -> bool:
    """Whether a vision linear pair with `num_units` heads (or intermediate rows) is split over TP ranks."""
    tp = get_tp_size() if tp is None else tp
    return tp > 1 and num_units % tp == 0


# ------------------------------------------------------------------------------------------ metadata
def vision_cu_seqlens(grid_thw: GridLike, device=None) -> torch.Tensor:
    """[segments+1] int32 boundaries of the attention segments: one per image, one per video frame."""
    lens = [h * w for t, h, w in _grid_list(grid_thw) for _ in range(t)]
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if lens:
        out[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).to(torch.int32)
    return out.to(device) if device is not None else out


@dataclass
class VisionSegments:
    """The attention segments of one vision batch (one per image, one per video frame): `bounds` on the host
    (cu_seqlens as a list). With `cu_seqlens` (int32, on the rows' device) set, attention runs as one
    variable-length kernel over those boundaries (`varlen_attention`, what a CUDA graph captures: no host work
    per segment), `max_seqlen` bounding every segment; without it, SDPA per group of equal-length segments."""
    bounds: list
    cu_seqlens: Optional[torch.Tensor] = None
    max_seqlen: int = 0

    @property
    def num_rows(self) -> int:
        return int(self.bounds[-1])


def vision_segments(grid_thw: GridLike) -> VisionSegments:
    return VisionSegments(vision_cu_seqlens(grid_thw).tolist())


@dataclass
class VisionInputs:
    """What a vision tower's rows need besides the pixel rows, all functions of grid_thw: the attention
    segments, the 2-D rotary (cos, sin) [P, head_dim] and the interpolated position embeddings [P, hidden].
    The generated tower computes them in `prepare(grid_thw)`; a CUDA graph of the tower (runtime/executor/
    vision_graphs.py) copies them, padded to its bucket, into its static inputs."""
    segments: VisionSegments
    rotary: tuple
    pos: torch.Tensor


def merge_order_hw(h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) patch coordinates of one frame, listed in merge order (the processor's row order)."""
    hh = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    ww = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    return hh.permute(0, 2, 1, 3).reshape(-1), ww.permute(0, 2, 1, 3).reshape(-1)


# ----------------------------------------------------------------------------------------- embedding
class _ConvWeights(nn.Module):
    """Holds `weight [hidden, C, tp, p, p]` and `bias [hidden]` (the checkpoint's Conv3d `proj`)."""

    def __init__(self, in_channels: int, temporal_patch: int, patch: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, in_channels, temporal_patch, patch, patch))
        self.bias = nn.Parameter(torch.empty(hidden))


class VisionPatchEmbed(nn.Module):
    """Conv3d with stride = kernel over (tp, p, p) patches == one linear over the flattened patch row."""

    def __init__(self, in_channels: int, temporal_patch: int, patch: int, hidden: int):
        super().__init__()
        self.in_channels, self.temporal_patch, self.patch, self.hidden = in_channels, temporal_patch, patch, hidden
        self.patch_dim = in_channels * temporal_patch * patch * patch
        self.proj = _ConvWeights(in_channels, temporal_patch, patch, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [P, C*tp*p*p] -> [P, hidden]"""
        x = pixel_values.reshape(-1, self.patch_dim).to(self.proj.weight.dtype)
        return F.linear(x, self.proj.weight.reshape(self.hidden, self.patch_dim), self.proj.bias)


class VisionPosEmbedInterpolate(nn.Module):
    """Learned square position table (`weight [side*side, hidden]`) bilinearly resampled (align_corners)
    to each frame's h x w patch grid, repeated over t, in merge order (HF `fast_pos_embed_interpolate`)."""

    def __init__(self, num_position_embeddings: int, hidden: int, spatial_merge: int):
        super().__init__()
        side = int(round(num_position_embeddings ** 0.5))
        if side * side != num_position_embeddings:
            raise ValueError(f"num_position_embeddings {num_position_embeddings} is not a square")
        self.side, self.hidden, self.merge = side, hidden, spatial_merge
        self.weight = nn.Parameter(torch.empty(num_position_embeddings, hidden))

    def _taps(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        src = torch.linspace(0, self.side - 1, n, dtype=torch.float32)
        lo = src.floor().long()
        hi = (lo + 1).clamp(max=self.side - 1)
        frac = src - lo.float()
        return lo, hi, frac

    def indices_and_weights(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[h*w, 4] table rows and bilinear weights of one frame, rows in merge order."""
        hl, hh, hf = self._taps(h)
        wl, wh, wf = self._taps(w)
        rows, cols = merge_order_hw(h, w, self.merge)
        r_lo, r_hi, r_f = hl[rows], hh[rows], hf[rows]
        c_lo, c_hi, c_f = wl[cols], wh[cols], wf[cols]
        s = self.side
        idx = torch.stack([r_lo * s + c_lo, r_lo * s + c_hi, r_hi * s + c_lo, r_hi * s + c_hi], dim=1)
        wts = torch.stack([(1 - r_f) * (1 - c_f), (1 - r_f) * c_f, r_f * (1 - c_f), r_f * c_f], dim=1)
        return idx, wts

    def forward(self, grid_thw: GridLike) -> torch.Tensor:
        """-> [sum(t*h*w), hidden] in the dtype of the table."""
        dev = self.weight.device
        out, cache = [], {}
        for t, h, w in _grid_list(grid_thw):
            if (h, w) not in cache:
                idx, wts = self.indices_and_weights(h, w)
                emb = (F.embedding(idx.to(dev), self.weight).float() * wts.to(dev)[..., None]).sum(1)
                cache[(h, w)] = emb.to(self.weight.dtype)
            out.append(cache[(h, w)].repeat(t, 1) if t > 1 else cache[(h, w)])
        if not out:
            return self.weight.new_zeros(0, self.hidden)
        return torch.cat(out, 0)


class VisionRotary2D(nn.Module):
    """Axial 2-D rotary of the vision tower: the first half of the rotated width encodes the patch row,
    the second the column (inv_freq over head_dim/2), in merge order. forward -> (cos, sin) [P, head_dim]."""

    def __init__(self, head_dim: int, theta: float = 10000.0, spatial_merge: int = 2):
        super().__init__()
        self.head_dim, self.theta, self.merge = head_dim, float(theta), spatial_merge
        dim = head_dim // 2
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, grid_thw: GridLike) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.inv_freq.device
        pos = []
        for t, h, w in _grid_list(grid_thw):
            rows, cols = merge_order_hw(h, w, self.merge)
            pos.append(torch.stack([rows, cols], -1).repeat(t, 1))
        if not pos:
            z = torch.zeros(0, self.head_dim, device=dev)
            return z, z
        pos = torch.cat(pos).to(dev)                                   # [P, 2]
        freqs = pos[..., None].float() * self.inv_freq                 # [P, 2, head_dim/4]
        freqs = freqs.flatten(1)                                       # [P, head_dim/2]: rows | cols
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos(), emb.sin()


def apply_vision_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [P, H, D] rotated in float32 (HF `apply_rotary_pos_emb_vision`), returned in x's dtype (the reference)."""
    return ops.reference.vision_rope(x, x, cos, sin)[0]


# ----------------------------------------------------------------------------------------- attention
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float) -> torch.Tensor:
    """Bidirectional attention inside each segment [cu[i], cu[i+1]) as one kernel whose boundaries live on the
    device (empty segments allowed): q/k/v [P, H, D] -> [P, H, D]. CUDA (float16 / bfloat16): the flash
    attention kernel's variable-length form (torch's aten._flash_attention_forward, no host synchronisation,
    capturable in a CUDA graph). Elsewhere: SDPA per segment (reads the boundaries on the host: a reference)."""
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False, scale=scale)[0]
    bounds = cu_seqlens.tolist()
    out = torch.zeros_like(q)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            qt, kt, vt = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out[a:b] = F.scaled_dot_product_attention(qt, kt, vt, scale=scale)[0].transpose(0, 1)
    return out


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens: Union[torch.Tensor, Sequence[int], VisionSegments], scale: float) -> torch.Tensor:
    """Bidirectional attention inside each segment [cu[i], cu[i+1]). q/k/v [P, H, D] -> [P, H, D].

    Segments of equal length (the frames of a video, same-size images) are batched into one SDPA call (a view
    when they are consecutive, as a video's frames are; else a gather). VisionSegments with device boundaries:
    one variable-length kernel (varlen_attention)."""
    if isinstance(cu_seqlens, VisionSegments):
        if cu_seqlens.cu_seqlens is not None:
            return varlen_attention(q, k, v, cu_seqlens.cu_seqlens, cu_seqlens.max_seqlen, scale)
        bounds = list(cu_seqlens.bounds)
    else:
        bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if len(bounds) == 2:                                    # one segment
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        return F.scaled_dot_product_attention(qt, kt, vt, scale=scale)[0].transpose(0, 1)
    n = bounds[1] - bounds[0]
    if n > 0 and bounds[0] == 0 and all(b - a == n for a, b in zip(bounds[:-1], bounds[1:])):
        s = len(bounds) - 1                                 # consecutive equal segments: [s, H, n, D] views
        qs, ks, vs = (x.reshape(s, n, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2).reshape(q.shape)
    out = torch.empty_like(q)
    by_len: dict[int, list[int]] = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            by_len.setdefault(b - a, []).append(a)
    for n, starts in by_len.items():
        idx = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(n, device=q.device)).reshape(-1)
        qs, ks, vs = (x.index_select(0, idx).view(len(starts), n, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)        # [B, H, n, D]
        out.index_copy_(0, idx, o.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return out


class VisionAttention(nn.Module):
    """Fused qkv projection (`qkv`, bias) -> 2-D rotary on q/k -> attention within each image / frame ->
    `proj`. Heads split over TP ranks when divisible, else replicated.

    Loading: `qkv.weight` / `qkv.bias` take the checkpoint's fused tensor whole (shard_id None). Sharded,
    the QKV loader splits it into its q, k, v segments (rows [0, H*D), [H*D, 2*H*D), [2*H*D, 3*H*D)) and
    reads this rank's heads of each; replicated, it is copied as it is."""

    def __init__(self, hidden: int, num_heads: int, head_dim: Optional[int] = None):
        super().__init__()
        head_dim = head_dim or hidden // num_heads
        self.hidden, self.total_num_heads, self.head_dim = hidden, num_heads, head_dim
        self.sharded = vision_tp_sharded(num_heads)
        if self.sharded:
            self.qkv = QKVParallelLinear(hidden, head_dim, num_heads, num_heads, bias=True)
            self.num_heads = self.qkv.num_heads
            self.proj = RowParallelLinear(num_heads * head_dim, hidden, bias=True)
        else:
            self.qkv = ReplicatedLinear(hidden, 3 * num_heads * head_dim, bias=True)
            self.num_heads = num_heads
            self.proj = ReplicatedLinear(num_heads * head_dim, hidden, bias=True)
        self.scale = head_dim ** -0.5

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        P = x.shape[0]
        q, k, v = self.qkv(x).view(P, 3, self.num_heads, self.head_dim).unbind(1)
        cos, sin = rotary
        q, k = ops.vision_rope(q, k, cos, sin)           # CUDA: one fused kernel, in place
        out = segment_attention(q, k, v, cu_seqlens, self.scale)
        return self.proj(out.reshape(P, self.num_heads * self.head_dim))


class VisionMLP(nn.Module):
    """linear_fc1 -> GELU (tanh approximation for `gelu_pytorch_tanh`) -> linear_fc2, both with bias."""

    def __init__(self, hidden: int, intermediate: int, approximate: str = "tanh"):
        super().__init__()
        self.sharded = vision_tp_sharded(intermediate)
        if self.sharded:
            self.linear_fc1 = ColumnParallelLinear(hidden, intermediate, bias=True)
            self.linear_fc2 = RowParallelLinear(intermediate, hidden, bias=True)
        else:
            self.linear_fc1 = ReplicatedLinear(hidden, intermediate, bias=True)
            self.linear_fc2 = ReplicatedLinear(intermediate, hidden, bias=True)
        self.act = GELU(approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(norm1(x)); x + mlp(norm2(x))."""

    def __init__(self, hidden: int, num_heads: int, intermediate: int, eps: float = 1e-6,
                 approximate: str = "tanh"):
        super().__init__()
        self.norm1 = LayerNorm(hidden, eps)
        self.norm2 = LayerNorm(hidden, eps)
        self.attn = VisionAttention(hidden, num_heads)
        self.mlp = VisionMLP(hidden, intermediate, approximate)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor,
                rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, rotary)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """m x m spatial merge (the m*m consecutive rows of a merge block concatenated) + MLP to the text width.

    use_postshuffle_norm=False (the main merger): LayerNorm over `hidden` per patch, then merge.
    use_postshuffle_norm=True (deepstack mergers): merge, then LayerNorm over the merged width.
    Then linear_fc1 -> exact GELU (nn.GELU(), not tanh) -> linear_fc2 -> [P/m^2, out_hidden]."""

    def __init__(self, hidden: int, out_hidden: int, spatial_merge: int, use_postshuffle_norm: bool,
                 eps: float = 1e-6):
        super().__init__()
        self.merged = hidden * spatial_merge * spatial_merge
        self.use_postshuffle_norm = use_postshuffle_norm
        self.norm = LayerNorm(self.merged if use_postshuffle_norm else hidden, eps)
        self.linear_fc1 = ReplicatedLinear(self.merged, self.merged, bias=True)
        self.act = GELU("none")
        self.linear_fc2 = ReplicatedLinear(self.merged, out_hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_postshuffle_norm:
            x = self.norm(x.reshape(-1, self.merged))
        else:
            x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


__all__ = [
    "VisionPatchEmbed", "VisionPosEmbedInterpolate", "VisionRotary2D", "VisionAttention", "VisionMLP",
    "VisionBlock", "PatchMerger", "vision_cu_seqlens", "segment_attention", "apply_vision_rotary",
    "vision_tp_sharded", "merge_order_hw", "VisionSegments", "VisionInputs", "vision_segments", "varlen_attention",
]
