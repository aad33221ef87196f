"""``--libra-config`` through the command-line path (``megatron.args.libra_config_from_args``): every bad file
is one ValueError line naming ``FILE:LINE`` and the key; values from the file are named by key and file,
values from flags by the flag; the format ``to_yaml`` writes (``libra:`` nesting) loads back.
"""
from __future__ import annotations

import argparse
import re

import pytest

from libra_megatron.config import LibraConfig
from libra_megatron.megatron.args import add_libra_args, libra_config_from_args

MODEL = dict(num_attention_heads=8, num_query_groups=2, group_query_attention=True, data_parallel_size=4,
             context_parallel_size=2, seq_length=4096, micro_batch_size=1, global_batch_size=16)


def _load(path, *flags):
    args = add_libra_args(argparse.ArgumentParser()).parse_args(["--libra-config", str(path), *flags])
    for key, value in MODEL.items():
        setattr(args, key, value)
    return libra_config_from_args(args)


# (id, file body, regex the message must match; {f} = the file's path)
ROWS = [
    ("empty", "", r"^{f}: empty file: no Libra keys; .* leave --libra-config out to run with every default$"),
    ("only-comments", "# nothing\n\n", r"^{f}: empty file: no Libra keys"),
    ("explicit-null", "null\n", r"^{f}: empty file"),
    ("empty-mapping", "{}\n", r"^{f}:1: no Libra keys"),
    ("empty-libra", "# c\nlibra:\n", r"^{f}:2: 'libra:' holds no Libra keys"),
    ("libra-not-mapping", "libra: 3\n", r"^{f}:1: 'libra:' must be a mapping of Libra keys .*got a single value"),
    ("top-level-list", "- pool_size: 2\n", r"^{f}:1: the top level must be a mapping of Libra keys .*got a list"),
    ("syntax-flow", "libra:\n  pool_size: [2\n", r"^{f}:3:1: YAML syntax error: expected ',' or '\]'"),
    ("syntax-colon", "pool_size: 2: 3\n", r"^{f}:1:13: YAML syntax error: mapping values are not allowed here"),
    ("syntax-tab", "libra:\n\tpool_size: 2\n", r"^{f}:2:1: YAML syntax error: .*'\\t'"),
    ("two-documents", "pool_size: 2\n---\ntau: 0.1\n", r"^{f}:2:1: YAML syntax error: but found another document"),
    ("python-tag", "pool_size: !!python/object:os.system {{}}\n", r"^{f}:1:12: YAML syntax error: could not determine a constructor"),
    ("tau-inf", "libra:\n  tau: .inf\n", r"^tau \({f}:2\) must be a finite number, got inf$"),
    ("tau-nan", "tau: .nan\n", r"^tau \({f}:1\) must be a finite number, got nan$"),
    ("tau-negative", "tau: -0.5\n", r"^tau \({f}:1\) must be a finite number >= 0, got -0.5$"),
    ("tau-string", "tau: '0.1'\n", r"^tau \({f}:1\) must be a finite number >= 0, got '0.1'$"),
    ("pool-size-word", "libra:\n  pool_size: \"eight\"\n", r"^pool_size \({f}:2\) must be a positive integer, got 'eight'$"),
    ("pool-size-float", "pool_size: 8.0\n", r"^pool_size \({f}:1\) must be a positive integer, got 8.0$"),
    ("pool-size-bool", "pool_size: yes\n", r"^pool_size \({f}:1\) must be a positive integer, got True$"),
    ("block-size-negative", "block_size: -4096\n", r"^block_size \({f}:1\) must be a positive integer, got -4096$"),
    ("enum-unknown", "tile_placement: greedy\n", r"^tile_placement \({f}:1\) must be one of \{{home, alg2, refined, time, dense\}}, got 'greedy'$"),
    ("enum-list", "token_layout: [zigzag]\n", r"^token_layout \({f}:1\) must be one of .*got \['zigzag'\]$"),
    ("unknown-key", "libra:\n  pool_size: 2\n  pool_sise: 4\n",
     r"^{f}:3: unknown Libra key 'pool_sise' \(did you mean 'pool_size'\?\); known keys \(at top level or under 'libra:'\)"),
    ("wrong-nest-name", "Libra:\n  pool_size: 2\n", r"^{f}:1: unknown Libra key 'Libra'.*at top level or under 'libra:'"),
    ("both-nestings", "libra:\n  pool_size: 2\ntau: 0.1\n",
     r"^{f}:3: top-level key 'tau' next to 'libra:' \(line 1\); put every Libra key under 'libra:'"),
    ("duplicate-key", "pool_size: 2\ntau: 0.1\npool_size: 4\n", r"^{f}:3: duplicate key 'pool_size' \(first at line 1\)"),
    ("binary", b"\x00\x01libra:\xff\n", r"^--libra-config {f}:1: not UTF-8 text \(byte 0xff at byte offset 8\)"),
    ("too-big", "# " + "x" * (1 << 20) + "\n", r"^--libra-config {f}: larger than 1048576 bytes"),
    # validate(): the value came from the file, so the file is named, not --libra-pool-size
    ("pool-size-vs-dp", "libra:\n  pool_size: 3\n",
     r"^pool_size \({f}:2\) 3 must divide the data-parallel size 4 \(4 % 3 = 1\)$"),
    ("chunks-vs-heads", "head_split: 2\nnum_chunks: 8\n",
     r"^num_chunks \({f}:2\) 8 must divide num_attention_heads/head_split = 8/2 = 4$"),
]


@pytest.mark.parametrize("body, pattern", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_yaml_is_one_line_naming_file_line_and_key(tmp_path, body, pattern):
    path = tmp_path / "libra.yaml"
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    with pytest.raises(ValueError) as exc:
        _load(path)
    message = str(exc.value)
    assert "\n" not in message and re.search(pattern.format(f=re.escape(str(path))), message), message


def test_missing_and_directory_config_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match=r"^--libra-config \S+missing.yaml: no such file$"):
        _load(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match=r"^--libra-config \S+: is a directory, expected a file$"):
        _load(tmp_path)


def test_a_flag_overriding_the_file_is_named_as_the_flag(tmp_path):
    path = tmp_path / "libra.yaml"
    path.write_text("libra:\n  pool_size: 2\n  head_split: 2\n")
    with pytest.raises(ValueError, match=r"^--libra-pool-size \(pool_size\) 3 must divide the data-parallel size 4"):
        _load(path, "--libra-pool-size", "3")
    with pytest.raises(ValueError, match=r"^--libra-num-chunks \(num_chunks\) 8 must divide num_attention_heads/"
                                         r"head_split = 8/2 = 4$"):  # head_split still from the file
        _load(path, "--libra-num-chunks", "8")
    with pytest.raises(ValueError, match=r"^--libra-tau \(tau\) must be a finite number >= 0, got inf$"):
        _load(path, "--libra-tau", "inf")


@pytest.mark.parametrize("body", ["libra:\n  pool_size: 2\n  tau: 0.05\n", "pool_size: 2\ntau: 0.05\n"])
def test_keys_load_at_top_level_or_under_libra(tmp_path, body):
    path = tmp_path / "libra.yaml"
    path.write_text(body)
    assert _load(path) == LibraConfig(pool_size=2, tau=0.05)


def test_to_yaml_output_loads_back_and_replace_forgets_the_file(tmp_path):
    path = tmp_path / "saved.yaml"
    config = LibraConfig(pool_size=4, head_split=2, tau=0.1, token_layout="contiguous")
    config.to_yaml(str(path))
    loaded = LibraConfig.from_yaml(str(path))
    assert loaded == config
    with pytest.raises(ValueError, match=rf"^pool_size \({re.escape(str(path))}:2\) 4 must divide"):
        loaded.validate(num_attention_heads=8, data_parallel_size=6)
    with pytest.raises(ValueError, match=r"^--libra-pool-size \(pool_size\) 5 must divide"):
        loaded.replace(pool_size=5).validate(num_attention_heads=8, data_parallel_size=6)


def test_from_flags_names_the_tools_own_flags():
    config = LibraConfig.from_flags(dict(pool_size=3), {"pool_size": "--pool-size"})
    with pytest.raises(ValueError, match=r"^--pool-size 3 must divide the data-parallel size 4 \(4 % 3 = 1\)$"):
        config.validate(num_attention_heads=8, data_parallel_size=4)
    with pytest.raises(ValueError, match=r"^--pool-size must be a positive integer, got 0$"):
        LibraConfig.from_flags(dict(pool_size=0), {"pool_size": "--pool-size"})


def test_shipped_configs_load():
    from pathlib import Path

    for path in sorted((Path(__file__).resolve().parents[1] / "configs" / "libra").glob("*.yaml")):
        assert LibraConfig.from_yaml(str(path)).pool_size == 8
