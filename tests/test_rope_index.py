"""runtime.rope_index against HF Qwen3VLModel.get_rope_index (called unbound, no model weights)."""
from __future__ import annotations

import functools
import inspect
import random
from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

from xllm_gen.runtime.multimodal.rope_index import decode_positions, get_rope_index, text_positions

IMG, VID, VS, VE = 151655, 151656, 151652, 151653
# transformers < 5.2x names the cache argument past_key_values
CACHE_KW = ("cache" if "cache" in inspect.signature(Qwen3VLModel.compute_3d_position_ids).parameters
            else "past_key_values")
MERGE = 2


def _hf_self(merge=MERGE, rope_deltas=None):
    return SimpleNamespace(
        config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)),
        get_vision_position_ids=functools.partial(Qwen3VLModel.get_vision_position_ids, None),
        rope_deltas=rope_deltas,
    )


def hf_rope_index(ids: list[int], image_grid, video_grid, merge=MERGE):
    input_ids = torch.tensor([ids])
    types = torch.zeros_like(input_ids)
    types[input_ids == IMG] = 1
    types[input_ids == VID] = 2
    pos, delta = Qwen3VLModel.get_rope_index(
        _hf_self(merge), input_ids, mm_token_type_ids=types,
        image_grid_thw=torch.tensor(image_grid) if image_grid else None,
        video_grid_thw=torch.tensor(video_grid) if video_grid else None)
    return pos[:, 0], int(delta[0, 0])


def _text(rng, lo=1, hi=6):
    return [rng.randrange(0, 1000) for _ in range(rng.randint(lo, hi))]


def build_prompt(rng, items, merge=MERGE):
    """items: list of ("image"|"video", grid). Returns token ids laid out the way the HF processor does."""
    ids = _text(rng)
    for kind, (t, h, w) in items:
        n = h * w // (merge * merge)
        if kind == "image":
            ids += [VS] + [IMG] * (t * n) + [VE]
        else:
            ids += [VS]                          # the chat template's vision_start around <|video_pad|>
            for _ in range(t):                   # "<x.y seconds>" text, then one frame block
                ids += _text(rng, 3, 6) + [VS] + [VID] * n + [VE]
            ids += [VE]
        ids += _text(rng, 0, 4)
    return ids


def _grid(rng, video=False):
    return (rng.randint(1, 4) if video else 1, 2 * rng.randint(1, 8), 2 * rng.randint(1, 8))


CASES = {
    "text": lambda rng: [],
    "one_image": lambda rng: [("image", _grid(rng))],
    "three_images": lambda rng: [("image", _grid(rng)) for _ in range(3)],
    "video": lambda rng: [("video", _grid(rng, True))],
    "image_video_mixed": lambda rng: [("image", _grid(rng)), ("video", _grid(rng, True)),
                                      ("image", _grid(rng)), ("video", _grid(rng, True))],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seed", range(6))
def test_matches_hf(case, seed):
    rng = random.Random(seed * 100 + len(case))
    items = CASES[case](rng)
    ids = build_prompt(rng, items)
    image_grid = [g for k, g in items if k == "image"]
    video_grid = [g for k, g in items if k == "video"]
    pos, delta = get_rope_index(ids, image_grid or None, video_grid or None, MERGE, IMG, VID)
    ref, ref_delta = hf_rope_index(ids, image_grid, video_grid)
    assert pos.dtype == torch.int64 and pos.shape == (3, len(ids))
    assert torch.equal(pos, ref)
    assert delta == ref_delta
    if case == "text":
        assert delta == 0 and torch.equal(pos, text_positions(len(ids)))


def test_merge_size_one_and_non_square():
    rng = random.Random(7)
    items = [("image", (1, 3, 7)), ("video", (3, 5, 2)), ("image", (1, 9, 1))]
    ids = build_prompt(rng, items, merge=1)
    image_grid = [g for k, g in items if k == "image"]
    video_grid = [g for k, g in items if k == "video"]
    pos, delta = get_rope_index(ids, image_grid, video_grid, 1, IMG, VID)
    ref, ref_delta = hf_rope_index(ids, image_grid, video_grid, merge=1)
    assert torch.equal(pos, ref) and delta == ref_delta


def test_decode_positions_continue_like_hf():
    rng = random.Random(3)
    items = [("image", (1, 8, 12)), ("video", (2, 4, 6))]
    ids = build_prompt(rng, items)
    image_grid = [g for k, g in items if k == "image"]
    video_grid = [g for k, g in items if k == "video"]
    pos, delta = get_rope_index(ids, image_grid, video_grid, MERGE, IMG, VID)
    L = len(ids)
    # HF's decode path: positions = arange(cache_len, cache_len + n) + rope_deltas on all 3 rows.
    for step in range(4):
        cache = SimpleNamespace(get_seq_length=lambda n=L + step: n)
        ref = Qwen3VLModel.compute_3d_position_ids(
            _hf_self(rope_deltas=torch.tensor([[delta]])), input_ids=torch.tensor([[5]]),
            inputs_embeds=torch.zeros(1, 1, 8), image_grid_thw=torch.tensor(image_grid),
            video_grid_thw=torch.tensor(video_grid), **{CACHE_KW: cache},
            mm_token_type_ids=torch.zeros(1, 1, dtype=torch.long))
        ours = decode_positions(L + step, delta)
        assert torch.equal(ours, ref[:, 0]), (step, ours, ref)
    # the first decode token follows the prompt's largest position
    assert int(decode_positions(L, delta)[0, 0]) == int(pos.max()) + 1
    # batched: per-request deltas
    out = decode_positions(torch.tensor([10, 20]), torch.tensor([-3, 0]))
    assert out.tolist() == [[7, 20]] * 3


def test_mismatch_raises():
    ids = [1, VS] + [IMG] * 4 + [VE]
    with pytest.raises(ValueError):
        get_rope_index(ids, [(1, 4, 6)], None, MERGE, IMG, VID)     # needs 6 tokens
    with pytest.raises(ValueError):
        get_rope_index(ids, None, None, MERGE, IMG, VID)            # no grid
    with pytest.raises(ValueError):
        get_rope_index(ids, [(1, 4, 4), (1, 4, 4)], None, MERGE, IMG, VID)  # grid left over


def test_back_to_back_items_are_consumed_grid_by_grid():
    """HF fails on two images with no token between them (one run); here the run is split by the grids,
    giving HF's positions for the same prompt with a separator, minus the separator."""
    sep = 77
    a, b = (1, 4, 6), (1, 6, 2)
    head, tail = [1, 2, VS], [VE, 3]
    na, nb = 6, 3
    ids_sep = head + [IMG] * na + [sep] + [IMG] * nb + tail
    ref, _ = hf_rope_index(ids_sep, [a, b], None)
    cut = len(head) + na
    expected = torch.cat([ref[:, :cut], ref[:, cut + 1:] - 1], dim=1)
    ids = head + [IMG] * (na + nb) + tail
    pos, delta = get_rope_index(ids, [a, b], None, MERGE, IMG, VID)
    assert torch.equal(pos, expected)
    assert delta == int(expected.max()) + 1 - len(ids)
    with pytest.raises(ValueError):
        get_rope_index(head + [IMG] * (na + nb + 1) + tail, [a, b], None, MERGE, IMG, VID)
