"""``torch`` backend: exact bottom-right causal varlen attention in pure torch (any device, any float dtype).

Shape legend: q (nq, hq, d), k/v (nk, hkv, d), out (nq, hq, d), lse (hq, nq); see ``kernels/__init__``.
Computes in fp32 (fp64 for fp64 inputs) and rounds each output once. A Python loop over entries and
``ROW_TILE``-row tiles: the reference the other backends are tested against, and the CPU path. Reads
only ``batch.bounds`` (host ints), so it never synchronises a CUDA device.
"""
from __future__ import annotations

import torch

__all__ = ["ROW_TILE", "torch_fwd", "torch_bwd"]

ROW_TILE = 256  # query rows per step: bounds memory to (hq, ROW_TILE, k_len) scores


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything else computes in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_tiles(q0: int, q1: int, k0: int, k1: int):
    """Split one entry into (r0, r1, kend, first_pos): query rows [r0, r1) see at most keys [k0, kend);
    ``first_pos`` = key position (entry-local) of row r0's last visible key. Keys a tile cannot see are
    never touched, so the work is ~ the causal pairs (Eq. 6), not the q_len x k_len rectangle."""
    offset = (k1 - k0) - (q1 - q0)
    for r0 in range(q0, q1, ROW_TILE):
        r1 = min(q1, r0 + ROW_TILE)
        kend = k0 + max(0, min(k1 - k0, offset + (r1 - q0)))
        yield r0, r1, kend, offset + (r0 - q0)


def _full_tiles(q0: int, q1: int, k0: int, k1: int):
    """Like ``_row_tiles`` without the causal mask: every row sees keys [k0, k1)."""
    for r0 in range(q0, q1, ROW_TILE):
        yield r0, min(q1, r0 + ROW_TILE), k1, (k1 - k0) + (q1 - q0)


def _tile_scores(q, k, scale, first_pos):
    """q (R, hq, d), k (n, hq, d) -> masked scores (hq, R, n): row i sees key j iff j <= first_pos + i."""
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(q.shape[0], device=q.device) + first_pos
    mask = torch.arange(k.shape[0], device=q.device)[None, :] > qpos[:, None]
    return s.masked_fill(mask[None], float("-inf"))


def _expand_kv(x, group: int):
    """(n, hkv, d) -> (n, hkv*group, d): query head i reads kv head i // group."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def torch_fwd(q, k, v, batch, scale: float, causal: bool = True):
    """(out, lse). ``causal`` False: every query row sees all of its entry's keys (the ring-style key blocks
    that precede all of an entry's queries, ``runtime.libra_attn``)."""
    ct = _compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=ct, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=ct, device=q.device)
    for q0, q1, k0, k1 in batch.bounds:
        ke, ve = _expand_kv(k[k0:k1].to(ct), group), _expand_kv(v[k0:k1].to(ct), group)
        tiles = _row_tiles(q0, q1, k0, k1) if causal else _full_tiles(q0, q1, k0, k1)
        for r0, r1, kend, first in tiles:
            if kend == k0:
                continue  # rows that see no key: out 0, lse -inf (flash-attn's convention)
            s = _tile_scores(q[r0:r1].to(ct), ke[: kend - k0], scale, first)
            lse_t = torch.logsumexp(s, dim=-1)  # (hq, R)
            p = torch.exp(s - lse_t.nan_to_num(neginf=0.0)[..., None])
            out[r0:r1] = torch.einsum("hqk,khd->qhd", p, ve[: kend - k0])
            lse[:, r0:r1] = lse_t
    return out.to(q.dtype), lse if ct == torch.float64 else lse.float()


def torch_bwd(dout, q, k, v, out, lse, batch, scale: float, deterministic: bool = False):
    """Exact gradients (dq, dk, dv). ``deterministic`` needs nothing here: slices summed in a fixed order."""
    ct = _compute_dtype(q.dtype)
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dv = torch.zeros(v.shape, dtype=ct, device=q.device)
    for q0, q1, k0, k1 in batch.bounds:
        ke, ve = _expand_kv(k[k0:k1].to(ct), group), _expand_kv(v[k0:k1].to(ct), group)
        for r0, r1, kend, first in _row_tiles(q0, q1, k0, k1):
            if kend == k0:
                continue
            n = kend - k0
            qt, dot, ot = (x[r0:r1].to(ct) for x in (q, dout, out))
            s = _tile_scores(qt, ke[:n], scale, first)
            p = torch.exp(s - lse[:, r0:r1].to(ct).nan_to_num(neginf=0.0)[..., None])  # (hq, R, n)
            dp = torch.einsum("qhd,khd->hqk", dot, ve[:n])
            delta = (dot * ot).sum(-1).transpose(0, 1)  # (hq, R)
            ds = p * (dp - delta[..., None]) * scale
            dq[r0:r1] = torch.einsum("hqk,khd->qhd", ds, ke[:n])
            dk[k0:kend] += torch.einsum("hqk,qhd->khd", ds, qt).reshape(n, hkv, group, -1).sum(2)
            dv[k0:kend] += torch.einsum("hqk,qhd->khd", p, dot).reshape(n, hkv, group, -1).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
