"""Property-based fuzz of the spec compiler (issue 11, specs): mutants of the real specs in specs/ go
through the CLI entry `xllm_gen.codegen.cli.main([path, "--dry-run", ...])` in-process, each under a
wall-clock alarm. Whatever the mutant, the CLI returns 0 or 2, never raises (no traceback), never hangs,
and on 2 every message line is `PATH:LINE:COL: error: ...`.

Mutations: on the parsed tree (delete a key or item, replace a node with a random scalar / list / mapping
of hostile values, swap two nodes, copy a subtree elsewhere) and on the text (truncate, insert random bytes,
duplicate or replace a line, which gives duplicate keys and broken indentation). A few hand-written hostile
files (alias bomb, deep nesting, recursive anchor, non-UTF-8, NUL in `extends`, a long `extends` chain, a
large file) run through a subprocess too, so the real entry point and exit code are checked.
"""
from __future__ import annotations

import contextlib
import io
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from xllm_gen.codegen.cli import main

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.yaml"))
SOURCE = {s.name: s.read_bytes() for s in SPECS}      # read once: mutants are drawn from a fixed corpus
NAMES = sorted(SOURCE)
LOCATED = re.compile(r"^[^\n]+:\d+:\d+: error: ")
DEADLINE_S = 10.0          # one compile takes ~0.1 s; anything near this is a hang


class _Hang(Exception):
    pass


@pytest.fixture(scope="module")
def workdir():
    """A copy of specs/ (mutants may `extends` their siblings) and an empty --out root."""
    d = Path(tempfile.mkdtemp(prefix="xllm-spec-fuzz-"))
    for name, raw in SOURCE.items():
        (d / name).write_bytes(raw)
    (d / "out").mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def run_cli(path: Path, out_root: Path) -> tuple[int, str]:
    """main([...]) in-process under an alarm; (exit code, stdout + stderr)."""
    buf_out, buf_err = io.StringIO(), io.StringIO()

    def on_alarm(signum, frame):
        raise _Hang(f"xllm-gen did not finish within {DEADLINE_S} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, DEADLINE_S)
    try:
        with contextlib.redirect_stdout(buf_out), contextlib.redirect_stderr(buf_err):
            rc = main([str(path), "--dry-run", "--out", str(out_root)])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return rc, buf_err.getvalue()


def check_outcome(rc: int, err: str, source: str = "") -> None:
    assert rc in (0, 2), f"exit {rc}\n{err}\n--- mutant ---\n{source[:3000]}"
    assert "Traceback" not in err and "internal error" not in err, f"{err}\n--- mutant ---\n{source[:3000]}"
    if rc == 2:
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(" ")]
        assert lines, "exit 2 without a message"
        bad = [ln for ln in lines if not LOCATED.match(ln)]
        assert not bad, f"unlocated error line(s): {bad}\n--- mutant ---\n{source[:3000]}"


# ---------------------------------------------------------------------------------------------- strategies
_IDENTS = ["hidden_size", "num_attention_heads", "head_dim", "rope_theta", "rms_norm_eps", "q", "k", "v", "gate",
           "up", "layer", "x", "neox", "rmsnorm", "attention", "model", "silu", "Qwen3ForCausalLM"]
_EXPRS = ["hidden_size // num_attention_heads", "head_dim ** -0.5", "1 / 0", "hidden_size // 0", "-hidden_size",
          "layer % 2", "len(x)", "undefined_symbol + 1", "rope_theta * 0", "'a' * 3", "[i for i in range(3)]",
          "hidden_size ** 64", "(", "import os", "__import__('os')", "max_position_embeddings * -1",
          "sliding_window if layer % 2 else None", "num_hidden_layers ** 9"]

scalars = st.one_of(
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([2 ** 31, 2 ** 31 - 1, 2 ** 63, -2 ** 63, 10 ** 30, 4096, 151936, 1 << 40]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, -1.0, 1e-300, 1e300, float("nan"), float("inf"), -float("inf"), 0.5]),
    st.booleans(),
    st.none(),
    st.sampled_from(_IDENTS + _EXPRS),
    st.text(max_size=12),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.sampled_from(_IDENTS) | st.text(max_size=6),
                                                                       inner, max_size=3)), max_leaves=8)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _get(node, path):
    for p in path:
        node = node[p]
    return node


def _set(root, path, value):
    parent = _get(root, path[:-1])
    parent[path[-1]] = value


def _delete(root, path):
    parent = _get(root, path[:-1])
    if isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent.pop(path[-1])


@st.composite
def tree_mutant(draw):
    name = draw(st.sampled_from(NAMES))
    data = yaml.safe_load(SOURCE[name].decode())
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(data) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["delete", "replace", "replace", "swap", "copy"]))
        try:
            if op == "delete":
                _delete(data, path)
            elif op == "replace":
                _set(data, path, draw(values))
            else:
                other = draw(st.sampled_from(paths))
                if other[:len(path)] == path or path[:len(other)] == other:
                    continue
                a, b = _get(data, path), _get(data, other)
                _set(data, path, b)
                if op == "swap":
                    _set(data, other, a)
        except (KeyError, IndexError, TypeError):
            continue
    return name, yaml.safe_dump(data, sort_keys=False, allow_unicode=True).encode()


_HOSTILE_NUMBERS = st.sampled_from([0, -1, 1, 2, 3, 7, 2 ** 31 - 1, 2 ** 31, 2 ** 62, -2 ** 31, 0.0, -0.0, -1e-6, 1e-300,
                                     1e300, 0.5, 1.0, 2.5, float("nan"), float("inf"), -float("inf")])


@st.composite
def value_mutant(draw):
    """A leaf that reaches the resolver (a number, a symbol, an expression, a list of numbers) replaced by a
    hostile number, another symbol of the spec, or an expression: the semantic checks, not the schema."""
    name = draw(st.sampled_from(NAMES))
    data = yaml.safe_load(SOURCE[name].decode())
    symbols = sorted(data.get("config", {}))
    leaves = [p for p in _paths(data) if p and p[0] in ("decoder", "lm_head", "vision", "variants", "config",
                                                        "tensor_parallel")
              and isinstance(_get(data, p), (int, float, str)) and not isinstance(_get(data, p), bool)
              and p[-1] not in ("kind", "name", "from", "type", "doc", "norm", "block", "post_norm")]
    for _ in range(draw(st.integers(1, 2))):
        path = draw(st.sampled_from(leaves))
        new = draw(st.one_of(_HOSTILE_NUMBERS, st.sampled_from(symbols or ["x"]), st.sampled_from(_EXPRS),
                             st.lists(_HOSTILE_NUMBERS, min_size=1, max_size=4)))
        _set(data, path, new)
    return name, yaml.safe_dump(data, sort_keys=False, allow_unicode=True).encode()


@st.composite
def text_mutant(draw):
    name = draw(st.sampled_from(NAMES))
    raw = SOURCE[name]
    op = draw(st.sampled_from(["truncate", "bytes", "dup_line", "replace_line"]))
    if op == "truncate":
        return name, raw[:draw(st.integers(0, len(raw)))]
    if op == "bytes":
        at = draw(st.integers(0, len(raw)))
        return name, raw[:at] + draw(st.binary(min_size=1, max_size=8)) + raw[at:]
    lines = raw.split(b"\n")
    i = draw(st.integers(0, len(lines) - 1))
    if op == "dup_line":
        j = draw(st.integers(0, len(lines)))
        lines.insert(j, lines[i])
    else:
        lines[i] = draw(st.sampled_from([b"", b"  x: 1", b"decoder: {}", b"config: [", b"- a", b"  &a b: *a",
                                         b"name: \xff\xfe", b"\t", b"extends: qwen3.yaml", b"variants:",
                                         b"extends: \"\\0\""]))
    return name, b"\n".join(lines)


def _write(workdir: Path, name: str, raw: bytes) -> Path:
    path = workdir / f"mutant_{name}"
    path.write_bytes(raw)
    return path


# ---------------------------------------------------------------------------------------------- properties
def FUZZ(n: int):
    """Fixed seed (CI reproducible), no shrinking (a failure prints its unshrunk mutant; shrinking a compile
    takes minutes), no per-example deadline from hypothesis (run_cli has its own alarm)."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.slow     # the default run compiles every real spec in test_codegen.py's --check of the committed tree
def test_real_specs_compile(workdir):
    for name in NAMES:
        rc, err = run_cli(workdir / name, workdir / "out")
        assert rc == 0, err


@FUZZ(40)
@given(tree_mutant())
def test_tree_mutants(workdir, mutant):
    name, raw = mutant
    rc, err = run_cli(_write(workdir, name, raw), workdir / "out")
    check_outcome(rc, err, raw.decode(errors="replace"))


@FUZZ(45)
@given(value_mutant())
def test_value_mutants(workdir, mutant):
    name, raw = mutant
    rc, err = run_cli(_write(workdir, name, raw), workdir / "out")
    check_outcome(rc, err, raw.decode(errors="replace"))


@FUZZ(40)
@given(text_mutant())
def test_text_mutants(workdir, mutant):
    name, raw = mutant
    rc, err = run_cli(_write(workdir, name, raw), workdir / "out")
    check_outcome(rc, err, raw.decode(errors="replace"))


# ------------------------------------------------------------------------------------ hostile files, by hand
def _bomb(levels=9) -> bytes:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return ("\n".join(lines) + "\n").encode()


HOSTILE = {
    "alias_bomb": (_bomb(), "more than 100000 YAML nodes"),
    "recursive_anchor": (b"name: &x [*x]\n", "refers to its own anchor"),
    "recursive_map": (b"a: &m {b: *m}\n", "refers to its own anchor"),
    "deep_flow": (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nesting deeper than 64"),
    "deep_block": ("".join("  " * i + f"k{i}:\n" for i in range(200)).encode() + b"  " * 200 + b"x\n",
                   "nesting deeper than 64"),
    "latin1": ("# Qwén\nname: x\n".encode("latin-1"), "not UTF-8"),
    "utf16": ("name: x\n".encode("utf-16"), "UTF-16"),
    "utf32": ("name: x\n".encode("utf-32"), "UTF-32"),
    "binary": (bytes(range(256)) * 4, "NUL byte"),
    "control_char": (b"name: a\x01b\n", "control characters"),
    "nul_in_extends": (b'extends: "qwen3\\0.yaml"\nname: x\n', "control character"),
    "newline_in_extends": (b'extends: "qwen3\\n.yaml"\nname: x\n', "control character"),
    "extends_not_str": (b"extends: [qwen3.yaml]\nname: x\n", "`extends` takes the path"),
    "extends_missing": (b"extends: nope.yaml\nname: x\n", "no such spec"),
    "extends_self": (b"extends: hostile_extends_self.yaml\nname: x\n", "cycle"),
    "huge_int": (b"name: x\nspec_version: " + b"9" * 20000 + b"\n", "error"),
    "top_level_list": (b"- a\n- b\n", "mapping at the top level"),
    "empty": (b"", "empty"),
    "too_big": (b"name: x\n" + b"# " + b"x" * (1 << 20) + b"\n", "larger than 1024 KiB"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file(workdir, case):
    raw, expect = HOSTILE[case]
    path = workdir / f"hostile_{case}.yaml"
    path.write_bytes(raw)
    rc, err = run_cli(path, workdir / "out")
    assert rc == 2, err
    check_outcome(rc, err)
    assert expect in err, err
    assert err.startswith(f"{path}:") or f"hostile_{case}.yaml:" in err.splitlines()[0], err


def test_extends_chain_limit_and_cycle(workdir):
    d = workdir / "chain"
    d.mkdir(exist_ok=True)
    shutil.copy(workdir / "qwen3.yaml", d / "c0.yaml")
    for i in range(1, 200):
        (d / f"c{i}.yaml").write_text(f"extends: c{i - 1}.yaml\nname: c{i}\n")
    rc, err = run_cli(d / "c199.yaml", workdir / "out")
    check_outcome(rc, err)
    assert rc == 2 and "`extends` chain longer than 32 specs" in err, err
    rc, err = run_cli(d / "c20.yaml", workdir / "out")        # 21 files: within the limit
    assert rc == 0, err
    (d / "x.yaml").write_text("extends: y.yaml\nname: x\n")
    (d / "y.yaml").write_text("extends: x.yaml\nname: y\n")
    rc, err = run_cli(d / "x.yaml", workdir / "out")
    check_outcome(rc, err)
    assert rc == 2 and "cycle" in err, err


@pytest.mark.parametrize("case", ["alias_bomb", "deep_flow", "latin1", "nul_in_extends"])
def test_hostile_file_subprocess(workdir, case):
    """The installed entry point: exit 2, one located line, no traceback, promptly."""
    raw, expect = HOSTILE[case]
    path = workdir / f"sub_{case}.yaml"
    path.write_bytes(raw)
    proc = subprocess.run([sys.executable, "-m", "xllm_gen.codegen.cli", str(path), "--dry-run"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    check_outcome(proc.returncode, proc.stderr)
    assert expect in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# ------------------------------------------------------------------------------------------ numeric fields
def _set_path(data, path, value):
    node = data
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


_ATTN = ("decoder", "layers", "blocks", "self_attn")
NUMERIC = [   # (spec, path, bad value, words of the message); every one is refused at the node it names
    ("qwen3.yaml", ("decoder", "layers", "blocks", "input_layernorm", "eps"), -1e-6, "must be > 0"),
    ("qwen3.yaml", ("decoder", "layers", "blocks", "input_layernorm", "eps"), 0.0, "must be > 0"),
    ("qwen3.yaml", ("decoder", "layers", "blocks", "input_layernorm", "eps"), float("nan"), "finite"),
    ("qwen3.yaml", ("decoder", "layers", "blocks", "input_layernorm", "eps"), 2.0, "must be < 1.0"),
    ("qwen3.yaml", ("decoder", "norm", "eps"), float("inf"), "finite"),
    ("qwen3.yaml", _ATTN + ("qk_norm", "eps"), -1.0, "must be > 0"),
    ("qwen3.yaml", _ATTN + ("rotary", "theta"), 0, "must be > 0"),
    ("qwen3.yaml", _ATTN + ("rotary", "theta"), -10000.0, "must be > 0"),
    ("qwen3.yaml", _ATTN + ("rotary", "theta"), float("nan"), "finite"),
    ("qwen3.yaml", _ATTN + ("scale",), 0.0, "must be > 0"),
    ("qwen3.yaml", _ATTN + ("scale",), -0.125, "must be > 0"),
    ("qwen3.yaml", _ATTN + ("softcap",), 0.0, "must be > 0"),
    ("qwen3.yaml", _ATTN + ("sliding_window",), 0, "window"),
    ("qwen3.yaml", _ATTN + ("sliding_window",), 2.5, "window"),
    ("qwen3.yaml", _ATTN + ("head_dim",), 2 ** 31, "at most 2**31 - 1"),
    ("qwen3.yaml", _ATTN + ("head_dim",), 0, "positive"),
    ("qwen3.yaml", _ATTN + ("rotary", "max_position"), -1, "positive"),
    ("qwen3.yaml", ("decoder", "embed_tokens", "scale"), -1.0, "must be > 0"),
    ("qwen3.yaml", ("lm_head", "softcap"), float("-inf"), "finite"),
    ("qwen3.yaml", ("tensor_parallel", "sizes", 0), 0, ">= 1"),
    ("qwen3.yaml", ("config", "rope_theta", "default"), 0.0, "must be > 0"),
    ("qwen3.yaml", ("config", "rms_norm_eps", "default"), -1e-6, "must be > 0"),
    ("qwen3.yaml", ("config", "max_position_embeddings", "default"), 0, "used as a size"),
    ("qwen3.yaml", ("variants", "Qwen3-0.6B", "rope_theta"), -1.0, "must be > 0"),
    ("qwen3.yaml", ("variants", "Qwen3-0.6B", "rope_theta"), 0, "must be > 0"),
    ("qwen3.yaml", ("variants", "Qwen3-0.6B", "rms_norm_eps"), 0.5 + 0.5, "must be < 1.0"),
    ("qwen3.yaml", ("variants", "Qwen3-0.6B", "hidden_size"), 2 ** 31, "outside [1, 2147483647]"),
    ("qwen3.yaml", ("variants", "Qwen3-0.6B", "vocab_size"), 0, "outside [1, 2147483647]"),
    ("qwen3.yaml", ("variants", "Qwen3-0.6B", "max_position_embeddings"), -5, "outside [1, 2147483647]"),
    ("qwen3.yaml", ("variants", "Qwen3-0.6B", "num_hidden_layers"), 20_000, "at most"),
    ("qwen3.yaml", ("variants", "Qwen3-0.6B", "head_dim"), 127, "even head_dim"),
    ("qwen3.yaml", ("variants", "Qwen3-0.6B", "sliding_window"), 0, "outside"),
    ("gemma2.yaml", ("variants", "gemma-2-2b", "query_pre_attn_scalar"), -256.0, "must be > 0"),
    ("gemma2.yaml", ("variants", "gemma-2-2b", "attn_logit_softcapping"), 0.0, "must be > 0"),
    ("gemma2.yaml", ("variants", "gemma-2-2b", "final_logit_softcapping"), -30.0, "must be > 0"),
    ("gemma2.yaml", ("decoder", "layers", "blocks", "input_layernorm", "weight_offset"), float("nan"), "finite"),
    ("qwen3_vl.yaml", ("variants", "Qwen3-VL-2B", "mrope_section"), [-4, 36, 32], "each >= 0"),
    ("qwen3_vl.yaml", ("variants", "Qwen3-VL-2B", "mrope_section"), [24, 40], "three sections"),
    ("qwen3_vl.yaml", ("variants", "Qwen3-VL-2B", "mrope_section"), [24, 20, 21], "sums to"),
    ("qwen3_vl.yaml", ("decoder", "layers", "blocks", "self_attn", "rotary", "mrope_section"), [-4, 36, 32],
     "each >= 0"),
    ("qwen3_vl.yaml", ("vision", "blocks", "blocks", "attn", "rotary", "theta"), -1.0, "must be > 0"),
    ("qwen3_vl.yaml", ("vision", "blocks", "blocks", "norm1", "eps"), 0.0, "must be > 0"),
    ("qwen3_vl.yaml", ("vision", "merger", "eps"), -1e-6, "must be > 0"),
    ("qwen3_vl.yaml", ("variants", "Qwen3-VL-2B", "vision_rope_theta"), 0.0, "must be > 0"),
]


@pytest.mark.parametrize("spec,path,value,words", NUMERIC, ids=lambda x: str(x)[:40])
def test_numeric_field_refused(workdir, spec, path, value, words):
    data = yaml.safe_load(SOURCE[spec].decode())
    if path[0] == "variants" and spec == "qwen3_vl.yaml" and path[1] not in data.get("variants", {}):
        pytest.skip("variant not in this spec")
    try:
        _set_path(data, path, value)
    except (KeyError, IndexError, TypeError):
        pytest.skip(f"{spec} has no {'.'.join(map(str, path))}")
    raw = yaml.safe_dump(data, sort_keys=False).encode()
    rc, err = run_cli(_write(workdir, f"num_{spec}", raw), workdir / "out")
    check_outcome(rc, err)
    assert rc == 2 and words in err, err
    line = int(err.split(":")[1])
    assert line > 1, err                              # located at a node, not at the top of the file


def test_variant_value_refused_by_the_generated_config_is_located(workdir):
    """A variant whose value the generated Config refuses at read time (a rope key given as a string, found by
    the value fuzzer) is a located compile error at the variant, not an internal error."""
    raw = SOURCE["llama.yaml"].replace(b"high_freq_factor: 4.0,", b'high_freq_factor: "a + b",')
    assert raw != SOURCE["llama.yaml"]
    rc, err = run_cli(_write(workdir, "llama_bad_variant.yaml", raw), workdir / "out")
    check_outcome(rc, err, raw.decode())
    assert rc == 2 and "variants.Llama-3.2-1B" in err and "high_freq_factor" in err, err


def test_expression_failing_on_a_variant_is_located(workdir):
    """An expression that fails on a variant's values (found by the fuzzer: lm_head.tie "hidden_size // 0"; tie now
    refuses any expression, so the rotary's theta carries it) is a spec error at that variant, not an internal
    error."""
    raw = (ROOT / "specs" / "qwen3.yaml").read_text().replace("theta: rope_theta,", 'theta: "rope_theta // 0",')
    assert '"rope_theta // 0"' in raw
    rc, err = run_cli(_write(workdir, "div0.yaml", raw.encode()), workdir / "out")
    assert rc != 0 and "division by zero" in err and "internal error" not in err and "variants." in err, err
