"""Against the real Megatron-LM, once per release (core_v0.16.1, core_v0.19.0): patch targets, parse_args with our
provider, the model flags.

Megatron-LM comes from the project's getter (``libra_megatron.megatron_lm``); under CI these tests fail,
never skip, when it cannot be had. The model / data-loader / forward step tests run in gloo processes
(``test_megatron_lm_distributed.py``); Megatron-LM's whole ``pretrain()`` loop is ``test_pretrain_loop.py``.
"""
import argparse
import sys

import pytest

from .megatron_lm import (
    REPO,
    import_megatron_training,
    needs_megatron_lm,
    tiny_model_args,
)

pytestmark = needs_megatron_lm


class _NoopHooks:
    """Stand-in hooks: lets a test exercise one patch point without Libra's start-up side effects."""

    def __init__(self):
        self.ready_calls = 0

    def add_args(self, parser):
        from libra_megatron.megatron.args import add_libra_args

        return add_libra_args(parser)

    def on_model_parallel_ready(self):
        self.ready_calls += 1

    def on_model_parallel_destroyed(self):
        pass

    def build_data_loader(self, dataset, consumed_samples):
        return ("libra-loader", dataset, consumed_samples)

    def make_get_batch(self, original):
        return original

    def make_dataset_rule(self, original):
        return original

    def after_training_log(self, iteration):
        pass


@pytest.fixture
def installed():
    """All patch points installed with ``_NoopHooks``; undone afterwards."""
    import_megatron_training()
    import libra_megatron.patches as patches

    hooks = _NoopHooks()
    patcher = patches.install_all(hooks)
    yield hooks
    patcher.undo()


def _targets():
    import megatron.core.parallel_state as ps
    import megatron.training
    import megatron.training.arguments as arguments
    import megatron.training.datasets.data_samplers as samplers
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    from_imported = {"initialize.parse_args": (initialize, "parse_args")} if hasattr(initialize, "parse_args") else {}
    return {
        "arguments.parse_args": (arguments, "parse_args"), **from_imported,
        "ps.initialize_model_parallel": (ps, "initialize_model_parallel"),
        "ps.destroy_model_parallel": (ps, "destroy_model_parallel"),
        "samplers.build_pretraining_data_loader": (samplers, "build_pretraining_data_loader"),
        "training.build_pretraining_data_loader": (training, "build_pretraining_data_loader"),
        "training.pretrain": (training, "pretrain"), "megatron.training.pretrain": (megatron.training, "pretrain"),
        "training.training_log": (training, "training_log"),
    }


def test_install_all_replaces_every_target_and_undo_restores_them():
    import_megatron_training()
    import libra_megatron.patches as patches

    before = {name: getattr(mod, attr) for name, (mod, attr) in _targets().items()}
    patcher = patches.install_all(_NoopHooks())
    try:
        after = {name: getattr(mod, attr) for name, (mod, attr) in _targets().items()}
        assert all(after[name] is not before[name] for name in before), "a target was not replaced"
        # from-imported names must point at the same wrapper as their defining module (core_v0.16 only:
        # core_v0.19's initialize.py no longer imports parse_args)
        assert after.get("initialize.parse_args", after["arguments.parse_args"]) is after["arguments.parse_args"]
        assert after["samplers.build_pretraining_data_loader"] is after["training.build_pretraining_data_loader"]
    finally:
        patcher.undo()
    restored = {name: getattr(mod, attr) for name, (mod, attr) in _targets().items()}
    assert all(restored[name] is before[name] for name in before)


def test_a_changed_megatron_target_aborts_the_whole_install(monkeypatch):
    import_megatron_training()
    import megatron.training.training as training
    import libra_megatron.patches as patches
    from libra_megatron.patches import PatchTargetChanged

    import megatron.training.arguments as arguments

    original_parse = arguments.parse_args

    def training_log(loss_dict, iteration):  # a "future Megatron" with a new signature
        return None

    monkeypatch.setattr(training, "training_log", training_log)
    with pytest.raises(PatchTargetChanged, match=r"training_log changed its signature"):
        patches.install_all(_NoopHooks())
    assert arguments.parse_args is original_parse, "earlier patch points were not rolled back"


def _program_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--program-flag", type=int, default=0)
    return parser


def _parse(monkeypatch, argv, provider=None):
    """The ``parse_args`` name Megatron-LM's own caller uses: ``initialize_megatron``'s (core_v0.16) or
    ``arguments.parse_and_validate_args``'s (core_v0.19), both patched."""
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"] + argv)
    return getattr(initialize, "parse_args", arguments.parse_args)(provider)


def test_real_parse_args_sees_libra_flags_next_to_the_programs_provider(installed, monkeypatch):
    argv = tiny_model_args() + ["--seq-length", "256", "--libra-pool-size", "4", "--libra-block-size", "512",
                              "--libra-tile-placement", "home", "--program-flag", "7"]
    args = _parse(monkeypatch, argv, _program_provider)
    assert (args.libra_pool_size, args.libra_block_size, args.program_flag) == (4, 512, 7)
    assert args.libra_tile_placement in ("home",) or getattr(args.libra_tile_placement, "value", None) == "home"
    assert args.num_layers == 2  # Megatron's own flags still parse


def test_bad_libra_flag_value_is_rejected_by_argparse_naming_the_flag(installed, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _parse(monkeypatch, tiny_model_args() + ["--libra-pool-size", "two"])
    assert "--libra-pool-size" in capsys.readouterr().err


def test_libra_validation_names_the_flag_and_arithmetic(installed, monkeypatch):
    from megatron.training.arguments import validate_args

    from libra_megatron.megatron.args import libra_config_from_args

    monkeypatch.setenv("WORLD_SIZE", "4")
    args = _parse(monkeypatch, tiny_model_args() + ["--seq-length", "256", "--max-position-embeddings", "256",
                                                  "--global-batch-size", "12",
                                                  "--libra-pool-size", "3"])
    args.world_size = 4
    validate_args(args, {})
    assert args.data_parallel_size == 4
    with pytest.raises(ValueError, match=r"--libra-pool-size.* 3 must divide the data-parallel size 4"):
        libra_config_from_args(args)


# Every run config through parse_args/validate_args and Libra's checks: test_shipped_configs.py.


@pytest.mark.parametrize("model", ["8B", "30B-A3B", "235B-A22B"])
def test_model_args_match_megatron_lm_qwen3_example(model, megatron_lm_path):
    """Each flag of configs/models/qwen3-*.args that also appears in Megatron-LM's Qwen3 example has its value."""
    import shlex
    from pathlib import Path

    example = Path(megatron_lm_path) / f"examples/post_training/modelopt/conf/Qwen/Qwen3-{model}.sh"
    text = example.read_text()
    model_args = shlex.split(text.split('MODEL_ARGS="', 1)[1].split('"', 1)[0].replace("\\\n", " "))
    ours = shlex.split((REPO / "configs" / "models" / f"qwen3-{model.lower()}.args").read_text(), comments=True)

    def as_dict(tokens):
        out, i = {}, 0
        while i < len(tokens):
            value = tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("--") else None
            out[tokens[i]] = value
            i += 2 if value is not None else 1
        return out

    theirs_d, ours_d = as_dict(model_args), as_dict(ours)
    shared = set(theirs_d) & set(ours_d)
    assert len(shared) >= 20
    assert {k: ours_d[k] for k in shared} == {k: theirs_d[k] for k in shared}
    structural = {"--num-layers", "--hidden-size", "--num-attention-heads", "--num-query-groups", "--kv-channels",
                  "--qk-layernorm", "--rotary-base", "--ffn-hidden-size"}
    assert structural <= shared
