"""The embedded default: a tiny random-weight Qwen3 checkpoint in real Hugging Face format, built offline
(no download). `xllm-gen-generate` without --model builds it on first use and serves it (runtime/cli.py);
`python -m xllm_gen.default_model DIR` writes it to DIR.

`make_default_checkpoint(dir)` writes config.json, model.safetensors (float32), a byte-level BPE tokenizer
trained here with the `tokenizers` library (Qwen's special tokens, a chat template) and generation_config.json.
Weights are random but widened (not the 0.02 init) so that greedy decoding is varied rather than one repeated
token. Same seed -> byte-identical files.

The test fixtures (tiny checkpoints of any architecture, Qwen3-VL with its processor) live in
tests/fixtures/tiny_hf.py and reuse `build_tokenizer` and `widen_init` from here. This module never runs in the
serving path (it imports transformers).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

# Bumped whenever the files written for the same arguments change (cache dirs of built checkpoints key on it).
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
def widen_init(
    model,
    seed: int,
    *,
    embed_std: float = 1.0,
    gain: float = 1.0,
    head_gain: float = 3.0,
    out_gain: float = 1.0,
    bias_buffer_std: float = 0.0,
) -> None:
    """Re-initialize every parameter from one seeded generator, much wider than HF's 0.02 default:

    - embeddings N(0, embed_std); linear / conv / stacked expert weights N(0, gain/sqrt(fan_in)); lm_head head_gain; the
      projections that add into the text residual stream (o_proj, down_proj, and the deepstack mergers'
      linear_fc2, whose output is added after decoder layers) out_gain, so that each layer's output
      outweighs the token embedding (with a tied head a weak residual branch makes greedy decoding repeat
      the input token forever) and zeroing the deepstack features visibly changes the output;
    - biases N(0, 0.1); norm weights U(0.5, 1.5) (so a missing or misplaced norm changes the output);
    - with bias_buffer_std, float buffers named *bias (routing correction biases) N(0, bias_buffer_std).
    Parameters are visited in name order so the result depends only on the seed and the shapes."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    # embeddings and norms by module type too, where their names do not say it (GPT-J's wte, ln_1, ln_f;
    # embed_in, word_embeddings); a 1-D weight is a norm's (ln_attn / ln_mlp)
    embeds = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    norms = {f"{n}.weight" for n, m in model.named_modules() if "Norm" in type(m).__name__}
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "embed_tokens" in name or (name.endswith("pos_embed.weight")) or name in embeds:
                std = embed_std
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif (("norm" in name or name in norms) and name.endswith("weight")) or (
                    name.endswith(".weight") and p.dim() == 1):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif p.dim() >= 2:
                # a stacked experts parameter [experts, out, in] is one linear per expert: fan_in is `in`
                fan_in = p.shape[-1] if ".experts." in name and p.dim() == 3 else math.prod(p.shape[1:])
                g = gain
                if name.startswith("lm_head"):
                    g = head_gain
                elif name.endswith(("o_proj.weight", "down_proj.weight", "attention.dense.weight",
                                    "dense_4h_to_h.weight")) or (
                    "deepstack_merger_list" in name and name.endswith("linear_fc2.weight")
                ):
                    g = out_gain
                p.copy_(torch.randn(p.shape, generator=gen) * (g / math.sqrt(fan_in)))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        if bias_buffer_std:   # bias buffers (DeepSeek-V3's e_score_correction_bias), after the parameters
            for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
                if name.endswith("bias") and b.is_floating_point():
                    b.copy_(torch.randn(b.shape, generator=gen) * bias_buffer_std)


def init_gains(tied: bool) -> dict:
    """widen_init keyword arguments for a text decoder with a tied or untied lm_head."""
    # Chosen by scanning seeds: 32-token greedy continuations of different prompts differ and use 10-30
    # distinct tokens. A tied head needs a small embedding and strong residual branches (see widen_init).
    if tied:
        return {"embed_std": 0.3, "gain": 1.0, "head_gain": 3.0, "out_gain": 5.0}
    return {"embed_std": 1.0, "gain": 1.0, "head_gain": 3.0, "out_gain": 1.0}


def write_generation_config(out: Path, eos_id: int, pad_id: int) -> None:
    # Only ids: no sampling defaults, so an engine applying generation_config defaults stays greedy.
    (Path(out) / "generation_config.json").write_text(
        json.dumps({"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}, indent=2) + "\n"
    )


# ------------------------------------------------------------------------------------- the default model
def make_default_checkpoint(out_dir, *, seed: int = 0) -> Path:
    """Write the embedded default, a complete tiny Qwen3ForCausalLM checkpoint (2 layers, hidden 64, heads 4 /
    kv_heads 2, head_dim 16, tied lm_head, vocab = the tokenizer's size rounded up to 64), to `out_dir`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    eos_id = tok.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen3Config(
        vocab_size=(len(tok) + 63) // 64 * 64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=None,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    widen_init(model, seed, **init_gains(tied=True))
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    write_generation_config(out, eos_id, eos_id)
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Write the embedded tiny random-weight Qwen3 checkpoint (no download).")
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(make_default_checkpoint(args.out_dir, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
