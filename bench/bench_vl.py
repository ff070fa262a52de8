"""Qwen3-VL prefill benchmark: TTFT of one image request and one video request, and the vision tower alone, on
the generated Qwen3-VL runner beside transformers' Qwen3VLForConditionalGeneration in the same run (random
weights of Qwen3-VL-8B's shapes from specs/qwen3_vl.yaml `variants`; nothing is downloaded). The report (.md +
.json) is rewritten after every section and every input, so a timeout keeps what was measured.

    python bench/bench_vl.py --out bench/results/h200_vl.md                          # one GPU
    python bench/bench_vl.py --device cpu --variant tiny --out /tmp/vl_smoke.md      # CPU smoke (the test's)

Checkpoint: config.json of the variant's shapes (transformers' Qwen3VLConfig layout: text_config /
vision_config, written by the config class itself), the byte-level tokenizer with the Qwen-VL special tokens
of tests/fixtures/tiny_hf.py (its ids are < vocab_size; the config's image / video / vision start / end token
ids are that tokenizer's) and the real Qwen3-VL processor classes with the released checkpoints' pixel budgets
(image 65536..16777216 pixels, video 4096..25165824 over all frames), so a 1024x1024 image is not resized
(1024 visual tokens) and 8 frames of 448x448 give 4 x 14 x 14 = 784. Our engine loads it with
load_format="dummy" (random weights), transformers builds the model from the config on the device and draws
every parameter from N(0, 0.02). `--variant tiny` uses the tiny fixture checkpoint itself (real float32 weights).

Inputs: a random-pixel RGB image (--image-size) and a random uint8 video (--frames x --frame-size^2, frames
used as given: do_sample_frames=False), each in a short chat-formatted text prompt.

Measured (medians of --runs after --warmup runs of the same request):
- xllm TTFT: wall time of LLM.generate(request, max_tokens=1), prefix caching off. It includes the request's
  preprocessing (the checkpoint's HF processor + mRoPE index), done inside generate. Two arms on the same
  engine: preprocessing on the device (mm_preprocess_device="auto", opt-in: transformers'
  torchvision processors resize / normalize / patchify on the GPU, the rows stay there) and on the host
  (mm_preprocess_device="cpu", the path before). The arms swap the engine's MultiModalProcessor, nothing else.
- HF TTFT: processor(text, images / videos) + .to(device) + model.generate(**inputs, max_new_tokens=1): the same
  work from the same raw input; also with processor(..., device=device) (HF's own GPU preprocessing). The
  generate call alone is reported beside it (HF generate ms: the target's reference, TTFT including
  preprocessing <= 0.5x of it), and the preprocessing alone (our engine's MultiModalProcessor.process, which
  calls the same HF processor; device-synchronized), host and device arms, with the largest difference of
  the two arms' pixel rows (GPU and CPU resize kernels round differently; token ids and grids must be equal).
- --timeout: the whole run's wall-clock limit; when it passes, the report of what was measured is written
  and the script exits 3 (every section and input is saved as it finishes, so a kill keeps those too).
- vision ms: the vision tower alone on the same processed pixel rows (already on the device, in the model
  dtype): our runner's `encode_vision(pixels, grid_thw)` (what a request runs: the CUDA graph of the tower's
  patch-count bucket, runtime/executor/vision_graphs.py) and `model.encode_vision` (eager; patch embed, blocks,
  merger, deepstack mergers)
  and transformers' `model.model.visual(pixels, grid_thw=grid)` (the same parts), under inference_mode,
  device-synchronized around each call.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))           # fixtures.tiny_hf: tokenizer, processor writer, tiny checkpoint
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import versions  # noqa: E402  (the same version record as the other benches)

ARCH = "Qwen3VLForConditionalGeneration"
VARIANT = "Qwen3-VL-8B"
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"
ROWS = ("image", "video")

# The released Qwen3-VL processors' pixel budgets (preprocessor_config.json / video_preprocessor_config.json).
IMAGE_MIN_PIXELS, IMAGE_MAX_PIXELS = 65536, 16777216
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS = 4096, 25165824

# specs/qwen3_vl.yaml variant symbol -> its config.json field (dotted), as the spec's `config:` section reads it
HF_FIELDS = {
    "vocab_size": "text_config.vocab_size",
    "hidden_size": "text_config.hidden_size",
    "intermediate_size": "text_config.intermediate_size",
    "num_hidden_layers": "text_config.num_hidden_layers",
    "num_attention_heads": "text_config.num_attention_heads",
    "num_key_value_heads": "text_config.num_key_value_heads",
    "head_dim": "text_config.head_dim",
    "max_position_embeddings": "text_config.max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings",
    "vision_depth": "vision_config.depth",
    "vision_hidden_size": "vision_config.hidden_size",
    "vision_num_heads": "vision_config.num_heads",
    "vision_intermediate_size": "vision_config.intermediate_size",
    "patch_size": "vision_config.patch_size",
    "temporal_patch_size": "vision_config.temporal_patch_size",
    "spatial_merge_size": "vision_config.spatial_merge_size",
    "vision_out_hidden_size": "vision_config.out_hidden_size",
    "num_position_embeddings": "vision_config.num_position_embeddings",
    "deepstack_visual_indexes": "vision_config.deepstack_visual_indexes",
}
# read elsewhere: rope_theta / mrope_section (text_config.rope_parameters); eos_token_id (the tokenizer's, as
# in the fixture: the released id 151645 has no token in the small tokenizer)
HF_SPECIAL = {"rope_theta", "mrope_section", "eos_token_id"}


# ------------------------------------------------------------------------------------------------ checkpoint
def vl_variant(name: str = VARIANT) -> dict:
    import yaml
    spec = yaml.safe_load((REPO / "specs" / "qwen3_vl.yaml").read_text())
    v = spec["variants"].get(name)
    if not v:
        raise ValueError(f"specs/qwen3_vl.yaml has no Qwen3-VL variant {name!r}")
    return dict(v)


def variant_overrides(v: dict) -> dict:
    """config.json fields (dotted keys, fixtures.tiny_hf.tiny_config's overrides) of a spec variant."""
    unknown = set(v) - set(HF_FIELDS) - HF_SPECIAL
    if unknown:                  # a new variant field must be mapped here, not dropped silently
        raise ValueError(f"variant fields without a config.json mapping in bench_vl.HF_FIELDS: {sorted(unknown)}")
    out = {HF_FIELDS[k]: (list(x) if isinstance(x, (list, tuple)) else x) for k, x in v.items() if k in HF_FIELDS}
    out["vision_config.in_channels"] = 3
    out["text_config.rope_parameters"] = {"rope_type": "default", "rope_theta": float(v["rope_theta"]),
                                          "mrope_section": list(v["mrope_section"]), "mrope_interleaved": True}
    out["text_config.rms_norm_eps"] = 1e-6
    out["text_config.tie_word_embeddings"] = bool(v["tie_word_embeddings"])
    return out


def write_checkpoint(root: Path, name: str) -> tuple[Path, str]:
    """(dir, load_format). `tiny`: the tiny fixture checkpoint (weights in safetensors); else config.json of the
    variant's shapes + the fixture tokenizer + the Qwen3-VL processor at the released pixel budgets, no weights."""
    from fixtures import tiny_hf

    if name == "tiny":
        return tiny_hf.make_tiny_qwen3_vl(root / "tiny"), "auto"
    from xllm_gen.default_model import build_tokenizer, write_generation_config

    config = tiny_hf.tiny_config(ARCH, variant_overrides(vl_variant(name)))   # token ids = the tokenizer's
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(d)
    tok = build_tokenizer()
    tok.save_pretrained(d)
    tiny_hf.PROCESSORS[ARCH](d, tok, config, image_min_pixels=IMAGE_MIN_PIXELS, image_max_pixels=IMAGE_MAX_PIXELS,
                             video_min_pixels=VIDEO_MIN_PIXELS, video_max_pixels=VIDEO_MAX_PIXELS)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    write_generation_config(d, eos, eos)
    check_token_ids(d)
    return d, "dummy"


def check_token_ids(d: Path) -> dict:
    """The config's placeholder token ids must be the tokenizer's special tokens (else the processor's expansion
    would not be recognised as visual rows)."""
    from transformers import AutoTokenizer

    cfg = json.loads((d / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(d)
    want = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
            "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
    ids = {f: tok.convert_tokens_to_ids(t) for f, t in want.items()}
    bad = {f: (cfg.get(f), ids[f]) for f in want if cfg.get(f) != ids[f]}
    if bad:
        raise ValueError(f"config token ids differ from the tokenizer's (config, tokenizer): {bad}")
    vocab = cfg["text_config"]["vocab_size"]
    if len(tok) > vocab:
        raise ValueError(f"tokenizer has {len(tok)} tokens > vocab_size {vocab}")
    return ids


# ------------------------------------------------------------------------------------------------ inputs
def make_inputs(image_size: int, frames: int, frame_size: int, seed: int = 0) -> dict:
    """name -> our engine's request dict (prompt, multi_modal_data, mm_processor_kwargs)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8), "RGB")
    vid = rng.integers(0, 256, (frames, frame_size, frame_size, 3), dtype=np.uint8)

    def chat(body: str) -> str:
        return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"

    return {
        "image": {"prompt": chat(f"{IMG}Describe this image."), "multi_modal_data": {"image": [img]},
                  "mm_processor_kwargs": {}},
        "video": {"prompt": chat(f"{VID}Describe this video."), "multi_modal_data": {"video": [vid]},
                  "mm_processor_kwargs": {"do_sample_frames": False}},
    }


# ------------------------------------------------------------------------------------------------ timing
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, runs: int, warmup: int, device: str) -> dict:
    """fn() `warmup` times, then `runs` timed calls (device synchronized before and after each): ms stats."""
    for _ in range(warmup):
        fn()
    sync(device)
    ms = []
    for _ in range(runs):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        ms.append((time.perf_counter() - t0) * 1e3)
    return dict(median_ms=statistics.median(ms), min_ms=min(ms), runs_ms=[round(x, 3) for x in ms])


def top_kernels(fn, device: str, calls: int = 3, n: int = 15) -> dict:
    """torch.profiler over `calls` calls of fn: GPU ms per call in all, and the top-n kernels (name, launches per
    call, GPU ms per call): where the time of a step goes. On a CPU: the top operators, CPU ms."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    sync(device)
    gpu = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    ka = prof.key_averages()
    key = ("device_time_total" if hasattr(ka[0], "device_time_total") else "cuda_time_total") if gpu \
        else "self_cpu_time_total"
    rows = sorted(ka, key=lambda e: getattr(e, key), reverse=True)
    kernels = [e for e in rows if not e.key.startswith(("cuda", "Activity"))]
    return {"unit": "GPU" if gpu else "CPU", "gpu_ms": sum(getattr(e, key) for e in kernels) / calls / 1e3,
            "launches": sum(e.count for e in kernels) // calls,
            "kernels": [(e.key[:100], e.count // calls, getattr(e, key) / calls / 1e3) for e in kernels[:n]]}


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def err(e: BaseException) -> str:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return (f"{type(e).__name__}: {e}"[:800] + " | " + "".join(tb[-3:]).replace("\n", " ")[-700:]).strip()


def token_budget(image_size: int, frames: int, frame_size: int, factor: int = 32) -> int:
    """An upper bound of the longest prompt (visual tokens + text and timestamps), for max_model_len."""
    img = math.ceil(image_size / factor) ** 2
    vid = math.ceil(frames / 2) * (math.ceil(frame_size / factor) ** 2 + 16)
    return max(img, vid) + 256


# ------------------------------------------------------------------------------------------------ sections
def bench_xllm(R: dict, model_dir: Path, load_format: str, reqs: dict, args, log, save) -> None:
    from xllm_gen import LLM, SamplingParams

    dev, dtype = args.device, args.dtype
    max_len = token_budget(args.image_size, args.frames, args.frame_size)
    blocks = 2 * math.ceil(max_len / 16) + 16
    t0 = time.perf_counter()
    extra = {}
    if args.prefill_graph_sizes:                 # e.g. finer buckets: a 1045-token prompt pads to 1536 by default
        extra["prefill_graph_sizes"] = [int(x) for x in args.prefill_graph_sizes.split(",") if x]
    debug = {"vision_graphs": True}
    if args.dummy_quantize:                      # random weights quantized in place, the vision tower kept bf16
        debug.update(dummy_quantize=args.dummy_quantize, dummy_quantize_skip=["visual"])   # as Qwen3-VL-*-FP8
    R["xllm_options"] = dict(extra, enable_prefix_caching=False, dummy_quantize=args.dummy_quantize)
    llm = LLM(str(model_dir), device=dev, dtype=dtype, load_format=load_format, max_model_len=max_len,
              num_kv_blocks=blocks, max_num_seqs=4, enable_prefix_caching=False, _debug=debug, **extra)
    sync(dev)
    R["xllm_load_s"] = time.perf_counter() - t0
    log(f"xllm: engine up in {R['xllm_load_s']:.1f} s (max_model_len {max_len}, {blocks} KV blocks)")
    try:
        engine = llm.engine
        model = engine.runner.model
        from xllm_gen.runtime.multimodal.processor import MultiModalProcessor
        hf_proc = engine.mm_processor.processor
        arms = {"device": MultiModalProcessor(processor=hf_proc, hf_config=engine.hf_config, device=engine.device),
                "host": MultiModalProcessor(processor=hf_proc, hf_config=engine.hf_config, device=None)}
        mmp = engine.mm_processor = arms["device"]
        R["xllm_preprocess_device"] = {"device": str(engine.device), "modalities": mmp.device_kwargs}
        R["xllm_processor"] = {k: type(getattr(mmp.processor, k, None)).__name__
                               for k in ("image_processor", "video_processor")}
        R["xllm_prefill_graphs"] = getattr(engine.runner, "prefill_graphs", None) is not None
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for name in ROWS:
            row = R["rows"].setdefault(name, {})
            req = reqs[name]
            try:
                def prep(arm):
                    return arms[arm].process(0, req["prompt"], None, req["multi_modal_data"],
                                             req["mm_processor_kwargs"])
                mms = {}
                for arm in ("device", "host"):          # host: mm_preprocess_device="cpu" (the path before)
                    engine.mm_processor = arms[arm]
                    out = llm.generate([req], sp)[0]
                    row["prompt_tokens"] = len(out.prompt_token_ids)
                    row[f"xllm_ttft{'' if arm == 'device' else '_host'}"] = timed(
                        lambda: llm.generate([req], sp), args.runs, args.warmup, dev)
                    mms[arm] = prep(arm)
                    row[f"xllm_preprocess{'' if arm == 'device' else '_host'}"] = timed(
                        lambda: prep(arm), args.runs, 1, dev)
                engine.mm_processor = arms["device"]
                mm, mh = mms["device"], mms["host"]
                row["visual_tokens"] = mm.num_visual_tokens
                pix, grid = mm.vision_batch()
                pix_h, grid_h = mh.vision_batch()
                row["pixel_device"] = str(pix.device)
                row["grid_thw"] = grid.tolist()
                row["pixel_rows"] = int(pix.shape[0])
                row["arms_same_ids_and_grids"] = (mm.prompt_token_ids == mh.prompt_token_ids
                                                  and torch.equal(grid, grid_h))
                row["arms_pixel_max_diff"] = float((pix.float().cpu() - pix_h.float()).abs().max())
                if not row["arms_same_ids_and_grids"]:
                    row["xllm_arms_error"] = "device and host preprocessing gave different token ids or grids"
                if args.profile and dev.startswith("cuda"):
                    try:
                        row["xllm_preprocess_profile"] = top_kernels(lambda: prep("device"), dev)
                    except Exception as e:   # noqa: BLE001
                        row["xllm_profile_error"] = err(e)
                pix_d = pix.to(engine.device, engine.dtype)
                grid_d = grid.to(engine.device)

                def vision():              # what a request runs: the bucket's CUDA graph where there is one
                    with torch.inference_mode():
                        engine.runner.encode_vision(pix_d, grid)

                def vision_eager():
                    with torch.inference_mode():
                        model.encode_vision(pix_d, grid_d)
                row["xllm_vision"] = timed(vision, args.runs, args.warmup, dev)
                row["xllm_vision_eager"] = timed(vision_eager, args.runs, args.warmup, dev)
                vg = getattr(engine.runner, "vision_graphs", None)
                row["vision_graphs"] = None if vg is None else {
                    "buckets": [list(k) for k in vg.buckets], "replays": vg.replays, "disabled": vg.disabled}
                if args.profile:
                    try:
                        row["xllm_vision_profile"] = top_kernels(vision, dev)
                        row["xllm_vision_eager_profile"] = top_kernels(vision_eager, dev)
                        row["xllm_ttft_profile"] = top_kernels(lambda: llm.generate([req], sp), dev, 1)
                    except Exception as e:   # noqa: BLE001  (the timings stand without it)
                        row["xllm_profile_error"] = err(e)
                log(f"xllm {name}: {row['prompt_tokens']} prompt tokens, TTFT {row['xllm_ttft']['median_ms']:.2f} ms "
                    f"(host preprocessing {row['xllm_ttft_host']['median_ms']:.2f} ms), "
                    f"vision {row['xllm_vision']['median_ms']:.2f} ms (eager {row['xllm_vision_eager']['median_ms']:.2f} "
                    f"ms; graphs {row['vision_graphs']}), "
                    f"preprocess {row['xllm_preprocess']['median_ms']:.2f} ms on {row['pixel_device']} "
                    f"(host {row['xllm_preprocess_host']['median_ms']:.2f} ms; rows differ by "
                    f"{row['arms_pixel_max_diff']:.3g})")
            except Exception as e:   # noqa: BLE001  (keep the other input's results)
                row["xllm_error"] = err(e)
                log(f"xllm {name}: {row['xllm_error']}")
            save()
    finally:
        llm.shutdown()
        llm = model = None                  # (the timing closures hold these names: no `del`)
        free(dev)


def hf_visual(model):
    """transformers 5.x: Qwen3VLForConditionalGeneration.model (Qwen3VLModel).visual; older: model.visual."""
    inner = getattr(model, "model", None)
    if inner is not None and getattr(inner, "visual", None) is not None:
        return inner.visual, "model.model.visual"
    return model.visual, "model.visual"


def bench_hf(R: dict, model_dir: Path, reqs: dict, args, log, save) -> None:
    import transformers
    from transformers import AutoConfig, AutoProcessor

    dev = args.device
    dtype = getattr(torch, args.dtype)
    cls = getattr(transformers, ARCH)
    processor = AutoProcessor.from_pretrained(model_dir)
    R["hf_processor"] = {k: type(getattr(processor, k, None)).__name__ for k in ("image_processor", "video_processor")}
    cfg = AutoConfig.from_pretrained(model_dir)
    kw = {"attn_implementation": args.hf_attn} if args.hf_attn else {}
    t0 = time.perf_counter()
    with torch.device(dev):
        model = cls._from_config(cfg, dtype=dtype, **kw)
    model.to(dev).eval()                    # (a no-op where the device context was honoured)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    sync(dev)
    R["hf_load_s"] = time.perf_counter() - t0
    R["hf_attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    visual, R["hf_visual_attr"] = hf_visual(model)
    log(f"hf: model built in {R['hf_load_s']:.1f} s (attention {R['hf_attn_implementation']}, "
        f"vision tower {R['hf_visual_attr']})")
    eos = cfg.text_config.eos_token_id if hasattr(cfg, "text_config") else None
    gen_kw = dict(max_new_tokens=1, do_sample=False, pad_token_id=eos if isinstance(eos, int) else None)
    try:
        for name in ROWS:
            row = R["rows"].setdefault(name, {})
            req = reqs[name]
            mm = req["multi_modal_data"]

            def process(**extra):
                return processor(text=[req["prompt"]], images=mm.get("image"), videos=mm.get("video"),
                                 return_tensors="pt", **req["mm_processor_kwargs"], **extra)

            def generate(inputs):
                if getattr(model, "model", None) is not None and hasattr(model.model, "rope_deltas"):
                    model.model.rope_deltas = None          # no cached mRoPE delta from the previous call
                with torch.inference_mode():
                    return model.generate(**inputs, **gen_kw)

            try:
                inputs = process().to(dev)
                row["hf_prompt_tokens"] = int(inputs["input_ids"].shape[1])
                row["hf_ttft"] = timed(lambda: generate(process().to(dev)), args.runs, args.warmup, dev)
                try:                        # HF's own GPU preprocessing (the torchvision processors' device=)
                    row["hf_ttft_device"] = timed(lambda: generate(process(device=dev).to(dev)), args.runs,
                                                  args.warmup, dev)
                except Exception as e:   # noqa: BLE001  (the host arm stands without it)
                    row["hf_device_preprocess_error"] = err(e)
                row["hf_generate"] = timed(lambda: generate(inputs), args.runs, 1, dev)
                key = "pixel_values" if name == "image" else "pixel_values_videos"
                gkey = "image_grid_thw" if name == "image" else "video_grid_thw"
                pix_d = inputs[key].to(dev, dtype)
                grid_d = inputs[gkey].to(dev)
                row["hf_grid_thw"] = grid_d.tolist()

                def vision():
                    with torch.inference_mode():
                        visual(pix_d, grid_thw=grid_d)
                row["hf_vision"] = timed(vision, args.runs, args.warmup, dev)
                if args.profile:
                    try:
                        row["hf_vision_profile"] = top_kernels(vision, dev)
                    except Exception as e:   # noqa: BLE001
                        row["hf_profile_error"] = err(e)
                log(f"hf {name}: {row['hf_prompt_tokens']} prompt tokens, TTFT {row['hf_ttft']['median_ms']:.2f} ms "
                    f"(generate {row['hf_generate']['median_ms']:.2f} ms), vision {row['hf_vision']['median_ms']:.2f} ms")
            except Exception as e:   # noqa: BLE001
                row["hf_error"] = err(e)
                log(f"hf {name}: {row['hf_error']}")
            save()
    finally:
        model = visual = None
        free(dev)


# ------------------------------------------------------------------------------------------------ report
def med(row: dict, key: str):
    v = row.get(key)
    return v.get("median_ms") if isinstance(v, dict) else None


def f(x, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def ratio(a, b) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def markdown(R: dict) -> str:
    L = [f"# Qwen3-VL prefill: TTFT and vision tower ({R['variant']} shapes, random {R['dtype']} weights, "
         f"{R['device']})\n",
         f"command: `{R['command']}`\n",
         f"versions: {json.dumps(R['versions'])}\n",
         f"inputs: image {R['image_size']}x{R['image_size']} (random pixels); video {R['frames']} frames of "
         f"{R['frame_size']}x{R['frame_size']} (random, do_sample_frames=False); medians of {R['runs']} runs after "
         f"{R['warmup']} warm-up(s) of the same request\n"]
    rows = R.get("rows", {})
    if rows:
        L.append("| input | prompt tokens | visual tokens | grid (t, h, w) | preprocess ms device / host "
                 "| xllm TTFT ms device-pre / host-pre | HF TTFT ms host-pre / device-pre | HF generate ms "
                 "| xllm TTFT / HF generate (target <= 0.5x) | HF / xllm TTFT | xllm vision ms graph / eager "
                 "| HF vision ms | HF / xllm vision |")
        L.append("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name in ROWS:
            r = rows.get(name)
            if r is None:
                continue
            x_t, h_t, x_v, h_v = med(r, "xllm_ttft"), med(r, "hf_ttft"), med(r, "xllm_vision"), med(r, "hf_vision")
            h_g = med(r, "hf_generate")
            grid = r.get("grid_thw") or r.get("hf_grid_thw")
            L.append(f"| {name} | {r.get('prompt_tokens', r.get('hf_prompt_tokens', '-'))} | "
                     f"{r.get('visual_tokens', '-')} | {grid if grid else '-'} | "
                     f"{f(med(r, 'xllm_preprocess'))} / {f(med(r, 'xllm_preprocess_host'))} | "
                     f"{f(x_t)} / {f(med(r, 'xllm_ttft_host'))} | {f(h_t)} / {f(med(r, 'hf_ttft_device'))} | "
                     f"{f(h_g)} | {ratio(x_t, h_g)} | {ratio(h_t, x_t)} | {f(x_v)} / {f(med(r, 'xllm_vision_eager'))} | "
                     f"{f(h_v)} | {ratio(h_v, x_v)} |")
        L.append("\nxllm TTFT: LLM.generate(max_tokens=1) wall time, preprocessing (the HF processor + mRoPE index) "
                 "included, prefix caching off; device-pre: the processor's resize / normalize / patchify on the "
                 "model's device (mm_preprocess_device=\"auto\"), host-pre: on the host "
                 "(mm_preprocess_device=\"cpu\"). HF TTFT: processor (host, or with device=) + .to(device) + "
                 "generate(max_new_tokens=1); HF generate: the generate call alone on processed inputs. preprocess: "
                 "our engine's request preparation alone (the same HF processor), synchronized. vision: the tower "
                 "alone on the same pixel rows (ours: graph = the runner's encode_vision, the CUDA graph of the "
                 "patch-count bucket, eager = model.encode_vision; HF: "
                 f"{R.get('hf_visual_attr', 'model.model.visual')}), synchronized.\n")
        vgs = {n: r.get("vision_graphs") for n, r in rows.items() if "vision_graphs" in r}
        if vgs:
            L.append(f"vision graphs (bucket rows, segment slots; replays; why off): {json.dumps(vgs)}\n")
        diffs = {n: (r.get("pixel_device"), r.get("arms_same_ids_and_grids"), r.get("arms_pixel_max_diff"))
                 for n, r in rows.items() if "arms_pixel_max_diff" in r}
        if diffs:
            L.append("device vs host preprocessing (rows' device, same token ids and grids, largest pixel-row "
                     f"difference): {json.dumps(diffs)}\n")
        mism = {n: (r.get("prompt_tokens"), r.get("hf_prompt_tokens")) for n, r in rows.items()
                if r.get("prompt_tokens") and r.get("hf_prompt_tokens") and r["prompt_tokens"] != r["hf_prompt_tokens"]}
        if mism:
            L.append(f"\nprompt token counts differ (xllm, HF): {json.dumps(mism)}\n")
    for name, r in rows.items():
        for key, what in (("xllm_preprocess_profile", "xllm preprocessing on the device"),
                          ("xllm_vision_profile", "xllm vision tower (graph)"),
                          ("xllm_vision_eager_profile", "xllm vision tower (eager)"),
                          ("hf_vision_profile", "HF vision tower"),
                          ("xllm_ttft_profile", "xllm LLM.generate(max_tokens=1)")):
            prof = r.get(key)
            if prof:
                u = prof.get("unit", "GPU")
                L.append(f"\n{name}, {what}: {prof['gpu_ms']:.2f} {u} ms in {prof['launches']} kernel launches "
                         f"per call; top kernels (launches, {u} ms per call):\n")
                L += [f"- `{k}` {c} {ms:.3f}" for k, c, ms in prof["kernels"]]
    info = {k: R[k] for k in ("xllm_load_s", "xllm_section_s", "xllm_peak_gib", "xllm_prefill_graphs", "hf_load_s",
                              "hf_section_s", "hf_peak_gib", "hf_attn_implementation", "xllm_processor",
                              "xllm_preprocess_device", "xllm_options", "timeout",
                              "hf_processor", "checkpoint") if k in R}
    if info:
        L.append(f"\nsetup: {json.dumps(info, default=str)}\n")
    errs = {f"{n} {k}": v for n, r in rows.items() for k, v in r.items() if k.endswith("_error")}
    errs.update({k: v for k, v in R.items() if k.endswith("_error")})
    if errs:
        L.append("\nerrors:\n")
        L += [f"- {k}: `{v}`" for k, v in errs.items()]
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------------------------------------ main
class BenchTimeout(BaseException):
    """--timeout passed (a BaseException: the sections' `except Exception` must not swallow it)."""


def _alarm(signum, frame):
    raise BenchTimeout()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dummy-quantize", default=None, choices=["fp8_block", "fp8", "int4"],
                    help="our engine's random weights quantized in place (the language model's linear layers; the "
                         "vision tower stays bf16, as in Qwen3-VL-8B-FP8): fp8_block is that release's form")
    ap.add_argument("--variant", default=VARIANT, help="a specs/qwen3_vl.yaml variant, or `tiny` (the test fixture)")
    ap.add_argument("--image-size", type=int, default=1024)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--frame-size", type=int, default=448)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sections", default="xllm,hf", help="comma list of xllm, hf (run in that order)")
    ap.add_argument("--device", default="cuda", help="cuda | cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--hf-attn", default=None, help="transformers attn_implementation (default: its own, sdpa)")
    ap.add_argument("--profile", action="store_true", help="also the top GPU kernels of the vision towers and of "
                    "our whole request (torch.profiler)")
    ap.add_argument("--prefill-graph-sizes", default=None,
                    help="comma list of prefill graph buckets for our engine (default: the engine's; a prompt "
                         "runs in the smallest bucket >= its length, padding rows included)")
    ap.add_argument("--timeout", type=float, default=570.0,
                    help="wall-clock seconds for the whole run (0: none); on expiry the partial report is written "
                         "and the exit status is 3")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "h200_vl.md"))
    ap.add_argument("--workdir", default=None, help="where the checkpoint is written (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    sections = [s for s in args.sections.split(",") if s]
    bad = set(sections) - {"xllm", "hf"}
    if bad:
        ap.error(f"unknown sections {sorted(bad)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_vl: --device cuda but no CUDA GPU (use --device cpu --variant tiny for the smoke run)",
              file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, flush=True)

    command = "python " + " ".join(shlex.quote(a) for a in ["bench/bench_vl.py"] +
                                   list(argv if argv is not None else sys.argv[1:]))
    R: dict = dict(command=command, versions=versions(), variant=args.variant, device=args.device, dtype=args.dtype,
                   image_size=args.image_size, frames=args.frames, frame_size=args.frame_size, runs=args.runs,
                   warmup=args.warmup, sections=sections, rows={})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:                      # after every step: a timeout later keeps what was measured
        out.write_text(markdown(R))
        out.with_suffix(".json").write_text(json.dumps(R, indent=1, default=str))

    own_tmp = args.workdir is None
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_vl_"))
    t_all = time.perf_counter()
    if args.timeout and args.timeout > 0:
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, args.timeout)
    try:
        try:
            t0 = time.perf_counter()
            model_dir, load_format = write_checkpoint(root, args.variant)
            R["checkpoint"] = dict(dir=str(model_dir), load_format=load_format,
                                   files=sorted(p.name for p in model_dir.iterdir()))
            reqs = make_inputs(args.image_size, args.frames, args.frame_size)
            log(f"checkpoint {model_dir} ({load_format}) in {time.perf_counter() - t0:.1f} s")
        except Exception as e:   # noqa: BLE001
            R["checkpoint_error"] = err(e)
            log(f"checkpoint: {R['checkpoint_error']}")
            save()
            return 1
        save()
        for s in sections:
            t0 = time.perf_counter()
            try:
                if s == "xllm":
                    bench_xllm(R, model_dir, load_format, reqs, args, log, save)
                else:
                    bench_hf(R, model_dir, reqs, args, log, save)
            except Exception as e:   # noqa: BLE001  (the other section still runs)
                R[f"{s}_error"] = err(e)
                log(f"{s}: {R[f'{s}_error']}")
            R[f"{s}_section_s"] = time.perf_counter() - t0
            if args.device.startswith("cuda"):
                R[f"{s}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()
            free(args.device)
            save()
        R["total_s"] = time.perf_counter() - t_all
        save()
        log(f"wrote {out} ({R['total_s']:.0f} s)")
        print(markdown(R), flush=True)
    except BenchTimeout:
        R["timeout"] = f"--timeout {args.timeout:g} s passed after {time.perf_counter() - t_all:.0f} s; the report " \
                       "holds what was measured before"
        save()
        log(f"bench_vl: TIMEOUT: {R['timeout']}; wrote {out}")
        print(markdown(R), flush=True)
        return 3
    finally:
        if args.timeout and args.timeout > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if own_tmp:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
