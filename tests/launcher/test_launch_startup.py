"""The launcher fails at start-up, before distributed init, with one line naming the flag.

In-process: Megatron-LM's real ``parse_args`` (defaults included) + ``validate_run`` — exactly what
``libra_megatron.launch`` runs before ``torch.distributed`` starts — over a table of settings Libra cannot
run with. In subprocesses: the whole command line prints ``libra_megatron.launch: error: <one line>`` and
exits 2 (no traceback), and ``--help`` works with and without Megatron-LM.
"""
import os
import re
import subprocess
import sys

import pytest

from libra_megatron.megatron_lm import release_line

from .megatron_lm import (REPO, TINY_MODEL_ARGS, import_megatron_training, launcher_import_set_up,
                          needs_megatron_lm, pairs_with_installed_megatron_core)

SPEC = ["--spec", "libra_megatron.megatron.spec", "libra_local_qk_spec"]
GOOD = TINY_MODEL_ARGS + SPEC + ["--seq-length", "256", "--max-position-embeddings", "256",
                                 "--global-batch-size", "8"]


def _without(argv, flag, with_value=True):
    i = argv.index(flag)
    return argv[:i] + argv[i + (2 if with_value else 1):]


def _replace(argv, flag, value):
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]


BAD = [  # (case, world size, argv, message pattern)
    ("megatron-default-attention-dropout", 2, _without(GOOD, "--attention-dropout"),
     r"^--attention-dropout 0.1: Libra's attention runs without dropout \(Megatron-LM's default is 0.1 when the "
     r"flag is not given\); pass --attention-dropout 0$"),
    ("hybrid-cp", 2, GOOD + ["--hybrid-context-parallel"], r"^--hybrid-context-parallel cannot be combined"),
    ("mla", 2, GOOD + ["--multi-latent-attention"], r"^--multi-latent-attention: .*not MLA$"),
    ("overlap-moe-ep-comm", 2, GOOD + ["--overlap-moe-expert-parallel-comm"],
     r"^--overlap-moe-expert-parallel-comm: Megatron-LM's forward_step for it \(build_schedule_plan\) passes "
     r"no packed_seq_params, "),
    ("micro-batch-2", 2, _replace(GOOD, "--micro-batch-size", "2"),
     r"^Libra requires --micro-batch-size 1 \(one packed sequence per microbatch\), got 2$"),
    ("reset-position-ids-cp-2", 2, GOOD + ["--context-parallel-size", "2", "--reset-position-ids"],
     r"^--reset-position-ids with --context-parallel-size 2: "),
    ("external-loader", 2, GOOD + ["--dataloader-type", "external"], r"^--dataloader-type external: "),
    ("no-spec", 2, _without(GOOD, "--spec", with_value=False)[:-2], r"^--spec is not given: "),
    ("pool-size-3-dp-4", 4, GOOD + ["--libra-pool-size", "3"],
     r"^--libra-pool-size \(pool_size\) 3 must divide the data-parallel size 4 \(4 % 3 = 1\)$"),
    ("pool-size-not-int", 2, GOOD + ["--libra-pool-size", "two"],
     r"^argument --libra-pool-size: invalid int value: 'two'$"),
    ("missing-yaml", 2, GOOD + ["--libra-config", "nope.yaml"], r"^--libra-config nope.yaml: "),
    ("chunks-vs-heads-per-tp-rank", 2, GOOD + ["--tensor-model-parallel-size", "2"],
     r"^--libra-num-chunks \(num_chunks\) 4 must divide num_attention_heads/--libra-head-split = 2/1 = 2 "
     r"\(heads per tensor-parallel rank: --num-attention-heads 4 / --tensor-model-parallel-size 2\)$"),
    ("local-attention-backend", 2, GOOD + ["--attention-backend", "local"],
     r"^--attention-backend local: Megatron-LM core_v0.19 then replaces the spec's core attention"),
]
BAD_CORE_V019 = [  # flags that exist from core_v0.19 on (core_v0.16's argparse rejects them anyway)
    ("inter-document-masking", 2, GOOD + ["--dataloader-inter-document-masking"],
     r"^--dataloader-inter-document-masking: Libra computes per-document attention itself"),
]


def _harness_unless_paired():
    """The product launcher when the test's release pairs with the installed megatron-core; else (core_v0.19 on
    Python 3.11, test-only) the CPU harness, whose import set-up puts that tree's own megatron/core first."""
    return "libra_megatron.launch" if pairs_with_installed_megatron_core() else "libra_megatron.testing.cpu_shims"


def _startup_checks(monkeypatch, world_size, argv, model=False, edit=None):
    """What the launcher runs before any start-up: parse_args, validate_run and (``model``) check_model with
    the device queries answered as sm90, as --check-only does without a GPU. ``edit(args)`` runs after parse."""
    import_megatron_training()
    from libra_megatron.megatron.args import parse_megatron_args
    from libra_megatron.megatron.hooks import validate_run
    from libra_megatron.megatron.model_checks import check_model

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    args = parse_megatron_args(REPO / "pretrain_gpt.py", argv)
    if edit is not None:
        edit(args)
    config = validate_run(args)
    return check_model(args, (9, 0)) if model else config


# Every refused TransformerConfig attention setting (model_checks.ATTENTION_RULES), set through Megatron-LM's
# real parse_args; a field without a Megatron flag is set on the parsed args, which is where
# core_transformer_config_from_args reads it from.
ATTENTION_CASES = {
    "window_size": (["--window-size", "128,0"], None),
    "softmax_type": (["--softmax-type", "off-by-one"], None),
    "qk_clip": (["--qk-clip"], None),
    "log_max_attention_logit": (["--log-max-attention-logit"], None),
    "batch_invariant_mode": (["--batch-invariant-mode"], None),
    "use_kitchen_attention": (["--use-kitchen-attention"], None),
    "experimental_attention_variant": (["--experimental-attention-variant", "gated_delta_net",
                                        "--linear-attention-freq", "2"], None),
    "attention_backend": (["--attention-backend", "flash"], None),
    "fp8_dot_product_attention": ([], lambda args: setattr(args, "fp8_dot_product_attention", True)),
    "cp_comm_type": (["--cp-comm-type", "a2a"], None),
}


def test_every_refused_attention_setting_has_a_case():
    from libra_megatron.megatron.model_checks import ATTENTION_RULES

    assert sorted(rule.field for rule in ATTENTION_RULES) == sorted(ATTENTION_CASES)


@needs_megatron_lm
@pytest.mark.parametrize("field", sorted(ATTENTION_CASES))
def test_attention_settings_libra_does_not_implement_are_one_line_naming_the_flag(monkeypatch, field):
    import argparse

    import_megatron_training()
    from megatron.training.arguments import add_megatron_arguments

    from libra_megatron.megatron.model_checks import ATTENTION_RULES

    rule = next(r for r in ATTENTION_RULES if r.field == field)
    extra, edit = ATTENTION_CASES[field]
    with pytest.raises(ValueError, match=rf"^{re.escape(rule.flag)} ") as caught:
        _startup_checks(monkeypatch, 2, GOOD + extra, model=True, edit=edit)
    assert "\n" not in str(caught.value)
    if rule.flag.startswith("--"):  # the flag the message names is Megatron-LM's own
        parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
        assert rule.flag in {o for action in parser._actions for o in action.option_strings}


@needs_megatron_lm
@pytest.mark.parametrize("extra", [[], ["--apply-query-key-layer-scaling"], ["--attention-softmax-in-fp32"],
                                   ["--deterministic-mode"], ["--attention-output-gate"]],
                         ids=["defaults", "qk-layer-scaling", "softmax-in-fp32", "deterministic", "output-gate"])
def test_accepted_attention_settings_build_the_transformer_config(monkeypatch, extra):
    import torch

    monkeypatch.setenv("NCCL_ALGO", "Ring")  # Megatron-LM's deterministic mode requires it
    saved = torch.are_deterministic_algorithms_enabled()
    try:
        config = _startup_checks(monkeypatch, 2, GOOD + extra, model=True)
    finally:
        torch.use_deterministic_algorithms(saved)  # validate_args turns it on for --deterministic-mode
    assert config.num_layers == 2 and config.deterministic_mode == ("--deterministic-mode" in extra)


def _with_spec(module, name):
    i = GOOD.index("--spec")
    return GOOD[:i] + ["--spec", module, name] + GOOD[i + 3:]


MODEL_BAD = [  # (case, argv, message pattern): refused by check_model, what Megatron-LM would reject later
    ("spec-missing-function", _with_spec("libra_megatron.megatron.spec", "libra_nope_spec"),
     r"^--spec libra_megatron.megatron.spec libra_nope_spec: libra_megatron.megatron.spec has no attribute "
     r"'libra_nope_spec'$"),
    ("spec-missing-module", _with_spec("libra_megatron.no_such_module", "libra_gpt_spec"),
     r"^--spec libra_megatron.no_such_module libra_gpt_spec: module libra_megatron.no_such_module cannot be "
     r"imported"),
    ("spec-without-libra-attention", _with_spec("megatron.core.models.gpt.gpt_layer_specs",
                                                "get_gpt_layer_local_spec"),
     r"^--spec megatron.core.models.gpt.gpt_layer_specs get_gpt_layer_local_spec: the spec has no "
     r"LibraCoreAttention"),
    ("moe-layer-recompute-with-full-recompute",
     GOOD + ["--num-experts", "4", "--moe-layer-recompute", "--recompute-granularity", "full",
             "--recompute-method", "uniform", "--recompute-num-layers", "1"],
     r"^Megatron-LM's TransformerConfig refused the flags: Do not set --moe-layer-recompute with full recompute "
     r"granularity\.$"),
    ("validate-args-assertion", GOOD + ["--fp16-lm-cross-entropy"],
     r"^Megatron-LM's validate_args refused the flags: lm cross entropy in fp16 only support in fp16 mode\.$"),
]


@needs_megatron_lm
@pytest.mark.parametrize("case, argv, pattern", MODEL_BAD, ids=[case[0] for case in MODEL_BAD])
def test_what_megatron_would_reject_later_fails_at_start_up(monkeypatch, case, argv, pattern):
    with pytest.raises(ValueError, match=pattern):
        _startup_checks(monkeypatch, 2, argv, model=True)


@needs_megatron_lm
@pytest.mark.parametrize("case, world_size, argv, pattern", BAD, ids=[case[0] for case in BAD])
def test_unsupported_settings_fail_before_distributed_init_naming_the_flag(monkeypatch, case, world_size, argv,
                                                                           pattern):
    with pytest.raises(ValueError, match=pattern):
        _startup_checks(monkeypatch, world_size, argv)


@needs_megatron_lm
@pytest.mark.parametrize("case, world_size, argv, pattern", BAD_CORE_V019, ids=[case[0] for case in BAD_CORE_V019])
def test_core_v019_settings_libra_does_not_take_fail_naming_the_flag(monkeypatch, megatron_lm_release, case,
                                                                     world_size, argv, pattern):
    if release_line(megatron_lm_release) == "0.16":  # not a core_v0.16 flag: its real parse_args rejects it
        import_megatron_training()
        from libra_megatron.megatron.args import parse_megatron_args

        assert not hasattr(parse_megatron_args(REPO / "pretrain_gpt.py", argv), argv[-1][2:].replace("-", "_"))
        return
    with pytest.raises(ValueError, match=pattern):
        _startup_checks(monkeypatch, world_size, argv)


@needs_megatron_lm
def test_supported_settings_pass_and_give_the_effective_config(monkeypatch):
    config = _startup_checks(monkeypatch, 4, GOOD + ["--libra-pool-size", "2", "--context-parallel-size", "2"])
    assert config.pool_size == 2


PIPELINES = [  # (case, world size, argv): pipeline layouts Libra runs (tests/launcher/test_pipeline_stages.py trains them)
    ("pp-4", 4, _replace(GOOD, "--num-layers", "4") + ["--pipeline-model-parallel-size", "4"]),
    ("pp-2-vpp-2", 4, _replace(GOOD, "--num-layers", "4") + ["--pipeline-model-parallel-size", "2",
                                                             "--num-layers-per-virtual-pipeline-stage", "1"]),
    ("pp-8-dp-1", 8, _replace(GOOD, "--num-layers", "8") + ["--pipeline-model-parallel-size", "8"]),
]


@needs_megatron_lm
@pytest.mark.parametrize("case, world_size, argv", PIPELINES, ids=[case[0] for case in PIPELINES])
def test_pipelines_of_any_depth_pass_the_start_up_checks(monkeypatch, case, world_size, argv):
    assert _startup_checks(monkeypatch, world_size, argv).pool_size == 1


@needs_megatron_lm
def test_the_samplers_pool_proxy_reads_megatron_lms_own_args(monkeypatch):
    """PP=2 x DP=4 with P=2 (two lanes, GA 2): the layout where the sampler prices pools at PP > 1, built from
    Megatron-LM's parsed args the way ``build_libra_data_loader`` builds it (heads per TP rank, --kv-channels,
    --seq-length, CP, bf16), so a renamed Megatron argument fails here rather than in a user's run."""
    from libra_megatron.megatron.sampler import pool_proxy_from_args, sync_layout_from_args
    from libra_megatron.plan.sequences import priced_lanes_apply

    parsed = []
    argv = _replace(GOOD, "--num-layers", "4") + ["--pipeline-model-parallel-size", "2", "--libra-pool-size", "2",
                                                  "--bf16"]
    config = _startup_checks(monkeypatch, 8, argv, edit=parsed.append)
    args = parsed[0]
    assert priced_lanes_apply(sync_layout_from_args(args, 4, config.pool_size))
    proxy = pool_proxy_from_args(args, config.pool_size)
    assert (proxy.pool_size, proxy.context_parallel_size, proxy.seq_len, proxy.num_q_heads, proxy.num_kv_heads,
            proxy.head_dim, proxy.elem_bytes) == (2, 1, 256, 4, 2, 16, 2)  # TINY_MODEL_ARGS: 4 heads, 2 groups, 16


def _launch(args, env_extra=None, module="libra_megatron.launch", cwd=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(env_extra or {}))
    env.pop("LIBRA_DEBUG", None)
    return subprocess.run([sys.executable, "-m", module] + args, capture_output=True, text=True, env=env,
                          timeout=300, cwd=cwd)


def _check_only(args, env_extra, cwd):
    """``--check-only`` with no GPU and no CUDA emulation: the product launcher where the test's release pairs
    with the installed megatron-core; else (core_v0.19 on Python 3.11, test-only) the launcher with only the CPU
    harness's import set-up of that tree (its own megatron/core first), still without CUDA."""
    if _harness_unless_paired() == "libra_megatron.launch":
        return _launch(["--check-only"] + args, env_extra, cwd=cwd)
    code = ("import sys; from libra_megatron import launch; from libra_megatron.testing import cpu_shims; "
            "launch.main(sys.argv[1:], before_megatron_import=cpu_shims._before_megatron_import)")
    env = dict(os.environ, PYTHONWARNINGS="ignore", **env_extra)
    env.pop("LIBRA_DEBUG", None)
    return subprocess.run([sys.executable, "-c", code, "--check-only"] + args, capture_output=True, text=True,
                          env=env, timeout=300, cwd=cwd)


def _one_error_line(result):
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("libra_megatron.launch: error: "), lines[0]
    return lines[0]


@needs_megatron_lm
def test_megatron_default_dropout_is_one_line_before_any_start_up(megatron_lm_path, tmp_path):
    """Through the CPU harness (CUDA emulated, so the flag checks are reached), one process, no torchrun."""
    line = _one_error_line(_launch(_without(GOOD, "--attention-dropout"), {"MEGATRON_LM_PATH": megatron_lm_path},
                                   module="libra_megatron.testing.cpu_shims", cwd=tmp_path))
    assert line.endswith("pass --attention-dropout 0")


@needs_megatron_lm
def test_no_cuda_is_one_line_pointing_to_the_cpu_harness(megatron_lm_path, tmp_path):
    result = _launch(GOOD, {"MEGATRON_LM_PATH": megatron_lm_path}, cwd=tmp_path)
    line = _one_error_line(result)
    assert "no CUDA device is visible" in line and "scripts/cpu_pretrain.sh" in line and "--check-only" in line
    assert result.stdout == ""


@needs_megatron_lm
def test_check_only_without_a_gpu_passes_and_says_cuda_was_not_checked(megatron_lm_path, tmp_path):
    result = _check_only(["--check-device-capability", "10.0"] + GOOD,
                         {"MEGATRON_LM_PATH": megatron_lm_path, "WORLD_SIZE": "2"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and result.stdout == "", result.stderr + result.stdout
    assert lines[0].startswith("libra_megatron.launch: start-up checks passed (world size 2 = TP 1 x PP 1 x CP 1 x "
                               "DP 2; full-size TransformerConfig: 2 layers, hidden 64, 4 heads")
    assert "CUDA not checked (no GPU visible; validate_args' device queries answered as compute capability 10.0" \
        in lines[0]


@needs_megatron_lm
def test_check_only_without_a_gpu_refuses_a_bad_setting_in_one_line(megatron_lm_path, tmp_path):
    line = _one_error_line(_check_only(_with_spec("libra_megatron.megatron.spec", "libra_nope_spec"),
                                       {"MEGATRON_LM_PATH": megatron_lm_path, "WORLD_SIZE": "2"}, cwd=tmp_path))
    assert line.endswith("libra_megatron.megatron.spec has no attribute 'libra_nope_spec'")


@needs_megatron_lm
def test_check_only_runs_every_check_before_any_distributed_start(megatron_lm_path, monkeypatch, capsys):
    """In-process: torch.distributed must not be started by any check (init_process_group would raise)."""
    import torch.distributed as dist

    from libra_megatron import launch

    def refuse(*_a, **_k):
        raise AssertionError("a start-up check started torch.distributed")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the launcher puts Megatron-LM first on it
    monkeypatch.setenv("MEGATRON_LM_PATH", megatron_lm_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as done:
        launch.main(["--check-only"] + GOOD + ["--window-size", "64,0"], before_megatron_import=launcher_import_set_up())
    assert done.value.code == 2 and not dist.is_initialized()
    assert capsys.readouterr().err.strip().endswith("drop --window-size (and --window-attn-skip-freq)")


def test_device_capability_flag_must_be_major_dot_minor():
    from libra_megatron.launch import parse_device_capability

    assert parse_device_capability("8.6") == (8, 6)
    with pytest.raises(ValueError, match=r"^--check-device-capability sm90: give MAJOR.MINOR"):
        parse_device_capability("sm90")


def test_a_missing_python_package_of_megatron_lm_is_named(tmp_path):
    """A Megatron-LM tree whose training package imports a package that is not installed (CUDA emulated so the
    launcher gets that far on CPU)."""
    root = tmp_path / "Megatron-LM"
    for package in ("megatron/training", "megatron/core"):
        (root / package).mkdir(parents=True)
    (root / "megatron" / "training" / "__init__.py").write_text("import libra_test_absent_package\n")
    (root / "megatron" / "core" / "__init__.py").write_text("")
    (root / "pretrain_gpt.py").write_text("")
    line = _one_error_line(_launch(["--num-layers", "2"], {"MEGATRON_LM_PATH": str(root)},
                                   module="libra_megatron.testing.cpu_shims", cwd=tmp_path))
    assert line == (f"libra_megatron.launch: error: Megatron-LM ({root}) needs the Python package "
                    f"'libra_test_absent_package' (pip install libra_test_absent_package; `pip install -e "
                    f".[megatron-lm]` installs every package Megatron-LM imports, pinned)")


def test_help_without_megatron_lm_shows_the_launchers_flags(tmp_path):
    result = _launch(["--help"], {"MEGATRON_LM_PATH": str(tmp_path / "absent")}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "usage: python -m libra_megatron.launch" in result.stdout and "--megatron-args-file" in result.stdout
    assert "Megatron-LM's own flags are not shown: MEGATRON_LM_PATH=" in result.stdout


@needs_megatron_lm
def test_help_with_megatron_lm_adds_megatrons_flags_and_libras(megatron_lm_path, tmp_path):
    result = _launch(["--help"], {"MEGATRON_LM_PATH": megatron_lm_path}, module=_harness_unless_paired(),
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    launcher, megatron = result.stdout.split("Megatron-LM's pretrain_gpt.py flags", 1)
    assert "--megatron-lm-path" in launcher and "--megatron-lm-release" in launcher
    assert "--num-layers" in megatron and "--libra-pool-size" in megatron and "--libra-config" in megatron


@needs_megatron_lm
def test_cpu_pretrain_script_checks_once_before_torchrun_starts_any_rank(megatron_lm_path, tmp_path):
    """A bad command line through scripts/cpu_pretrain.sh: one line and exit 2, no per-rank or torchrun output."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", MEGATRON_LM_PATH=megatron_lm_path)
    result = subprocess.run(["bash", str(REPO / "scripts" / "cpu_pretrain.sh"), "--nproc-per-node", "2"]
                            + GOOD + ["--tensor-model-parallel-size", "2"], capture_output=True, text=True,
                            env=env, timeout=300, cwd=tmp_path)
    line = _one_error_line(result)
    assert "(heads per tensor-parallel rank: --num-attention-heads 4 / --tensor-model-parallel-size 2)" in line
    assert result.stdout == ""


def test_a_core_v019_tree_beside_the_installed_megatron_core_016_is_one_line(tmp_path):
    """The product launcher (CUDA faked, nothing else) with the core_v0.19.0 tree on this Python 3.11 install:
    the tree goes after the installed megatron-core 0.16.1, and the pairing check refuses the mix in one line."""
    from .megatron_lm import megatron_lm_path

    tree = megatron_lm_path("core_v0.19.0")
    code = ("import sys, torch; torch.cuda.is_available = lambda: True; from libra_megatron.launch import main; "
            "main(sys.argv[1:])")
    env = dict(os.environ, PYTHONWARNINGS="ignore", MEGATRON_LM_PATH=tree, WORLD_SIZE="2")
    result = subprocess.run([sys.executable, "-c", code, "--check-only"] + GOOD, capture_output=True, text=True,
                            env=env, timeout=300, cwd=tmp_path)
    line = _one_error_line(result)
    assert line.startswith("libra_megatron.launch: error: megatron-core 0.16.1 (")
    assert line.endswith(f"does not pair with the Megatron-LM tree {tree} (version 0.19.1): install megatron-core "
                         f"0.19.x, or use the tree of release core_v0.16.1")
