"""Every text spec in specs/ on a GPU: bf16 weights, FlashInfer attention, decode CUDA graphs on, against
Hugging Face transformers on the same tiny checkpoint (built from the transformers config class the spec's
`architectures` names, so a new spec is covered without a list to maintain).

The reference is HF in float32 (eager attention). bf16 noise is measured, not guessed: HF itself in bf16 gives
the scale of rounding error on these weights, and the engine's error must stay within a small multiple of it.
Prompts cross the tiny sliding window (32) where the architecture has one. Figures go to $XLLM_TEST_REPORT.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from fixtures.report import report as _report
from spec_yaml import read_yaml

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
PROMPT_LENS = (5, 40, 100)        # 40 and 100 cross the window of 32
NEW_TOKENS = 32
WINDOW = 32
NEAR_TIE = 0.05
# MoE models: bf16 rounding may route a position to other experts than float32 does (one position's logits 0.6 off on
# the tiny GLM-4-MoE, 2026-12-05: its top-2 experts 0.0015 apart in float32), a discrete difference that neither
# side's bf16 noise bound covers, and that moves every later position through attention. So the prefill is compared
# once more with the engine routed as its float32 run routes (every position), and the free run (graph prefill, greedy
# decode) sets aside such positions and those after a flip (_routing_ties, the rule of codegen/verify_routing.py).
# Tiny random MoE checkpoints are chaotic in bf16: on the H100 (2026-12-05) DBRX, JetMoE and Qwen3.5-MoE had
# 188 / 152 / 124 of 241 positions within noise of a tie
# families whose transformers reference computes another model in older releases than the one the spec follows
# (the GPU host may have an older transformers than the CPU tests): (first release that agrees, what differs)
REFERENCE_SINCE = {
    "CohereCompassForCausalLM": ((5, 24), "transformers 5.17's text rotary permutes the frequencies of the mRoPE "
                                 "h/w sections (a pre-rotation for the vision positions; 5.24 rotates text with the "
                                 "plain neox frequencies, as the spec does): a different model for text"),
}

# families whose older transformers releases compute another model for some of the fixture's config values (they
# hard-code a field the spec reads, or ignore it): on such a host the tiny checkpoint is built with values where both
# releases agree (so the reference and the spec compute the same model and the test still runs): (first release that
# agrees, {field: a value older releases compute alike})
REFERENCE_HARDCODES = {
    # 5.18 and earlier: GptOssExperts sets alpha = 1.702, limit = 7.0 (5.19 reads config.swiglu_alpha / swiglu_limit;
    # the tiny fixture's swiglu_limit 0.5 made every engine path, float32 torch attention included, 0.33 off the
    # 5.17 reference on the H200)
    "GptOssForCausalLM": ((5, 19), {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}),
    # 5.22 and earlier: the Mamba-2 mixer's gated RMSNorm spans all of the intermediate, not each of mamba_n_groups
    # groups (5.23 passes group_size, as the spec computes): the fixture's 2 groups made the 5.17 reference another
    # model (float32 on the CPU: prefill 0.97 / 0.13 off; the H100 run of 2026-12-05 read it as a regression). One group
    "BambaForCausalLM": ((5, 23), {"mamba_n_groups": 1}),
    "GraniteMoeHybridForCausalLM": ((5, 23), {"mamba_n_groups": 1}),
    "Mamba2ForCausalLM": ((5, 23), {"n_groups": 1}),
    # 5.17: MiniMax-M2's config ignores the released `rotary_dim` (5.18 turns it into partial_rotary_factor): full
    # rotary on 5.17, 0.28 off the fixture's rotary_dim 8 (float32, CPU). Rotary over the whole head
    "MiniMaxM2ForCausalLM": ((5, 18), {"rotary_dim": 128}),
    # every release so far: Helium's o_proj maps hidden_size to hidden_size, so heads x head_dim must equal it
    # (the test's head_dim 128 with 4 heads of a 256 model makes a checkpoint that transformers cannot run)
    "HeliumForCausalLM": ((99, 0), {"head_dim": 64}),
}


def _text_specs():
    """(architecture, spec name) of every spec whose architecture has no vision tower (the vision-language
    specs run in test_gpu_graphs.py), found from the transformers config class, so `extends` chains count."""
    from fixtures.tiny_hf import model_class
    out = []
    for path in sorted((ROOT / "specs").glob("*.yaml")):
        data = read_yaml(path)
        if not isinstance(data, dict) or not data.get("architectures"):
            continue
        arch = data["architectures"][0]
        try:
            if "vision_config" in model_class(arch).config_class().to_dict():
                continue
        except Exception:        # noqa: BLE001 - an architecture this transformers lacks: reported by the test
            pass
        out.append(pytest.param(arch, id=path.stem))
    return out


def _cuda_refusal(architecture: str, ckpt: Path | None = None):
    """What the CUDA path refuses at load for this architecture's spec (None: it serves it): ALiBi
    (codegen/README.md, attention `alibi`), chunked local attention, value heads narrower than q/k (`mla_attention`'s
    expanded K/V), a head_dim FlashInfer has no kernels for (the checkpoint's, read by the generated Config). Attention
    sinks are served (GPT-OSS runs the battery; tests/gpu/test_gpu_sinks_kv_scales.py). Read from the generated model
    (a GPU host needs no compiler)."""
    import importlib

    from xllm_gen.runtime.attention.base import FLASHINFER_HEAD_DIMS
    from xllm_gen.runtime.loading import registry
    package = registry.generated_packages().get(architecture)
    source = importlib.import_module(f"{package}.model").__file__ if package else None
    if source and "v_head_dim=" in Path(source).read_text():      # mla_attention, an attention `v_head_dim`: value
        return "value heads of another width"                      # heads of their own width (checked first)
    if source and "L.alibi_slopes(" in Path(source).read_text():     # attention `alibi`
        return "ALiBi"
    if source and "chunk_size=" in Path(source).read_text():         # attention `chunk_size` (the fixtures chunk)
        return "chunked local attention"
    if source and "L.Attention(" not in Path(source).read_text():   # no attention layer (Mamba-2): no head_dim limit
        return None
    if package and ckpt is not None:
        config = importlib.import_module(f"{package}.model").Config.from_hf(
            json.loads((ckpt / "config.json").read_text()))
        head_dim = getattr(config, "head_dim", None)
        if head_dim is None and getattr(config, "num_attention_heads", None):    # derived in the model (GPT-J)
            head_dim = config.hidden_size // config.num_attention_heads
        if head_dim is not None and head_dim > max(FLASHINFER_HEAD_DIMS):     # (smaller ones: zero-padded heads)
            return r"head_dim [0-9, ]+ is larger than FlashInfer"    # (every layer's distinct head_dim, named)
    return None




def _checkpoint(architecture: str, out: Path) -> Path:
    from fixtures.tiny_hf import ARCH_DEFAULTS, TEXT_SIZES, make_tiny_checkpoint, model_class
    if architecture in REFERENCE_SINCE:
        import transformers
        since, why = REFERENCE_SINCE[architecture]
        if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < since:
            pytest.skip(f"transformers {transformers.__version__} < {'.'.join(map(str, since))}: {why}")
    try:
        default = model_class(architecture).config_class().to_dict()
    except (ImportError, AttributeError, KeyError, ValueError) as exc:    # the reference itself is missing
        import transformers
        pytest.skip(f"transformers {transformers.__version__} has no {architecture} (the reference): {exc}")
    sizes = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                 intermediate_size=512, num_hidden_layers=4, max_position_embeddings=1024)
    # only the fields the family's config has (GPT-J names its sizes n_embd, ...; GPT-NeoX has no KV heads field)
    overrides = {k: v for k, v in sizes.items() if k in default}
    if "sliding_window" in default:
        overrides["sliding_window"] = WINDOW
    # a fixture that fixes the head count under another name (Bloom's n_head): keep 128-wide heads
    fixed = ARCH_DEFAULTS.get(architecture, {})
    heads = next((fixed[f] for f in ("n_head", "n_heads", "num_heads") if f in fixed and f not in overrides), None)
    if heads and "hidden_size" in overrides and "head_dim" not in default:
        overrides["hidden_size"] = 128 * heads
    # per-layer patterns the tiny fixture fixes (layer_types, no_rope_layers, ...: the lists with one entry per
    # fixture layer): repeated over this test's layer count
    layers = overrides.get("num_hidden_layers", 4)
    patterns = {}
    for field, pattern in ARCH_DEFAULTS.get(architecture, {}).items():
        if isinstance(pattern, list) and len(pattern) == TEXT_SIZES["num_hidden_layers"]:
            if field not in default:        # a GPU host's older transformers would ignore the layer pattern
                import transformers
                pytest.skip(f"transformers {transformers.__version__}: {architecture}'s config has no `{field}`, "
                            "the per-layer pattern the spec (written for a newer transformers) reads")
            patterns[field] = (list(pattern) * layers)[:layers]
    overrides.update(patterns)
    if architecture in REFERENCE_HARDCODES:         # before the build: a value may size tensors (mamba_n_groups)
        import transformers
        since, values = REFERENCE_HARDCODES[architecture]
        if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < since:
            overrides.update(values)
    try:
        ckpt = make_tiny_checkpoint(architecture, out, overrides=overrides, seed=0)
    except Exception:           # noqa: BLE001 - sizes the family's config validates against each other (a Mamba-2 mixer's
        # hidden_size * expand == num_heads * head_dim): the fixture's own consistent tiny sizes and layer patterns
        overrides = {k: v for k, v in overrides.items() if k not in sizes and k not in patterns}
        ckpt = make_tiny_checkpoint(architecture, out, overrides=overrides, seed=0)
    if "num_key_value_heads" in overrides and _guard_refuses(architecture, ckpt):
        # a spec that admits only as many KV heads as heads (multi-head latent attention): no GQA override
        del overrides["num_key_value_heads"]
        ckpt = make_tiny_checkpoint(architecture, out, overrides=overrides, seed=0)
    return ckpt


def _guard_refuses(architecture: str, ckpt: Path) -> bool:
    import importlib

    from xllm_gen.runtime.loading import registry
    package = registry.generated_packages().get(architecture)
    if not package:
        return False
    try:
        importlib.import_module(f"{package}.model").Config.from_hf(json.loads((ckpt / "config.json").read_text()))
    except Exception:           # noqa: BLE001 - any refusal of the config guard
        return True
    return False


def _routing(llm, tokens: list):
    """How the engine routes each position of `tokens` in each MoE layer (teacher-forced prefill, eager so that hooks
    run): verify_routing.Routing (FusedMoE.routing_view and router logits per layer, on the host; empty without
    routed experts)."""
    from xllm_gen.codegen.verify_routing import record_routing
    runner = llm.engine.runner
    with torch.inference_mode():
        return record_routing(runner.model, lambda: llm.prefill_logits(tokens), runner)


def _routing_ties(routes: list, ckpt: Path, seqs: list) -> tuple[list, list]:
    """(per sequence [len] bool: the positions a free run's comparison sets aside, per sequence the float32 run's
    router logits). Set aside: where bf16 rounding may route a position to other experts than float32 does, and every
    position after one routed otherwise (codegen/verify_routing.py, the rule `verify --dtype bfloat16` applies too;
    the float32 routing is the engine's on the CPU). Experts that differ beyond the measured noise fail the test."""
    from xllm_gen import LLM
    from xllm_gen.codegen.verify_routing import contaminated, routing_ties
    if not any(r.views for r in routes):
        return [torch.zeros(len(s), dtype=torch.bool) for s in seqs], [[] for _ in seqs]
    llm = LLM(str(ckpt), device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=512, max_model_len=512,
              enforce_eager=True)
    try:
        exact = [_routing(llm, s) for s in seqs]
    finally:
        llm.shutdown()
    ties = []
    for i, (routed, routed32, seq) in enumerate(zip(routes, exact, seqs)):
        t = routing_ties(routed.views, routed32.views, len(seq))
        assert not t.errors, (f"request {i}: routed to other experts than in float32 where bf16 rounding (the noise) "
                              f"cannot overturn the choice, (MoE layer, positions, float32 margins, noise) {t.errors}: "
                              f"a routing error")
        ties.append(t.tie | contaminated(t.differs))
    return ties, [r.logits for r in exact]


def _forced_prefill(llm, prompt: list, logits32: list) -> torch.Tensor:
    """The engine's bf16 prefill logits of `prompt` with every MoE layer routed as the float32 run routed it (the
    first len(prompt) rows of its router logits; eager, verify_routing.forced_routing)."""
    from xllm_gen.codegen.verify_routing import forced_routing
    runner = llm.engine.runner
    with torch.inference_mode(), forced_routing(runner.model, [lg[:len(prompt)] for lg in logits32], runner):
        return llm.prefill_logits(prompt).float()


def _hf(ckpt: Path, dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype, attn_implementation="eager").cuda().eval()


@pytest.mark.parametrize("architecture", _text_specs())
def test_spec_bf16_graphs_vs_hf(architecture, tmp_path):
    from xllm_gen import LLM, SamplingParams

    ckpt = _checkpoint(architecture, tmp_path / "ckpt")
    if _guard_refuses(architecture, ckpt):   # the host's transformers writes a tiny config of another era (e.g. 5.17's
        pytest.skip(f"the spec's config guard refuses transformers {__import__('transformers').__version__}'s tiny "
                    f"{architecture} config (the CPU conformance battery checks the spec against 5.24's)")
    refused = _cuda_refusal(architecture, ckpt)
    if refused:                  # a documented refusal: at load, naming the feature
        with pytest.raises(Exception, match=refused):
            LLM(str(ckpt), dtype="bfloat16", max_num_seqs=16, num_kv_blocks=512, max_model_len=512)
        return
    rng = random.Random(3)
    vocab = json.loads((ckpt / "config.json").read_text()).get("vocab_size", 1000)
    prompts = [[rng.randrange(min(vocab, 5000)) for _ in range(n)] for n in PROMPT_LENS]
    llm = LLM(str(ckpt), dtype="bfloat16", max_num_seqs=16, num_kv_blocks=512, max_model_len=512)
    try:
        runner = llm.engine.runner
        # every model decodes in graphs, also one with recurrent-state layers (its state slots a static graph input)
        assert runner.graphs is not None, "decode graphs were not captured"
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        with torch.inference_mode():
            prefill = [llm.prefill_logits(p).float() for p in prompts]
        seqs = [p + list(o.token_ids) for p, o in zip(prompts, outs)]
        routes = [_routing(llm, seq) for seq in seqs]
        ties, logits32 = _routing_ties(routes, ckpt, seqs)
        # MoE: the prefill once more with float32's routing, compared at every position (no near-tie, no flip)
        forced = ([_forced_prefill(llm, p, lg) for p, lg in zip(prompts, logits32)] if any(logits32) else None)
    finally:
        llm.shutdown()

    hf32, hf16 = _hf(ckpt, torch.float32), _hf(ckpt, torch.bfloat16)
    worst = dict(engine_prefill=0.0, hf16_prefill=0.0, engine_decode=0.0, hf16_decode=0.0,
                 **({"engine_forced_prefill": 0.0, "hf16_all_prefill": 0.0} if forced else {}))
    first_token_bad, flips, agree, hf16_agree, total = [], [], 0, 0, 0
    tied = []                                   # (request, row) set aside: routing within bf16 noise of a tie
    worst_row = None
    with torch.inference_mode():
        for i, (p, o, ours_prefill) in enumerate(zip(prompts, outs, prefill)):
            toks = list(o.token_ids)
            tie = ties[i]
            views = routes[i].views
            margin = torch.stack([v.margin for v in views]).amin(0) if views else torch.full(tie.shape, torch.inf)
            tied += [(i, r) for r in tie.nonzero().flatten().tolist()]
            keep = ~tie[:len(p)].cuda()
            full = torch.tensor([p + toks], device="cuda")
            # no cache: only the logits are wanted (transformers' cache refuses a model of linear-attention layers only)
            lp32 = torch.log_softmax(hf32(full, use_cache=False).logits[0].float(), -1)
            lp16 = torch.log_softmax(hf16(full, use_cache=False).logits[0].float(), -1)
            ref_prefill = hf32(torch.tensor([p], device="cuda"), use_cache=False).logits[0].float()
            hf16_prefill = hf16(torch.tensor([p], device="cuda"), use_cache=False).logits[0].float()
            scale = ref_prefill.abs().max().item()
            for side, logits in (("engine_prefill", ours_prefill), ("hf16_prefill", hf16_prefill)):
                err = (logits - ref_prefill).abs().amax(-1)[keep]
                worst[side] = max(worst[side], err.max().item() / scale if err.numel() else 0.0)
            if forced:                  # routed as float32: every position, against HF bf16's error at every position
                err = (forced[i] - ref_prefill).abs().amax(-1)
                worst["engine_forced_prefill"] = max(worst["engine_forced_prefill"], err.max().item() / scale)
                err = (hf16_prefill - ref_prefill).abs().amax(-1)
                worst["hf16_all_prefill"] = max(worst["hf16_all_prefill"], err.max().item() / scale)
            rows = [len(p) - 1 + j for j in range(len(toks))]
            for j, (r, t) in enumerate(zip(rows, toks)):
                if tie[r]:
                    continue
                err = abs(o.logprobs[j][t].logprob - lp32[r, t].item())
                if err > worst["engine_decode"]:   # where it is, and how near a routing tie that row is
                    worst_row = (i, j, round(err, 4), round(margin[r].item(), 4))
                worst["engine_decode"] = max(worst["engine_decode"], err)
                worst["hf16_decode"] = max(worst["hf16_decode"], abs(lp16[r, t].item() - lp32[r, t].item()))
                agree += int(lp32[r].argmax().item() == t)
                if lp32[r].argmax().item() != t:        # how far below float32's best our greedy token is
                    flips.append((i, j, round((lp32[r].max() - lp32[r, t]).item(), 4), round(margin[r].item(), 4)))
                hf16_agree += int(lp16[r].argmax().item() == lp32[r].argmax().item())
                total += 1
            top2 = lp32[rows[0]].topk(2).values
            if lp32[rows[0]].argmax().item() != toks[0] and not tie[rows[0]]:
                first_token_bad.append((i, (top2[0] - top2[1]).item()))
    rows_all = sum(len(p) + len(o.token_ids) for p, o in zip(prompts, outs))
    _report(test="spec_bf16_graphs_vs_hf", architecture=architecture, prompt_lens=list(PROMPT_LENS),
            new_tokens=NEW_TOKENS, **{f"max_{k}_err": v for k, v in worst.items()},
            hf32_argmax_agree=f"{agree}/{total}", hf16_vs_hf32_argmax_agree=f"{hf16_agree}/{total}",
            first_token_differs=first_token_bad, decode_flips=flips, routing_ties=f"{len(tied)}/{rows_all}",
            worst_decode_row=worst_row)
    # a first token may differ from float32 only at a near-tie: a top-2 gap within bf16 noise, which HF's own bf16
    # run measures on these weights (twice its worst logprob error), and never less than NEAR_TIE
    near_tie = max(NEAR_TIE, 2 * worst["hf16_decode"])
    bad = [(i, gap) for i, gap in first_token_bad if gap >= near_tie]
    assert not bad, (f"{architecture}: first greedy token differs from HF float32 (request, top-2 gap) {bad}; "
                     f"bf16 near-tie bound {near_tie:.3f}")
    # prefill logits relative to the largest logit, decode as the logprob of each chosen token
    assert worst["engine_prefill"] <= max(3 * worst["hf16_prefill"], 0.02), worst
    assert worst.get("engine_forced_prefill", 0.0) <= max(3 * worst.get("hf16_all_prefill", 0.0), 0.02), worst
    assert worst["engine_decode"] <= max(3 * worst["hf16_decode"], 0.05), worst
    # a greedy token may differ from float32's argmax only at a near-tie (the same bf16-noise bound as the first
    # token): counting flips is noise on random tiny weights (HF's own bf16 flips some), a flip at a clear margin
    # is an error
    clear = [f for f in flips if f[2] >= near_tie]
    assert not clear, (f"{architecture}: {agree}/{total} tokens are HF float32's argmax (HF bf16: {hf16_agree}/{total}); "
                       f"flips at a clear margin (request, step, logprob margin, routing margin) {clear}, near-tie bound {near_tie:.3f}")
