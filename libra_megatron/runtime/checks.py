"""Plan verification, once per call key: every rank checks its plan against its tensors, then all agree.

Shape legend: t = local tokens, hq/hkv = query/kv heads, d = head dim; q (t, hq, d), k/v (t, hkv, d).

Call key. A 128-bit hash of (plan fingerprint, dtype, hq, hkv, d, t, save mode): everything that sizes
the exchange's messages. Two ranks with equal keys send and expect the same byte counts; a rank with fp32
tensors and fp64 peers, another token count or another save mode has a different key.

Verification = one small ``all_gather`` of int64 [1 + KEY_WORDS] (local mismatch bitmask, call key) over
the check group (the pool group, or a gloo twin of it so that no device value is read on the host); then
every rank sees the same table and raises the same ``PlanError`` naming the offending ranks, or all go on.

When. A collective that some ranks skip hangs the others, so the decision must be the same on every rank:
    verify=True    verify now (the caller guarantees all ranks pass True in this call; ``LibraCoreAttention``
                   does so in the first Libra layer of every microbatch)
    verify=False   skip (caller's guarantee that a verified call key is in use)
    verify="auto"  verify iff this rank has not verified this call key on this group yet. Ranks that run
                   the same sequence of calls hold the same keys, so they decide the same; any rank
                   whose plan or tensors are new makes its key new, and the peers' keys are new in the same
                   call whenever they changed plans together (every microbatch gets a new plan).
Later calls with a verified key issue no collective and read nothing from the device. A rank that
switches to an *already verified* key while its peers switch to a new one is not caught by "auto"; the
Megatron path closes that case with verify=True once per microbatch.
"""
from __future__ import annotations

import collections
import hashlib
import threading
import weakref
from typing import Tuple

import torch
import torch.distributed as dist

from ..plan.errors import PlanError

__all__ = ["call_key", "local_mismatches", "ensure_plan_verified", "forget_verified_keys"]

KEY_WORDS = 2  # 128-bit call key as two int64
_MISMATCH = {
    1: "local token count != plan.local_tokens",
    2: "query heads / kv heads != plan.heads",
    4: "head dim != plan.heads.head_dim",
    8: "group size != plan.num_workers",
    16: "rank in group != plan.rank",
    32: "q/k/v dtypes or devices differ",
    64: "k and v shapes differ",
}
_VERIFIED_PER_GROUP = 256  # call keys remembered per group (LRU; identical eviction on identical histories)


def call_key(plan, q, k, save_mode) -> Tuple[int, ...]:
    """KEY_WORDS signed int64 hashing (plan fingerprint, dtype, hq, hkv, d, t, save mode)."""
    text = f"{plan.fingerprint}|{q.dtype}|{q.shape[1]}|{k.shape[1]}|{q.shape[-1]}|{q.shape[0]}|{save_mode}"
    digest = hashlib.blake2b(text.encode(), digest_size=8 * KEY_WORDS).digest()
    return tuple(int.from_bytes(digest[8 * i: 8 * i + 8], "little", signed=True) for i in range(KEY_WORDS))


def local_mismatches(q, k, v, plan, group) -> int:
    """Bitmask of ``_MISMATCH`` codes for this rank's tensors (thd views) against its RankPlan."""
    heads, code = plan.heads, 0
    if q.shape[0] != plan.local_tokens or k.shape[0] != plan.local_tokens:
        code |= 1
    if q.shape[1] != heads.num_q_heads or k.shape[1] != heads.num_kv_heads:
        code |= 2
    if q.shape[2] != heads.head_dim or k.shape[2] != heads.head_dim:
        code |= 4
    if dist.get_world_size(group) != plan.num_workers:
        code |= 8
    if dist.get_rank(group) != plan.rank:
        code |= 16
    if len({(x.dtype, x.device) for x in (q, k, v)}) != 1:
        code |= 32
    if k.shape != v.shape:
        code |= 64
    return code


class _Verified:
    """Per process group: LRU of verified call keys."""

    def __init__(self):
        self._groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def _keys(self, group) -> "collections.OrderedDict":
        return self._groups.setdefault(group, collections.OrderedDict())

    def seen(self, group, key) -> bool:
        with self._lock:
            keys = self._keys(group)
            if key in keys:
                keys.move_to_end(key)
                return True
            return False

    def add(self, group, key) -> None:
        with self._lock:
            keys = self._keys(group)
            keys[key] = True
            while len(keys) > _VERIFIED_PER_GROUP:
                keys.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._groups.clear()


_VERIFIED = _Verified()


def forget_verified_keys() -> None:
    """Drop every remembered call key (tests; after re-creating process groups)."""
    _VERIFIED.clear()


def _describe(code: int) -> str:
    return "; ".join(msg for bit, msg in _MISMATCH.items() if code & bit)


def _gather_rows(row, check_group, device):
    """all_gather of one int64 row over ``check_group``; rows as host lists (gloo: CPU tensors, no sync)."""
    on_cpu = dist.get_backend(check_group) == "gloo"
    mine = torch.tensor(row, dtype=torch.int64, device="cpu" if on_cpu else device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(check_group))]
    dist.all_gather(table, mine, group=check_group)
    return [t.tolist() for t in table]  # one host read per verification (none per layer)


def _raise_if_bad(rows, group) -> None:
    problems = [f"rank {r}: {_describe(row[0])}" for r, row in enumerate(rows) if row[0]]
    keys = {}
    for r, row in enumerate(rows):
        keys.setdefault(tuple(row[1:]), []).append(r)
    if len(keys) > 1:
        groups = sorted(keys.values(), key=len, reverse=True)
        minority = ", ".join(f"rank {r}" for g in groups[1:] for r in g)
        problems.append(f"plan fingerprints differ (plan, dtype, heads, head dim, local tokens or save mode): "
                        f"ranks {groups[0]} agree, {minority} hold(s) a different (stale?) plan or tensors")
    if problems:
        raise PlanError(f"libra_attn_func: plan mismatch ({len(problems)} problem(s)): " + " | ".join(problems)
                        + f" (seen from rank {dist.get_rank(group)})")


def ensure_plan_verified(q, k, v, plan, group, *, save_mode, verify="auto", check_group=None) -> bool:
    """Verify (see module doc) when ``verify`` says so; returns whether a verification ran.

    Raises ``PlanError`` on every rank if any rank's plan does not fit its tensors or group, or the call
    keys differ. ``check_group``: group with the same ranks in the same order as ``group`` (default group).
    """
    key = call_key(plan, q, k, save_mode)
    if verify is False or (verify == "auto" and _VERIFIED.seen(group, key)):
        return False
    if verify not in (True, "auto"):
        raise ValueError(f"verify must be True, False or 'auto', got {verify!r}")
    check_group = group if check_group is None else check_group
    code = local_mismatches(q, k, v, plan, group)
    if dist.get_world_size(check_group) > 1:
        _raise_if_bad(_gather_rows([code, *key], check_group, q.device), group)
    elif code:
        _raise_if_bad([[code, *key]], group)
    _VERIFIED.add(group, key)
    return True
