"""HeadLayout KV classes and the chunks that send / return K/V once per step (hand cases)."""
import pytest

from libra_megatron.plan.errors import PlanError
from libra_megatron.plan.layout import HeadLayout


@pytest.mark.parametrize("args, classes, pieces, sends, returns", [
    # Qwen3-30B-A3B (hq 32, hkv 4, GQA group 8), M = 4
    ((32, 4, 128, 1, 4), [0], [[0, 1, 2, 3]], [1, 1, 1, 1], [1, 1, 1, 1]),  # q piece 8 = group: 4 kv heads
    ((32, 4, 128, 2, 4), [0, 1], [[0, 0, 1, 1], [2, 2, 3, 3]], [1, 0, 1, 0], [0, 1, 0, 1]),  # q piece 4
    ((32, 4, 128, 8, 4), [0, 0, 1, 1, 2, 2, 3, 3], [[0] * 4, [1] * 4, [2] * 4, [3] * 4], [1, 0, 0, 0], [0, 0, 0, 1]),
    ((16, 4, 8, 2, 2), [0, 1], [[0, 1], [2, 3]], [1, 1], [1, 1]),
])
def test_kv_classes_and_send_return_chunks(args, classes, pieces, sends, returns):
    heads = HeadLayout(*args)
    assert heads.kv_class_of_shard().tolist() == classes
    assert heads.kv_piece_of_class().tolist() == pieces
    assert heads.kv_send_chunks().astype(int).tolist() == sends
    assert heads.kv_return_chunks().astype(int).tolist() == returns


def test_kv_bytes_per_token_do_not_depend_on_m_or_on_shards_sharing_a_kv_head():
    one = HeadLayout(32, 4, 128, 1, 4).kv_bytes_per_token()
    assert one == 2 * 4 * 128 * 2  # K and V of the 4 kv heads, bf16
    assert HeadLayout(32, 4, 128, 1, 1).kv_bytes_per_token() == one
    assert HeadLayout(32, 4, 128, 2, 4).kv_bytes_per_token() * 2 == one  # 2 kv heads per shard, sent once
    assert HeadLayout(32, 4, 128, 8, 4).kv_bytes_per_token() * 4 == one  # one class per kv head


def test_shards_that_straddle_kv_heads_are_rejected():
    with pytest.raises(PlanError, match="H=4 and kv heads hkv=6: one must divide the other"):
        HeadLayout(24, 6, 8, 4, 3)
