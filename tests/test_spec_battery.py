"""The spec-level regression battery: the same checks for every spec in specs/, found by globbing.

Nothing is listed per spec. Each specs/*.yaml is read as YAML (its `architectures[0]` and `name`, and its
`config:` section with the `extends` chain followed) and gets:

  (a) generated/<name>/ is up to date (`xllm-gen --check`);
  (b) the resolved spec equals tests/golden/<name>.resolved.txt (`xllm-gen --explain`);
  (c) greedy parity with Hugging Face transformers (float32, CPU) on the tiny checkpoint of the architecture
      (tests/fixtures/tiny_hf.py): prompts of 3, 9, 17 and 30 tokens (the tiny sliding window is 6) in one
      `LLM.generate` call, block_size 4, 16 new tokens, at TP 1 and at TP 2 (gloo; marked slow: --runslow), one
      engine each; a vision-language architecture adds one image request (TP 1 by default for the specs the
      conformance battery does not serve with their features ON: `_greedy_cases`);
  (d) rope scaling: for every `type: rope` config symbol, one tiny checkpoint per non-default rope type in
      its `values` (standard parameters in ROPE_ARMS, chosen so that scaling matters at these lengths),
      greedy parity at TP 1 (and HF's own output must differ from the unscaled checkpoint's);
  (e) sliding window: where the architecture's tiny config uses a sliding window, serving the checkpoint
      with `sliding_window` removed from config.json changes the output (and matches HF without it); by default
      for each window field's first spec and the specs the conformance battery does not cover (`_sliding_cases`).

Checkpoints are built once per session (conftest `tiny_checkpoint`); HF and engine tokens are computed once
per checkpoint and reused across arms. Graph vs eager runs on a GPU host (tests/gpu/).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures.tiny_hf import SPECIAL_TOKENS, edit_config, text_config_of, tiny_config, tokenizer_size
from hf_ref import hf_greedy, hf_model, hf_vl_greedy, hf_vl_inputs
from spec_sample import sampled
from spec_yaml import read_yaml

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LENS = (3, 9, 17, 30)
# the conformance batteries' default runs compare the shortest and the longest (one block; several, with a window's
# and a chunk's edges), all four with --runslow: transformers' generate is most of their time, per prompt
DEFAULT_PROMPT_LENS = (3, 30)
MAX_TOKENS = 16
BLOCK_SIZE = 4

# Standard parameters per rope type (transformers 5's rope_parameters form; rope_theta is added from the tiny
# config). Factor 4 with an original context of 16 positions, so that scaling changes the output at the
# prompt lengths above. "dynamic" is the default rope up to max_position_embeddings in HF (it rescales only
# beyond it, per forward call, which a paged KV cache cannot reproduce): its arm checks parity within the
# context and that a prompt past a shortened max_position_embeddings is refused, never served differently.
ROPE_ARMS: dict[str, dict[str, Any]] = {
    "proportional": {"partial_rotary_factor": 0.25, "factor": 2.0},
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 4.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}
WITHIN_CONTEXT_ONLY = ("dynamic",)


def _longrope_arm(config, node) -> dict[str, Any]:
    """longrope: a factor list per rotating frequency (their number follows the tiny config's rotary dims); the
    original context is the tiny max_position_embeddings, so that the engine (max_model_len = max_position_embeddings)
    and transformers (every sequence within it) both use short_factor (tests/test_longrope.py covers long_factor)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    prf = (node or {}).get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    half = int(head_dim * prf) // 2
    rng = np.random.default_rng(3)
    arm = {"short_factor": [round(float(x), 3) for x in rng.uniform(1.0, 4.0, half)],
           "long_factor": [round(float(x), 3) for x in rng.uniform(4.0, 16.0, half)],
           "original_max_position_embeddings": config.max_position_embeddings}
    if "short_mscale" in inspect.getsource(type(config)):     # PhiMoE's config requires the per-regime mscale
        arm.update(short_mscale=1.25, long_mscale=1.5)
    return arm


# rope types whose standard parameters depend on the tiny config: fn(config, its rope mapping) -> parameters
ROPE_ARM_FNS = {"longrope": _longrope_arm}
UNSCALED_ROPE_TYPES = ("default", "mrope")   # the parity arm (c) covers them


# ------------------------------------------------------------------------------------------- spec reading
@dataclasses.dataclass(frozen=True)
class RopeSymbol:
    symbol: str
    location: str               # dotted config.json path of the rope-parameters dict
    values: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SpecCase:
    path: Path
    name: str
    architecture: str | None
    rope: tuple[RopeSymbol, ...] = ()
    error: str | None = None

    @property
    def rel(self) -> str:
        return str(self.path.relative_to(ROOT))

    def check(self) -> None:
        if self.error:
            pytest.fail(f"{self.rel}: {self.error}")


def _spec_config(path: Path, depth: int = 0) -> dict:
    """The spec's `config:` section with its `extends` chain merged in (a child's entry updates its parent's)."""
    doc = read_yaml(path) or {}
    config: dict = {}
    if doc.get("extends") and depth < 8:
        config = _spec_config(path.parent / doc["extends"], depth + 1)
    for key, value in (doc.get("config") or {}).items():
        base = config.get(key)
        config[key] = {**base, **value} if isinstance(base, dict) and isinstance(value, dict) else value
    return config


def _rope_location(from_: Any) -> str:
    paths = [from_] if isinstance(from_, str) else list(from_ or [])
    for p in paths:
        parts = p.split(".")
        if parts[-1] == "rope_type":
            parts = parts[:-1]
        if len(parts) > 1 and parts[-2] == "rope_parameters":   # a per-layer-type mapping (Gemma 3's full_attention)
            return ".".join(parts)
        if parts and parts[-1] in ("rope_parameters", "rope_scaling"):
            return ".".join(parts[:-1] + ["rope_parameters"])
    return "rope_parameters"


def _read_spec(path: Path) -> SpecCase:
    try:
        doc = read_yaml(path) or {}
        name = doc.get("name") or path.stem
        archs = doc.get("architectures") or []
        if not archs:
            return SpecCase(path, name, None, error="no `architectures` list")
        rope = tuple(
            RopeSymbol(sym, _rope_location(entry.get("from")), tuple(entry.get("values") or ()))
            for sym, entry in _spec_config(path).items()
            if isinstance(entry, dict) and entry.get("type") == "rope"
        )
        return SpecCase(path, name, archs[0], rope)
    except Exception as e:  # a broken spec fails its own tests, not the collection of the others
        return SpecCase(path, path.stem, None, error=f"cannot read the spec: {type(e).__name__}: {e}")


SPECS = [_read_spec(p) for p in sorted((ROOT / "specs").glob("*.yaml"))]


def _uses_sliding_window(architecture: str | None) -> bool:
    """Whether the architecture's tiny config (tiny_hf) has layers with a sliding window."""
    if architecture is None:
        return False
    try:
        text = text_config_of(tiny_config(architecture))
    except Exception:
        return False
    if getattr(text, "sliding_window", None) is None or getattr(text, "use_sliding_window", True) is False:
        return False
    layer_types = getattr(text, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types


def _rope_cases():
    """Every (spec, rope symbol, scaled rope type). The default run keeps a fast arm: each rope type's first spec
    (the scaling itself), and each spec's first scaled type (its rope wiring) where the conformance battery's
    features-ON parity does not already turn a scaled rope on for it (tests/conformance/families.py takes the
    first of llama3 / yarn / linear the symbol admits); the rest run with --runslow."""
    cases, seen_specs, seen_types = [], set(), set()
    for spec in SPECS:
        for sym in spec.rope:
            wired_by_conformance = any(t in sym.values for t in ("llama3", "yarn", "linear"))
            for rope_type in sym.values:
                if rope_type in UNSCALED_ROPE_TYPES:
                    continue
                fast = rope_type not in seen_types or (spec.name not in seen_specs and not wired_by_conformance)
                seen_specs.add(spec.name)
                seen_types.add(rope_type)
                cases.append(pytest.param(spec, sym, rope_type, id=f"{spec.name}-{sym.symbol}-{rope_type}",
                                          marks=() if fast else pytest.mark.slow))
    return cases


ROPE_CASES = _rope_cases()
# the config.json fields that set the window where `sliding_window` is not the only one: ModernBERT decoder's config
# class derives it from local_attention (local_attention // 2) unless config.json states it; dropping both restores
# the class default, a window longer than the prompts
WINDOW_FIELDS = {"ModernBertDecoderForCausalLM": ("sliding_window", "local_attention")}


def _window_fields(architecture: str) -> tuple[str, ...]:
    """The config.json field(s) that set the architecture's window: `sliding_window`, the one its config class maps
    it to (RecurrentGemma's attention_window_size), or WINDOW_FIELDS' own."""
    key = getattr(text_config_of(tiny_config(architecture)), "attribute_map", {}).get("sliding_window",
                                                                                     "sliding_window")
    return WINDOW_FIELDS.get(architecture, (key,))


def _sliding_cases():
    """Every spec whose tiny config has a window. The default run keeps each window field's first spec and every
    spec that the conformance battery's features-ON parity does not serve by default; the rest run with --runslow
    (their features-ON parity already runs with the window on, at prompts longer than it, where this arm's fixture
    check shows that the window changes transformers' tokens)."""
    from conformance import families as F
    covered = {p.spec.name for p in F.served_plans() if p.status == "served" and p.accepted}
    cases, seen = [], set()
    for spec in SPECS:
        if not _uses_sliding_window(spec.architecture):
            continue
        fields = _window_fields(spec.architecture)
        fast = spec.name not in covered or fields not in seen
        seen.add(fields)
        cases.append(pytest.param(spec, id=spec.name, marks=() if fast else pytest.mark.slow))
    return cases


SLIDING_CASES = _sliding_cases()


def _ids(specs):
    return [s.name for s in specs]


def _needs_transformers(spec: SpecCase) -> None:
    """The arms that compare with transformers need its class of the architecture. A remote-code family (the
    release's own modeling code, `auto_map`, served by vLLM with trust_remote_code: InternLM2, Baichuan, ...) has
    none: its parity is checked against a plain-PyTorch reference of the published modeling code in
    tests/test_remote_<name>.py, which must exist (else the spec would be compared with nothing)."""
    import transformers
    spec.check()
    if spec.architecture and hasattr(getattr(transformers, spec.architecture, None), "config_class"):
        return
    ref = ROOT / "tests" / f"test_remote_{spec.name}.py"
    if not ref.exists():
        pytest.fail(f"{spec.rel}: transformers {transformers.__version__} has no class {spec.architecture!r} and "
                    f"there is no {ref.relative_to(ROOT)} comparing the spec with a reference of its modeling code")
    pytest.skip(f"{spec.architecture} is remote code (no transformers class): {ref.relative_to(ROOT)} checks it")


# ---------------------------------------------------------------------------------------------- requests
def _image(h: int, w: int, seed: int):
    from PIL import Image
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))


def _requests(ckpt: Path, prompt_lens=PROMPT_LENS) -> list[dict]:
    """Token-id prompts of `prompt_lens` tokens (ordinary BPE tokens, no special ones); plus one image request
    for a vision-language checkpoint."""
    import json

    rng = np.random.default_rng(0)
    n_regular = tokenizer_size() - len(SPECIAL_TOKENS)
    reqs: list[dict] = [{"prompt_token_ids": rng.integers(0, n_regular, n).tolist()} for n in PROMPT_LENS]
    reqs = [r for r, n in zip(reqs, PROMPT_LENS) if n in prompt_lens]      # the same prompts, a subset
    if "vision_config" in json.loads((ckpt / "config.json").read_text()):
        img = "<|vision_start|><|image_pad|><|vision_end|>"
        reqs.append({"prompt": f"{img}What is in this picture?", "multi_modal_data": {"image": [_image(64, 96, 1)]}})
    return reqs


def _fresh(model) -> None:
    """Forget per-request state HF keeps on the model: Qwen-VL's rope_deltas, and dynamic rope's grown
    frequencies (HF grows them with the longest sequence seen and keeps them for the next prompt)."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "rope_deltas"):
        inner.rope_deltas = None
    for m in model.modules():
        if hasattr(m, "original_inv_freq") and hasattr(m, "original_max_seq_len"):
            m.register_buffer("inv_freq", m.original_inv_freq.clone(), persistent=False)
            m.max_seq_len_cached = m.original_max_seq_len


LOGPROB_TOP = 5           # engine log-probabilities compared per step
LOGPROB_TOL = 1e-3        # float32, absolute (nats)


class Tokens:
    """HF and engine greedy tokens per checkpoint, computed once per session, with each step's log-probabilities
    (HF: the log_softmax of its logits; engine: its top LOGPROB_TOP and the chosen token's) for
    `assert_same_distribution`."""

    def __init__(self, prompt_lens=PROMPT_LENS):
        self.prompt_lens = prompt_lens            # which of the battery's prompts (a default arm may take fewer)
        self._hf: dict[str, list[list[int]]] = {}
        self._hf_lp: dict[str, list] = {}
        self._engine: dict[tuple[str, int], list[list[int]]] = {}
        self._engine_lp: dict[tuple[str, int], list] = {}

    def hf(self, ckpt: Path) -> list[list[int]]:
        key = str(ckpt)
        if key not in self._hf:
            model = hf_model(ckpt)
            out, lps = [], []
            for r in _requests(ckpt, self.prompt_lens):
                _fresh(model)
                if "multi_modal_data" in r:
                    inputs = hf_vl_inputs(ckpt, r["prompt"], images=r["multi_modal_data"]["image"])
                    out.append(hf_vl_greedy(ckpt, inputs, MAX_TOKENS))
                    lps.append(None)
                else:
                    out.append(hf_greedy(ckpt, [r["prompt_token_ids"]], MAX_TOKENS, lps)[0])
            _fresh(model)
            self._hf[key], self._hf_lp[key] = out, lps
        return self._hf[key]

    def engine(self, ckpt: Path, tp: int = 1) -> list[list[int]]:
        key = (str(ckpt), tp)
        if key not in self._engine:
            from xllm_gen import LLM, SamplingParams

            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=LOGPROB_TOP)
            with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                     tensor_parallel_size=tp) as llm:
                outs = llm.generate(_requests(ckpt, self.prompt_lens), params)
            self._engine[key] = [o.outputs[0].token_ids for o in outs]
            self._engine_lp[key] = [o.outputs[0].logprobs for o in outs]
        return self._engine[key]

    def hf_logprobs(self, ckpt: Path) -> list:
        """Per request, HF's log_softmax [vocab] per generated step (None for an image request)."""
        self.hf(ckpt)
        return self._hf_lp[str(ckpt)]

    def distribution_error(self, ckpt: Path, tp: int = 1) -> list[tuple[float, int | None]]:
        """Per text request: (max |engine - HF| log-probability over the engine's entries, first step over
        LOGPROB_TOL), over the steps where both have generated the same tokens so far."""
        from xllm_gen.codegen.verify import logprob_row_error
        hf_tokens, engine_tokens = self.hf(ckpt), self.engine(ckpt, tp)
        out = []
        for want, got, ref, mine in zip(hf_tokens, engine_tokens, self._hf_lp[str(ckpt)],
                                        self._engine_lp[(str(ckpt), tp)]):
            if ref is None or not mine:
                continue
            err, bad = 0.0, None
            for step, (r, m) in enumerate(zip(ref, mine)):
                if want[:step] != list(got[:step]):
                    break
                e = logprob_row_error(m, r)
                err = max(err, e)
                if bad is None and e > LOGPROB_TOL:
                    bad = step
            out.append((err, bad))
        return out

    def assert_same_distribution(self, ckpt: Path, tp: int, what: str) -> None:
        """What comes after the last layer (logit scales, soft-caps) may keep every argmax: the engine's
        log-probabilities must equal HF's too."""
        bad = [(i, e, s) for i, (e, s) in enumerate(self.distribution_error(ckpt, tp)) if s is not None]
        assert not bad, f"{what}: engine log-probabilities != HF's (> {LOGPROB_TOL}) for requests " + "; ".join(
            f"#{i} from step {s} (max error {e:.3g})" for i, e, s in bad)


@pytest.fixture(scope="session")
def tokens() -> Tokens:
    return Tokens()


def _assert_same(got, want, what: str) -> None:
    bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert len(got) == len(want) and not bad, f"{what}: engine != HF for requests " + "; ".join(
        f"#{i} (prompt {PROMPT_LENS[i] if i < len(PROMPT_LENS) else 'image'}): {g} != {w}" for i, g, w in bad)


def _unreplicable_split(spec, message: str) -> bool:
    """Whether a TP refusal names only segments that the spec declares unreplicable (a mixture of attention heads'
    KV heads, whose query heads are tied to them): the checkpoint's shapes (e.g. one KV head at TP 2) cannot be split,
    refused by name at load, never served wrong. A replicable segment (plain attention's KV heads) is never excused."""
    import re as _re

    from xllm_gen.codegen.compiler import compile_spec
    found = _re.findall(r"^\s*- (\S+): segment '([^']+)' has \d+ units: not divisible by tensor parallel size",
                        message, _re.M)
    if "is not possible for this checkpoint" not in message or not found:
        return False
    params = {p.name: p for p in compile_spec(spec.path).ir.params}
    for name, seg in found:
        p = params.get(name.replace("*", "{i}"))
        segs = [s for s in (p.segments if p is not None else ()) if s.name == seg]
        if not segs or any(s.replicate_ok for s in segs):
            return False
    return True


def engine_or_tp_refusal(tokens, ckpt, tp: int, spec) -> list | None:
    """The engine's tokens at TP `tp`, or None where a spec that declares `tensor_parallel: {sizes: [1]}` is refused
    at TP > 1 naming tensor parallelism (a primitive that a split by heads cannot run, e.g. differential attention):
    refused by name, never served wrong."""
    try:
        return tokens.engine(ckpt, tp)
    except Exception as e:        # noqa: BLE001 - the refusal is checked below, anything else re-raised
        if tp > 1 and _unreplicable_split(spec, str(e)):
            return None
        if tp == 1 or "tensor_parallel_size=1" not in str(e):
            raise
        sizes = (read_yaml(spec.path).get("tensor_parallel") or {}).get("sizes")
        assert sizes == [1], f"{spec.rel}: refused at TP {tp} ({e}) but declares tensor_parallel sizes {sizes}"
        return None


# ------------------------------------------------------------------------------------------------ arms
def _cli(*args) -> subprocess.CompletedProcess:
    """`xllm-gen ARGS` run in this process, from the repository root (a subprocess would spend ~4 s importing
    torch for each of the 2 x specs calls; test_codegen.py runs the real command line)."""
    from xllm_gen.codegen.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:
            rc = e.code
    return subprocess.CompletedProcess(list(args), rc, out.getvalue(), err.getvalue())


# per spec under --runslow: the default run checks every spec's generated/ in one CLI call
# (tests/test_codegen.py::test_check_passes_on_committed_tree), at a third of the cost
@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS, ids=_ids(SPECS))
def test_generated_is_up_to_date(spec):
    spec.check()
    r = _cli("--check", spec.rel)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("spec", sampled("golden", SPECS, lambda s: s.name), ids=_ids(SPECS))
def test_resolved_spec_equals_golden(spec):
    spec.check()
    r = _cli("--explain", spec.rel)
    assert r.returncode == 0, r.stderr
    golden = ROOT / "tests" / "golden" / f"{spec.name}.resolved.txt"
    assert golden.exists(), f"no golden for {spec.name}: xllm-gen --explain {spec.rel} > {golden.relative_to(ROOT)}"
    assert r.stdout == golden.read_text(), f"resolved spec changed; refresh {golden.relative_to(ROOT)} if intended"


def _greedy_cases():
    """(spec, tp) of the default-config greedy parity arm. TP 2 starts a second process per spec (~6 s each on two
    cores): `slow` (--runslow), like the other long multi-process tests; the default run keeps TP 2 parity through
    tests/test_tp.py and test_moe.py. TP 1 runs by default for every spec that the conformance battery's features-ON
    parity does not serve by default (a vision-language spec, a class transformers does not enumerate, a guard that
    refuses every feature toggle); the rest with --runslow. So every spec is checked against transformers by default, with its features ON or off, and the default
    suite stays within its time budget as specs are added."""
    from conformance import families as F
    covered = {p.spec.name for p in F.served_plans() if p.status == "served" and p.accepted}
    cases = []
    for spec in SPECS:
        default = spec.name not in covered
        cases.append(pytest.param(spec, 1, marks=() if default else pytest.mark.slow, id=f"{spec.name}-tp1"))
        cases.append(pytest.param(spec, 2, marks=pytest.mark.slow, id=f"{spec.name}-tp2"))
    return cases


@pytest.mark.engine
@pytest.mark.parametrize("spec, tp", _greedy_cases())
def test_greedy_matches_hf(spec, tp, tiny_checkpoint, tokens):
    _needs_transformers(spec)
    ckpt = tiny_checkpoint(spec.architecture)
    got = engine_or_tp_refusal(tokens, ckpt, tp, spec)
    if got is not None:
        _assert_same(got, tokens.hf(ckpt), f"{spec.name} ({spec.architecture}) tp={tp}")
        tokens.assert_same_distribution(ckpt, tp, f"{spec.name} ({spec.architecture}) tp={tp}")


@pytest.mark.engine
@pytest.mark.parametrize("spec, sym, rope_type", ROPE_CASES)
def test_rope_scaling_matches_hf(spec, sym, rope_type, tiny_checkpoint, tokens):
    _needs_transformers(spec)
    if rope_type not in ROPE_ARMS and rope_type not in ROPE_ARM_FNS:
        pytest.fail(f"{spec.rel}: config.{sym.symbol} admits rope type {rope_type!r}, which has no standard "
                    f"parameters in ROPE_ARMS (tests/test_spec_battery.py): add them there")
    base_cfg = tiny_config(spec.architecture)
    node: Any = base_cfg
    for part in sym.location.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    theta = (node or {}).get("rope_theta")
    assert theta is not None, f"the tiny {spec.architecture} config has no rope_theta at {sym.location}"
    level = sym.location.rpartition(".")[0]
    prefix = f"{level}." if level else ""
    arm = ROPE_ARMS[rope_type] if rope_type in ROPE_ARMS else ROPE_ARM_FNS[rope_type](
        text_config_of(base_cfg), node)
    overrides = {sym.location: {"rope_type": rope_type, "rope_theta": theta, **arm}}
    ckpt = tiny_checkpoint(spec.architecture, overrides=overrides)
    want = tokens.hf(ckpt)
    if rope_type in WITHIN_CONTEXT_ONLY:
        _assert_same(tokens.engine(ckpt, 1), want, f"{spec.name} rope {rope_type} tp=1 within the context")
        short = tiny_checkpoint(spec.architecture, overrides={**overrides, prefix + "max_position_embeddings": 16})
        _assert_refuses_past_context(short, 17)
        return
    assert want != tokens.hf(tiny_checkpoint(spec.architecture)), (
        f"fixture: rope {rope_type} {overrides} does not change HF's output at these prompt lengths")
    _assert_same(tokens.engine(ckpt, 1), want, f"{spec.name} rope {rope_type} tp=1")


def _assert_refuses_past_context(ckpt: Path, prompt_len: int) -> None:
    """A prompt longer than max_position_embeddings is refused by name, not served with other frequencies."""
    from xllm_gen import LLM, SamplingParams
    from xllm_gen.runtime.engine.llm import InvalidRequestError

    with LLM(model=str(ckpt), device="cpu", dtype="float32", block_size=BLOCK_SIZE) as llm:
        with pytest.raises(InvalidRequestError, match="max_model_len"):
            llm.generate([{"prompt_token_ids": list(range(prompt_len))}], SamplingParams(max_tokens=2))


@pytest.mark.engine
@pytest.mark.parametrize("spec", SLIDING_CASES)
def test_sliding_window_matters(spec, tiny_checkpoint, tokens, tmp_path_factory):
    spec.check()
    ckpt = tiny_checkpoint(spec.architecture)

    # the field's name in config.json: `sliding_window`, or the one the config class maps it to (RecurrentGemma's
    # attention_window_size, whose transformers default is then far beyond the prompts), or the family's own fields
    fields = _window_fields(spec.architecture)
    field = " and ".join(fields)

    def drop_window(cfg: dict) -> None:
        level = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
        for f in fields:
            assert f in level, f"the tiny config.json has no {f}"
            del level[f]

    no_window = edit_config(ckpt, tmp_path_factory.mktemp(f"{spec.name}_no_window"), drop_window)
    assert tokens.hf(no_window) != tokens.hf(ckpt), (
        "fixture: HF's output does not depend on the tiny sliding window at these prompt lengths")
    got = tokens.engine(no_window, 1)
    assert got != tokens.engine(ckpt, 1), (
        f"{spec.name}: removing {field} from config.json does not change the engine's output")
    _assert_same(got, tokens.hf(no_window), f"{spec.name} without {field} tp=1")


@pytest.mark.parametrize("spec", sampled("head_dim", SPECS, lambda s: s.name), ids=_ids(SPECS))
def test_explicit_head_dim_is_read(spec):
    """config.json may state `head_dim` (transformers 5.17's Phi3Config writes it; Gemma 2 / Qwen3 always do):
    every architecture in transformers honours it, so every spec must read it, not refuse or ignore it.
    A head_dim different from hidden / heads must reach the model's Config."""
    from xllm_gen.runtime.loading import registry
    _needs_transformers(spec)
    hf_cfg = tiny_config(spec.architecture)
    cfg = hf_cfg.to_dict()
    level = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    text = getattr(hf_cfg, "text_config", None) or hf_cfg      # attribute names (GPT-J's n_embd is hidden_size)
    if hasattr(text, "allow_global_per_layer_attribute_access"):  # a heterogeneous config (per_layer_config):
        text.allow_global_per_layer_attribute_access = True       # its top-level values
    if "num_attention_heads" not in text.attribute_map and "num_attention_heads" not in level:
        pytest.skip("no attention heads (a recurrent-state model: its head_dim is a mixer size, read as such)")
    level["head_dim"] = 2 * text.hidden_size // text.num_attention_heads   # not the hidden / heads default
    model_module, _ = registry.resolve(cfg)
    if not _hf_reads_head_dim(spec.architecture, level["head_dim"]) or not _hf_reads_config_json(spec.architecture, cfg):
        # transformers computes hidden / heads and ignores the field (GPT-NeoX, Falcon): so must the spec, or refuse
        # it by name where transformers' model cannot run it (ModernBERT decoder's rotary reads it, its attention not)
        try:
            config = model_module.Config.from_hf(cfg)
        except Exception as e:
            assert "head_dim" in str(e), f"{spec.name}: a config.json head_dim refused without naming it: {e}"
            assert not _hf_runs(spec.architecture, level["head_dim"]), \
                f"{spec.name}: transformers runs a config.json head_dim that the spec refuses: {e}"
            return
        assert getattr(config, "head_dim", None) in (None, text.hidden_size // text.num_attention_heads), \
            f"{spec.name}: transformers ignores config.json head_dim, but the spec reads it"
        return
    try:
        config = model_module.Config.from_hf(cfg)
    except Exception as e:
        # a spec may refuse, naming head_dim, only a head_dim that transformers' own model cannot run either (BitNet's
        # attn_sub_norm is a [hidden_size] RMSNorm applied to the heads' [heads * head_dim] output)
        assert "head_dim" in str(e), f"{spec.name}: a config.json head_dim refused without naming it: {e}"
        assert not _hf_runs(spec.architecture, level["head_dim"]), \
            f"{spec.name}: transformers runs a config.json head_dim that the spec refuses: {e}"
        return
    assert config.head_dim == level["head_dim"], f"{spec.name}: config.json head_dim is not read"


def _hf_runs(architecture: str, head_dim: int) -> bool:
    """Whether transformers' tiny model of the architecture runs a forward pass with this config.json head_dim."""
    import torch
    from fixtures.tiny_hf import model_class
    config = tiny_config(architecture, {("text_config.head_dim" if hasattr(tiny_config(architecture), "text_config")
                                         else "head_dim"): head_dim})
    try:
        with torch.no_grad():
            model_class(architecture)(config).eval()(torch.tensor([[1, 2, 3]]))
    except Exception:
        return False
    return True


def _hf_reads_config_json(architecture: str, cfg: dict) -> bool:
    """Whether transformers' model built from this config.json dict differs in shape from the tiny default (a
    config whose head_dim feeds another field only where that field is absent, as the Bailing hybrid's
    linear_head_dim, which its config.json states)."""
    import torch
    from fixtures.tiny_hf import model_class
    base = tiny_config(architecture)
    with torch.device("meta"):
        a = {n: tuple(p.shape) for n, p in model_class(architecture)(base).named_parameters()}
        b = {n: tuple(p.shape) for n, p in model_class(architecture)(type(base).from_dict(cfg)).named_parameters()}
    return a != b


def _hf_reads_head_dim(architecture: str, head_dim: int) -> bool:
    """Whether transformers' model of the architecture changes shape with config.json's head_dim (built on meta)."""
    import torch
    from fixtures.tiny_hf import model_class

    def shapes(**extra):
        try:
            config = tiny_config(architecture, extra or None)
        except AttributeError:      # head_dim is a read-only property of the config class (Falcon): never read
            return None
        with torch.device("meta"):
            return {n: tuple(p.shape) for n, p in model_class(architecture)(config).named_parameters()}
    changed = shapes(**{("text_config.head_dim" if hasattr(tiny_config(architecture), "text_config")
                                   else "head_dim"): head_dim})
    return changed is not None and changed != shapes()
