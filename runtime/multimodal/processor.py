"""Multimodal request preparation through the checkpoint's own Hugging Face processor (AutoProcessor).

A request is `prompt` (text with `<|image_pad|>` / `<|video_pad|>` placeholders, one per item, usually inside
`<|vision_start|>...<|vision_end|>` as the chat template writes them) or `prompt_token_ids` (one placeholder
*token* per item), plus `multi_modal_data = {"image": [...], "video": [...]}` and `mm_processor_kwargs`
(passed to the processor, e.g. `fps`, `do_sample_frames`, `size`).

- Text prompts: the processor expands the placeholders itself (an image -> t*h*w/m^2 image tokens; a video
  -> per temporal patch `<x.y seconds><|vision_start|>` + h*w/m^2 video tokens + `<|vision_end|>`) and
  tokenizes.
- Token-id prompts: the same processor is called once on a text made only of the request's items, each
  with its `<|vision_start|>...<|vision_end|>` wrapper when the ids have one, between separator tokens; its
  expansion of each item (wrapper included: transformers >= 5.25 drops a video's outer wrapper, older ones
  keep it) replaces the item's span of the ids (runtime.multimodal.token_prompt, which also says the one
  tokenization difference this can leave against the decoded text prompt under >= 5.25).

Then the 3-row mRoPE positions and the decode delta are computed (runtime.multimodal.rope_index, HF's algorithm).

Preprocessing device: given `device` (the engine passes the model's device when it is not the CPU), the
processor's torchvision-backend image / video processors run resize, rescale, normalize and patchify in torch
on that device (their own `device` argument), and the pixel rows stay there: no host round trip. What stays on
the host: decoding (PIL -> uint8 array), frame sampling, the token expansion and the grids (computed from the
resized shapes, so ids, grids and positions do not depend on the device). A processor without that backend
(a PIL one) is called without `device` and its rows are moved by the runner, as on the CPU path. A request's
`mm_processor_kwargs` may name `device` itself (e.g. "cpu"), which then goes to the processor unchanged. With
rows off the host, the prefix-cache key of the images is a digest of the raw inputs and the processor
arguments (`MultiModalInputs.source_digest`), never a copy of the rows back to the host.
Images are PIL images, or uint8 arrays/tensors (H, W, 3) / (H, W); videos are uint8 arrays/tensors
(T, H, W, 3), lists of PIL frames, or `(frames, metadata_dict)` (metadata as HF VideoMetadata: `fps`,
`total_num_frames`, `frames_indices`, ...; without it HF assumes 24 fps for sampling and timestamps).
Bad input raises ValueError naming the request index, so the engine can fail that request alone.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from xllm_gen.runtime.multimodal.rope_index import get_rope_index, text_positions
from xllm_gen.runtime.multimodal.token_prompt import (
    items_text,
    pick_separator,
    placeholder_spans,
    replace_spans,
    split_expansions,
)


@dataclass
class MultiModalInputs:
    prompt_token_ids: list[int]                        # expanded
    mrope_positions: torch.Tensor                      # [3, L] int64
    mrope_delta: int                                   # decode token at sequence position p: p + delta
    pixel_values: Optional[torch.Tensor] = None        # [P_img, C*tp*p*p] float32, processor layout
    image_grid_thw: Optional[torch.Tensor] = None      # [n_img, 3] int64
    pixel_values_videos: Optional[torch.Tensor] = None  # [P_vid, C*tp*p*p]
    video_grid_thw: Optional[torch.Tensor] = None      # [n_vid, 3] int64 (t = temporal patches)
    image_token_positions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    video_token_positions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    # the raw inputs (images, videos, metadata, processor kwargs) when the pixel rows are off the host: the
    # prefix-cache key is then their digest (source_digest), not the rows; None on the host path
    source: Any = field(default=None, repr=False, compare=False)
    _digest: Optional[bytes] = field(default=None, repr=False, compare=False)

    def source_digest(self) -> Optional[bytes]:
        """16-byte digest of the raw inputs and processor arguments the pixel rows were computed from (equal
        inputs -> equal rows); None when the rows are on the host (the key is then the rows themselves).
        Computed once, on first use (prefix caching), so that a request without caching never pays for it."""
        if self._digest is None and self.source is not None:
            self._digest = _digest_source(*self.source)
            self.source = None
        return self._digest

    @property
    def has_vision(self) -> bool:
        return self.pixel_values is not None or self.pixel_values_videos is not None

    @property
    def num_visual_tokens(self) -> int:
        return int(self.image_token_positions.numel() + self.video_token_positions.numel())

    @property
    def visual_token_positions(self) -> torch.Tensor:
        """[M] prompt indices of the visual tokens: image tokens (ascending), then video tokens (ascending);
        row i of `cat(encode(images), encode(videos))` belongs at position i of this list."""
        return torch.cat([self.image_token_positions, self.video_token_positions])

    def vision_batch(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(pixel rows, grid_thw) of all images then all videos, for one vision-tower call whose output rows
        go to `visual_token_positions` (the tower attends within each image / frame only)."""
        pix = [p for p in (self.pixel_values, self.pixel_values_videos) if p is not None]
        grid = [g for g in (self.image_grid_thw, self.video_grid_thw) if g is not None]
        if not pix:
            return None, None
        if len(pix) == 1:                    # one modality: its rows as they are (no copy)
            return pix[0], grid[0]
        return torch.cat(pix), torch.cat(grid)


def _update_array(h, x) -> None:
    if _is_pil(x):
        h.update(f"pil {x.mode} {x.size}".encode())
        h.update(x.tobytes())
        return
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.ascontiguousarray(x)
    h.update(f"array {x.dtype} {x.shape}".encode())
    h.update(memoryview(x).cast("B"))


def _digest_source(images, videos, metas, kwargs) -> bytes:
    """A digest of a request's raw images / videos (pixels, shapes, modes), video metadata and the processor
    arguments: what the processor's pixel rows are a function of."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(sorted((str(k), repr(v)) for k, v in (kwargs or {}).items())).encode())
    for img in images:
        h.update(b"image")
        _update_array(h, img)
    for vid, meta in zip(videos, metas):
        h.update(b"video" + repr(sorted((meta or {}).items())).encode())
        for frame in (vid if isinstance(vid, (list, tuple)) else [vid]):
            _update_array(h, frame)
    return h.digest()


def supports_device(processor) -> bool:
    """Whether a Hugging Face image / video processor runs its transforms in torch on a device it is given
    (the torchvision backend; `is_fast` in transformers 4); a PIL / NumPy one does not."""
    if processor is None:
        return False
    return getattr(processor, "backend", None) == "torchvision" or getattr(processor, "is_fast", False) is True


def _is_pil(x) -> bool:
    try:
        from PIL import Image
    except ImportError:      # pragma: no cover
        return False
    return isinstance(x, Image.Image)


class MultiModalProcessor:
    """Wraps AutoProcessor.from_pretrained(model_dir) (or a given processor) for request preparation.
    `device`: where the image / video processors that support it (torchvision backend) run and leave the
    pixel rows (None: the processor's default, the host)."""

    def __init__(self, model_dir: Optional[str] = None, hf_config: Optional[dict] = None, processor=None,
                 trust_remote_code: bool = False, device=None):
        if processor is None:
            from transformers import AutoProcessor
            processor = AutoProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        self.processor = processor
        self.tokenizer = processor.tokenizer
        tok = self.tokenizer
        self.image_token = getattr(processor, "image_token", "<|image_pad|>")
        self.video_token = getattr(processor, "video_token", "<|video_pad|>")
        hf_config = hf_config or {}
        self.image_token_id = int(hf_config.get("image_token_id", getattr(processor, "image_token_id", None)
                                                or tok.convert_tokens_to_ids(self.image_token)))
        self.video_token_id = int(hf_config.get("video_token_id", getattr(processor, "video_token_id", None)
                                                or tok.convert_tokens_to_ids(self.video_token)))
        self.vision_start_token_id = int(getattr(processor, "vision_start_token_id", None)
                                         or tok.convert_tokens_to_ids("<|vision_start|>"))
        self.vision_end_token_id = int(getattr(processor, "vision_end_token_id", None)
                                       or tok.convert_tokens_to_ids("<|vision_end|>"))
        ip = getattr(processor, "image_processor", None)
        vp = getattr(processor, "video_processor", None)
        merge = hf_config.get("vision_config", {}).get("spatial_merge_size")
        self.spatial_merge_size = int(merge or getattr(ip, "merge_size", None) or getattr(vp, "merge_size", 2))
        self.temporal_patch_size = int(getattr(vp, "temporal_patch_size", None)
                                       or getattr(ip, "temporal_patch_size", 2))
        self._vision_ids = (self.image_token_id, self.video_token_id, self.vision_start_token_id,
                            self.vision_end_token_id)
        self._token_text = dict(zip(self._vision_ids, (self.image_token, self.video_token,
                                                       tok.convert_ids_to_tokens(self.vision_start_token_id),
                                                       tok.convert_ids_to_tokens(self.vision_end_token_id))))
        self._separator = None           # (text, id) of the token between the items of a token-id prompt
        self.device = torch.device(device) if device is not None else None
        # the modalities whose processor takes the device: their kwargs group gets `device`
        self.device_kwargs = [key for key, p in (("images_kwargs", ip), ("videos_kwargs", vp))
                              if self.device is not None and supports_device(p)]

    # ------------------------------------------------------------------------------------ validation
    @staticmethod
    def _err(index, msg: str) -> ValueError:
        return ValueError(f"request {index}: {msg}")

    def _check_image(self, index, i: int, img) -> None:
        if _is_pil(img):
            w, h = img.size
            if w == 0 or h == 0:
                raise self._err(index, f"image {i} has zero size ({w}x{h})")
            return
        if isinstance(img, (np.ndarray, torch.Tensor)):
            shape = tuple(img.shape)
            dtype = img.dtype
            if dtype not in (np.uint8, torch.uint8):
                raise self._err(index, f"image {i}: array dtype {dtype} is not supported (use uint8 or a PIL image)")
            ok = len(shape) == 2 or (len(shape) == 3 and (shape[-1] in (1, 3) or shape[0] in (1, 3)))
            if not ok:
                raise self._err(index, f"image {i}: array of shape {shape} is not an image (H, W, 3) / (H, W)")
            if 0 in shape:
                raise self._err(index, f"image {i} has zero size (shape {shape})")
            return
        raise self._err(index, f"image {i} has unsupported type {type(img).__name__} "
                               f"(PIL.Image.Image or a uint8 array (H, W, 3))")

    def _check_video(self, index, i: int, vid) -> tuple[Any, Optional[dict]]:
        meta = None
        if isinstance(vid, tuple) and len(vid) == 2 and isinstance(vid[1], dict):
            vid, meta = vid
        if isinstance(vid, (list, tuple)):
            if not vid:
                raise self._err(index, f"video {i} is empty (no frames)")
            for f, frame in enumerate(vid):
                if not _is_pil(frame):
                    raise self._err(index, f"video {i} frame {f} has unsupported type {type(frame).__name__}")
                if 0 in frame.size:
                    raise self._err(index, f"video {i} frame {f} has zero size")
            n = len(vid)
        elif isinstance(vid, (np.ndarray, torch.Tensor)):
            shape = tuple(vid.shape)
            if vid.dtype not in (np.uint8, torch.uint8):
                raise self._err(index, f"video {i}: array dtype {vid.dtype} is not supported (use uint8 (T, H, W, 3))")
            if len(shape) != 4 or shape[-1] != 3:
                raise self._err(index, f"video {i}: array of shape {shape} is not a video (T, H, W, 3)")
            if shape[0] == 0:
                raise self._err(index, f"video {i} is empty (no frames)")
            if 0 in shape:
                raise self._err(index, f"video {i} has zero-size frames (shape {shape})")
            n = shape[0]
        else:
            raise self._err(index, f"video {i} has unsupported type {type(vid).__name__} "
                                   f"(a uint8 array (T, H, W, 3) or a list of PIL images)")
        if n < self.temporal_patch_size:
            raise self._err(index, f"video {i} has {n} frame(s): too short for one temporal patch "
                                   f"of {self.temporal_patch_size} frames")
        return vid, meta

    def _mm_lists(self, index, multi_modal_data: Optional[dict]):
        data = dict(multi_modal_data or {})
        unknown = set(data) - {"image", "video"}
        if unknown:
            raise self._err(index, f"unsupported multi_modal_data key(s) {sorted(unknown)} (use 'image', 'video')")
        images = data.get("image")
        videos = data.get("video")
        if images is not None and not isinstance(images, (list, tuple)):
            images = [images]
        if videos is not None and not isinstance(videos, list):
            videos = [videos]
        images = list(images or [])
        videos = list(videos or [])
        for i, img in enumerate(images):
            self._check_image(index, i, img)
        checked = [self._check_video(index, i, v) for i, v in enumerate(videos)]
        frames = [v for v, _ in checked]
        metas = [m for _, m in checked]
        return images, frames, metas

    def check_no_placeholders(self, index, token_ids) -> None:
        """A request without multi_modal_data must not carry image/video placeholder tokens."""
        n_img = sum(1 for t in token_ids if t == self.image_token_id)
        n_vid = sum(1 for t in token_ids if t == self.video_token_id)
        if n_img:
            raise self._err(index, f"{n_img} image placeholder token(s) ({self.image_token}) in the prompt but "
                                   f"no image given")
        if n_vid:
            raise self._err(index, f"{n_vid} video placeholder token(s) ({self.video_token}) in the prompt but "
                                   f"no video given")

    # ---------------------------------------------------------------------------------- processing
    def _call(self, index, text: str, images, videos, metas, kwargs: dict):
        kw = dict(kwargs or {})
        if "device" not in kw:           # a request's own `device` wins (it goes to every modality)
            for key in self.device_kwargs:
                group = kw.get(key)
                if group is None or (isinstance(group, dict) and "device" not in group):
                    kw[key] = {**(group or {}), "device": self.device}
        if videos and any(m is not None for m in metas) and "video_metadata" not in kw:
            kw["video_metadata"] = [
                m if m is not None else {"total_num_frames": len(v), "fps": None} for v, m in zip(videos, metas)]
        try:
            out = self.processor(text=[text], images=images or None, videos=videos or None,
                                 return_tensors="pt", **kw)
        except ValueError as e:
            raise self._err(index, f"the processor rejected the input: {e}") from e
        except (TypeError, RuntimeError, IndexError) as e:
            raise self._err(index, f"the processor failed on the input: {type(e).__name__}: {e}") from e
        return out, kw

    def _expand_ids(self, index, ids: list[int], images, videos, metas, kwargs):
        """The processor's expansion of each placeholder of a token-id prompt, cut out of one call on the
        items alone (runtime.multimodal.token_prompt) -> (expanded ids, the processor's output, its kwargs)."""
        if self._separator is None:
            self._separator = pick_separator(self.tokenizer, self._vision_ids) or ()
        if not self._separator:
            raise self._err(index, "prompt_token_ids with image / video placeholders need a special token of the "
                                   "tokenizer that is no vision token (to separate the items); this one has none: "
                                   "send the prompt as text")
        sep, sep_id = self._separator
        spans = placeholder_spans(ids, *self._vision_ids)
        text = items_text(ids, spans, self._token_text, sep)
        out, kw = self._call(index, text, images, videos, metas, kwargs)
        chunks = split_expansions(out["input_ids"][0].tolist(), sep_id, len(spans))
        if chunks is None:
            raise self._err(index, f"internal: the processor's expansion of the placeholders does not split at "
                                   f"{sep!r} into {len(spans)} item(s)")
        return replace_spans(ids, spans, chunks), out, kw

    def process(self, index, prompt: Optional[str], prompt_token_ids: Optional[list[int]],
                multi_modal_data: Optional[dict], mm_processor_kwargs: Optional[dict] = None) -> MultiModalInputs:
        images, videos, metas = self._mm_lists(index, multi_modal_data)
        n_img, n_vid = len(images), len(videos)

        if prompt_token_ids is not None:
            try:
                ids = [int(t) for t in prompt_token_ids]
            except (TypeError, ValueError) as e:
                raise self._err(index, f"prompt_token_ids must be a list of ints: {e}") from e
            c_img = sum(1 for t in ids if t == self.image_token_id)
            c_vid = sum(1 for t in ids if t == self.video_token_id)
        elif prompt is not None:
            if not isinstance(prompt, str):
                raise self._err(index, f"prompt must be a string, got {type(prompt).__name__}")
            ids = None
            c_img, c_vid = prompt.count(self.image_token), prompt.count(self.video_token)
        else:
            raise self._err(index, "neither prompt nor prompt_token_ids is given")
        if c_img != n_img:
            raise self._err(index, f"{c_img} image placeholder(s) ({self.image_token}) in the prompt but "
                                   f"{n_img} image(s) given")
        if c_vid != n_vid:
            raise self._err(index, f"{c_vid} video placeholder(s) ({self.video_token}) in the prompt but "
                                   f"{n_vid} video(s) given")

        if n_img == 0 and n_vid == 0:               # text only: 3 equal rows, delta 0
            if ids is None:
                ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            return MultiModalInputs(prompt_token_ids=ids, mrope_positions=text_positions(len(ids)), mrope_delta=0)

        if ids is None:
            out, kw = self._call(index, prompt, images, videos, metas, mm_processor_kwargs)
            ids = out["input_ids"][0].tolist()
        else:
            ids, out, kw = self._expand_ids(index, ids, images, videos, metas, mm_processor_kwargs)

        image_grid = out.get("image_grid_thw") if n_img else None
        video_grid = out.get("video_grid_thw") if n_vid else None
        try:
            positions, delta = get_rope_index(ids, image_grid, video_grid, self.spatial_merge_size,
                                              self.image_token_id, self.video_token_id)
        except ValueError as e:
            raise self._err(index, str(e)) from e
        t = torch.tensor(ids, dtype=torch.long)
        pixels = [out.get(k) for k in ("pixel_values", "pixel_values_videos")]
        on_host = all(p is None or p.device.type == "cpu" for p in pixels)
        return MultiModalInputs(
            prompt_token_ids=ids,
            mrope_positions=positions,
            mrope_delta=delta,
            pixel_values=out.get("pixel_values") if n_img else None,
            image_grid_thw=image_grid.to(torch.long) if image_grid is not None else None,
            pixel_values_videos=out.get("pixel_values_videos") if n_vid else None,
            video_grid_thw=video_grid.to(torch.long) if video_grid is not None else None,
            image_token_positions=torch.nonzero(t == self.image_token_id).flatten(),
            video_token_positions=torch.nonzero(t == self.video_token_id).flatten(),
            source=None if on_host else (images, videos, metas, kw),
        )


__all__ = ["MultiModalInputs", "MultiModalProcessor", "supports_device"]
