"""Patch-point machinery without Megatron-LM: loud version checks, reversible replacement, args merging."""
import argparse
from pathlib import Path

import pytest

from libra_megatron.patches import PATCH_POINTS
from libra_megatron.patches._base import (
    PatchTargetChanged,
    Patcher,
    TargetSpec,
    check_megatron_core_version,
    resolve_target,
)
from libra_megatron.patches.get_batch import swap_dataset_rule, swap_get_batch
from libra_megatron.patches.parse_args import merge_args_providers

TARGET_SOURCE = """
def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = object()
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser
"""
SPEC = TargetSpec("fake_megatron_args", "parse_args", ("extra_args_provider", "ignore_unknown_args"),
                  ("parser = extra_args_provider(parser)",))


def test_resolve_target_returns_the_verified_function(fake_module):
    module = fake_module("fake_megatron_args", TARGET_SOURCE)
    assert resolve_target(SPEC) is module.parse_args


def test_missing_target_raises_naming_it(fake_module):
    fake_module("fake_megatron_args", "def something_else():\n    pass\n")
    with pytest.raises(PatchTargetChanged, match=r"fake_megatron_args\.parse_args does not exist"):
        resolve_target(SPEC)


def test_changed_signature_raises_with_expected_and_found(fake_module):
    fake_module("fake_megatron_args", TARGET_SOURCE.replace("ignore_unknown_args=False", "strict=True"))
    with pytest.raises(PatchTargetChanged) as info:
        resolve_target(SPEC)
    message = str(info.value)
    assert "changed its signature" in message
    assert "['extra_args_provider', 'ignore_unknown_args']" in message
    assert "['extra_args_provider', 'strict']" in message


def test_changed_source_raises_listing_the_missing_fragment(fake_module):
    fake_module("fake_megatron_args", TARGET_SOURCE.replace("parser = extra_args_provider(parser)",
                                                            "parser = extra_args_provider(parser, 1)"))
    with pytest.raises(PatchTargetChanged, match=r"lacks \['parser = extra_args_provider\(parser\)'\]"):
        resolve_target(SPEC)


def test_unimportable_module_raises():
    with pytest.raises(PatchTargetChanged, match="cannot be imported"):
        resolve_target(TargetSpec("no_such_megatron_module_xyz", "f", ()))


def test_a_missing_third_party_package_is_named_not_reported_as_a_changed_target(fake_module):
    """Megatron-LM importing a package that is not installed is an environment problem (e.g. 'six')."""
    from libra_megatron.megatron_lm import MegatronLMDependencyMissing

    with pytest.raises(ModuleNotFoundError):
        fake_module("fake_megatron_needs_six", "import libra_test_absent_six\n")
    with pytest.raises(MegatronLMDependencyMissing,
                       match=r"^Megatron-LM needs the Python package 'libra_test_absent_six' "
                             r"\(pip install libra_test_absent_six; "):
        resolve_target(TargetSpec("fake_megatron_needs_six", "f", ()))


@pytest.mark.parametrize("version", ["0.15.3", "0.17.0", "1.16.0"])
def test_other_megatron_core_versions_are_refused(version):
    with pytest.raises(PatchTargetChanged, match=rf"megatron-core {version} is installed.*0\.16\.x"):
        check_megatron_core_version(version)


def test_megatron_core_016_is_accepted():
    check_megatron_core_version("0.16.1")


def test_patcher_undo_restores_originals_in_reverse_order(fake_module):
    module = fake_module("fake_patch_target", "def f():\n    return 'original'\n")
    original = module.f
    patcher = Patcher()
    patcher.replace("fake_patch_target", "f", lambda: "first")
    patcher.replace("fake_patch_target", "f", lambda: "second")
    assert module.f() == "second" and patcher.num_replaced == 2
    patcher.undo()
    assert module.f is original and patcher.num_replaced == 0


def _provider(flag):
    def add(parser):
        parser.add_argument(flag, type=int)
        return parser

    return add


def test_merged_providers_register_every_flag_in_order():
    theirs, ours = _provider("--theirs"), _provider("--ours")
    parser = merge_args_providers(theirs, ours)(argparse.ArgumentParser())
    args = parser.parse_args(["--theirs", "1", "--ours", "2"])
    assert (args.theirs, args.ours) == (1, 2)


def test_merge_keeps_a_repeated_provider_once():
    ours = _provider("--ours")
    merged = merge_args_providers(ours, None, ours)
    assert merged is ours  # argparse would reject the flag registered twice
    assert merge_args_providers(None, None) is None


def test_merged_provider_returning_none_is_a_type_error():
    merged = merge_args_providers(_provider("--a"), lambda parser: None)
    with pytest.raises(TypeError, match="returned None"):
        merged(argparse.ArgumentParser())


FORWARD_STEP_SOURCE = """
def get_batch(data_iterator, vp_stage=None):
    return ("megatron",) * 5 + (None,)

def forward_step(data_iterator, model):
    vp_stage = None
    tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params = get_batch(data_iterator, vp_stage)
    return model(tokens, packed_seq_params=packed_seq_params)
"""


def test_swap_get_batch_redirects_forward_step(fake_module):
    program = fake_module("fake_pretrain_gpt", FORWARD_STEP_SOURCE)
    seen = []

    def make(original):
        def libra_get_batch(data_iterator, vp_stage=None):
            seen.append(original(data_iterator, vp_stage)[0])
            return ("libra",) * 5 + ("plan",)

        return libra_get_batch

    original = swap_get_batch(program.forward_step, make)
    out = program.forward_step(iter(()), lambda tokens, packed_seq_params: (tokens, packed_seq_params))
    assert out == ("libra", "plan") and seen == ["megatron"]
    assert original(None)[0] == "megatron"


def test_swap_get_batch_refuses_a_changed_forward_step(fake_module):
    changed = FORWARD_STEP_SOURCE.replace("get_batch(data_iterator, vp_stage)", "get_batch(data_iterator)")
    program = fake_module("fake_pretrain_gpt", changed)
    before = program.get_batch
    with pytest.raises(PatchTargetChanged, match="no longer matches core_v0.16.1"):
        swap_get_batch(program.forward_step, lambda original: original)
    assert program.get_batch is before


def test_swap_get_batch_refuses_a_changed_get_batch_signature(fake_module):
    changed = FORWARD_STEP_SOURCE.replace("def get_batch(data_iterator, vp_stage=None)",
                                          "def get_batch(data_iterator, vp_stage=None, tokenizer=None)")
    program = fake_module("fake_pretrain_gpt", changed)
    with pytest.raises(PatchTargetChanged, match="changed its signature"):
        swap_get_batch(program.forward_step, lambda original: original)


DATASET_PROVIDER_SOURCE = """
from functools import partial

def is_dataset_built_on_rank(vp_stage=None):
    return vp_stage in (None, 0)

def build(is_built_on_rank):
    return "dataset" if is_built_on_rank() else None

def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    return build(partial(is_dataset_built_on_rank, vp_stage=vp_stage))
"""


def test_swap_dataset_rule_builds_on_every_stage_the_provider_serves(fake_module):
    from functools import partial

    program = fake_module("fake_pretrain_gpt", DATASET_PROVIDER_SOURCE)
    assert program.train_valid_test_datasets_provider(None, vp_stage=1) is None  # Megatron's rule: not here
    wrapped = partial(program.train_valid_test_datasets_provider, vp_stage=1)  # how training.py hands it on
    original = swap_dataset_rule(wrapped, lambda megatron_rule: lambda vp_stage=None: True)
    assert program.train_valid_test_datasets_provider(None, vp_stage=1) == "dataset"
    assert original(0) and not original(1)


def test_swap_dataset_rule_refuses_a_provider_that_does_not_use_the_rule(fake_module):
    changed = DATASET_PROVIDER_SOURCE.replace("partial(is_dataset_built_on_rank, vp_stage=vp_stage)",
                                              "lambda: True")
    program = fake_module("fake_pretrain_gpt", changed)
    before = program.is_dataset_built_on_rank
    with pytest.raises(PatchTargetChanged, match="no longer matches core_v0.16.1"):
        swap_dataset_rule(program.train_valid_test_datasets_provider, lambda original: original)
    assert program.is_dataset_built_on_rank is before


def test_model_parallel_target_matches_installed_megatron_core():
    """The one target that lives in megatron-core (PyPI) is verified without Megatron-LM."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state
    from libra_megatron.patches.model_parallel import DESTROY_MODEL_PARALLEL, INITIALIZE_MODEL_PARALLEL

    assert resolve_target(INITIALIZE_MODEL_PARALLEL["0.16"]) is parallel_state.initialize_model_parallel
    assert resolve_target(DESTROY_MODEL_PARALLEL["0.16"]) is parallel_state.destroy_model_parallel


def test_patch_point_table_names_existing_modules():
    repo_root = Path(__file__).resolve().parents[2]
    for point in PATCH_POINTS:
        assert (repo_root / point.module).is_file(), point
        assert point.targets and point.why


@pytest.mark.parametrize("version", ["0.16.1", "0.19.1", "0.19.2+abc"])
def test_both_supported_release_lines_are_accepted(version):
    check_megatron_core_version(version)


def test_every_patch_point_has_a_verified_target_per_release():
    """Each table of exact parameter lists / source lines covers core_v0.16 and core_v0.19, no other."""
    from libra_megatron.patches import data_loader, get_batch, model_parallel, parse_args, training_log
    from libra_megatron.patches._base import RELEASE_TAGS

    tables = [parse_args.PARSE_ARGS, parse_args.CALLERS, parse_args.FROM_IMPORTERS,
              model_parallel.INITIALIZE_MODEL_PARALLEL, model_parallel.DESTROY_MODEL_PARALLEL, model_parallel.CALLER,
              data_loader.BUILD_LOADER, get_batch.PRETRAIN, get_batch.FORWARD_STEP_FRAGMENTS,
              training_log.TRAINING_LOG]
    assert RELEASE_TAGS == {"0.16": "core_v0.16.1", "0.19": "core_v0.19.0"}
    for table in tables:
        assert sorted(table) == ["0.16", "0.19"], table
        for line, spec in table.items():
            assert not isinstance(spec, TargetSpec) or spec.release == line


def test_a_target_of_another_release_is_refused_naming_that_release(fake_module):
    """core_v0.19's parse_args table entry read against a module shaped like something else names core_v0.19.0."""
    fake_module("fake_megatron_args", TARGET_SOURCE.replace("ignore_unknown_args=False", "strict=True"))
    spec19 = TargetSpec("fake_megatron_args", "parse_args", SPEC.params, SPEC.source_fragments, "0.19")
    with pytest.raises(PatchTargetChanged, match=r"expected parameters .* \(core_v0\.19\.0\), found"):
        resolve_target(spec19)


FORWARD_STEP_SOURCE_019 = '''
BATCH_KEYS = ["attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
              "loss_mask", "max_seqlen", "position_ids", "tokens"]


class PackedSeqParams:
    def __init__(self, **fields):
        self.fields = fields


def get_batch(data_iterator, vp_stage=None):
    return [None] * len(BATCH_KEYS)


def forward_step(data_iterator, model):
    vp_stage = None
    (
        attention_mask, cu_seqlens, cu_seqlens_padded, hybrid_cp_group, labels, local_cp_size, loss_mask,
        max_seqlen, position_ids, tokens,
    ) = get_batch(data_iterator, vp_stage)
    packed_seq_params = None
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.squeeze(0)
        packed_seq_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens,
                                            max_seqlen_q=int(max_seqlen.item()))
    return model(tokens, position_ids, attention_mask, labels=labels, packed_seq_params=packed_seq_params)
'''


class _Carrier:
    """What the Libra get_batch returns as its sixth value (a LibraPackedSeqParams, here a plain record)."""

    def __init__(self, cu_seqlens, max_seqlen):
        self.cu_seqlens_q, self.max_seqlen_q = cu_seqlens, max_seqlen


def test_core_v019_forward_step_gets_the_libra_carrier_not_an_upstream_thd_one(fake_module):
    """core_v0.19: get_batch returns the BATCH_KEYS values and forward_step builds PackedSeqParams itself; the
    model must receive the Libra carrier of the same batch, and upstream's max_seqlen.item() a host tensor."""
    torch = pytest.importorskip("torch")
    program = fake_module("fake_pretrain_gpt_019", FORWARD_STEP_SOURCE_019)
    carriers = [_Carrier(torch.tensor([0, 3, 8], dtype=torch.int32), 5),
                _Carrier(torch.tensor([0, 8], dtype=torch.int32), 8)]

    def make(original):
        assert original(None) == [None] * 10

        def libra_get_batch(data_iterator, vp_stage=None):
            return ("tokens", "labels", "loss_mask", None, "positions", carriers[next(data_iterator)])

        return libra_get_batch

    swap_get_batch(program.forward_step, make, release="0.19")
    seen = [program.forward_step(iter([i]), lambda *a, **k: (a, k)) for i in (0, 1)]
    for (args, kwargs), carrier in zip(seen, carriers):
        assert args == ("tokens", "positions", None) and kwargs["labels"] == "labels"
        assert kwargs["packed_seq_params"] is carrier


def test_core_v019_swap_refuses_a_program_with_other_batch_keys(fake_module):
    program = fake_module("fake_pretrain_gpt_019", FORWARD_STEP_SOURCE_019.replace('"tokens"]', '"tokens", "x"]'))
    before = program.get_batch
    with pytest.raises(PatchTargetChanged, match=r"expected BATCH_KEYS .* \(core_v0\.19\.0\)"):
        swap_get_batch(program.forward_step, lambda original: original, release="0.19")
    assert program.get_batch is before


def test_core_v019_swap_refuses_a_forward_step_without_its_packed_seq_params_line(fake_module):
    program = fake_module("fake_pretrain_gpt_019", FORWARD_STEP_SOURCE_019.replace(
        "packed_seq_params = PackedSeqParams(", "packed_seq_params = dict("))
    with pytest.raises(PatchTargetChanged, match=r"no longer matches core_v0\.19\.0: its source lacks "
                                                 r"\['packed_seq_params = PackedSeqParams\('\]"):
        swap_get_batch(program.forward_step, lambda original: original, release="0.19")
