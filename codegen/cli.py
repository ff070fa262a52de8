"""`xllm-gen SPEC [SPEC ...]`: validate, resolve and render specs into generated/<name>/.

Exit codes: 0 ok; 1 `--check` found stale or hand-edited files; 2 a bad spec or bad arguments.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from .compiler import Compiled, compile_spec
from .errors import SpecError, SpecErrors
from .explain import DTYPE_BYTES, format_resolved, format_variant, model_module_of, tp_rank_table
from .writer import check, claimed_architectures, output_dir, write
from .yaml_loader import display_path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xllm-gen", description="Compile model specs (YAML) into generated model and runner modules.")
    p.add_argument("specs", nargs="+", metavar="SPEC", help="spec files, e.g. specs/*.yaml")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 with a unified diff when generated files are stale or edited")
    mode.add_argument("--dry-run", action="store_true", help="validate and render, write nothing")
    mode.add_argument("--explain", action="store_true",
                      help="print the resolved spec and per-variant parameter/byte tables; write nothing")
    p.add_argument("--tp", type=int, metavar="N", help="with --explain: per-rank shapes and bytes at TP size N")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES), help="with --explain (default bfloat16)")
    p.add_argument("--out", metavar="DIR", help="write generated/<name>/ under DIR instead of the repository's generated/")
    return p


def _report(err) -> None:
    errors = err.errors if isinstance(err, SpecErrors) else [err]
    for e in errors:
        print(str(e), file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `xllm-gen --explain ... | head`
        sys.stderr.close()
        return 0


def _main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
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
                e = SpecError(f"{spec}: {e.message}")
            _report(e)
            failed = True
    names = {}
    for c in compiled:
        if c.ir.name in names:
            print(f"{c.ir.spec_path}: error: spec name '{c.ir.name}' is also the name of {names[c.ir.name]}: "
                  f"both would write generated/{c.ir.name}/", file=sys.stderr)
            failed = True
        names[c.ir.name] = c.ir.spec_path
    # one spec per architecture: among the specs compiled together and the packages already generated
    compiled_names = {c.ir.name for c in compiled}
    seen: dict = {}
    for c in compiled:
        existing = claimed_architectures(output_dir(c.ir.name, args.out, c.ir.spec_file).parent, skip=c.ir.name)
        for arch in c.ir.architectures:
            other = seen.get(arch)
            if other is None and arch in existing and Path(existing[arch]).name not in compiled_names:
                other = existing[arch]
            if other:
                print(f"{c.ir.spec_path}: error: architecture {arch} is also claimed by {other}: one spec per "
                      f"architecture (the runtime could not tell which serves a checkpoint)", file=sys.stderr)
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
            module = model_module_of(c.ir, c.files)
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
            diffs = check(c.files, directory)
            if diffs:
                stale = True
                sys.stdout.write("".join(diffs))
                print(f"error: {display_path(directory)} is stale or was edited by hand; "
                      f"run: xllm-gen {c.ir.spec_path}", file=sys.stderr)
            else:
                print(f"up to date: {display_path(directory)}/ ({c.ir.spec_path})")
        return 1 if stale else 0

    for c in compiled:
        directory = output_dir(c.ir.name, args.out, c.ir.spec_file)
        for path, written in write(c.files, directory):
            print(f"{'wrote' if written else 'unchanged'}: {display_path(path)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
