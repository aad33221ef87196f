"""--libra-* flags and YAML: precedence, ablations, and validation messages that name the flag and arithmetic."""
from __future__ import annotations

import argparse
import dataclasses
import logging

import pytest
import yaml

from libra_megatron.config import LibraConfig, SequencePlacement, TilePlacement, TokenLayoutKind
from libra_megatron.megatron.args import (
    CONFIG_FILE_NAME,
    add_libra_args,
    libra_config_from_args,
    log_and_save_libra_config,
)

MODEL = dict(num_attention_heads=8, num_query_groups=2, group_query_attention=True, data_parallel_size=4,
             context_parallel_size=2, seq_length=4096, micro_batch_size=1, global_batch_size=16)


def _args(argv, **model):
    args = add_libra_args(argparse.ArgumentParser()).parse_args(argv)
    for key, value in (MODEL | model).items():
        setattr(args, key, value)
    return args


def _yaml(tmp_path, data, name="libra.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_flags_default_to_none_so_overrides_are_detectable():
    args = add_libra_args(argparse.ArgumentParser()).parse_args([])
    libra = {k: v for k, v in vars(args).items() if k.startswith("libra_")}
    num_flags = len(dataclasses.fields(LibraConfig)) + 3  # + --libra-config and the two ablation switches
    assert len(libra) == num_flags and all(v is None for v in libra.values())
    assert libra_config_from_args(_args([])) == LibraConfig()


def test_flags_override_yaml_and_yaml_overrides_defaults(tmp_path):
    path = _yaml(tmp_path, {"libra": {"pool_size": 2, "head_split": 2, "tau": 0.05, "token_layout": "contiguous"}})
    config = libra_config_from_args(_args(["--libra-config", path, "--libra-head-split", "4", "--libra-num-chunks",
                                           "2", "--libra-tile-placement", "refined"]))
    assert (config.pool_size, config.head_split, config.num_chunks, config.tau) == (2, 4, 2, 0.05)
    assert config.token_layout is TokenLayoutKind.CONTIGUOUS and config.tile_placement is TilePlacement.REFINED
    assert config.block_size == LibraConfig().block_size


def test_tiling_and_kv_fetch_flags_override_the_yaml(tmp_path):
    path = _yaml(tmp_path, {"libra": {"tiling": "uniform", "kv_fetch": "group"}})
    assert (libra_config_from_args(_args(["--libra-config", path])).tiling.value,
            libra_config_from_args(_args(["--libra-config", path])).kv_fetch.value) == ("uniform", "group")
    config = libra_config_from_args(_args(["--libra-config", path, "--libra-tiling", "adaptive",
                                           "--libra-kv-fetch", "prefix"]))
    assert (config.tiling.value, config.kv_fetch.value) == ("adaptive", "prefix")


def test_ablation_switches_force_placements_and_log(caplog):
    with caplog.at_level(logging.WARNING, logger="libra_megatron.megatron.args"):
        config = libra_config_from_args(_args(["--libra-disable-vrsp", "--libra-disable-tap"]))
    assert config.sequence_placement is SequencePlacement.CONTIGUOUS and config.tile_placement is TilePlacement.HOME
    assert "--libra-disable-vrsp: sequence_placement=contiguous" in caplog.text
    assert "--libra-disable-tap: tile_placement=home" in caplog.text
    with pytest.raises(ValueError, match="--libra-disable-vrsp forces sequence_placement=contiguous but "
                                         "--libra-sequence-placement alg1 was also given"):
        libra_config_from_args(_args(["--libra-disable-vrsp", "--libra-sequence-placement", "alg1"]))


@pytest.mark.parametrize(
    "argv,model,needle",
    [(["--libra-pool-size", "3"], {}, "--libra-pool-size (pool_size) 3 must divide the data-parallel size 4 (4 % 3 = 1)"),
     (["--libra-head-split", "3"], {}, "--libra-head-split (head_split) 3 must divide num_attention_heads 8"),
     (["--libra-head-split", "2", "--libra-num-chunks", "3"], {},
      "--libra-num-chunks (num_chunks) 3 must divide num_attention_heads/--libra-head-split = 8/2 = 4"),
     ([], {"micro_batch_size": 2}, "--micro-batch-size 1"),
     ([], {"seq_length": 4098}, "--seq-length 4098 must be divisible by 4 CP chunks"),
     ([], {"global_batch_size": 18}, "--global-batch-size 18 must be divisible by DP*mbs = 4*1"),
     (["--libra-pool-size", "0"], {}, "--libra-pool-size (pool_size) must be a positive integer"),
     ([], {"tensor_model_parallel_size": 4}, "--num-query-groups 2 must be divisible by "
      "--tensor-model-parallel-size 4 (each tensor-parallel rank runs --num-query-groups / "
      "--tensor-model-parallel-size heads; 2 % 4 = 2)"),
     ([], {"data_parallel_size": None, "world_size": 12, "tensor_model_parallel_size": 2,
           "pipeline_model_parallel_size": 1, "context_parallel_size": 4},
      "world size 12 must be divisible by TP*PP*CP = 2*1*4 = 8")],
)
def test_bad_flags_are_rejected_naming_flag_and_arithmetic(argv, model, needle):
    with pytest.raises(ValueError) as err:
        libra_config_from_args(_args(argv, **model))
    assert needle in str(err.value)


def test_data_parallel_size_is_derived_from_world_size_when_absent():
    args = _args(["--libra-pool-size", "3"], data_parallel_size=None, world_size=24, tensor_model_parallel_size=2,
                 pipeline_model_parallel_size=2, context_parallel_size=1, global_batch_size=12)
    assert libra_config_from_args(args).pool_size == 3  # DP = 24 / (2*2*1) = 6
    with pytest.raises(ValueError, match=r"must divide the data-parallel size 6 \(6 % 4 = 2\)"):
        libra_config_from_args(_args(["--libra-pool-size", "4"], data_parallel_size=None, world_size=24,
                                     tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                     context_parallel_size=1, global_batch_size=12))


def test_bad_yaml_is_rejected(tmp_path):
    unknown = _yaml(tmp_path, {"libra": {"pool_size": 2, "pool_sise": 4}})
    with pytest.raises(ValueError, match=r"libra.yaml:2: unknown Libra key 'pool_sise' \(did you mean 'pool_size'"):
        libra_config_from_args(_args(["--libra-config", unknown]))
    bad_enum = _yaml(tmp_path, {"tile_placement": "greedy"}, "enum.yaml")
    with pytest.raises(ValueError, match=r"^tile_placement \(\S*enum.yaml:1\) must be one of \{home, alg2, refined, time, dense\}"):
        libra_config_from_args(_args(["--libra-config", bad_enum]))
    with pytest.raises(ValueError, match="--libra-config .*missing.yaml: no such file"):
        libra_config_from_args(_args(["--libra-config", str(tmp_path / "missing.yaml")]))


def test_bad_choice_flag_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit):
        add_libra_args(argparse.ArgumentParser()).parse_args(["--libra-token-layout", "ring"])
    assert "--libra-token-layout" in capsys.readouterr().err


def test_saved_yaml_reloads_to_the_effective_config(tmp_path):
    args = _args(["--libra-pool-size", "2", "--libra-disable-tap"], save=str(tmp_path / "run"))
    config = libra_config_from_args(args)
    text = log_and_save_libra_config(config, args)
    saved = tmp_path / "run" / CONFIG_FILE_NAME
    assert saved.read_text() == text and "flag overrides: ['pool_size']" in text
    assert LibraConfig.from_yaml(str(saved)) == config


@pytest.mark.parametrize("tp, head_split, want", [(1, 1, 2), (1, 2, 1), (2, 1, 1)])
def test_auto_chunks_resolve_from_the_heads_of_one_tensor_parallel_rank(tp, head_split, want):
    """--libra-num-chunks auto: M = the K/V heads of a head shard on one TP rank (8 query heads, 2 groups here)."""
    args = _args(["--libra-num-chunks", "auto", "--libra-head-split", str(head_split)],
                 tensor_model_parallel_size=tp)
    config = libra_config_from_args(args)
    assert config.num_chunks == want and config.head_split == head_split


def test_bad_chunks_value_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit):
        _args(["--libra-num-chunks", "many"])
    assert "--libra-num-chunks" in capsys.readouterr().err
