"""CUDA graphs of the vision tower, one per bucket of patch counts (and of attention-segment slots).

An eager tower call is host-bound where its GPU work is short: about 20 launches per block (close to 600 for a
27-block tower), plus per-segment gathers when a video has several frames. A call of P pixel rows
(n attention segments: one per image, one per video frame) runs in the graph of the smallest bucket B >= P
and the smallest slot count S > n. The tower is generic: it only has to offer `prepare(grid_thw) ->
VisionInputs` (the inputs that depend on the grid alone: segments, 2-D rotary, interpolated positions, computed
eagerly) and `forward(pixel_values, inputs=...)` (everything else; the generated towers do).

Padding, and why it never reaches the real rows: the request's rows are copied into the bucket's static
inputs (pixel rows, position embeddings, rotary cos / sin); rows P..B-1 keep whatever they hold. Attention
runs as one variable-length kernel over device boundaries (runtime/layers/vision.py `varlen_attention`, the
flash kernel's varlen form: no host work per segment, so it is captured with the rest), with the boundaries
[b_0 .. b_n, B, B, ..., B]: the padding rows are one extra segment of their own and the unused slots are
empty segments. One segment exactly as long as a bucket (a 1024 x 1024 image is 4096 patches) has a graph of
its own without padding (slots 1), whose attention is the eager path's SDPA call. Every other op of a tower is row-wise (patch embedding, norms, MLPs) or merges m x m
*consecutive* rows (B and P are multiples of m^2), so the first P / m^2 rows of each output are the
request's, whatever the padding holds. They are copied out of the graph's static outputs (the next call
overwrites them).

Graphs are captured lazily, at the first call of each (bucket, slots) key (the first request of a new size
pays a capture, about three eager calls), and share one memory pool (replays run one at a time). Calls
beyond the largest bucket or slot count run eagerly, and so does every call after a capture failed (logged
once, with the reason). `capture=False` runs the same padded inputs eagerly: the CPU tests' path, and the
graph's exact reference on the GPU (same kernels, so graph == eager bit for bit on the real rows).
"""
from __future__ import annotations

import bisect
import logging
from typing import Optional

import torch

from xllm_gen.runtime.layers.vision import VisionInputs, VisionSegments

logger = logging.getLogger(__name__)

# patch-count buckets (multiples of merge^2; padding rows cost GEMM work, so 256 apart up to 4096 patches, a
# 1024 x 1024 image, then 1024 apart; graphs are captured only for the buckets that calls use)
DEFAULT_VISION_GRAPH_SIZES = tuple(range(256, 4097, 256)) + tuple(range(5120, 16385, 1024))
# attention-segment slots (images + video frames + the padding segment)
DEFAULT_SEGMENT_SLOTS = (2, 4, 8, 16, 32, 64)


class _Bucket:
    """The static inputs / outputs (and graph) of one (rows, slots) key."""

    def __init__(self, rows: int, slots: int, like: VisionInputs, pixels: torch.Tensor):
        dev = pixels.device
        self.rows, self.slots = rows, slots
        self.pixels = torch.zeros(rows, pixels.shape[1], dtype=pixels.dtype, device=dev)
        self.pos = torch.zeros(rows, like.pos.shape[1], dtype=like.pos.dtype, device=dev)
        cos, sin = like.rotary
        self.cos = torch.ones(rows, cos.shape[1], dtype=cos.dtype, device=dev)
        self.sin = torch.zeros(rows, sin.shape[1], dtype=sin.dtype, device=dev)
        if slots == 1:          # one segment filling the bucket: no padding, plain SDPA (the eager kernels)
            self.cu = None
            segments = VisionSegments([0, rows])
        else:
            self.cu = torch.full((slots + 1,), rows, dtype=torch.int32, device=dev)
            self.cu[0] = 0                                    # capture: one padding segment, the rest empty
            segments = VisionSegments([0, rows], self.cu, rows)
        self.inputs = VisionInputs(segments, (self.cos, self.sin), self.pos)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.out = None

    def fill(self, pixels: torch.Tensor, inputs: VisionInputs) -> None:
        p = pixels.shape[0]
        bounds = list(inputs.segments.bounds)
        self.pixels[:p].copy_(pixels)
        self.pos[:p].copy_(inputs.pos)
        self.cos[:p].copy_(inputs.rotary[0])
        self.sin[:p].copy_(inputs.rotary[1])
        if self.cu is None:
            return
        cu = bounds + [self.rows] * (self.slots + 1 - len(bounds))
        self.cu.copy_(torch.tensor(cu, dtype=torch.int32), non_blocking=True)
        self.inputs.segments.bounds = cu                      # (read only by the host reference of varlen)


class VisionGraphs:
    """`__call__(pixel_values, grid_thw) -> the tower's outputs` through the bucket graphs (see the module
    docstring). `tower`: a vision tower with prepare / forward(inputs=); pixel rows in the tower's dtype on
    its device; grid_thw on the host."""

    def __init__(self, tower, sizes=DEFAULT_VISION_GRAPH_SIZES, slots=DEFAULT_SEGMENT_SLOTS, capture: bool = True):
        self.tower = tower
        self.sizes = tuple(sorted(set(int(s) for s in sizes)))
        self.slots = tuple(sorted(set(int(s) for s in slots)))
        if any(s < 1 for s in self.sizes) or any(s < 2 for s in self.slots):
            raise ValueError(f"vision graph sizes must be >= 1 and slots >= 2, got {sizes!r}, {slots!r}")
        self.capture = capture
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.pool = None
        self.disabled: Optional[str] = None         # why graphs are off (a capture failed), else None
        self.replays = 0

    def key(self, rows: int, segments: int) -> Optional[tuple[int, int]]:
        """(bucket rows, slots) for a call of `rows` rows in `segments` segments; None: run eagerly. One segment
        exactly as long as a bucket (a 1024 x 1024 image: 4096 patches) has slots 1: a graph without padding
        whose attention is the eager path's SDPA (on an H200 cuDNN's kernel is faster than the varlen one)."""
        if segments == 1 and rows in self.sizes:
            return rows, 1
        i = bisect.bisect_left(self.sizes, rows)
        j = bisect.bisect_left(self.slots, segments + 1)
        if i == len(self.sizes) or j == len(self.slots):
            return None
        return self.sizes[i], self.slots[j]

    @torch.no_grad()
    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        inputs = self.tower.prepare(grid_thw)
        rows, segs = inputs.segments.num_rows, len(inputs.segments.bounds) - 1
        key = self.key(rows, segs) if self.disabled is None else None
        if key is None:
            return self.tower(pixel_values, inputs=inputs)
        b = self.buckets.get(key)
        if b is None:
            b = _Bucket(key[0], key[1], inputs, pixel_values)
            if self.capture:
                try:
                    self._capture(b)
                except Exception as e:   # noqa: BLE001  (the tower still serves, eagerly)
                    self.disabled = f"{type(e).__name__}: {e}"
                    logger.warning("vision tower CUDA graph capture failed, the tower runs eagerly: %s", self.disabled)
                    torch.cuda.synchronize(pixel_values.device)
                    return self.tower(pixel_values, inputs=inputs)
            self.buckets[key] = b
        b.fill(pixel_values, inputs)
        if b.graph is not None:
            b.graph.replay()
            out = b.out
            self.replays += 1
        else:
            out = self.tower(b.pixels, inputs=b.inputs)
        return _real_rows(out, rows, b.rows)

    def _capture(self, b: _Bucket) -> None:
        stream = torch.cuda.Stream(device=b.pixels.device)
        stream.wait_stream(torch.cuda.current_stream(b.pixels.device))
        with torch.cuda.stream(stream):                      # warm-up: lazy kernel / cuBLAS initialisation
            self.tower(b.pixels, inputs=b.inputs)
        torch.cuda.current_stream(b.pixels.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # captured lazily while serving: other threads' CUDA work must not invalidate the capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self.tower(b.pixels, inputs=b.inputs)
        if self.pool is None:
            self.pool = graph.pool()
        b.graph, b.out = graph, out


def _real_rows(out, rows: int, bucket_rows: int):
    """The request's rows of every output: an output of R rows per B padded rows keeps rows * R / B of them
    (the m x m merges: R = B / m^2). Copies, so the next call cannot overwrite them."""
    def cut(t: torch.Tensor, dim: int) -> torch.Tensor:
        n = t.shape[dim] * rows // bucket_rows
        return t.narrow(dim, 0, n).clone()

    embeds, deepstack = out
    return cut(embeds, 0), cut(deepstack, 1)


__all__ = ["VisionGraphs", "DEFAULT_VISION_GRAPH_SIZES", "DEFAULT_SEGMENT_SLOTS"]
