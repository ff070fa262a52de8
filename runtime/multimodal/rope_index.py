"""3-row (temporal, height, width) mRoPE position ids of one request with image / video grids (transformers'
`get_rope_index` of vision-language models with timestamped video frame blocks).

Standalone (torch only). The prompt's token ids are already expanded: every image is a run of
`t*h*w/merge^2` image tokens, every video is split per temporal patch, each frame block being
`<timestamp text><vision_start> (h*w/merge^2 video tokens) <vision_end>` (HF >= 5 inserts the timestamps in
front of each frame block; the tokens between blocks are text). HF's algorithm:

- videos are split into one grid per temporal patch (`t` grids of `t=1`), in order;
- the prompt is cut into runs of equal token type (text 0, image 1, video 2);
- a text run of length n continues at `current` with `current + arange(n)` on all 3 rows;
- a visual run takes the next grid of its kind: rows are (current + t_index, current + h_index,
  current + w_index) over the merged grid (t_index is 0 for a video frame block), and `current`
  advances by max(h, w) / merge (not by t);
- delta = max(position) + 1 - L.
Items placed back to back (no text between them) form one run in HF, whose get_rope_index then fails; here
such a run is consumed grid by grid, as if the items were separated. In decode, the token at sequence position p has position p + delta on
  all 3 rows.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2

GridLike = Union[torch.Tensor, Sequence[Sequence[int]], None]


def _grids(grid: GridLike) -> list[tuple[int, int, int]]:
    if grid is None:
        return []
    if isinstance(grid, torch.Tensor):
        grid = grid.reshape(-1, 3).tolist()
    return [tuple(int(v) for v in g) for g in grid]


def _runs(types: torch.Tensor) -> list[tuple[int, int, int]]:
    """(type, start, end) of each run of equal values, like itertools.groupby."""
    n = types.numel()
    if n == 0:
        return []
    change = torch.nonzero(types[1:] != types[:-1]).flatten() + 1
    bounds = [0] + change.tolist() + [n]
    vals = types[bounds[:-1]].tolist()
    return [(vals[i], bounds[i], bounds[i + 1]) for i in range(len(vals))]


def get_rope_index(
    input_ids: Union[torch.Tensor, Sequence[int]],
    image_grid_thw: GridLike,
    video_grid_thw: GridLike,
    spatial_merge_size: int,
    image_token_id: int,
    video_token_id: int,
) -> tuple[torch.Tensor, int]:
    """-> (positions [3, L] int64, mrope_position_delta int) for one request.

    Raises ValueError when the visual token runs do not match the grids (count or length)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).flatten().cpu()
    L = ids.numel()
    types = torch.zeros(L, dtype=torch.long)
    types[ids == image_token_id] = IMAGE
    types[ids == video_token_id] = VIDEO

    m = int(spatial_merge_size)
    queues = {IMAGE: _grids(image_grid_thw), VIDEO: []}
    for t, h, w in _grids(video_grid_thw):          # one grid per temporal patch, like HF
        queues[VIDEO].extend([(1, h, w)] * t)
    used = {IMAGE: 0, VIDEO: 0}

    pieces = []
    current = 0
    for kind, start, end in _runs(types):
        n = end - start
        if kind == TEXT:
            pieces.append(torch.arange(current, current + n).expand(3, -1))
            current += n
            continue
        name = "image" if kind == IMAGE else "video frame"
        while n > 0:                  # items placed back to back form one run: take grids until it is used up
            if used[kind] >= len(queues[kind]):
                raise ValueError(f"more {name} placeholder tokens in the prompt than the {name} grids "
                                 f"({len(queues[kind])}) account for")
            t, h, w = queues[kind][used[kind]]
            used[kind] += 1
            gt, gh, gw = t, h // m, w // m
            if gt * gh * gw > n:
                raise ValueError(f"{name} {used[kind] - 1}: grid {(t, h, w)} needs {gt * gh * gw} tokens, "
                                 f"the prompt has a run of {n}")
            tt = torch.arange(gt).view(-1, 1, 1).expand(gt, gh, gw)
            hh = torch.arange(gh).view(1, -1, 1).expand(gt, gh, gw)
            ww = torch.arange(gw).view(1, 1, -1).expand(gt, gh, gw)
            pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + current)
            current += max(h, w) // m
            n -= gt * gh * gw
    for kind, name in ((IMAGE, "image"), (VIDEO, "video frame")):
        if used[kind] != len(queues[kind]):
            raise ValueError(f"{len(queues[kind])} {name} grids but {used[kind]} {name} placeholder runs "
                             f"in the prompt")

    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long), 0
    positions = torch.cat(pieces, dim=1).to(torch.long).contiguous()
    delta = int(positions.max()) + 1 - L
    return positions, delta


def text_positions(length: int, start: int = 0) -> torch.Tensor:
    """[3, length]: a text-only request on an mRoPE model (3 equal rows, delta 0)."""
    return torch.arange(start, start + length, dtype=torch.long).expand(3, -1).contiguous()


def request_positions(prompt_positions: torch.Tensor, delta: int, start: int, end: int) -> torch.Tensor:
    """[R, end - start] positions of a request's tokens start..end-1: the prompt's columns of
    `prompt_positions` [R, L] (from get_rope_index), then p + delta on every row for generated tokens."""
    prompt_len = prompt_positions.shape[1]
    parts = []
    if start < prompt_len:
        parts.append(prompt_positions[:, start:min(end, prompt_len)])
    if end > prompt_len:
        lo = max(start, prompt_len)
        parts.append((torch.arange(lo, end, dtype=torch.int64) + int(delta)).expand(prompt_positions.shape[0], -1))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def decode_positions(seq_positions: Union[torch.Tensor, int], delta: Union[torch.Tensor, int]) -> torch.Tensor:
    """mRoPE positions of decode tokens: p + delta on all 3 rows. `seq_positions` [N] (or an int) are the
    tokens' 0-based indices in their sequences, `delta` [N] (or an int) the per-request deltas -> [3, N]."""
    p = torch.as_tensor(seq_positions, dtype=torch.long).reshape(-1)
    d = torch.as_tensor(delta, dtype=torch.long, device=p.device).reshape(-1)
    return (p + d).expand(3, -1).contiguous()


def visual_token_mask(input_ids: torch.Tensor, image_token_id: int, video_token_id: int,
                      ) -> torch.Tensor:
    ids = torch.as_tensor(input_ids)
    return (ids == image_token_id) | (ids == video_token_id)


__all__ = ["get_rope_index", "request_positions", "decode_positions", "text_positions", "visual_token_mask"]
