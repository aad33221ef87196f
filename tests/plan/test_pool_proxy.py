"""The priced-pool proxy (plan.sequences.pool_proxy): its terms by hand, its weights, its errors (its prices against
planned pools: tests/sim/test_pool_proxy_prices.py)."""
import numpy as np
import pytest

from libra_megatron.plan.model import GB, TFLOP
from libra_megatron.plan.sequences import PoolProxy, SequenceStats
from libra_megatron.plan.sequences import pool_proxy as proxy_module


def test_terms_by_hand():
    proxy = PoolProxy(pool_size=2, context_parallel_size=2, seq_len=8, num_q_heads=4, num_kv_heads=2, head_dim=16,
                      elem_bytes=2, attn_tflops=100.0, inter_node_gbps=25.0)
    stats = SequenceStats.of([[4, 4], [8], [2, 3, 3]])  # F = 32, 64, 22; longest 4, 8, 3; documents 2, 1, 3
    assert stats.flops.tolist() == [32.0, 64.0, 22.0] and stats.max_doc.tolist() == [4.0, 8.0, 3.0]
    x = proxy.features(stats, np.array([[0, 1], [2, 1]]))
    W, flop = 4, 4 * 16 / (100.0 * TFLOP)  # 4 workers; FLOPs of one query-key pair of one head / peak rate
    kv, q = 2 * 2 * 16 * 2, 4 * 16 * 2  # K|V and Q bytes of a token
    # pool (0, 1): F = 96, mean 48, excess 16; longest 8; 3 documents
    assert x[0].tolist() == pytest.approx([96 / 2 * 4 * flop / W, 16 / 2 * 4 * flop / W, 8 * kv / (25 * GB),
                                           3 * 1024 * kv / (25 * GB) / W, 2 * 8 * (q + kv) / W / 1e12], rel=1e-12)
    # pool (2, 1): F = 86, mean 43, excess 21; longest 8; 4 documents
    assert x[1, :4].tolist() == pytest.approx([86 / 2 * 4 * flop / W, 21 / 2 * 4 * flop / W, 8 * kv / (25 * GB),
                                               4 * 1024 * kv / (25 * GB) / W], rel=1e-12)
    fwd, bwd = proxy.seconds(stats, np.array([[0, 1]]))
    assert fwd[0] == pytest.approx(x[0] @ np.asarray(proxy_module.FORWARD_WEIGHTS), rel=1e-12)
    assert bwd[0] == pytest.approx(x[0] @ np.asarray(proxy_module.BACKWARD_WEIGHTS), rel=1e-12)


def test_shipped_weights_are_fitted_and_non_negative():
    for weights in (proxy_module.FORWARD_WEIGHTS, proxy_module.BACKWARD_WEIGHTS):
        assert len(weights) == len(proxy_module.FEATURES) and min(weights) >= 0 and weights[0] > 0
    assert proxy_module.BACKWARD_WEIGHTS[0] > proxy_module.FORWARD_WEIGHTS[0]  # backward kernels cost more


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="PoolProxy.num_kv_heads must be a positive integer, got 0"):
        PoolProxy(2, 1, 8, 4, 0, 16)
    with pytest.raises(ValueError, match="PoolProxy.attn_tflops must be > 0"):
        PoolProxy(2, 1, 8, 4, 2, 16, attn_tflops=0.0)
    proxy = PoolProxy(2, 1, 8, 4, 2, 16)
    stats = SequenceStats.of([[4], [8], [2]])
    with pytest.raises(ValueError, match=r"pools must be \[n, P = 2\]"):
        proxy.features(stats, np.array([0, 1]))
    with pytest.raises(ValueError, match="do not split into pools of P = 2"):
        proxy.pricer(stats)
    with pytest.raises(ValueError, match="sequence 1: document lengths must be positive"):
        SequenceStats.of([[4, 2], [3, 0]])
    with pytest.raises(ValueError, match="flat sequence of numbers"):  # lengths in rows would miscount documents
        SequenceStats.of([np.array([[4, 2], [3, 1]]), np.array([[5, 5]])])


def test_sequence_stats_match_sequence_flops_on_a_real_trace():
    from libra_megatron.plan.model import sequence_flops
    from libra_megatron.plan.packing import pack_documents
    from libra_megatron.plan.traces import find_trace, load_trace
    from libra_megatron.config import PackingMode

    segments = pack_documents(load_trace(find_trace("linux-6.12-files.qwen.txt")), 262144, PackingMode.MEGATRON, 1,
                              300)
    stats = SequenceStats.of(segments)
    assert np.array_equal(stats.flops, sequence_flops(segments))  # bit for bit
    assert stats.max_doc.tolist() == [float(max(s)) for s in segments]
    assert stats.num_docs.tolist() == [float(len(s)) for s in segments]
    as_arrays = SequenceStats.of([np.asarray(s, dtype=np.int64) for s in segments])  # the sampler's segments
    assert all(np.array_equal(a, b) for a, b in zip((as_arrays.flops, as_arrays.max_doc, as_arrays.num_docs),
                                                    (stats.flops, stats.max_doc, stats.num_docs)))
    with pytest.raises(ValueError, match="sequence 1: a packed sequence needs at least one document"):
        SequenceStats.of([[3], []])
