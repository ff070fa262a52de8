"""Plain-PyTorch pieces for the references of families transformers does not ship (served by vLLM through
trust_remote_code): each test writes its family's forward pass from the published modeling code with these, never
with xllm-gen code. Also: writing a tiny checkpoint (safetensors + config.json, the release's tensor names and
config keys) and comparing the engine's greedy tokens and log-probabilities with a reference's."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ([5, 17, 3], [9, 1, 40, 22, 7, 31, 2, 11, 60], list(range(3, 60, 3)))   # 3, 9, 19 tokens
MAX_TOKENS = 8
LOGPROB_TOL = 1e-3


def rand(gen: torch.Generator, *shape: int, std: float = 0.2) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def norm_weight(gen: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + rand(gen, n, std=0.1)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def rope_neox(x: torch.Tensor, pos: torch.Tensor, theta: float, scale: float = 1.0) -> torch.Tensor:
    """x [T, H, D]; rotate_half over the whole head (Llama's apply_rotary_pos_emb); `scale` divides the positions
    (linear scaling)."""
    d = x.shape[-1]
    f = (pos.float() / scale)[:, None] * inv_freq(d, theta)[None]
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k / v [T, KV, D] (each KV head serving H / KV consecutive query heads); bias [H, T, T] added to
    the scaled scores. Returns [T, H * D]."""
    t, h, _ = q.shape
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("thd,shd->hts", q, k) * scale
    if bias is not None:
        s = s + bias
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(t, -1)


def alibi_slopes(heads: int) -> torch.Tensor:
    """Baichuan's / Bloom's: the power-of-two series, then every other slope of the 2n series."""
    def pow2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(heads).is_integer():
        return torch.tensor(pow2(heads))
    closest = 2 ** math.floor(math.log2(heads))
    return torch.tensor(pow2(closest) + pow2(2 * closest)[0::2][: heads - closest])


def write_checkpoint(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def ref_greedy(forward: Callable[[torch.Tensor], torch.Tensor], prompt: list[int], n: int = MAX_TOKENS):
    """Greedy tokens and each step's log_softmax, recomputing the whole sequence every step (no cache)."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = forward(torch.tensor(ids))[-1].double()
            lps.append(torch.log_softmax(logits, -1))
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], lps


def engine_greedy(ckpt: Path, prompts=PROMPTS, n: int = MAX_TOKENS, tp: int = 1):
    from xllm_gen import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5)
    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=4, tensor_parallel_size=tp) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def _logprob(entry) -> float:
    return float(getattr(entry, "logprob", entry))


def assert_matches(engine_out, forward, prompts=PROMPTS, what: str = "") -> None:
    """Same greedy tokens, and the engine's top log-probabilities equal the reference's (float32)."""
    for i, (prompt, (tokens, lps)) in enumerate(zip(prompts, engine_out)):
        want, ref_lps = ref_greedy(forward, prompt)
        assert tokens == want, f"{what} prompt #{i}: engine {tokens} != reference {want}"
        for step, (mine, ref) in enumerate(zip(lps, ref_lps)):
            for tok, entry in mine.items():
                err = abs(_logprob(entry) - float(ref[tok]))
                assert err < LOGPROB_TOL, f"{what} prompt #{i} step {step} token {tok}: logprob error {err:.3g}"


def distinct(forward_a, forward_b, prompts=PROMPTS) -> bool:
    """Whether two references give different greedy tokens (a sensitivity check of the fixture)."""
    return any(ref_greedy(forward_a, p)[0] != ref_greedy(forward_b, p)[0] for p in prompts)
