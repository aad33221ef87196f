"""LibraConfig: YAML round trip, unknown keys, and every validation rule names its flag and arithmetic."""
import pytest

from libra_megatron.config import LibraConfig, SequencePlacement, TokenLayoutKind


def _validate(cfg, **kw):
    base = dict(num_attention_heads=32, num_query_groups=8, data_parallel_size=8, context_parallel_size=2,
                seq_length=4096, micro_batch_size=1, global_batch_size=64)
    base.update(kw)
    return cfg.validate(**base)


def test_paper_defaults():
    cfg = LibraConfig()
    assert cfg.tau == 0.03 and cfg.num_chunks == 4


def test_beyond_the_paper_defaults_are_adaptive_tiles_and_prefix_fetch():
    cfg = LibraConfig()
    assert (cfg.tiling.value, cfg.kv_fetch.value) == ("adaptive", "prefix")


def test_yaml_round_trip(tmp_path):
    cfg = LibraConfig(pool_size=8, head_split=2, block_size=8192, num_chunks=2, tau=0.05,
                      sequence_placement="alg1", token_layout="contiguous", tiling="uniform", kv_fetch="group")
    path = tmp_path / "libra.yaml"
    cfg.to_yaml(str(path))
    back = LibraConfig.from_yaml(str(path))
    assert back == cfg
    assert back.sequence_placement is SequencePlacement.ALG1
    assert back.token_layout is TokenLayoutKind.CONTIGUOUS


def test_yaml_unknown_key_is_an_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("libra:\n  pool_size: 4\n  pool_sise: 8\n")
    with pytest.raises(ValueError, match="unknown Libra key.*pool_sise"):
        LibraConfig.from_yaml(str(path))


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(pool_size=0), r"--libra-pool-size \(pool_size\) must be a positive integer"),
        (dict(tau=-0.1), r"--libra-tau \(tau\) must be a finite number >= 0"),
        (dict(tau=float("inf")), r"--libra-tau \(tau\) must be a finite number >= 0, got inf"),
        (dict(sequence_placement="lpt"), r"--libra-sequence-placement .* must be one of"),
        (dict(tiling="dyadic"), r"--libra-tiling \(tiling\) must be one of \{uniform, adaptive\}"),
        (dict(kv_fetch="all"), r"--libra-kv-fetch \(kv_fetch\) must be one of \{group, prefix\}"),
    ],
)
def test_standalone_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        LibraConfig(**kwargs)


@pytest.mark.parametrize(
    "cfg_kw, model_kw, pattern",
    [
        (dict(pool_size=3), {}, r"--libra-pool-size \(pool_size\) 3 must divide the data-parallel size 8 \(8 % 3 = 2\)"),
        (dict(head_split=3), {}, r"--libra-head-split \(head_split\) 3 must divide num_attention_heads 32"),
        (dict(head_split=4, num_chunks=16), {}, r"--libra-num-chunks \(num_chunks\) 16 must divide num_attention_heads/--libra-head-split = 32/4 = 8"),
        (dict(head_split=3, num_chunks=2), dict(num_attention_heads=12, num_query_groups=4, data_parallel_size=8),
         r"query heads per chunk piece .* = 12/\(3\*2\) = 2 must be a multiple or a divisor of the GQA group size 12/4 = 3"),
        (dict(head_split=4, num_chunks=3), dict(num_attention_heads=24, num_query_groups=6),
         r"head-split 4 and num_query_groups 6: one must divide the other \(4 % 6 = 4, 6 % 4 = 2\)"),
        ({}, dict(micro_batch_size=2), r"--micro-batch-size 1"),
        ({}, dict(seq_length=4094), r"--seq-length 4094 must be divisible by 4 CP chunks"),
        (dict(pool_size=8), dict(global_batch_size=68), r"--global-batch-size 68 must be divisible by DP\*mbs = 8\*1"),
    ],
)
def test_model_validation_names_flag_and_arithmetic(cfg_kw, model_kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        _validate(LibraConfig(**cfg_kw), **model_kw)


def test_valid_layout_passes_and_returns_self():
    cfg = LibraConfig(pool_size=4, head_split=2, num_chunks=4)
    assert _validate(cfg) is cfg


@pytest.mark.parametrize("hq, hkv, H, want", [
    (32, 4, 2, 2),    # Qwen3-30B-A3B, TP=1: two K/V heads per head shard
    (32, 8, 2, 4),    # Qwen3-8B, TP=1
    (16, 4, 2, 2),    # Qwen3-8B, TP=2
    (8, 2, 2, 1),     # Qwen3-8B, TP=4: one K/V head per shard
    (16, 1, 2, 1),    # Qwen3-235B-A22B, TP=4: a shard inside one K/V head
    (32, 32, 4, 8),   # no GQA: every query head its own K/V head
])
def test_auto_chunks_are_the_kv_heads_of_a_head_shard(hq, hkv, H, want):
    """num_chunks: auto -> M = K/V heads per head shard (at least 1); validate returns the resolved config, which
    passes the same rules an explicit M must pass, and leaves every other knob as it was."""
    cfg = LibraConfig(head_split=H, num_chunks="auto", block_size=1024, tau=0.01)
    assert cfg.chunks_for(hq, hkv) == want
    resolved = _validate(cfg, num_attention_heads=hq, num_query_groups=hkv)
    assert resolved.num_chunks == want and resolved is not cfg
    assert resolved.replace(num_chunks="auto") == cfg
    assert (hq // H) % want == 0
    explicit = _validate(LibraConfig(head_split=H, num_chunks=want, block_size=1024, tau=0.01),
                         num_attention_heads=hq, num_query_groups=hkv)
    assert explicit == resolved
    assert LibraConfig(num_chunks=3).chunks_for(hq, hkv) == 3  # an explicit M is taken as it is


def test_auto_chunks_yaml_and_bad_values(tmp_path):
    path = tmp_path / "libra.yaml"
    path.write_text("libra:\n  head_split: 2\n  num_chunks: auto\n")
    cfg = LibraConfig.from_yaml(str(path))
    cfg.to_yaml(str(tmp_path / "out.yaml"))
    assert cfg.num_chunks == "auto" and LibraConfig.from_yaml(str(tmp_path / "out.yaml")).num_chunks == "auto"
    assert _validate(cfg, num_attention_heads=32, num_query_groups=4).num_chunks == 2
    with pytest.raises(ValueError, match=r"num_chunks \(.*libra.yaml:3\) must be a positive integer or auto, got 'Auto'"):
        path.write_text("libra:\n  head_split: 2\n  num_chunks: Auto\n")
        LibraConfig.from_yaml(str(path))
    with pytest.raises(ValueError, match=r"--libra-head-split \(head_split\) 3 must divide num_attention_heads 32"):
        _validate(LibraConfig(head_split=3, num_chunks="auto"), num_attention_heads=32, num_query_groups=4)
