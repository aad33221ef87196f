"""Kernel backends: the torch varlen reference against dense per-entry attention (autograd), and AUTO."""
import torch
from hypothesis import given, settings, strategies as st

from libra_megatron.config import KernelBackendName
from libra_megatron.runtime.kernels import VarlenBatch, resolve_backend, torch_ref, varlen_bwd, varlen_fwd


def _dense_entry(q, k, v, scale):
    """Bottom-right causal attention of one entry with an explicit (q_len, k_len) mask, fp64 autograd."""
    group = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    ql, kl = q.shape[0], k.shape[0]
    allowed = torch.tensor([[j <= kl - ql + i for j in range(kl)] for i in range(ql)])
    s = torch.einsum("qhd,khd->hqk", q, ke) * scale
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", p, ve), torch.logsumexp(s.masked_fill(~allowed, float("-inf")), -1)


@settings(deadline=None, max_examples=40)
@given(
    lens=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 6)), min_size=1, max_size=4),
    heads=st.sampled_from([(4, 4), (4, 1), (8, 2), (2, 2)]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    seed=st.integers(0, 1000),
    row_tile=st.sampled_from([2, 3, 256]),
)
def test_torch_varlen_fwd_bwd_match_dense_reference_per_entry(lens, heads, dtype, seed, row_tile):
    saved_tile, torch_ref.ROW_TILE = torch_ref.ROW_TILE, row_tile  # small tiles exercise the row tiling
    try:
        _check_against_dense(lens, heads, dtype, seed)
    finally:
        torch_ref.ROW_TILE = saved_tile


def _check_against_dense(lens, heads, dtype, seed):
    q_lens = [a for a, _ in lens]
    k_lens = [a + extra for a, extra in lens]  # k_len >= q_len: bottom-right causal prefix
    hq, hkv, d = heads[0], heads[1], 4
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), hq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(k_lens), hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn_like(q)
    batch = VarlenBatch.from_lengths(q_lens, k_lens, "cpu")
    out, lse = varlen_fwd(q.to(dtype), k.to(dtype), v.to(dtype), batch, 0.7, "torch")
    dq, dk, dv = varlen_bwd(do.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), out, lse, batch, 0.7, "torch")
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert out.dtype == dtype and dq.dtype == dtype and lse.shape == (hq, q.shape[0])
    for q0, q1, k0, k1 in batch.bounds:
        leaves = [x.clone().requires_grad_(True) for x in (q[q0:q1], k[k0:k1], v[k0:k1])]
        ref_out, ref_lse = _dense_entry(*leaves, 0.7)
        ref_out.backward(do[q0:q1])
        got = (out[q0:q1], lse[:, q0:q1], dq[q0:q1], dk[k0:k1], dv[k0:k1])
        want = (ref_out, ref_lse, *(x.grad for x in leaves))
        for a, b in zip(got, want):
            assert torch.allclose(a.double(), b.detach(), atol=tol, rtol=tol), (a, b)


def test_auto_backend_resolves_to_torch_on_cpu_and_flash_is_refused_without_flash_attn():
    assert resolve_backend(KernelBackendName.AUTO, torch.device("cpu")).name is KernelBackendName.TORCH
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        try:
            resolve_backend("flash", torch.device("cpu"))
        except ValueError as exc:
            assert "kernel_backend" in str(exc)
        else:
            raise AssertionError("flash backend accepted without flash_attn")
