"""Looped decoders (`layers.stored_as`), stream rewrites over carried values (`decoder.schedule`), checkpoint tensors
split into equal chunks (`checkpoint_renames` with a list) and the gate projection's bias (`out_gate.bias`), as
HRM-Text (specs/hrm_text.yaml) uses them.

The tiny checkpoint: 3 layers per stack, H_cycles 2, L_cycles 3 (24 executed layers: passes L L L H L L L H of 3
layers each), a random z_L_init, gate / q / k / v stored as one `attn.gqkv_proj` tensor.

- the engine's modules: 24 executed layers, each its own KV cache; the passes of a stack share its parameters
  (layer 3's are layer 0's objects, layer 9's, the first H pass, are not), named after their first layer;
- greedy parity with transformers (the spec battery and the conformance battery, features ON, do it at TP 1 / 2);
- sensitivity (slow): zeroing z_L_init or exchanging the gate's and q's chunks of gqkv changes transformers' tokens
  and the engine follows; spec mutants that skip a pass's final norm, start z_L from the embedding, or read the
  split in another order load and differ from transformers (verify);
- located compile errors for a `stored_as` without a layer placeholder, an unknown value or norm in a rewrite, and
  a split of one name; a split whose rows do not divide is refused at load by name.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from xllm_gen.codegen import cli

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "specs" / "hrm_text.yaml"
ARCH = "HrmTextForCausalLM"
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [7, 300, 12, 64, 9, 123, 77, 2, 31, 400, 18, 55, 6]]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint(ARCH)


def _engine_tokens(path, n: int = 6) -> list[list[int]]:
    from xllm_gen import LLM, SamplingParams
    with LLM(str(path), device="cpu", dtype="float32") as llm:
        out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in out]


def _hf_tokens(path, n: int = 6) -> list[list[int]]:
    from hf_ref import hf_greedy
    return hf_greedy(path, PROMPTS, n)


def test_passes_share_their_stack_and_keep_their_caches(ckpt):
    from xllm_gen import LLM
    with LLM(str(ckpt), device="cpu", dtype="float32") as llm:
        runner = llm.engine.runner
        layers = runner.model.model.layers
        assert len(layers) == 24
        assert layers[0].stored_as == "model.L_module.layers.0." and layers[9].stored_as == "model.H_module.layers.0."
        assert layers[3].self_attn.qkv_proj.weight is layers[0].self_attn.qkv_proj.weight
        assert layers[21].mlp.down_proj.weight is layers[9].mlp.down_proj.weight
        assert layers[9].self_attn.qkv_proj.weight is not layers[0].self_attn.qkv_proj.weight
        assert runner.attn_layers == [layer.self_attn.attn for layer in layers]      # a KV cache per executed layer
        names = {n for n, _ in runner.model.named_parameters()}
        assert "model.layers.9.self_attn.gate_proj.weight" in names
        assert "model.layers.3.self_attn.gate_proj.weight" not in names
        assert "model.z_L_init" in names
        assert [on[4] or on[5] for on in runner.model.model.before_layer_on] == [i % 3 == 0 for i in range(24)]


def _mutated(ckpt, tmp_path, edit) -> Path:
    from safetensors.torch import load_file, save_file
    out = tmp_path / "mutated"
    shutil.copytree(ckpt, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _zero_z_l_init(t):
    t["model.z_L_init"] = torch.zeros_like(t["model.z_L_init"])


def _swap_gate_and_q(t):
    for name in [n for n in t if n.endswith("attn.gqkv_proj.weight")]:
        g, q, k, v = t[name].chunk(4)
        t[name] = torch.cat([q, g, k, v]).contiguous()


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.parametrize("edit", [_zero_z_l_init, _swap_gate_and_q], ids=["zero_z_L_init", "swap_gate_q"])
def test_checkpoint_sensitivity(ckpt, tmp_path, edit):
    """z_L_init and the order of the split are load-bearing: transformers' tokens change and the engine follows."""
    out = _mutated(ckpt, tmp_path, edit)
    want = _hf_tokens(out)
    assert want != _hf_tokens(ckpt)
    assert _engine_tokens(out) == want


@pytest.mark.slow
@pytest.mark.parametrize("old,new", [
    # a pass's final norm skipped for z_L
    ("""        set: z_l
        sum: [{norm: stack_norm, of: stream}]""", """        set: z_l
        sum: [stream]"""),
    # z_L starting from the embedding instead of z_L_init
    ("{when: \"layer == 0\", set: z_l, sum: [z_L_init]}", "{when: \"layer == 0\", set: z_l, sum: [stream]}"),
    # the split read as q | gate | k | v
    ("[.self_attn.gate_proj.weight, .self_attn.q_proj.weight,", "[.self_attn.q_proj.weight, .self_attn.gate_proj.weight,"),
], ids=["no_pass_norm", "z_l_from_embedding", "split_order"])
def test_spec_mutants_differ(ckpt, tmp_path, old, new):
    from codegen.verify import verify
    text = SPEC.read_text()
    assert old in text
    path = tmp_path / "hrm_mutant.yaml"
    path.write_text(text.replace(old, new).replace("extends: llama.yaml", f"extends: {ROOT / 'specs' / 'llama.yaml'}"))
    shutil.copy(ROOT / "specs" / "spec.schema.json", tmp_path / "spec.schema.json")
    report = verify(path, ckpt, max_tokens=4, prompt_lens=(9,))
    assert not report.ok and not report.refused, report.text()


def _compile(tmp_path, capsys, text):
    path = tmp_path / "hrm_bad.yaml"
    path.write_text(text.replace("extends: llama.yaml", f"extends: {ROOT / 'specs' / 'llama.yaml'}"))
    shutil.copy(ROOT / "specs" / "spec.schema.json", tmp_path / "spec.schema.json")
    code = cli.main(["--dry-run", str(path)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("old,new,msg", [
    ("stored_as: >-", "stored_as: model.layers.0.\n    old_stored_as: >-", "old_stored_as"),
    ("{when: \"layer == 0\", set: z_h, sum: [stream]}", "{when: \"layer == 0\", set: z_h, sum: [strem]}",
     "no value 'strem'"),
    ("sum: [{norm: stack_norm, of: stream}]", "sum: [{norm: stack_nrm, of: stream}]", "no norm 'stack_nrm'"),
    ("'\\.mlp\\.gate_up_proj\\.weight$': [.mlp.gate_proj.weight, .mlp.up_proj.weight]",
     "'\\.mlp\\.gate_up_proj\\.weight$': [.mlp.gate_proj.weight]", "a split names two or more"),
])
def test_located_errors(tmp_path, capsys, old, new, msg):
    text = SPEC.read_text()
    assert old in text
    code, err = _compile(tmp_path, capsys, text.replace(old, new, 1))
    assert code == 2 and "hrm_bad.yaml:" in err and msg in err, err


def test_stored_as_needs_a_layer_placeholder(tmp_path, capsys):
    text = SPEC.read_text()
    start = text.index("    stored_as: >-")
    end = text.index("    blocks:", start)
    code, err = _compile(tmp_path, capsys, text[:start] + "    stored_as: model.layers.0.\n" + text[end:])
    assert code == 2 and "hrm_bad.yaml:" in err and "names one prefix for every layer" in err, err


def test_split_reads_chunks_and_refuses_uneven_rows(tmp_path):
    from safetensors.torch import save_file

    from xllm_gen.runtime.loading.loader import Checkpoint, CheckpointError
    t = torch.arange(24.0).reshape(6, 4)
    save_file({"a.w": t, "b.w": torch.zeros(5, 2)}, str(tmp_path / "model.safetensors"))
    ck = Checkpoint(tmp_path, [(r"^a\.w$", ("x.w", "y.w", "z.w")), (r"^b\.w$", ("p.w", "q.w"))])
    assert set(ck.names()) == {"x.w", "y.w", "z.w", "p.w", "q.w"}
    y = ck.slice("y.w")
    assert y.get_shape() == [2, 4]
    assert torch.equal(y[:], t[2:4]) and torch.equal(y[1:2, 1:3], t[3:4, 1:3])
    with pytest.raises(CheckpointError, match=r"'b.w' has 5 rows"):
        ck.slice("p.w")


def test_schedule_reading_an_unset_value_is_refused_at_build():
    from xllm_gen.runtime.layers import check_schedule
    check_schedule([(True, False), (False, True)], [(), ("z",)], ["z", "stream"])
    with pytest.raises(ValueError, match=r"before layer 1, rewrite 1 reads 'z'"):
        check_schedule([(False, False), (False, True)], [(), ("z",)], ["z", "stream"])
