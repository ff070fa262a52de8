"""Per-element reads of a list of mappings in config.json (`from: block_configs[*].attention.no_op`, a tuple symbol;
`config_assume` of `list[*].field`): the runtime reader (runtime/loading/hf_config.py) and the compiler's checks
(codegen/resolver_config.py). specs/decilm.yaml's Nemotron-NAS form is the user; tests/test_remote_nemotron_nas.py
serves it."""
from __future__ import annotations

from pathlib import Path

import pytest

from xllm_gen.codegen.compiler import compile_spec
from xllm_gen.codegen.errors import SpecError, SpecErrors
from xllm_gen.runtime.loading.hf_config import ConfigError, ConfigReader

SPECS = Path(__file__).resolve().parent.parent / "specs"
BLOCKS = [{"attention": {"no_op": False, "n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.5}},
          {"attention": {"no_op": True, "n_heads_in_group": None}, "ffn": {"ffn_mult": 2.0}},
          {"attention": {"n_heads_in_group": 4}, "ffn": {"ffn_mult": 3}}]


def _read(hf, assume=None, ignore=()):
    r = ConfigReader(hf, "x.yaml", assume=assume or {}, ignore=ignore)
    r.read("no_op", "bool_tuple", ("block_configs[*].attention.no_op",), item_default=False, optional=True)
    r.read("groups", "int_tuple", ("block_configs[*].attention.n_heads_in_group",), optional=True)
    r.read("mult", "float_tuple", ("block_configs[*].ffn.ffn_mult",))
    return r.finish()


def test_each_element_read_into_a_tuple():
    v = _read({"block_configs": BLOCKS})
    assert v["no_op"] == (False, True, False)          # element 2's absent flag: item_default
    assert v["groups"] == (2, None, 4)                 # element 1's null: None (optional)
    assert v["mult"] == (1.5, 2.0, 3.0)
    assert _read({"block_configs": BLOCKS[:1]})["mult"] == (1.5,)        # the length is the list's (checked by spec)


@pytest.mark.parametrize("blocks, assume, msg", [
    # every key of every element is read, assumed or ignored; an unknown one is refused by its element
    ([BLOCKS[0], {**BLOCKS[1], "ffn": {"ffn_mult": 2.0, "hidden_act": "relu"}}], None,
     r"does not model config.json field\(s\) block_configs\[1\]\.ffn\.hidden_act='relu'"),
    ([BLOCKS[0], {**BLOCKS[1], "attention": {"no_op": True, "sparsify": ["x"]}}], None,
     r"block_configs\[1\]\.attention\.sparsify"),
    # a required field (no item_default, not optional) absent or null in one element
    ([BLOCKS[0], {"attention": {"no_op": True}, "ffn": {}}], None,
     r"'block_configs\[1\]\.ffn\.ffn_mult' is missing \(symbol 'mult'"),
    ([BLOCKS[0], {"attention": {}, "ffn": {"ffn_mult": None}}], None, r"'block_configs\[1\]\.ffn\.ffn_mult' is null"),
    ([{"attention": {"no_op": 1}, "ffn": {"ffn_mult": 1.0}}], None, r"'block_configs\[0\]\.attention\.no_op' = 1 is not a bool"),
    ([BLOCKS[0], "x"], None, r"'block_configs\[1\]' = 'x' is not a mapping"),
    # an assumed per-element value, refused by the element that differs
    ([BLOCKS[0], {**BLOCKS[1], "ffn": {"ffn_mult": 2.0, "replace_with_linear": True}}],
     {"block_configs[*].ffn.replace_with_linear": False}, r"has block_configs\[1\]\.ffn\.replace_with_linear=True"),
])
def test_each_element_refusals_name_the_element(blocks, assume, msg):
    with pytest.raises(ConfigError, match=msg):
        _read({"block_configs": blocks}, assume=assume)


def test_each_element_assumed_and_ignored_keys_pass():
    blocks = [{**b, "ffn": {**b["ffn"], "replace_with_linear": False, "sparsify": None}} for b in BLOCKS]
    blocks[0]["attention"]["note"] = "kept"
    assert _read({"block_configs": blocks}, assume={"block_configs[*].ffn.replace_with_linear": False},
                 ignore=("block_configs[*].attention.note",))["mult"] == (1.5, 2.0, 3.0)
    with pytest.raises(ConfigError, match=r"block_configs\[0\]\.attention\.note='kept'"):
        _read({"block_configs": blocks}, assume={"block_configs[*].ffn.replace_with_linear": False})


def test_absent_list_is_the_symbol_default():
    r = ConfigReader({}, "x.yaml")
    assert r.read("no_op", "bool_tuple", ("block_configs[*].attention.no_op",), item_default=False,
                  optional=True) is None
    with pytest.raises(ConfigError, match=r"no field 'block_configs\[\*\]\.ffn\.ffn_mult'"):
        r.read("mult", "float_tuple", ("block_configs[*].ffn.ffn_mult",))
    with pytest.raises(ConfigError, match=r"'block_configs' = 3 is not a list"):
        ConfigReader({"block_configs": 3}, "x.yaml").read("m", "float_tuple", ("block_configs[*].ffn.ffn_mult",))


def _compile_error(tmp_path, old, new) -> SpecError:
    text = (SPECS / "decilm.yaml").read_text()
    assert old in text, old
    path = tmp_path / "decilm.yaml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises((SpecError, SpecErrors)) as info:
        compile_spec(path)
    err = info.value
    return err.errors[0] if isinstance(err, SpecErrors) else err


NO_OP = '''attention_no_op:         {type: bool_tuple, from: "block_configs[*].attention.no_op", item_default: false, optional: true}'''


@pytest.mark.parametrize("new, msg", [
    (NO_OP.replace("bool_tuple", "bool"), "reads one value per element of a list: the symbol is a tuple"),
    (NO_OP.replace("item_default: false", "item_default: 2"), "item_default: 2 is not an item of a bool_tuple"),
    (NO_OP.replace("block_configs[*].attention.no_op", "block_configs[*]"), "followed by the field of each element"),
    (NO_OP.replace("block_configs[*].attention.no_op", "block_configs[*].attention[*].no_op"), "one `[*]` per path"),
    (NO_OP.replace('"block_configs[*].attention.no_op"', "attention_no_op"), "only a per-element read"),
])
def test_each_element_spec_errors_are_located(tmp_path, new, msg):
    err = _compile_error(tmp_path, NO_OP, new)
    assert msg in err.message
    assert "attention_no_op" in err.message and err.location is not None


def test_short_variant_list_is_a_located_error(tmp_path):
    """A variant whose per-element list is shorter than the layers: the spec's guard names it at compile time."""
    err = _compile_error(tmp_path, "     attention_no_op: [false, false, false,", "     attention_no_op: [")
    assert "kv_heads_per_layer" in err.message
