"""`xllm-gen SPEC [SPEC ...]`: validate, resolve and render specs into generated/<name>/.

`xllm-gen draft ARCH_OR_CHECKPOINT_DIR -o specs/x.yaml` writes a first spec (codegen/draft.py);
`xllm-gen verify SPEC CHECKPOINT_DIR` checks a spec against transformers on a checkpoint (codegen/verify.py).

`xllm-gen --json-schema [PATH]` prints (writes) the JSON Schema of the spec language (for editors:
yaml-language-server); `--check` also checks a `spec.schema.json` that sits beside the checked specs.

Exit codes: 0 ok; 1 `--check` found stale or hand-edited files; 2 a bad spec or bad arguments.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import io
import json
import sys
import tokenize
import typing
from pathlib import Path
from typing import List, Optional

from .compiler import Compiled, compile_spec
from .errors import Location, SpecError, SpecErrors
from .explain import DTYPE_BYTES, format_resolved, format_variant, tp_rank_table
from .writer import check, claimed_architectures, output_dir, write
from .yaml_loader import display_path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xllm-gen", description="Compile model specs (YAML) into generated model and runner modules.")
    p.add_argument("specs", nargs="*", metavar="SPEC", help="spec files, e.g. specs/*.yaml")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 with a unified diff when generated files are stale or edited")
    mode.add_argument("--dry-run", action="store_true", help="validate and render, write nothing")
    mode.add_argument("--explain", action="store_true",
                      help="print the resolved spec and per-variant parameter/byte tables; write nothing")
    p.add_argument("--tp", type=int, metavar="N", help="with --explain: per-rank shapes and bytes at TP size N")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="with --explain (default bfloat16)")
    p.add_argument("--out", metavar="DIR", help="write generated/<name>/ under DIR instead of the repository's generated/")
    p.add_argument("--json-schema", nargs="?", const="-", metavar="PATH",
                   help="print (or write to PATH) the JSON Schema of the spec language, e.g. specs/spec.schema.json")
    from xllm_gen import __version__
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


# ---- JSON Schema of the spec language (`--json-schema`) ------------------------------------------------

SCHEMA_FILE = "spec.schema.json"     # beside the specs; a spec's first line: # yaml-language-server: $schema=...


def _field_docs(module) -> dict:
    """{class: {field: doc}} from the comments of the schema's modules (codegen/schema/*.py, or the one file of a
    module `S`): a field's trailing `# ...` comment and the comment lines right above it (the spec language
    documents its fields there)."""
    if hasattr(module, "__path__"):                       # a package: every module of it
        files = sorted(f for d in module.__path__ for f in Path(d).glob("*.py"))
    else:
        files = [Path(module.__file__)]
    out: dict = {}
    for f in files:
        for cls, docs in _file_field_docs(f.read_text(encoding="utf-8")).items():
            out.setdefault(cls, {}).update(docs)
    return out


def _file_field_docs(source: str) -> dict:
    """_field_docs of one module's source."""
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    out: dict = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                above, n = [], node.lineno - 1
                while n >= 1 and lines[n - 1].strip().startswith("#"):
                    above.insert(0, comments.get(n, ""))
                    n -= 1
                parts = above + ([comments[node.end_lineno]] if node.end_lineno in comments else [])
                if parts:
                    out.setdefault(cls.name, {})[node.target.id] = " ".join(parts)
    return out


def _value_word(module, annotation) -> str:
    """What a Dim / Num / Flag field takes, for hover text."""
    args = set(map(repr, typing.get_args(annotation))) - {repr(type(None))}
    for alias, word in ((module.Dim, "a size: an int literal, an int config symbol, or an expression over config "
                                     "symbols"),
                        (module.Num, "a number: a literal, a config symbol, or an expression over config symbols"),
                        (module.Flag, "true / false, a bool config symbol, or an expression")):
        if args and args == set(map(repr, typing.get_args(alias))):
            return word
    return ""


def _relaxed(node, strict_items: bool = True):
    """The schema of a spec that `extends` another: every key optional, `~` (null) deletes an inherited key."""
    if isinstance(node, list):
        return [_relaxed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref":
            out[key] = value + "Extension"
        elif key == "required" or key == "discriminator":
            continue
        elif key == "oneOf":                   # a block that only overrides some keys may omit `kind`
            out["anyOf"] = _relaxed(value)
        elif key == "properties":
            out[key] = {k: _nullable(_relaxed(v)) for k, v in value.items()}
        elif key == "additionalProperties" and isinstance(value, dict):
            out[key] = _nullable(_relaxed(value))
        elif key == "additionalProperties" and value is False:
            # another key only as `~`: it deletes an inherited key (e.g. the gated MLP's keys of a block that
            # becomes a `moe`)
            out[key] = {"type": "null"}
        elif key == "items":                   # lists replace the inherited list: items stay complete
            out[key] = value
        else:
            out[key] = _relaxed(value)
    return out


def _nullable(node: dict) -> dict:
    if node.get("type") == "null" or any(m.get("type") == "null" for m in node.get("anyOf", ())):
        return node
    if "anyOf" in node:
        return {**node, "anyOf": node["anyOf"] + [{"type": "null"}]}
    keep = {k: node[k] for k in ("title", "description", "default") if k in node}
    inner = {k: v for k, v in node.items() if k not in keep}
    return {"anyOf": [inner, {"type": "null"}], **keep}


def spec_json_schema(S=None) -> dict:
    """The JSON Schema (draft 2020-12) of a spec file, from the pydantic models of codegen/schema/ (or the
    module `S`) with the field comments as descriptions. A file with `extends` is an overlay: keys optional,
    `~` deletes."""
    if S is None:
        from . import schema as S

    docs = _field_docs(S)
    top = S.Spec.model_json_schema()
    defs = top.pop("$defs")
    defs["Spec"] = top
    for name, d in defs.items():
        cls = getattr(S, name)
        fields = {(f.alias or n): (n, f) for n, f in cls.model_fields.items()}
        for key, prop in d.get("properties", {}).items():
            n, f = fields[key]
            text = " ".join(x for x in (docs.get(name, {}).get(n, ""), _value_word(S, f.annotation)) if x)
            if text:
                prop["description"] = text[0].upper() + text[1:]
    defs["Spec"]["properties"]["extends"] = {
        "type": "string", "title": "Extends",
        "description": "Path of another spec (relative to this file) that this spec is deep-merged over: mappings "
                       "merge key by key, lists and scalars replace, `key: ~` deletes an inherited key."}
    defs["Spec"]["description"] = ("An xllm-gen model spec (spec_version 2): one architecture, as data. "
                                   "The language: codegen/README.md.")
    for name in list(defs):
        ext = _relaxed(defs[name])
        ext["title"] = f"{defs[name].get('title', name)} (extending spec)"
        defs[name + "Extension"] = ext
    defs["SpecExtension"]["required"] = ["extends"]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "xllm-gen model spec",
        "description": defs["Spec"]["description"],
        "type": "object",
        "if": {"required": ["extends"]},
        "then": {"$ref": "#/$defs/SpecExtension"},
        "else": {"$ref": "#/$defs/Spec"},
        "$defs": defs,
    }


def spec_json_schema_text(S=None) -> str:
    return json.dumps(spec_json_schema(S), indent=2, ensure_ascii=False) + "\n"


def _json_schema(target: str) -> int:
    text = spec_json_schema_text()
    if target == "-":
        sys.stdout.write(text)
        return 0
    path = Path(target)
    old = path.read_text(encoding="utf-8") if path.is_file() else None
    if old != text:
        path.write_text(text, encoding="utf-8")
    print(f"{'wrote' if old != text else 'unchanged'}: {display_path(path)}")
    return 0


def _check_json_schemas(spec_paths) -> bool:
    """`--check`: a spec.schema.json beside the checked specs must equal the current export."""
    ok, text = True, None
    for folder in sorted({Path(s).resolve().parent for s in spec_paths}):
        path = folder / SCHEMA_FILE
        if not path.is_file():
            continue
        text = text or spec_json_schema_text()
        old = path.read_text(encoding="utf-8")
        if old != text:
            ok = False
            shown = display_path(path)
            sys.stdout.write("".join(difflib.unified_diff(old.splitlines(keepends=True), text.splitlines(keepends=True),
                                                          fromfile=f"{shown} (on disk)", tofile=f"{shown} (codegen/schema/)")))
            print(f"error: {shown} is stale: run: xllm-gen --json-schema {shown}", file=sys.stderr)
        else:
            print(f"up to date: {display_path(path)}")
    return ok


def _one_line(text: str) -> str:
    """Control characters (a key named "\\r", a newline in a value) escaped: one error is one line."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


def _report(err) -> None:
    errors = err.errors if isinstance(err, SpecErrors) else [err]
    for e in errors:
        print(_one_line(str(e)), file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `xllm-gen --explain ... | head`
        sys.stderr.close()
        return 0


def _main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS:       # `xllm-gen draft ...`, `xllm-gen verify ...` (a spec is a file path)
        return SUBCOMMANDS[argv[0]](argv[1:])
    args = _parser().parse_args(argv)
    if args.json_schema is not None:
        if args.specs or args.check or args.dry_run or args.explain:
            print("error: --json-schema takes no specs and no other mode", file=sys.stderr)
            return 2
        return _json_schema(args.json_schema)
    if not args.specs:
        print("error: give one or more SPEC files (or --json-schema)", file=sys.stderr)
        return 2
    if args.tp is not None and not args.explain:
        print("error: --tp only goes with --explain", file=sys.stderr)
        return 2
    if args.tp is not None and args.tp < 1:
        print(f"error: --tp {args.tp}: a tensor parallel size is >= 1", file=sys.stderr)
        return 2

    compiled: List[Compiled] = []
    failed = False
    for spec in args.specs:
        try:
            compiled.append(compile_spec(Path(spec)))
        except (SpecError, SpecErrors) as e:
            if isinstance(e, SpecError) and e.location is None:
                e = SpecError(e.message, Location(display_path(Path(spec)), 1, 1))
            _report(e)
            failed = True
        except Exception as e:  # noqa: BLE001 - a compiler bug: still one located line, never a traceback
            _report(SpecError(f"internal error while compiling this spec ({type(e).__name__}: {e}); please "
                              f"report it with the spec", Location(display_path(Path(spec)), 1, 1)))
            failed = True
    names = {}
    for c in compiled:
        if c.ir.name in names:
            _report(SpecError(f"spec name '{c.ir.name}' is also the name of {names[c.ir.name]}: both would write "
                              f"generated/{c.ir.name}/", c.loaded.tree.smap.value(("name",))))
            failed = True
        names[c.ir.name] = c.ir.spec_path
    # one spec per architecture: among the specs compiled together and the packages already generated
    compiled_names = {c.ir.name for c in compiled}
    seen: dict = {}
    for c in compiled:
        existing = claimed_architectures(output_dir(c.ir.name, args.out, c.ir.spec_file).parent, skip=c.ir.name)
        for i, arch in enumerate(c.ir.architectures):
            other = seen.get(arch)
            if other is None and arch in existing and Path(existing[arch]).name not in compiled_names:
                other = existing[arch]
            if other:
                _report(SpecError(f"architecture {arch} is also claimed by {other}: one spec per architecture "
                                  f"(the runtime could not tell which serves a checkpoint)",
                                  c.loaded.tree.smap.value(("architectures", i))))
                failed = True
            seen.setdefault(arch, c.ir.spec_path)
    if failed:
        return 2

    if args.explain:
        for c in compiled:
            # every table, tp=1 included, comes from the runtime's plan: the generated Model built on the meta
            # device (parameters a config flag leaves out, such as absent biases, are not counted)
            from xllm_gen.runtime.executor.sharding import ShardingError

            parts = [format_resolved(c.ir)]
            module = c.module()
            for v in c.ir.variants:
                try:         # the runtime's per-rank plan: the generated Model built on the meta device
                    table = tp_rank_table(c.ir, c.files, v, args.tp or 1, module)
                except ShardingError as e:
                    lines = "\n  ".join(e.problems)
                    print(f"error: --tp {args.tp}: variant {v.name}: {lines}", file=sys.stderr)
                    return 2
                parts.append(format_variant(c.ir, v, table, args.dtype))
            print("\n".join(parts))
        return 0

    if args.dry_run:
        for c in compiled:
            print(f"ok: {c.ir.spec_path} -> {len(c.files)} files for generated/{c.ir.name}/ (dry run, nothing written)")
        return 0

    if args.check:
        stale = False
        for c in compiled:
            directory = output_dir(c.ir.name, args.out, c.ir.spec_file)
            if not directory.is_dir():     # a new spec: nothing to diff (--dry-run compiles without writing)
                stale = True
                print(f"error: {display_path(directory)}/ was never generated for {c.ir.spec_path} (the spec "
                      f"compiles); run: xllm-gen {c.ir.spec_path}", file=sys.stderr)
                continue
            diffs = check(c.files, directory)
            if diffs:
                stale = True
                sys.stdout.write("".join(diffs))
                print(f"error: {display_path(directory)} is stale or was edited by hand; "
                      f"run: xllm-gen {c.ir.spec_path}", file=sys.stderr)
            else:
                print(f"up to date: {display_path(directory)}/ ({c.ir.spec_path})")
        if not _check_json_schemas(args.specs):
            stale = True
        return 1 if stale else 0

    for c in compiled:
        directory = output_dir(c.ir.name, args.out, c.ir.spec_file)
        for path, written in write(c.files, directory):
            print(f"{'wrote' if written else 'unchanged'}: {display_path(path)}")
    return 0


def _draft_main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(
        prog="xllm-gen draft",
        description="Write a first spec from transformers' classes: the config class's fields as symbols / "
                    "config_assume / config_ignore, a Llama-like pre-norm decoder with the module names of the HF "
                    "model's state_dict, and a CHECKLIST (comments at the top) of what could not be inferred.")
    p.add_argument("target", metavar="ARCH_OR_CHECKPOINT_DIR",
                   help="a transformers model class (e.g. SeedOssForCausalLM) or a checkpoint directory")
    p.add_argument("-o", "--output", metavar="SPEC", help="write the spec here (default: print it)")
    p.add_argument("--name", help="the spec's `name` (default: from the class name)")
    args = p.parse_args(argv)
    from .draft import draft_spec  # imports transformers (lazily: compiles never do)

    try:
        text, d = draft_spec(args.target, name=args.name)
    except SpecError as e:
        print(_one_line(f"error: {e.message}"), file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a config class the draft cannot read: one line, never a traceback
        print(_one_line(f"error: {args.target}: cannot draft ({type(e).__name__}: {e})"), file=sys.stderr)
        return 2
    if not args.output:
        sys.stdout.write(text)
        return 0
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"wrote: {display_path(out)} ({len(d.checklist)} checklist items at the top of the file)")
    return 0


def _verify_main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(
        prog="xllm-gen verify",
        description="Compile SPEC into a temporary directory, load CHECKPOINT_DIR in transformers and in the engine, "
                    "compare per-layer hidden states teacher-forced and greedy tokens; print the first divergence "
                    "(layer, position, max error). Exit 0 when tokens agree and errors are within tolerance, 1 "
                    "otherwise, 2 on a bad spec or checkpoint.")
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    p.add_argument("--device", default="cpu", help="engine and transformers device (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32 (default), float64 (CPU, TP 1: both sides in float64 "
                                                         "throughout, bounds ~1e-15: a constant slightly off shows), "
                                                         "bfloat16 or float16 (16-bit: measured against transformers in "
                                                         "float32, within a few times transformers' own 16-bit error)")
    p.add_argument("--tp", type=int, default=1, help="the engine's tensor parallel size (default 1; on CPU, TP > 1 "
                                                      "runs one process per rank)")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")
    p.add_argument("--prompt-lens", default="3,9,17,30", help="prompt lengths in tokens (default 3,9,17,30)")
    p.add_argument("--atol", type=float, default=None,
                   help="max abs error per layer, relative to the layer's max |hidden| (default 1e-4 for float32, "
                        "5e-2 for 16-bit dtypes)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run the checkpoint's own modeling code (its config.json auto_map) as the "
                        "reference, for a family transformers does not ship")
    args = p.parse_args(argv)
    from .verify import VerifyError, verify

    try:
        lens = [int(x) for x in args.prompt_lens.split(",") if x.strip()]
        report = verify(args.spec, args.checkpoint, device=args.device, dtype=args.dtype,
                        max_tokens=args.max_tokens, prompt_lens=lens, rtol=args.atol, tensor_parallel_size=args.tp,
                        trust_remote_code=args.trust_remote_code)
    except (SpecError, SpecErrors) as e:
        _report(e)
        return 2
    except VerifyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a checkpoint that cannot load: one line naming it, never a traceback
        print(_one_line(f"error: {args.checkpoint}: {type(e).__name__}: {e}"), file=sys.stderr)
        return 2
    print(report.text())
    return 0 if report.ok else 1


SUBCOMMANDS = {"draft": _draft_main, "verify": _verify_main}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
