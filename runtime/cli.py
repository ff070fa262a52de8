"""`xllm-gen-generate`: generate text from a checkpoint dir on the command line.

Without --model it serves the embedded default (xllm_gen/default_model.py): a tiny random-weight checkpoint (real HF
format, tokenizer included) that the project builds itself, so it runs on a fresh machine with no download."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path


def default_checkpoint() -> Path:
    """The embedded default checkpoint dir, built on first use under $XLLM_GEN_CACHE (~/.cache/xllm_gen)."""
    from xllm_gen import default_model as tiny
    root = Path(os.environ.get("XLLM_GEN_CACHE", Path.home() / ".cache" / "xllm_gen"))
    out = root / f"tiny-default-v{tiny.TINY_VERSION}"      # a new tiny recipe never reuses an old build
    if not (out / "config.json").exists():
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")   # built aside, then moved: never half-written
        tiny.make_default_checkpoint(tmp)
        if out.exists() and not (out / "config.json").exists():
            shutil.rmtree(out, ignore_errors=True)             # a half-written build of an older version
        try:
            os.replace(tmp, out)
        except OSError:                                        # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _one_error(e: BaseException) -> str:
    """An exception as one message: a rank's traceback carried in it shrinks to its first and last lines."""
    text = str(e).strip() or type(e).__name__
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if any(ln.startswith("Traceback (most recent call last)") for ln in lines):
        lines = [lines[0], lines[-1].strip()]
    msg = " | ".join(lines)
    return msg if isinstance(e, ValueError) else f"{type(e).__name__}: {msg}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="xllm-gen-generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF checkpoint dir (default: the embedded tiny checkpoint, built on first use)")
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--json", action="store_true", help="print one JSON object per request")
    from xllm_gen import __version__
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    ap.add_argument("--quantization", default=None, choices=["fp8"],
                    help="fp8: quantize an unquantized checkpoint's linear weights to fp8 per channel at load")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                    help="fp8: the KV cache in float8 e4m3 (with the checkpoint's k_scale / "
                         "v_scale, per tensor or per KV head, where it has them, else scale 1.0)")
    args = ap.parse_args(argv)

    from xllm_gen import LLM, SamplingParams
    from xllm_gen.runtime.engine.llm import InvalidRequestError

    model = args.model or str(default_checkpoint())
    prompts = args.prompt or ["The quick brown fox", "Once upon a time", "Paged attention is"]
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        llm = LLM(model=model, device=args.device, dtype=args.dtype,
                  tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    except (ValueError, FileNotFoundError) as e:     # the checkpoint's faults name the file and the field
        print(f"error: {_one_error(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - anything else (memory, a failed rank): one line, no traceback
        print(f"error: {model}: cannot be loaded: {_one_error(e)}", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    rc = 0
    try:
        outs = llm.generate(prompts, params)
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        outs, rc = e.outputs, 1
    except Exception as e:  # noqa: BLE001 - a failure while generating: one line, no traceback
        print(f"error: generation failed: {_one_error(e)}", file=sys.stderr)
        llm.shutdown()
        return 1
    t2 = time.perf_counter()
    for out in outs:
        if args.json:
            print(json.dumps({"request": out.request_id, "prompt": out.prompt, "error": out.error,
                              "text": out.outputs[0].text if out.outputs else None,
                              "token_ids": out.outputs[0].token_ids if out.outputs else [],
                              "finish_reason": out.outputs[0].finish_reason if out.outputs else None}))
        elif out.error is None:
            c = out.outputs[0]
            print(f"[{out.request_id}] {out.prompt!r} -> {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
    ntok = sum(len(o.outputs[0].token_ids) for o in outs if o.outputs)
    print(f"model {model}: loaded in {t1 - t0:.2f} s; {ntok} tokens in {t2 - t1:.2f} s", file=sys.stderr)
    llm.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
