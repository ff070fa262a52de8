import logging, sys, time, tempfile
from pathlib import Path
sys.path.insert(0, "tests"); sys.path.insert(0, "tests/gpu")
logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s %(message)s")
from test_gpu_specs import _checkpoint
from xllm_gen import LLM
for arch in sys.argv[1:]:
    t0 = time.time()
    ckpt = _checkpoint(arch, Path(tempfile.mkdtemp()) / "c")
    t1 = time.time()
    llm = LLM(str(ckpt), dtype="bfloat16", max_num_seqs=16, num_kv_blocks=512, max_model_len=512)
    t2 = time.time()
    print(f"STARTUP {arch}: checkpoint {t1-t0:.1f} s, LLM() {t2-t1:.1f} s", flush=True)
    llm.shutdown()
