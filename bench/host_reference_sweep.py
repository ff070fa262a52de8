"""Runs tests/gpu/test_gpu_specs.py's references on the CPU under another transformers release (the GPU host's), so
that a reference that computes another model there is found without device time.

    pip download --no-deps transformers==5.17.0 "huggingface-hub>=1.5,<2" -d /tmp/w
    mkdir /tmp/tf && for f in /tmp/w/*.whl; do python -m zipfile -e $f /tmp/tf; done
    PYTHONPATH=/tmp/tf python bench/host_reference_sweep.py [SPEC_NAME ...]

Each text spec's tiny checkpoint is built by that release exactly as the GPU test builds it (its REFERENCE_SINCE /
REFERENCE_HARDCODES applied for that release), the engine runs it in float32 on the CPU and is compared with that
release's transformers in float32: OK (< 1e-3 relative), DIFF (the host's reference is another model: a fixture
value or a REFERENCE_* entry is due) or ERROR / SKIP with the reason. 2026-12-05, transformers 5.17: 131 specs, found
Bamba, Granite-4.0-H, Mamba-2, MiniMax-M2, Helium, Qwen4-Exp and DBRX (bench/results/h100_2026-12-05_session24.md).
"""
import json
import random
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
OUT = Path("/tmp/host_reference_sweep")


def main(only: list) -> None:
    import test_gpu_specs as T
    import transformers
    from transformers import AutoModelForCausalLM

    from xllm_gen import LLM
    print("transformers", transformers.__version__, flush=True)
    for param in T._text_specs():
        arch, name = param.values[0], param.id
        if only and name not in only:
            continue
        out = OUT / transformers.__version__ / name
        try:
            if not (out / "config.json").exists():
                T._checkpoint(arch, out)
            if T._guard_refuses(arch, out):
                print(name, "SKIP: the spec's config guard refuses this release's tiny config", flush=True)
                continue
            vocab = json.loads((out / "config.json").read_text()).get("vocab_size", 1000)
            rng = random.Random(3)
            prompts = [[rng.randrange(min(vocab, 5000)) for _ in range(n)] for n in (5, 40)]
            llm = LLM(str(out), dtype="float32", max_num_seqs=4, num_kv_blocks=256, max_model_len=512,
                      enforce_eager=True)
            with torch.inference_mode():
                ours = [llm.prefill_logits(p).float() for p in prompts]
            llm.shutdown()
            hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager").eval()
            with torch.inference_mode():
                errs = []
                for p, o in zip(prompts, ours):
                    ref = hf(torch.tensor([p]), use_cache=False).logits[0].float()
                    errs.append(((o - ref).abs().max() / ref.abs().max()).item())
            print(name, "OK" if max(errs) < 1e-3 else "DIFF", [f"{e:.2g}" for e in errs], flush=True)
        except BaseException as e:          # noqa: BLE001 - pytest.skip, a reference that fails, a refusal: all reported
            if isinstance(e, KeyboardInterrupt):
                raise
            kind = "SKIP" if type(e).__name__ == "Skipped" else "ERROR"
            print(name, kind, type(e).__name__, str(e)[:200].replace("\n", " "), flush=True)
            if kind == "ERROR":
                traceback.print_exc(limit=-3)


if __name__ == "__main__":
    main(sys.argv[1:])
