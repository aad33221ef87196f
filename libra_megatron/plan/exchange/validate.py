"""Plan invariants (§4.3.3, §4.4): ``validate_plan`` raises PlanError naming the rank (and tile).

What is checked, independently of how ``build_exchange_plan`` computed the plan:
  shape      every RankPlan belongs to this pool (rank id, worker count, local tokens, heads, fingerprint)
  routes     split sums match index lengths, indices lie inside source/target buffers, forward routes place
             (recv_index is a permutation of the arranged buffer; for K/V, the KV route's and the relay
             route's together), send_splits[r][d] == recv_splits[d][r]; a pool has relay routes on every
             rank or on none
  Q          every local unit (token, h) of every rank is sent exactly once, to the destination the
             assignment gives its tile; the inverse route returns every output to its home exactly once
  KV         simulated with (sequence, position, KV class) ids, the relay hop after the KV route (a relay
             forwards only rows it holds by then): per destination no unit arrives twice
             (dedup over tiles, head shards of one class and chunks: each kv piece is sent by the first chunk
             that reads it, reused by the next ones and its dK/dV returned after the last one),
             every referenced group arrives as its rows [0, p) contiguous in doc order, p = the longest
             key prefix of the tiles reading it there (every tile's prefix is present; the whole doc
             under KvFetch.GROUP), and nothing else arrives
  varlen     cu_seqlens_q tiles the arranged Q buffer; entry i's query rows are doc positions
             [e-q_len, e) of one doc s on one shard h and keys [off, off+e) hold rows [0, e) of group (s, h)
  bytes      plan totals equal Eq. 8 summed over the assignment: sum over referenced (g, r) of the rows of
             r's prefix of g it does not hold (``tiles.group_remote_bytes``) + sum over migrated tiles of
             V_Q + V_O; per-rank
             ``bytes_sent`` equals the remote units its routes move (K/V: both hops); ``peer_units`` and
             ``relay_units`` (what ``plan.exchange.traffic`` prices per link and Pipeliner phase) equal every rank's
             per-peer route splits
Cost: O(total units of all ranks) -- meant for tests and debug runs, not for every step at scale.
"""
from __future__ import annotations

import numpy as np

from ...config import KvFetch
from ..errors import PlanError
from .records import ExchangePlan, Route

__all__ = ["validate_plan"]


def validate_plan(plan: ExchangePlan, tiles) -> None:
    """Raise PlanError (naming rank, and tile where one is involved) if ``plan`` does not execute
    ``plan.assignment`` of ``tiles`` exactly; return None otherwise."""
    _check_pool(plan, tiles)
    _check_kv_chunks(tiles.heads)
    ranks = list(plan.ranks)
    relayed = _check_relay_presence(ranks)
    per_unit = {"q_route": tiles.head_split, "kv_route": tiles.num_kv_classes}
    for name, units_per_token in per_unit.items():
        routes = [getattr(rp, name) for rp in ranks]
        for w, rt in enumerate(routes):
            _check_route(rt, w, name, ranks[w].local_tokens * units_per_token,
                         partial=relayed and name == "kv_route")
        _check_cross_rank(routes, name)
    if relayed:
        for w, rp in enumerate(ranks):
            _check_route(rp.relay_route, w, "relay_route", rp.kv_route.target_len, partial=True)
            _check_covers(rp, w)
        _check_cross_rank([rp.relay_route for rp in ranks], "relay_route")
    unit_tile = _unit_tiles(tiles)
    q_ids, kv_ids = _unit_ids(tiles, tiles.head_split), _unit_ids(tiles, tiles.num_kv_classes)
    arranged_q = _check_q(plan, ranks, unit_tile, np.concatenate(q_ids))
    arranged_kv = _exchange([rp.kv_route for rp in ranks], kv_ids)
    if relayed:
        arranged_kv = _relay_exchange(ranks, arranged_kv)
    for w, rp in enumerate(ranks):
        _check_kv_dedup(arranged_kv[w], w)
        _check_varlen(rp, tiles, arranged_q[w], arranged_kv[w])
    _check_bytes(plan, tiles, ranks)
    _check_peer_units(plan, ranks)


def _check_relay_presence(ranks) -> bool:
    """Whether the pool relays K/V: every rank has a relay route or none does (all call its collective)."""
    has = [rp.relay_route is not None for rp in ranks]
    if any(has) and not all(has):
        raise PlanError(f"rank {has.index(not has[0])}: relay route present on some ranks only; every rank of a "
                        f"relaying pool must call the relay exchange")
    return bool(has and has[0])


def _check_covers(rp, w: int) -> None:
    """The KV route's and the relay route's receive rows place every arranged-KV row exactly once."""
    rows = np.concatenate([rp.kv_route.recv_index, rp.relay_route.recv_index])
    if rows.size != rp.kv_route.target_len or (np.bincount(rows, minlength=rp.kv_route.target_len) != 1).any():
        raise PlanError(f"rank {w}: kv_route and relay_route receive rows are not a permutation of "
                        f"range({rp.kv_route.target_len})")


def _relay_exchange(ranks, arranged_kv):
    """The relay hop on the simulated arranged K/V: a relay forwards rows it holds after the KV route."""
    for w, rp in enumerate(ranks):
        if (arranged_kv[w][rp.relay_route.send_index] < 0).any():
            raise PlanError(f"rank {w}: relay_route forwards arranged KV rows it has not received")
    relayed = _exchange([rp.relay_route for rp in ranks], arranged_kv)
    out = []
    for rp, held, got in zip(ranks, arranged_kv, relayed):
        full = held.copy()
        full[rp.relay_route.recv_index] = got[rp.relay_route.recv_index]
        out.append(full)
    return out


def _check_peer_units(plan: ExchangePlan, ranks) -> None:
    """``plan.peer_units[kind][w]`` must be rank w's send splits of the Q (kind 0) and KV (kind 1) routes, and
    ``plan.relay_units[w]`` its relay route's (with the self pair 0)."""
    if plan.relay_units is not None:
        for w, rp in enumerate(ranks):
            splits = rp.relay_route.send_splits if rp.relay_route is not None else None
            if splits is None or not np.array_equal(plan.relay_units[w], splits):
                raise PlanError(f"rank {w}: relay_units {plan.relay_units[w].tolist()} != its relay send_splits "
                                f"{None if splits is None else splits.tolist()}")
    if plan.peer_units is None:
        return
    for kind, name in enumerate(("q_route", "kv_route")):
        for w, rp in enumerate(ranks):
            splits = getattr(rp, name).send_splits
            if not np.array_equal(plan.peer_units[kind][w], splits):
                raise PlanError(f"rank {w}: peer_units of {name} {plan.peer_units[kind][w].tolist()} != its "
                                f"send_splits {splits.tolist()}")


# ------------------------------------------------------------------ structure
def _check_pool(plan: ExchangePlan, tiles) -> None:
    W = tiles.num_workers
    if plan.num_workers != W:
        raise PlanError(f"plan has {plan.num_workers} ranks, the pool has {W} workers")
    a = np.asarray(plan.assignment)
    if a.shape != (tiles.num_tiles,):
        raise PlanError(f"assignment has shape {a.shape}, expected ({tiles.num_tiles},)")
    bad = np.flatnonzero((a < 0) | (a >= W))
    if bad.size:
        raise PlanError(f"tile {int(bad[0])}: destination {int(a[bad[0]])} outside the pool of {W} workers")
    for w, rp in enumerate(plan.ranks):
        got = (rp.rank, rp.num_workers, rp.local_tokens, rp.heads, rp.fingerprint)
        want = (w, W, tiles.layout.local_len, tiles.heads, plan.fingerprint)
        if got != want:
            raise PlanError(f"rank {w}: (rank, num_workers, local_tokens, heads, fingerprint) = {got}, expected {want}")


def _check_route(rt: Route, w: int, name: str, source_len: int, partial: bool = False) -> None:
    """One forward route; ``partial``: its receive rows are distinct but need not cover the target (the KV
    and relay routes of a relaying pool cover it together, ``_check_covers``)."""
    W = len(rt.send_splits)
    where = f"rank {w}: {name}"
    if rt.accumulate:
        raise PlanError(f"{where} is a forward route but accumulate=True")
    if rt.source_len != source_len:
        raise PlanError(f"{where}: source_len {rt.source_len} != local_tokens*H = {source_len}")
    if len(rt.recv_splits) != W or (rt.send_splits < 0).any() or (rt.recv_splits < 0).any():
        raise PlanError(f"{where}: splits must be {W} non-negative counts")
    if rt.send_splits.sum() != rt.send_index.size or rt.recv_splits.sum() != rt.recv_index.size:
        raise PlanError(
            f"{where}: splits sum to ({int(rt.send_splits.sum())}, {int(rt.recv_splits.sum())}) but the "
            f"index arrays hold ({rt.send_index.size}, {rt.recv_index.size}) units"
        )
    if rt.send_index.size and (rt.send_index.min() < 0 or rt.send_index.max() >= rt.source_len):
        raise PlanError(f"{where}: send_index outside [0, {rt.source_len})")
    if rt.recv_index.size and (rt.recv_index.min() < 0 or rt.recv_index.max() >= rt.target_len):
        raise PlanError(f"{where}: recv_index outside [0, {rt.target_len})")
    hits = np.bincount(rt.recv_index, minlength=rt.target_len)
    if (hits > 1).any() or (not partial and (hits != 1).any()):
        raise PlanError(f"{where}: recv_index is not a permutation of range({rt.target_len})")


def _check_cross_rank(routes, name: str) -> None:
    send = np.stack([rt.send_splits for rt in routes])
    recv = np.stack([rt.recv_splits for rt in routes])
    bad = np.argwhere(send != recv.T)
    if bad.size:
        r, d = (int(x) for x in bad[0])
        raise PlanError(f"rank {r}: {name} sends {int(send[r, d])} units to rank {d}, which expects {int(recv[d, r])}")


# ------------------------------------------------------------------ simulated exchange
def _exchange(routes, sources):
    """all_to_all of id arrays (same contract as ``execute.exchange_numpy``, kept separate on purpose)."""
    W = len(routes)
    sent = [src[rt.send_index] for rt, src in zip(routes, sources)]
    offs = [np.concatenate([[0], np.cumsum(rt.send_splits)]) for rt in routes]
    out = []
    for d, rt in enumerate(routes):
        recv = np.concatenate([sent[s][offs[s][d] : offs[s][d + 1]] for s in range(W)])
        tgt = np.full(rt.target_len, -1, dtype=np.int64)
        if rt.accumulate:
            np.add.at(tgt, rt.recv_index, recv + 1)
        else:
            tgt[rt.recv_index] = recv
        out.append(tgt)
    return out


def _unit_ids(tiles, per_token: int):
    """Per worker: int64 [local_len*n] ids ((seq*L + global pos)*n + j) of its local units, n = per_token
    (H for Q units: j = head shard; G for KV units: j = KV class)."""
    lay, n = tiles.layout, per_token
    out = []
    for w in range(tiles.num_workers):
        seq, c = divmod(w, lay.cp)
        pos = lay.local_to_global(c)
        out.append(((seq * lay.seq_len + pos)[:, None] * n + np.arange(n)[None, :]).reshape(-1))
    return out


def _check_kv_chunks(heads) -> None:
    """Within a step every kv row arrives once: each kv piece is read by consecutive chunks only, the first
    of them is a KV-sending chunk, no later one is, and the last of them returns dK/dV (from kv_piece_index)."""
    pieces = heads.kv_piece_index()  # [H, M], computed independently of kv_send_chunks
    sends, returns = heads.kv_send_chunks(), heads.kv_return_chunks()
    for h in range(heads.head_split):
        for j in np.unique(pieces[h]):
            chunks = np.flatnonzero(pieces[h] == j)
            if (np.diff(chunks) != 1).any() or not sends[chunks[0]] or sends[chunks[1:]].any() \
                    or not returns[chunks[-1]] or returns[chunks[:-1]].any():
                raise PlanError(f"shard {h}: kv piece {int(j)} is read by chunks {chunks.tolist()}, but chunks "
                                f"{np.flatnonzero(sends).tolist()} send K/V and {np.flatnonzero(returns).tolist()} "
                                f"return dK/dV: a kv row would arrive twice or too late in one step")


def _unit_tiles(tiles):
    """Per worker: int64 [local_len*H] tile id of every local unit (from the block table)."""
    H, n = tiles.head_split, tiles.layout.local_len * tiles.head_split
    out = [np.full(n, -1, dtype=np.int64) for _ in range(tiles.num_workers)]
    for b in range(tiles.num_blocks):
        lo = int(tiles.block_local_start[b])
        tok = np.arange(lo, lo + int(tiles.block_end[b] - tiles.block_start[b]))
        for h in range(H):
            out[int(tiles.block_home[b])][tok * H + h] = b * H + h
    return out


# ------------------------------------------------------------------ Q dispatch and O return
def _check_q(plan, ranks, unit_tile, flat_unit_ids):
    """Q units go exactly once to their tile's destination; outputs come back home exactly once."""
    W = len(ranks)
    for w, rp in enumerate(ranks):
        rt = rp.q_route
        counts = np.bincount(rt.send_index, minlength=rt.source_len)
        if (counts != 1).any():
            u = int(np.flatnonzero(counts != 1)[0])
            raise PlanError(f"rank {w}: Q unit {u} (tile {int(unit_tile[w][u])}) is sent {int(counts[u])} times")
        dest = np.repeat(np.arange(W), rt.send_splits)
        tile = unit_tile[w][rt.send_index]
        bad = np.flatnonzero(dest != plan.assignment[tile])
        if bad.size:
            t = int(tile[bad[0]])
            raise PlanError(
                f"rank {w}: tile {t} Q sent to rank {int(dest[bad[0]])}, assigned to {int(plan.assignment[t])}"
            )
    ids = [w * ranks[0].q_route.source_len + np.arange(rp.q_route.source_len) for w, rp in enumerate(ranks)]
    arranged = _exchange([rp.q_route for rp in ranks], ids)
    back = _exchange([rp.q_route.inverse() for rp in ranks], arranged)
    for w in range(W):
        bad = np.flatnonzero(back[w] != ids[w])  # accumulate adds 1 to the -1 fill: exact iff one return
        if bad.size:
            u = int(bad[0])
            raise PlanError(
                f"rank {w}: output of unit {u} (tile {int(unit_tile[w][u])}) does not return home exactly once"
            )
    return [flat_unit_ids[a] for a in arranged]  # (worker*source_len + unit) -> (seq*L + pos)*H + h


# ------------------------------------------------------------------ KV and varlen
def _check_kv_dedup(arranged_kv: np.ndarray, w: int) -> None:
    uniq, counts = np.unique(arranged_kv, return_counts=True)
    if (counts > 1).any():
        raise PlanError(f"rank {w}: KV unit id {int(uniq[counts > 1][0])} arrives {int(counts.max())} times (no dedup)")


def _decode(ids: np.ndarray, tiles):
    """(seq*L + pos)*H + h ids -> (doc, doc-local position, h)."""
    H, L = tiles.head_split, tiles.layout.seq_len
    tok, h = np.divmod(ids, H)
    seq, pos = np.divmod(tok, L)
    key = seq * L + pos
    doc_key = tiles.doc_seq * L + tiles.doc_start
    doc = np.searchsorted(doc_key, key, side="right") - 1
    return doc, key - doc_key[doc], h


def _check_varlen(rp, tiles, q_ids: np.ndarray, kv_ids: np.ndarray) -> None:
    w, cu = rp.rank, rp.cu_seqlens_q
    n = rp.num_seqs
    if cu.shape != (n + 1,) or rp.seq_kv_offset.shape != (n,) or cu[0] != 0 or cu[-1] != q_ids.size:
        raise PlanError(f"rank {w}: cu_seqlens_q must be [0 .. {q_ids.size}] with {n}+1 entries")
    q_len = np.diff(cu)
    if (q_len < 1).any() or (rp.seq_k_len < q_len).any():
        raise PlanError(f"rank {w}: varlen entry with q_len < 1 or k_len < q_len")
    entry = np.repeat(np.arange(n), q_len)
    doc, pos, h = _decode(q_ids, tiles)
    want_pos = (rp.seq_k_len - q_len)[entry] + (np.arange(q_ids.size) - cu[entry])
    bad = np.flatnonzero((pos != want_pos) | (doc != doc[cu[entry]]) | (h != h[cu[entry]]))
    if bad.size:
        i = int(entry[bad[0]])
        raise PlanError(f"rank {w}: varlen entry {i} query rows are not doc positions [e-q_len, e) of one group")
    _check_groups(rp, tiles, doc[cu[:-1]], tiles.heads.kv_class_of_shard()[h[cu[:-1]]], kv_ids)


def _check_groups(rp, tiles, ent_doc, ent_h, kv_ids) -> None:
    """The arranged KV is one run per referenced group (s, c) (``ent_h``: the entries' KV classes), at its
    entries' offset, holding its rows
    [0, p) in doc order: p >= the longest key prefix of its entries (every tile's prefix is present),
    p == that prefix under KvFetch.PREFIX and p == the doc length under GROUP (nothing else is fetched)."""
    w, H, L = rp.rank, tiles.num_kv_classes, tiles.layout.seq_len
    off, idx, inverse = np.unique(rp.seq_kv_offset, return_index=True, return_inverse=True)
    if not off.size or off[0] != 0:
        if kv_ids.size or off.size:
            raise PlanError(f"rank {w}: arranged KV ({kv_ids.size} rows) does not start with a referenced group")
        return
    s, h = ent_doc[idx], ent_h[idx]
    length = np.diff(np.append(off, kv_ids.size))
    needed = np.zeros(off.size, dtype=np.int64)
    np.maximum.at(needed, inverse.reshape(-1), rp.seq_k_len)
    want = tiles.doc_len[s] if tiles.kv_fetch is KvFetch.GROUP else needed
    bad = np.flatnonzero((length != want) | (length < needed))
    if bad.size:
        i = int(bad[0])
        raise PlanError(f"rank {w}: arranged KV of group (doc {int(s[i])}, class {int(h[i])}) has {int(length[i])} rows; "
                        f"its tiles need {int(needed[i])}, {tiles.kv_fetch.value} fetch wants {int(want[i])}")
    for o, si, hi, ln in zip(off, s, h, length):
        rows = ((tiles.doc_seq[si] * L + tiles.doc_start[si] + np.arange(ln)) * H + hi)
        got = kv_ids[o : o + ln]
        if got.shape != rows.shape or (got != rows).any():
            raise PlanError(f"rank {w}: KV rows [{o}, {o + ln}) do not hold rows [0, {ln}) of group (doc {si}, class {hi})")
    for i in range(rp.num_seqs):
        j = int(np.searchsorted(off, rp.seq_kv_offset[i]))
        if (s[j], h[j]) != (ent_doc[i], ent_h[i]):
            raise PlanError(f"rank {w}: varlen entry {i} points at the KV of another group")


# ------------------------------------------------------------------ bytes (Eq. 8)
def _eq8_bytes(tiles, assignment: np.ndarray):
    """(kv bytes, q+o bytes) of Eq. 8 summed over the assignment: per referenced (group, destination) the
    rows of its longest needed prefix the destination does not hold (``tile_kv_refs``/``group_remote_bytes``)."""
    prefix = {}
    for t in range(tiles.num_tiles):
        r = int(assignment[t])
        for g, e in zip(*tiles.tile_kv_refs(t)):
            prefix[int(g), r] = max(prefix.get((int(g), r), 0), int(e))
    kv = sum(tiles.group_remote_bytes(g, r, e) for (g, r), e in prefix.items())
    migrated = assignment != tiles.tile_home()
    per_token = tiles.heads.q_bytes_per_token() + tiles.heads.o_bytes_per_token()
    return kv, int(tiles.tile_tokens()[migrated].sum()) * per_token


def _check_bytes(plan: ExchangePlan, tiles, ranks) -> None:
    kv, qo = _eq8_bytes(tiles, np.asarray(plan.assignment))
    if (plan.bytes_kv, plan.bytes_q + plan.bytes_o) != (kv, qo):
        raise PlanError(
            f"plan bytes (kv {plan.bytes_kv}, q+o {plan.bytes_q + plan.bytes_o}) != "
            f"Eq. 8 accounting (kv {kv}, q+o {qo})"
        )
    hd = tiles.heads
    per_unit = np.array([hd.q_bytes_per_token(), hd.kv_bytes_per_token(), hd.o_bytes_per_token()])
    for w, rp in enumerate(ranks):
        o_units = rp.q_route.recv_splits.sum() - rp.q_route.recv_splits[w]
        kv_units = rp.kv_route.remote_units_sent(w)
        kv_units += 0 if rp.relay_route is None else rp.relay_route.remote_units_sent(w)
        units = np.array([rp.q_route.remote_units_sent(w), kv_units, o_units])
        if tuple(int(x) for x in units * per_unit) != tuple(rp.bytes_sent):
            raise PlanError(
                f"rank {w}: bytes_sent {rp.bytes_sent} != remote units {units.tolist()} * {per_unit.tolist()}"
            )
    if sum(rp.bytes_sent[0] for rp in ranks) != plan.bytes_q:
        raise PlanError(f"plan bytes_q {plan.bytes_q} != sum of per-rank Q bytes")
