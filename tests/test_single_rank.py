"""A tensor-parallel size 1 engine in a process that is also another engine's rank 0 (verify builds a float32 engine
beside the TP 2 engine under test): the TP state is process-wide, read by the layers when they are built and by the
collectives when they run, so the TP 1 engine must build and run as (0, 1) whatever the process holds. It used to
build half-width layers and wait in an all-reduce with no peer (verify --tp 2 --dtype bfloat16 on MoE models hung
for the gloo timeout)."""
from __future__ import annotations


def _shapes(llm) -> list:
    return [tuple(p.shape) for p in llm.engine.runner.model.parameters()]


def test_a_tp1_engine_ignores_the_process_tp_state(tiny_checkpoint):
    from xllm_gen import LLM, SamplingParams
    from xllm_gen.runtime.executor import distributed as tpdist
    ckpt = tiny_checkpoint("Qwen3ForCausalLM")
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 17, 33, 2]}]
    plain = LLM(str(ckpt), device="cpu", dtype="float32")
    want, shapes = plain.generate(prompt, sp)[0].outputs[0].token_ids, _shapes(plain)
    plain.shutdown()
    with tpdist.tp_state(0, 2):            # as on the rank 0 of a TP 2 engine (no process group: a collective raises)
        llm = LLM(str(ckpt), device="cpu", dtype="float32")
        assert tpdist.get_tp_size() == 2   # the process's state is kept outside the engine's calls
        got = llm.generate(prompt, sp)[0].outputs[0].token_ids
        assert tpdist.get_tp_size() == 2 and _shapes(llm) == shapes        # built whole, not as a half shard
        llm.shutdown()
    assert got == want
    assert tpdist.get_tp_size() == 1
