"""The K/V relay between nodes (issue 14; ``records`` module docstring, "Relay"), and every rank's Pipeliner lead.

``choose_relay`` prices the candidate relay sets of one plan on the Pipeliner timeline (``plan.model``) and keeps
the fastest; ``relay_runs`` cuts a KV run table into the hop-1 runs and the relay runs; ``leads`` picks every
rank's lead (``plan.model.best_lead``).

Two layouts of the relay inside a node. *Single* (the default): the destination that needs the most of a home run
fetches all of it and forwards every other destination its prefix, so its NVLink egress carries up to (k - 1)
prefixes for k destinations. *Striped* (``stripe``, in KV units): the home run's rows are cut where the
destinations' prefixes end, each cut among the destinations that need it (at least ``stripe`` units a stripe, the
destinations needing the fewest rows owning first), each owner fetches its stripes over the NIC and forwards
them to the others that need them: the same bytes cross nodes once, spread over the node's NICs, and the
forwarding spreads over the node's NVLink egress. The Pipeliner prices both alike (it sums bytes per link class);
the dense placement keeps the one whose whole layer is faster (``plan.tiles.placement.fastest_layer``).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..layout import HeadLayout
from ..model import best_lead, pipeline_seconds
from .records import frozen_int64
from .tables import UnitRuns, hosted_pair_heads, pair_units, peer_units
from .traffic import traffic_of_units

__all__ = ["RELAY_SENDER_CUTS", "RELAY_STRIPE_UNITS", "relay_runs", "choose_relay", "leads"]

RELAY_SENDER_CUTS = (0.95, 0.99)  # relay candidates besides every home run (module docstring, "Relay")
RELAY_STRIPE_UNITS = 512  # the striped relay's least stripe, in KV units (tokens of one KV class)


def relay_runs(kv: UnitRuns, nodes: np.ndarray, kv_classes: int, senders: Optional[np.ndarray] = None,
               stripe: Optional[int] = None):
    """(hop-1 KV runs, relay runs or None) (module docstring, "Relay"); ``kv_classes``: G, the stride of a KV run's
    source units; ``senders`` (bool [W]): relay only the home runs of these workers (None: every worker's);
    ``stripe``: the striped layout with stripes of at least this many units (None: single).

    KV runs of one home run (same src and src_start: same K/V class, same first row) fetched by several
    destinations on one node other than the source's: single, only the longest (the relay R; lowest rank on ties)
    stays on the KV route and every other destination w gets a relay run R -> w of its own count, from R's
    arranged rows [tgt_R, +count_w) to its rows [tgt_w, +count_w); striped, ``_striped_runs``. Relay runs come
    sorted by (dst, tgt)."""
    if stripe is not None and stripe < 1:
        raise ValueError(f"the relay's least stripe must be >= 1 unit, got {stripe}")
    node = np.asarray(nodes, dtype=np.int64)
    cross = np.flatnonzero(node[kv.src] != node[kv.dst])
    if senders is not None:
        cross = cross[np.asarray(senders, dtype=bool)[kv.src[cross]]]
    if cross.size < 2:
        return kv, None
    src, start, dnode = kv.src[cross], kv.src_start[cross], node[kv.dst[cross]]
    order = cross[np.lexsort((kv.dst[cross], -kv.count[cross], dnode, start, src))]
    key = np.stack([kv.src[order], kv.src_start[order], node[kv.dst[order]]])
    first = np.ones(order.size, dtype=bool)
    first[1:] = (key[:, 1:] != key[:, :-1]).any(axis=0)
    if first.all():
        return kv, None
    if stripe is not None:
        return _striped_runs(kv, order, first, int(stripe), int(kv_classes))
    lead = order[np.maximum.accumulate(np.where(first, np.arange(order.size), 0))]  # the relay's run
    moved = order[~first]
    relay_of = lead[~first]
    relay = UnitRuns(src=kv.dst[relay_of], dst=kv.dst[moved], src_start=kv.tgt_start[relay_of],
                      count=kv.count[moved], tgt_start=kv.tgt_start[moved])
    by_dst = np.lexsort((relay.tgt_start, relay.dst))
    keep = np.ones(kv.src.size, dtype=bool)
    keep[moved] = False
    return UnitRuns(*(x[keep] for x in kv.arrays())), UnitRuns(*(x[by_dst] for x in relay.arrays()))


def _striped_runs(kv: UnitRuns, order: np.ndarray, first: np.ndarray, stripe: int, kv_classes: int):
    """The striped layout (module docstring) of the relayed runs ``order`` (grouped by home run and node, ``first``
    marks each group's first run; inside a group by count descending, then rank). Member i of a group (0-based)
    holds the cut [count of member i + 1, its own count) (the last member's starts at 0), which members 0..i
    need; the cut is split into n = clip(length // ``stripe``, 1, i + 1) near-equal stripes owned by members
    i, i - 1, ..., i - n + 1. Each stripe is one hop-1 run home -> owner and one relay run owner -> every other
    member of 0..i. Returns (hop-1 runs sorted by (dst, tgt), relay runs sorted by (dst, tgt))."""
    group = np.cumsum(first) - 1
    start = np.flatnonzero(first)
    size = np.diff(np.append(start, order.size))
    pos = np.arange(order.size) - start[group]  # member index inside its group
    count = kv.count[order]
    lo = np.where(pos + 1 < size[group], np.append(count[1:], 0), 0)  # the next member's count (the cut's start)
    length = count - lo
    owners = np.where((length > 0) & (size[group] > 1), np.clip(length // stripe, 1, pos + 1), 0)
    seg = np.repeat(np.arange(order.size), owners)  # one entry per stripe: the member whose cut it is
    nth = np.arange(seg.size) - np.repeat(np.cumsum(owners) - owners, owners)
    n = owners[seg]
    x = lo[seg] + length[seg] * nth // n  # the stripe's units [x, y) of the home run
    y = lo[seg] + length[seg] * (nth + 1) // n
    own = order[seg - nth]  # the owner's run: member pos - nth of the same group
    hop = (kv.src[own], kv.dst[own], kv.src_start[own] + x * kv_classes, y - x, kv.tgt_start[own] + x)
    consumers = pos[seg] + 1  # members 0..i need the stripe
    stripe_of = np.repeat(np.arange(seg.size), consumers)
    member = np.arange(stripe_of.size) - np.repeat(np.cumsum(consumers) - consumers, consumers)
    to = order[start[group[seg[stripe_of]]] + member]
    forward = to != own[stripe_of]
    stripe_of, to = stripe_of[forward], to[forward]
    relay = UnitRuns(src=kv.dst[own[stripe_of]], dst=kv.dst[to], src_start=kv.tgt_start[own[stripe_of]] + x[stripe_of],
                     count=(y - x)[stripe_of], tgt_start=kv.tgt_start[to] + x[stripe_of])
    if relay.src.size == 0:
        return kv, None
    keep = np.ones(kv.src.size, dtype=bool)
    keep[order[size[group] > 1]] = False
    hop1 = UnitRuns(*(np.concatenate([a[keep], b]) for a, b in zip(kv.arrays(), hop)))
    by_dst = np.lexsort((hop1.tgt_start, hop1.dst))
    relay_by_dst = np.lexsort((relay.tgt_start, relay.dst))
    return UnitRuns(*(a[by_dst] for a in hop1.arrays())), UnitRuns(*(a[relay_by_dst] for a in relay.arrays()))



def choose_relay(q_runs: UnitRuns, kv_runs: UnitRuns, q_len, kv_len, varlen, heads: HeadLayout, timing, peers,
                 hosted, relay_senders=None, stripe=None):
    """The plan's relay under ``timing`` (``timing.kv_relay``): (kv_runs, peers, hosted, lead, relay_units, relay
    runs), the direct plan's when no relay set prices the pool's slowest worker no slower. ``relay_senders``
    (bool [W], tests) relays exactly the home runs of these workers (no pricing); ``stripe``: the striped layout
    (``relay_runs``), None the single."""
    W = q_len.shape[0]
    lead, seconds = leads(peers, hosted, heads, timing)
    direct = (kv_runs, peers, hosted, lead, None, None)
    if not timing.kv_relay:
        return direct
    sets = [relay_senders] if relay_senders is not None else \
        [None] + _distinct([seconds >= cut * seconds.max() for cut in RELAY_SENDER_CUTS])
    best = None
    for senders in sets:
        hop1, runs = relay_runs(kv_runs, timing.nodes(W), heads.num_kv_classes, senders, stripe)
        if runs is None:
            continue
        r_peers = frozen_int64(peer_units(q_runs, hop1, W))
        r_units = frozen_int64(pair_units(runs, W))
        r_hosted = hosted_pair_heads(q_runs, hop1, q_len, kv_len, varlen, heads, runs)
        r_lead, r_seconds = leads(r_peers, r_hosted, heads, timing, r_units)
        # relay unless the timeline prices the pool's slowest worker slower with it (ties relay: the
        # same step for fewer bytes between nodes); the fastest set wins, ties the earlier (more relayed)
        if relay_senders is None and (r_seconds.max() > seconds.max() * (1 + 1e-12) or
                                      (best is not None and r_seconds.max() >= best[0])):
            continue
        best = (r_seconds.max(), (hop1, r_peers, r_hosted, r_lead, r_units, runs))
    return direct if best is None else best[1]


def _distinct(masks: list) -> list:
    """``masks`` without the ones equal to an earlier one (the same relay set priced once)."""
    out = []
    for mask in masks:
        if not any(np.array_equal(mask, seen) for seen in out):
            out.append(mask)
    return out


def leads(peers, hosted, heads: HeadLayout, timing, relay_units=None):
    """(int64 [W] leads, float64 [W] every worker's seconds with them) under ``timing``: every rank's
    ``plan.model.best_lead`` from its local / remote loads and phase seconds; with a relay, also every relay
    sender at lead 0 (it issues its forwards before its local work, so its receivers start sooner), whichever
    prices the pool's slowest worker faster."""
    traffic = traffic_of_units(peers, heads, relay_units)
    nodes = timing.nodes(traffic.num_workers)
    dispatch, ret = traffic.phase_seconds(nodes, timing)
    local, remote = (timing.compute_seconds(x) for x in hosted)
    relay = traffic.relay_timing(nodes, timing)
    lead = best_lead(local, remote, dispatch, ret, relay)
    seconds = pipeline_seconds(local, remote, dispatch, ret, timing.local_first, lead, relay)[0]
    if relay is not None:
        early = np.where(np.asarray(relay_units).sum(axis=1) > 0, 0, lead)
        other = pipeline_seconds(local, remote, dispatch, ret, timing.local_first, early, relay)[0]
        if other.max() < seconds.max():
            lead, seconds = early, other
    return lead, seconds
