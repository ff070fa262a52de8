"""The decode-attention kernel's rope prologue (runtime/ops/decode_attention.py with ops/fused_rope_store.RopeStore):
the kernel given q, k, v as the qkv projection left them norms and rotates q, writes the step's k (normed, rotated)
and v into the paged caches and attends, in one launch. Its reference is the two-launch path it replaces: the
qk_norm_rope_store kernel (itself bit-exact to qk_norm_rope + store_kvcache, tests/test_fused_decode.py) then the
same decode kernel on the rotated q. On CPU under TRITON_INTERPRET=1 (a subprocess): rows of 1 to 23 keys, a
padding row (slot -1, no pages), GQA group 2 and 4, one and three splits (the new position in the last split of
its row), with and without q/k norms, a sliding window; float32 and float16; mRoPE (positions [3, B] whose rows
differ, interleaved and blocked axis maps). Sensitivity: wrong norm weights, the
new k / v written to another slot, no prologue at all, or mRoPE read as 1-D rope change the output."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def decode_rows(lens: list, page: int, pool: int, device="cpu", seed: int = 1):
    """A decode step's page table over a shuffled pool of `pool` pages for rows of `lens` keys (0: a padding row):
    (indptr, page indices, last-page lengths) int32, the slot of each row's new position (-1: padding) and the
    positions, on `device`."""
    perm = torch.randperm(pool, generator=torch.Generator().manual_seed(seed)).tolist()
    ptr, idx, last, slots = [0], [], [], []
    for L in lens:
        n = (L + page - 1) // page
        table = perm[len(idx): len(idx) + n]
        idx += table
        ptr.append(ptr[-1] + n)
        last.append(L - (n - 1) * page if n else 1)
        slots.append(table[(L - 1) // page] * page + (L - 1) % page if L else -1)
    ip, ix, lp = (torch.tensor(a, dtype=torch.int32, device=device) for a in (ptr, idx, last))
    return (ip, ix, lp, torch.tensor(slots, dtype=torch.int64, device=device),
            torch.tensor([max(L - 1, 0) for L in lens], dtype=torch.int64, device=device))


def _checks() -> dict:
    from xllm_gen.runtime.ops.decode_attention import DecodeScratch, paged_decode_attention
    from xllm_gen.runtime.ops.fused_rope_store import RopeStore, qk_norm_rope_store

    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    def err(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1.0)).item()

    page, pool = 4, 40
    lens = [1, 9, 0, 23, 5]
    ip, ix, lp, slot_mapping, positions = decode_rows(lens, page, pool)
    B = len(lens)
    out = {}
    for H, Hk, D, norms, window, runs in [(4, 2, 32, True, -1, [(torch.float32, 1), (torch.float32, 3),
                                                                  (torch.float16, 3)]),
                                          (8, 2, 16, False, -1, [(torch.float32, 3)]),
                                          (4, 2, 32, True, 6, [(torch.float32, 3)])]:
        inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
        ang = torch.arange(64).float()[:, None] * inv[None, :]
        cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1)                       # [positions, D]: cos | sin
        for dt, splits in runs:
            qkv = rnd(B, (H + 2 * Hk) * D + 3).to(dt)                             # strided rows, as the split gives
            q = qkv[:, : H * D].view(B, H, D)
            k = qkv[:, H * D: (H + Hk) * D].view(B, Hk, D)
            v = qkv[:, (H + Hk) * D: (H + 2 * Hk) * D].view(B, Hk, D)
            qw, kw = (1.0 + 0.3 * rnd(D)).to(dt), (1.0 + 0.3 * rnd(D)).to(dt)
            if not norms:
                qw = kw = None
            kc0, vc0 = rnd(pool, page, Hk, D).to(dt), rnd(pool, page, Hk, D).to(dt)
            scratch = DecodeScratch(8, H, Hk, D, splits, "cpu")
            kw_run = dict(window_left=window, block_n=4)

            def attend(qq, kc, vc, rope=None):
                return paged_decode_attention(qq, kc, vc, ip, ix, lp, D ** -0.5, scratch, rope=rope, **kw_run)

            kc_ref, vc_ref = kc0.clone(), vc0.clone()
            q_rot, _ = qk_norm_rope_store(q, k, v, qw, kw, 1e-6, positions, cos_sin, None, kc_ref, vc_ref,
                                          slot_mapping)
            want = attend(q_rot, kc_ref, vc_ref)
            kc, vc = kc0.clone(), vc0.clone()
            rope = RopeStore(k, v, qw, kw, 1e-6, positions, cos_sin, slot_mapping)
            got = attend(q, kc, vc, rope)
            tol = 1e-6 if dt == torch.float32 else 3e-3
            name = f"H{H}_Hk{Hk}_D{D}_{'norm' if norms else 'nonorm'}_w{window}_splits{splits}_{str(dt)[6:]}"
            out[f"output_{name}"] = (err(got, want), tol)
            out[f"k_cache_{name}"] = (err(kc, kc_ref), tol)
            out[f"v_cache_{name}"] = (err(vc, vc_ref), 0.0)
            out[f"tickets_reset_{name}"] = (float(scratch.counters.abs().sum()), 0.0)
            if dt != torch.float32 or splits != 3:
                continue
            # sensitivity: each of these must move the output well past the tolerance
            wrong = {"no_prologue": (q, None),
                     "slot_shifted": (q, RopeStore(k, v, qw, kw, 1e-6, positions, cos_sin,
                                                   torch.where(slot_mapping >= 0, slot_mapping + 1, -1)))}
            if norms:
                wrong["q_norm_weight"] = (q, RopeStore(k, v, qw * 1.5, kw, 1e-6, positions, cos_sin, slot_mapping))
            for what, (qq, rr) in wrong.items():
                live = torch.tensor([L > 0 for L in lens])
                bad = attend(qq, kc0.clone(), vc0.clone(), rr)
                out[f"changes_output_{what}_{name}"] = (float(not err(bad[live], want[live]) > 1e-2), 0.0)

    # mRoPE (positions [3, B], each frequency reading its axis's row): rows that differ, so the axis gather matters
    from xllm_gen.runtime.layers.rotary import mrope_axis_map
    H, Hk, D = 4, 2, 32
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    cos_sin = torch.cat([(torch.arange(64).float()[:, None] * inv).cos(), (torch.arange(64).float()[:, None] * inv).sin()], -1)
    pos3 = torch.stack([positions, positions // 2, (positions * 3) % 40])
    qkv = rnd(B, (H + 2 * Hk) * D)
    q, k, v = (qkv[:, a * D: b * D].view(B, -1, D) for a, b in ((0, H), (H, H + Hk), (H + Hk, H + 2 * Hk)))
    qw, kw = 1.0 + 0.3 * rnd(D), 1.0 + 0.3 * rnd(D)
    kc0, vc0 = rnd(pool, page, Hk, D), rnd(pool, page, Hk, D)
    scratch = DecodeScratch(8, H, Hk, D, 3, "cpu")
    live = torch.tensor([L > 0 for L in lens])
    for kind in ("mrope_interleaved", "mrope_blocked"):
        ax = mrope_axis_map(kind, [4, 6, 6], D // 2)
        kc_ref, vc_ref = kc0.clone(), vc0.clone()
        q_rot, _ = qk_norm_rope_store(q, k, v, qw, kw, 1e-6, pos3, cos_sin, ax, kc_ref, vc_ref, slot_mapping)
        want = paged_decode_attention(q_rot, kc_ref, vc_ref, ip, ix, lp, D ** -0.5, scratch, block_n=4)
        kc, vc = kc0.clone(), vc0.clone()
        got = paged_decode_attention(q, kc, vc, ip, ix, lp, D ** -0.5, scratch, block_n=4,
                                     rope=RopeStore(k, v, qw, kw, 1e-6, pos3, cos_sin, slot_mapping, axis_map=ax))
        out[f"output_{kind}"] = (err(got, want), 1e-6)
        out[f"k_cache_{kind}"] = (err(kc, kc_ref), 1e-6)
        out[f"v_cache_{kind}"] = (err(vc, vc_ref), 0.0)
        # sensitivity: the first row alone (1-D rope at the temporal positions) must differ from the axis gather
        bad = paged_decode_attention(q, kc0.clone(), vc0.clone(), ip, ix, lp, D ** -0.5, scratch, block_n=4,
                                     rope=RopeStore(k, v, qw, kw, 1e-6, pos3[0], cos_sin, slot_mapping))
        out[f"changes_output_axis_gather_{kind}"] = (float(not err(bad[live], want[live]) > 1e-2), 0.0)
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    from interpreted import run_interpreted
    return run_interpreted(__file__)


def test_rope_prologue_matches_the_two_launch_path(results):
    bad = {k: v for k, v in results.items() if not v[0] <= v[1]}
    assert not bad, bad
    assert any(k.startswith("changes_output_slot_shifted") for k in results)
    assert any(k.startswith("changes_output_q_norm_weight") for k in results)
    assert "output_mrope_interleaved" in results and "changes_output_axis_gather_mrope_blocked" in results


def test_rope_store_refuses_a_changed_q():
    """The attention runs the rotary of exactly the q / k it was handed for: a q changed in between is an error, never
    a silently wrong rotary (the generated code passes into_attention=False where it changes q)."""
    from xllm_gen.runtime.ops.fused_rope_store import RopeStore
    q, k, v = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8)
    r = RopeStore(k, v, None, None, 1e-6, torch.zeros(2, dtype=torch.long), torch.zeros(4, 8), torch.zeros(2), q=q)
    r.check(q, k)
    with pytest.raises(RuntimeError, match="into_attention=False"):
        r.check(q * 2, k)


def test_generated_code_keeps_the_rotary_out_of_the_attention_where_q_changes():
    """Every generated attention that changes q between L.qk_norm_rope_store and its attention call (a query scale)
    passes into_attention=False; the others leave the rotary to the attention."""
    root = Path(__file__).resolve().parents[1] / "generated"
    seen = 0
    for f in sorted(root.glob("*/model.py")):
        lines = f.read_text().splitlines()
        for i, line in enumerate(lines):
            if "L.qk_norm_rope_store(" not in line:
                continue
            body = []
            for nxt in lines[i + 1:]:
                if "self.attn(" in nxt:
                    break
                body.append(nxt)
            changes_q = any(ln.strip().startswith("q = ") for ln in body)
            seen += changes_q
            assert ("into_attention=False" in line) == changes_q, f"{f}:{i + 1}"
    assert seen, "no generated attention changes q after its rotary (the check would not be exercised)"


if __name__ == "__main__" and "--interpret" in sys.argv:
    print("RESULT " + json.dumps(_checks()))
