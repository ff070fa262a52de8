"""Tiny, complete Hugging Face checkpoints built offline (no download): the README's first command and the
parity tests use them.

`make_tiny_qwen3(dir)` writes a real Qwen3ForCausalLM checkpoint (config.json, safetensors, a byte-level BPE
tokenizer trained here with the `tokenizers` library, generation_config.json); `make_tiny_qwen3_vl(dir)` a
real Qwen3VLForConditionalGeneration checkpoint with the real Qwen3-VL processor classes. Weights are random
but widened (not the 0.02 init) so that greedy decoding is varied rather than one repeated token, and so
that an image really changes the output. Same arguments and seed -> byte-identical files.

This module is a helper for users and tests; it never runs in the serving path (it imports transformers).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

# Bumped whenever the files written for the same arguments change (cache dirs of built checkpoints can key on it).
TINY_VERSION = 2

# Special tokens appended after the BPE vocabulary (as in Qwen, where they follow the merges' tokens).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A small embedded English corpus (written for this project) so that the BPE merges are real words.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model reads the text one token at a time.
Once upon a time, in a quiet village by the river, there lived an old clockmaker and his daughter.
Every morning she opened the shop, wound the clocks, and listened to them ticking together.
The weather today is cold and windy, with rain expected in the afternoon and clear skies at night.
Machine learning models turn numbers into other numbers; language models turn words into tokens.
Attention lets each token look at the tokens before it and decide which of them matter most.
A paged cache stores keys and values in fixed blocks, so that many requests can share the memory.
The scheduler picks which requests run in the next step, and it may pause one when memory runs out.
Hello, world! How are you today? I am fine, thank you. What is your name? My name is Ada.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 3.14 2.71 0.5 1.5 seconds minutes hours.
Describe the image. What is in this picture? The picture shows a red square, a blue circle and a cat.
Describe the video. In the video a ball rolls from the left to the right and then stops.
The capital of France is Paris. The capital of Japan is Tokyo. Water boils at one hundred degrees.
She said that the train would leave at seven, but it was late, and they waited on the platform.
Write a short poem about the sea: the waves come in, the waves go out, the gulls call overhead.
def add(a, b): return a + b  # simple code, with symbols like ( ) [ ] { } = + - * / < > and quotes " '.
In spring the trees turn green; in autumn their leaves fall, yellow and brown, onto the road.
The library opens at nine and closes at five. Please return your books before the end of the month.
user assistant system: You are a helpful assistant. Answer the question briefly and clearly.
"""


# ---------------------------------------------------------------------------------------------- tokenizer
def build_tokenizer(bpe_vocab_size: int = 500):
    """A byte-level BPE tokenizer (any text tokenizes) with Qwen's special tokens, as a transformers
    PreTrainedTokenizerFast. Deterministic."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab_size,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    lines = _CORPUS.splitlines()
    tok.train_from_iterator(lines * 4, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=1 << 20,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


# ------------------------------------------------------------------------------------------ weight init
def _widen_init(
    model,
    seed: int,
    *,
    embed_std: float = 1.0,
    gain: float = 1.0,
    head_gain: float = 3.0,
    out_gain: float = 1.0,
) -> None:
    """Re-initialize every parameter from one seeded generator, much wider than HF's 0.02 default:

    - embeddings N(0, embed_std); linear / conv weights N(0, gain/sqrt(fan_in)); lm_head head_gain; the
      projections that add into the text residual stream (o_proj, down_proj, and the deepstack mergers'
      linear_fc2, whose output is added after decoder layers) out_gain, so that each layer's output
      outweighs the token embedding (with a tied head a weak residual branch makes greedy decoding repeat
      the input token forever) and zeroing the deepstack features visibly changes the output;
    - biases N(0, 0.1); norm weights U(0.5, 1.5) (so a missing or misplaced norm changes the output).
    Parameters are visited in name order so the result depends only on the seed and the shapes."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "embed_tokens" in name or (name.endswith("pos_embed.weight")):
                std = embed_std
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif p.dim() >= 2:
                fan_in = math.prod(p.shape[1:])
                g = gain
                if name.startswith("lm_head"):
                    g = head_gain
                elif name.endswith(("o_proj.weight", "down_proj.weight")) or (
                    "deepstack_merger_list" in name and name.endswith("linear_fc2.weight")
                ):
                    g = out_gain
                p.copy_(torch.randn(p.shape, generator=gen) * (g / math.sqrt(fan_in)))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _text_init(tied: bool) -> dict:
    # Chosen by scanning seeds: 32-token greedy continuations of different prompts differ and use 10-30
    # distinct tokens. A tied head needs a small embedding and strong residual branches (see _widen_init).
    if tied:
        return {"embed_std": 0.3, "gain": 1.0, "head_gain": 3.0, "out_gain": 5.0}
    return {"embed_std": 1.0, "gain": 1.0, "head_gain": 3.0, "out_gain": 1.0}


def _pad_vocab(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def _save_model(model, out: Path, max_shard_size) -> None:
    kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)


def _write_generation_config(out: Path, eos_id: int, pad_id: int) -> None:
    # Only ids: no sampling defaults, so an engine applying generation_config defaults stays greedy.
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}, indent=2) + "\n"
    )


def _to_hub_style(out: Path) -> None:
    """Rewrite config.json the way most Hub checkpoints store it (rope_theta at top level, torch_dtype)."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())

    def flatten(c: dict) -> None:
        rp = c.pop("rope_parameters", None)
        if rp:
            c["rope_theta"] = rp.get("rope_theta")
            extra = {k: v for k, v in rp.items() if k not in ("rope_theta", "rope_type")}
            c["rope_scaling"] = ({"rope_type": rp.get("rope_type", "default"), **extra} if extra else None)
        if "dtype" in c:
            c["torch_dtype"] = c.pop("dtype")

    flatten(cfg)
    if isinstance(cfg.get("text_config"), dict):
        flatten(cfg["text_config"])
    vision = cfg.get("vision_config")
    if isinstance(vision, dict) and vision.get("rope_parameters") == {"rope_theta": 10000.0, "rope_type": "axial"}:
        del vision["rope_parameters"]  # Hub Qwen3-VL configs carry no vision rope fields (this is the default)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _tokenizer_and_vocab(vocab_size: int | None):
    """The tiny tokenizer and the model's vocabulary size (None: the tokenizer's, padded to 64)."""
    tok = build_tokenizer()
    n_tok = len(tok)
    if vocab_size is None:
        vocab_size = _pad_vocab(n_tok)
    if vocab_size < n_tok:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({n_tok} tokens)")
    return tok, vocab_size


# ------------------------------------------------------------------------------------------------ Qwen3
def make_tiny_qwen3(
    out_dir,
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 512,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    max_shard_size: int | str | None = None,
    hub_style_config: bool = False,
    seed: int = 0,
) -> Path:
    """Write a complete tiny Qwen3ForCausalLM checkpoint to `out_dir` and return its path.

    vocab_size: None -> the tokenizer's size rounded up to a multiple of 64 (ids past the tokenizer are
    valid model ids that decode to nothing, as in real Qwen checkpoints). max_shard_size (e.g. "40KB"):
    split model.safetensors into several files plus model.safetensors.index.json. hub_style_config: write
    rope_theta at the top level of config.json as older Hub checkpoints do."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok, vocab_size = _tokenizer_and_vocab(vocab_size)
    eos_id = tok.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    _widen_init(model, seed, **_text_init(tie_word_embeddings))
    if tie_word_embeddings:
        model.tie_weights()
    _save_model(model, out, max_shard_size)
    tok.save_pretrained(out)
    _write_generation_config(out, eos_id, eos_id)
    if hub_style_config:
        _to_hub_style(out)
    return out


# --------------------------------------------------------------------------------------------- Qwen3-VL
def make_tiny_qwen3_vl(
    out_dir,
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_hidden_layers: int = 3,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    mrope_section: tuple[int, int, int] = (4, 2, 2),
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 1024,
    rope_theta: float = 100.0,
    vision_depth: int = 3,
    vision_hidden_size: int = 32,
    vision_num_heads: int = 2,
    vision_intermediate_size: int = 64,
    patch_size: int = 16,
    temporal_patch_size: int = 2,
    spatial_merge_size: int = 2,
    deepstack_visual_indexes: tuple[int, ...] = (0, 1, 2),
    num_position_embeddings: int = 64,
    image_min_pixels: int | None = None,
    image_max_pixels: int | None = None,
    video_min_pixels: int | None = None,
    video_max_pixels: int | None = None,
    max_shard_size: int | str | None = None,
    hub_style_config: bool = False,
    seed: int = 0,
) -> Path:
    """Write a complete tiny Qwen3VLForConditionalGeneration checkpoint (config, safetensors, tokenizer with
    the Qwen-VL special tokens, Qwen3VLProcessor + its image processor + Qwen3VLVideoProcessor) and return
    its path. AutoProcessor.from_pretrained(path) loads it offline.

    rope_theta defaults to 100 (not Qwen's 5e6) so that the text mRoPE layout matters at the tiny grid sizes:
    with slow frequencies a wrong (blocked) layout would change the output too little to be caught.
    Pixel budgets default to small values (factor = patch_size * spatial_merge_size): an image gets between
    1 and 16 merged tokens; a video at most 64 merged tokens in total over all its frames."""
    import torch
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    if sum(mrope_section) * 2 != head_dim:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim/2 = {head_dim // 2}")
    side = int(round(math.sqrt(num_position_embeddings)))
    if side * side != num_position_embeddings:
        raise ValueError(f"num_position_embeddings {num_position_embeddings} must be a square")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok, vocab_size = _tokenizer_and_vocab(vocab_size)
    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS}
    eos_id = ids["<|endoftext|>"]

    text_config = dict(
        model_type="qwen3_vl_text",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(rope_theta),
            "mrope_section": list(mrope_section),
            "mrope_interleaved": True,
        },
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    vision_config = dict(
        model_type="qwen3_vl_vision",
        depth=vision_depth,
        hidden_size=vision_hidden_size,
        hidden_act="gelu_pytorch_tanh",
        intermediate_size=vision_intermediate_size,
        num_heads=vision_num_heads,
        in_channels=3,
        patch_size=patch_size,
        spatial_merge_size=spatial_merge_size,
        temporal_patch_size=temporal_patch_size,
        out_hidden_size=hidden_size,
        num_position_embeddings=num_position_embeddings,
        deepstack_visual_indexes=list(deepstack_visual_indexes),
    )
    config = Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings,
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    config.eos_token_id = eos_id
    config.bos_token_id = eos_id

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()
    _widen_init(model, seed, **_text_init(tie_word_embeddings))
    if tie_word_embeddings:
        model.tie_weights()
    _save_model(model, out, max_shard_size)

    factor = patch_size * spatial_merge_size
    image_min_pixels = image_min_pixels or factor * factor
    image_max_pixels = image_max_pixels or factor * factor * 16
    video_min_pixels = video_min_pixels or factor * factor * 2
    video_max_pixels = video_max_pixels or factor * factor * 64
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": image_min_pixels, "longest_edge": image_max_pixels},
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
        merge_size=spatial_merge_size,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    video_processor = Qwen3VLVideoProcessor(
        size={"shortest_edge": video_min_pixels, "longest_edge": video_max_pixels},
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
        merge_size=spatial_merge_size,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        fps=2,
        min_frames=2,
        max_frames=16,
        cap_pixels_per_frame=False,
    )
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    _write_generation_config(out, eos_id, eos_id)
    if hub_style_config:
        _to_hub_style(out)
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write a tiny random Qwen3 / Qwen3-VL checkpoint (no download).")
    ap.add_argument("out_dir")
    ap.add_argument("--vl", action="store_true", help="Qwen3-VL instead of Qwen3")
    ap.add_argument("--untied", action="store_true", help="untied lm_head")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    make = make_tiny_qwen3_vl if args.vl else make_tiny_qwen3
    path = make(args.out_dir, tie_word_embeddings=not args.untied, seed=args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
