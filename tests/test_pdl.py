"""Programmatic dependent launch switch (runtime/ops/pdl.py): off on CPU and for XLLM_PDL=0, the levels of its
modes, a clear error for an unknown mode, and every kernel launched with `pdl.launch` takes the PDL constexpr
and waits first thing (a kernel that wrote before its wait could race the previous kernel). The GPU arm
(tests/gpu/test_gpu_fused_decode.py::test_pdl_bit_exact) checks PDL on == off bit for bit."""
from __future__ import annotations

import inspect
import re

import pytest
import torch

from xllm_gen.runtime.ops import (
    decode_attention,
    fused_gemv,
    fused_rope_store,
    kvcache_kernels,
    norm_act_kernels,
    pdl,
    rope_kernels,
    skinny_fma,
    skinny_mma,
)


def test_levels(monkeypatch):
    cpu = torch.zeros(1)
    for mode in ("0", "wait", "1", "late", "auto"):
        monkeypatch.setattr(pdl, "MODE", mode)
        assert pdl.level(cpu) == 0 and pdl.launch(cpu) == {"PDL": 0}       # never on a CPU tensor
    monkeypatch.setattr(pdl, "MODE", "sometimes")
    with pytest.raises(ValueError, match="XLLM_PDL='sometimes'"):
        pdl.level(cpu)
    assert {m: pdl._LEVEL[m] for m in ("0", "wait", "auto", "1", "late")} == {"0": 0, "wait": 1, "auto": 1, "1": 2,
                                                                              "late": 3}


@pytest.mark.parametrize("module", [norm_act_kernels, rope_kernels, kvcache_kernels, skinny_fma, skinny_mma, fused_gemv,
                                    fused_rope_store, decode_attention])
def test_pdl_kernels_wait_first(module):
    src = inspect.getsource(module)
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"(_\w+_kernel)\[", src)]
    launched = {name for (pos, name), (end, _) in zip(starts, starts[1:] + [(len(src), "")])
                if "**pdl.launch(" in src[pos:end]}
    assert launched, f"{module.__name__}: no kernel launched with pdl.launch"
    for name in launched:
        body = inspect.getsource(getattr(module, name).fn)
        assert "PDL: tl.constexpr" in body, f"{name} takes no PDL constexpr"
        code = [ln.strip() for ln in body.split("):\n", 1)[1].splitlines() if ln.strip()]
        first = next(i for i, ln in enumerate(code) if ln.startswith("pdl_enter("))
        # before the wait: only index arithmetic and the L2 prefetch of weights (never written), no load or store
        assert not any("tl.store" in ln or "tl.load" in ln or "atomic" in ln for ln in code[:first]), name
