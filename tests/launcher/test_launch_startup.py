"""The launcher fails at start-up, before distributed init, with one line naming the flag.

In-process: Megatron-LM's real ``parse_args`` (defaults included) + ``validate_run`` — exactly what
``libra_megatron.launch`` runs before ``torch.distributed`` starts — over a table of settings Libra cannot
run with. In subprocesses: the whole command line prints ``libra_megatron.launch: error: <one line>`` and
exits 2 (no traceback), and ``--help`` works with and without Megatron-LM.
"""
import os
import subprocess
import sys

import pytest

from libra_megatron.megatron_lm import release_line

from .megatron_lm import REPO, TINY_MODEL_ARGS, active_release, import_megatron_training, needs_megatron_lm

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
    ("micro-batch-2", 2, _replace(GOOD, "--micro-batch-size", "2"),
     r"^Libra requires --micro-batch-size 1 \(one packed sequence per microbatch\), got 2$"),
    ("pp-4", 4, GOOD + ["--pipeline-model-parallel-size", "4"], r"^--pipeline-model-parallel-size 4: .*PP <= 2\)$"),
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
    from importlib import metadata

    if release_line(metadata.version("megatron-core")) == release_line(active_release()):
        return "libra_megatron.launch"
    return "libra_megatron.testing.cpu_shims"


def _startup_checks(monkeypatch, world_size, argv):
    import_megatron_training()
    from libra_megatron.megatron.args import parse_megatron_args
    from libra_megatron.megatron.hooks import validate_run

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    return validate_run(parse_megatron_args(REPO / "pretrain_gpt.py", argv))


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


def _launch(args, env_extra=None, module="libra_megatron.launch", cwd=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(env_extra or {}))
    env.pop("LIBRA_DEBUG", None)
    return subprocess.run([sys.executable, "-m", module] + args, capture_output=True, text=True, env=env,
                          timeout=300, cwd=cwd)


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
    assert "no CUDA device is visible" in line and "scripts/cpu_pretrain.sh" in line
    assert result.stdout == ""


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
