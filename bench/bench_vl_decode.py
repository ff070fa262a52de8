"""Qwen3-VL text decode: TPOT of text-only requests on the generated Qwen3-VL runner (mRoPE positions [3, N]),
with the decode layers' q/k norm + rotary + KV store in its own kernel (XLLM_ATTENTION_ROPE off) and inside the
decode-attention launch (on), in the same process, one engine after the other (random weights of the variant's
shapes from specs/qwen3_vl.yaml, as bench/bench_vl.py writes them; nothing is downloaded).

    python bench/bench_vl_decode.py --batch-sizes 1,16 --out /tmp/vl_decode.json
    python bench/bench_vl_decode.py --device cpu --variant tiny --batch-sizes 1 --input-len 16 --output-len 4   # smoke
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench"), str(REPO / "tests")]

from bench_decode import bench_batch, runs_for, versions  # noqa: E402
from bench_vl import VARIANT, write_checkpoint  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default=VARIANT)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=129)
    ap.add_argument("--arms", default="separate,in_attention", help="separate (XLLM_ATTENTION_ROPE off), in_attention")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="JSON report")
    args = ap.parse_args(argv)
    from xllm_gen import LLM
    from xllm_gen.runtime.layers import fused as FU
    batches = [int(b) for b in args.batch_sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench_vl_decode_"))
    model_dir, load_format = write_checkpoint(root, args.variant)
    R = dict(versions=versions(), variant=args.variant, input_len=args.input_len, output_len=args.output_len,
             command="python bench/bench_vl_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]), rows={})
    cuda = args.device.startswith("cuda")
    for arm in args.arms.split(","):
        FU.ATTENTION_ROPE = arm == "in_attention"
        llm = LLM(str(model_dir), device=args.device, dtype="bfloat16" if cuda else "float32", load_format=load_format,
                  max_num_seqs=max(batches), max_model_len=args.input_len + args.output_len + 16,
                  enable_prefix_caching=False)
        for B in batches:
            r = bench_batch(llm, B, args.input_len, args.output_len, runs_for(B), seed=B) if cuda else None
            if r is None:      # CPU smoke: one short run, no timing claims
                from xllm_gen import SamplingParams
                outs = llm.generate([{"prompt_token_ids": [5] * args.input_len}] * B,
                                    SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True))
                r = dict(tokens=[o.outputs[0].token_ids for o in outs])
            R["rows"][f"{arm}_b{B}"] = r
            print(arm, B, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
        llm.shutdown()
        del llm
        if cuda:
            torch.cuda.empty_cache()
    for B in batches:
        a, b = R["rows"].get(f"separate_b{B}", {}), R["rows"].get(f"in_attention_b{B}", {})
        if "tpot_ms" in a and "tpot_ms" in b:
            print(f"batch {B}: TPOT {a['tpot_ms']:.3f} -> {b['tpot_ms']:.3f} ms ({b['tpot_ms'] / a['tpot_ms']:.3f}x)")
    if args.out:
        Path(args.out).write_text(json.dumps(R, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
