"""plan.exchange.runtime_tables: the run tables expand to exactly the unit-based row tables, in O(runs) on the host."""
import numpy as np
import pytest

from libra_megatron.plan.model import StepTimeModel
from libra_megatron.plan.exchange import IndexRuns, RowRuns, build_exchange_plan, build_rank_tables, rank_tables
from libra_megatron.plan.exchange.local_entries import rank_local_entries
from libra_megatron.plan.layout import HeadLayout, TokenLayout
from libra_megatron.plan.tiles import build_tiles
from libra_megatron.testing.unit_tables import entry_kinds_by_units, local_entries_by_units, unit_tables

# (hq, hkv, H, M): affine kv rows (shared and disjoint kv pieces), H not a power of two, H > hkv (KV classes;
# a shard straddling two kv heads, e.g. hq 12, hkv 2, H 3, is rejected by HeadLayout), non-affine kv columns
HEADS = [(8, 8, 2, 2), (8, 2, 1, 4), (8, 1, 4, 2), (8, 2, 4, 1), (16, 2, 2, 1), (4, 4, 4, 1), (8, 8, 1, 4),
         (16, 4, 2, 2), (12, 12, 3, 2), (18, 6, 3, 2), (12, 1, 3, 2), (128, 4, 4, 4), (32, 8, 4, 4)]


def _plan(hq, hkv, H, M, kv_fetch="prefix", tiling="adaptive", relay=False):
    """A random assignment over 4 workers; ``relay``: K/V relayed over nodes {0}, {1, 2, 3}."""
    rng = np.random.default_rng(hq * 100 + hkv * 10 + H + M)
    heads = HeadLayout(hq, hkv, 4, H, M)
    tiles = build_tiles([[20, 28], [3, 45]], TokenLayout("zigzag", 48, 2), heads, 5, tiling=tiling, kv_fetch=kv_fetch)
    timing = StepTimeModel(4, attn_tflops=1e-6, inter_node_gbps=1e-7, intra_node_gbps=1e-3, worker_nodes=(0, 1, 1, 1),
                           kv_relay=True) if relay else None  # links between nodes slow enough that relays pay off
    return heads, build_exchange_plan(tiles, rng.integers(0, tiles.num_workers, tiles.num_tiles), timing)


def assert_tables_equal_unit_tables(rp, t, expand):
    """Every table of ``t`` expanded with ``expand`` equals the unit-based reference of ``rp``."""
    ref = unit_tables(rp)
    for m in range(rp.heads.num_chunks):
        np.testing.assert_array_equal(expand(t.q_send[m]), ref.q_send[m])
        np.testing.assert_array_equal(expand(t.kv_send[m]), ref.kv_send[m])
    for name in ("q_arranged", "kv_arranged", "k_gather"):
        np.testing.assert_array_equal(expand(getattr(t, name)), getattr(ref, name), err_msg=name)
    np.testing.assert_array_equal(t.cu_q, ref.cu_q)
    np.testing.assert_array_equal(t.cu_k, ref.cu_k)
    assert (t.relay_send is None) == (ref.relay_send is None)
    if ref.relay_send is not None:
        np.testing.assert_array_equal(expand(t.relay_send), ref.relay_send)
        np.testing.assert_array_equal(expand(t.relay_recv), ref.relay_recv)


@pytest.mark.parametrize("hq, hkv, H, M", HEADS)
@pytest.mark.parametrize("kv_fetch, relay", [("group", False), ("prefix", False), ("prefix", True)])
def test_run_tables_expand_to_the_unit_tables_for_every_rank(hq, hkv, H, M, kv_fetch, relay):
    heads, plan = _plan(hq, hkv, H, M, kv_fetch, relay=relay)
    assert (plan.relay_units is not None) == relay
    for w in range(plan.num_workers):
        rp = plan.for_rank(w)
        t = build_rank_tables(rp)
        assert_tables_equal_unit_tables(rp, t, RowRuns.expand)
        assert all(r.dtype == np.int32 and r.expand().dtype == np.int32 for r in t.distinct_runs())
        assert all((r.count > 0).all() and not r.start.flags.writeable for r in t.distinct_runs())
        assert t.cu_q.dtype == t.cu_k.dtype == np.int32
        assert t.kv_splits.send == tuple(rp.kv_route.send_splits) and t.q_back_splits.send == tuple(rp.q_route.recv_splits)


def test_tables_never_expand_the_routes_and_stay_the_size_of_the_runs():
    _, plan = _plan(32, 8, 4, 4)
    for rp in plan.ranks:
        t = build_rank_tables(rp)
        for route in (rp.q_route, rp.kv_route):  # cached_property: an expansion would sit in __dict__
            assert "send_index" not in vars(route) and "recv_index" not in vars(route)
        runs = rp.q_route.send_runs.num_runs + rp.kv_route.send_runs.num_runs
        assert max(r.num_runs for r in t.distinct_runs()) <= max(runs, rp.num_seqs)
        assert t.nbytes() == sum(a.nbytes for a in _unit_arrays(unit_tables(rp), t, rp))


def _entry_set_arrays(rp, keep, k_start=None, k_end=None):
    """Brute-force arrays of an entry set: arranged Q rows, packed key rows [k_start, k_end) (default: every
    key), cu_q, cu_k of the kept entries."""
    cu, off, kl = np.asarray(rp.cu_seqlens_q), np.asarray(rp.seq_kv_offset), np.asarray(rp.seq_k_len)
    k_start = off if k_start is None else k_start
    k_end = off + kl if k_end is None else k_end
    idx = np.flatnonzero(keep)
    q = [np.arange(cu[i], cu[i + 1]) for i in idx]
    k = [np.arange(k_start[i], k_end[i]) for i in idx]
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
    return [cat(q), cat(k), np.concatenate([[0], np.cumsum([len(x) for x in q])]),
            np.concatenate([[0], np.cumsum([len(x) for x in k])])]


def _unit_arrays(ref, t, rp):
    """The reference arrays the device holds (int32; chunks sharing a kv piece share one array)."""
    kv = {id(r): a for r, a in zip(t.kv_send, ref.kv_send)}
    arrays = [*ref.q_send, *kv.values(), ref.q_arranged, ref.kv_arranged, ref.k_gather, ref.cu_q, ref.cu_k]
    arrays += [np.argsort(ref.q_arranged)]  # the inverse permutations forward routes place through
    if t.relay_send is None:
        arrays += [np.argsort(ref.kv_arranged)]
    arrays += [np.argsort(ref.q_send[0] // len(ref.q_send))]  # the O / dQ returns' gather into local unit order
    sets = _reference_sets(rp)
    arrays += [a for part in sets if part is not None for a in part]
    if sets[0] is not None:  # the local set's rows in the dispatches' send buffers
        arrays += [sets[0][0]] + ([sets[0][1]] if t.relay_send is None else [])
    if np.array_equal(np.unique(ref.k_gather), np.arange(t.kv_target_len)):  # dK|dV sums from first packed rows
        first = np.unique(ref.k_gather, return_index=True)[1]
        repeat = np.setdiff1d(np.arange(ref.k_gather.size), first)
        arrays += [first, repeat, ref.k_gather[repeat]]
    return [a.astype(np.int32) for a in arrays]


def _reference_sets(rp):
    """(local, remote, heads) brute-force set arrays of ``rp`` (None where ``build_rank_tables`` has no set)."""
    kinds, tail = entry_kinds_by_units(rp)
    if not (kinds > 0).any():
        return None, None, None
    off = np.asarray(rp.seq_kv_offset)
    split = kinds == 2
    local = _entry_set_arrays(rp, kinds > 0, np.where(split, tail, off))
    heads = _entry_set_arrays(rp, split, off, tail) if split.any() else None
    return local, _entry_set_arrays(rp, kinds == 0), heads


@pytest.mark.parametrize("hq, hkv, H, M", HEADS)
@pytest.mark.parametrize("kv_fetch", ["group", "prefix"])
def test_local_first_entry_sets_equal_the_row_by_row_split(hq, hkv, H, M, kv_fetch):
    """The (local, remote, heads) sets equal the row-by-row split of the expanded routes: local entries with all
    their keys and split entries with their self-sourced key tail (causal), remote entries (causal), split
    entries with the keys before the tail (no mask)."""
    heads, plan = _plan(hq, hkv, H, M, kv_fetch)
    seen = set()
    for rp in plan.ranks:
        t = build_rank_tables(rp)
        np.testing.assert_array_equal(rank_local_entries(rp), local_entries_by_units(rp))
        want = _reference_sets(rp)
        seen.add(tuple(w is not None for w in want))
        for part, ref in zip((t.local, t.remote, t.heads), want):
            assert (part is None) == (ref is None)
            if part is not None:
                for got, arr in zip((part.q_rows.expand(), part.k_gather.expand(), part.cu_q, part.cu_k), ref):
                    np.testing.assert_array_equal(got, arr)
    assert (True, True, False) in seen or (True, True, True) in seen, seen  # ranks with local entries


def test_chunks_reading_the_same_kv_pieces_share_one_table_and_tables_are_cached_per_plan():
    heads = HeadLayout(32, 8, 4, 4, 4)  # chunks (0, 1) and (2, 3) read the same kv heads
    tiles = build_tiles([[30, 18], [48]], TokenLayout("zigzag", 48, 2), heads, 6)
    rp = build_exchange_plan(tiles, tiles.tile_home()).for_rank(1)
    t = rank_tables(rp)
    assert t.kv_send[0] is t.kv_send[1] and t.kv_send[2] is t.kv_send[3] and t.kv_send[0] is not t.kv_send[2]
    assert rank_tables(rp) is t


def test_row_dtype_follows_the_plan_bound_not_the_values():
    small = RowRuns.make([0, 10], [3, 2], 2, bound=2**31)
    assert small.dtype == np.int32 and small.nbytes == 5 * 4
    np.testing.assert_array_equal(small.expand(), [0, 2, 4, 10, 12])
    big = RowRuns.make([2**31 + 1, 5], [2, 1], 3, bound=2**31 + 8)
    assert big.dtype == np.int64 and big.nbytes == 3 * 8
    np.testing.assert_array_equal(big.expand(), [2**31 + 1, 2**31 + 4, 5])


def test_index_runs_expand_like_concatenated_ranges():
    rng = np.random.default_rng(3)
    for _ in range(50):
        n, stride = int(rng.integers(0, 8)), int(rng.integers(0, 5))
        start, count = rng.integers(0, 100, n), rng.integers(0, 6, n)
        want = [s + stride * i for s, c in zip(start, count) for i in range(c)]
        runs = IndexRuns(start, count, stride)
        np.testing.assert_array_equal(runs.expand(), np.array(want, dtype=np.int64))
        assert runs.num_indices == len(want)
        assert runs.index_range() == ((min(want), max(want) + 1) if want else (0, 0))


def assert_size_fields(got, want, fields) -> set:
    """``got`` and ``want`` agree on every named field (entry sets by their lengths); returns the entry sets present."""
    present = set()
    for name in fields:
        a, b = getattr(got, name), getattr(want, name)
        if name in ("local", "remote", "heads"):
            assert (a is None) == (b is None), name
            if b is not None:
                present.add(name)
                assert (a.q_lens, a.k_lens, a.q_span) == (b.q_lens, b.k_lens, b.q_span), name
        else:
            assert a == b, name
    return present


@pytest.mark.parametrize("hq, hkv, H, M", HEADS)
@pytest.mark.parametrize("kv_fetch, relay", [("group", False), ("prefix", False), ("prefix", True)])
def test_rank_sizes_are_the_size_fields_of_the_rank_tables(hq, hkv, H, M, kv_fetch, relay):
    """What the op lists read (``rank_sizes``, issue 25) is field for field what the runtime's tables hold."""
    from libra_megatron.plan.exchange import RankSizes, rank_sizes

    _, plan = _plan(hq, hkv, H, M, kv_fetch, relay=relay)
    seen_sets = set()
    for w in range(plan.num_workers):
        rp = plan.for_rank(w)
        sizes, tables = rank_sizes(rp), build_rank_tables(rp)
        seen_sets |= assert_size_fields(sizes, tables, RankSizes.__dataclass_fields__)
        assert (sizes.relay_splits is None) == (tables.relay_send is None) == (not relay)
    assert "remote" in seen_sets or plan.num_workers == 1
