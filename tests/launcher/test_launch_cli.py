"""Launcher command line, args files, configs and scripts — no Megatron-LM needed."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from libra_megatron.config import LibraConfig
from libra_megatron.launch import expand_args_files, parse_launch_args, resolve_megatron_lm
from libra_megatron.megatron_lm import MegatronLMNotFound, get_megatron_lm

from .simulated_run import simulated_run

REPO = Path(__file__).resolve().parents[2]
RUN_CONFIGS = sorted((REPO / "configs").glob("qwen3-*.args"))


@pytest.fixture
def fake_megatron(tmp_path):
    root = tmp_path / "Megatron-LM"
    for package in ("megatron/training", "megatron/core"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "pretrain_gpt.py").write_text("raise SystemExit('not run in these tests')\n")
    return root


def _offline_getter(repo_root):
    """The project's getter for a clone at ``repo_root`` with no Megatron-LM archive beside it and no network."""
    return lambda environ: get_megatron_lm(environ, repo_root=repo_root, allow_clone=False)


def test_without_flag_the_getter_is_asked_and_its_error_names_what_it_tried(tmp_path):
    repo = tmp_path / "clone"
    (repo / "libra_megatron").mkdir(parents=True)
    (repo / "setup.py").write_text("")
    with pytest.raises(MegatronLMNotFound,
                       match=r"MEGATRON_LM_PATH is not set; no archive at .*: set MEGATRON_LM_PATH"):
        resolve_megatron_lm(None, "pretrain_gpt.py", environ={}, getter=_offline_getter(repo))


def test_flag_wins_over_environment(fake_megatron, tmp_path):
    root, program = resolve_megatron_lm(str(fake_megatron), "pretrain_gpt.py",
                                        environ={"MEGATRON_LM_PATH": str(tmp_path / "elsewhere")})
    assert root == fake_megatron.resolve() and program == fake_megatron.resolve() / "pretrain_gpt.py"


def test_environment_is_used_without_flag(fake_megatron):
    root, _ = resolve_megatron_lm(None, "pretrain_gpt.py", environ={"MEGATRON_LM_PATH": str(fake_megatron)})
    assert root == fake_megatron.resolve()


def test_not_a_megatron_checkout_is_rejected(tmp_path):
    with pytest.raises(MegatronLMNotFound, match=r"MEGATRON_LM_PATH=.*: not a Megatron-LM checkout"):
        resolve_megatron_lm(None, "pretrain_gpt.py", environ={"MEGATRON_LM_PATH": str(tmp_path)})
    with pytest.raises(ValueError, match=r"--megatron-lm-path=.*megatron/training does not exist"):
        resolve_megatron_lm(str(tmp_path), "pretrain_gpt.py", environ={})


def test_missing_program_is_rejected(fake_megatron):
    with pytest.raises(ValueError, match=r"--megatron-program pretrain_bert.py: .* does not exist"):
        resolve_megatron_lm(str(fake_megatron), "pretrain_bert.py", environ={})


def test_launcher_flags_are_consumed_and_the_rest_passes_through_in_order(fake_megatron):
    argv = ["--num-layers", "2", "--megatron-lm-path", str(fake_megatron), "--libra-pool-size", "4",
            "--spec", "libra_megatron.megatron.spec", "libra_local_spec"]
    plan = parse_launch_args(argv, environ={})
    assert plan.megatron_argv == ["--num-layers", "2", "--libra-pool-size", "4",
                                  "--spec", "libra_megatron.megatron.spec", "libra_local_spec"]
    assert plan.megatron_lm_path == fake_megatron.resolve()


def test_args_files_expand_in_place_with_comments_quotes_and_nesting(tmp_path):
    inner = tmp_path / "inner.args"
    inner.write_text("--hidden-size 64  # trailing comment\n# full-line comment\n--data-path 'a b'\n")
    outer = tmp_path / "outer.args"
    outer.write_text(f"--num-layers 2\n--megatron-args-file {inner}\n")
    out = expand_args_files(["--seed", "1", f"--megatron-args-file={outer}", "--lr", "0.1"])
    assert out == ["--seed", "1", "--num-layers", "2", "--hidden-size", "64", "--data-path", "a b", "--lr", "0.1"]


def test_self_including_args_file_is_an_error(tmp_path):
    loop = tmp_path / "loop.args"
    loop.write_text(f"--megatron-args-file {loop}\n")
    with pytest.raises(ValueError, match="nesting deeper than 8"):
        expand_args_files(["--megatron-args-file", str(loop)])


def test_missing_args_file_is_an_error():
    with pytest.raises(ValueError, match=r"--megatron-args-file nope.args: no such file"):
        expand_args_files(["--megatron-args-file", "nope.args"])


def test_paths_inside_an_args_file_resolve_against_its_folder_from_any_cwd(tmp_path, monkeypatch):
    """--megatron-args-file and --libra-config inside a file: its folder; other flags (a user's --data-path)
    pass unchanged, so they resolve against the working directory like any pretrain_gpt.py flag."""
    configs = tmp_path / "my-configs"
    (configs / "models").mkdir(parents=True)
    (configs / "models" / "m.args").write_text("--num-layers 2\n--libra-config=../knobs.yaml\n")
    (configs / "run.args").write_text("--megatron-args-file models/m.args\n--libra-config knobs.yaml\n"
                                      "--data-path data/text_document\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = expand_args_files(["--megatron-args-file", str(configs / "run.args"), "--save", "ckpt"])
    knobs = str((configs / "knobs.yaml").resolve())
    assert out == ["--num-layers", "2", "--libra-config", knobs, "--libra-config", knobs,
                   "--data-path", "data/text_document", "--save", "ckpt"]


def test_a_missing_nested_args_file_names_the_including_folder(tmp_path):
    (tmp_path / "run.args").write_text("--megatron-args-file models/none.args\n")
    with pytest.raises(ValueError, match=r"--megatron-args-file models/none.args \(in .*\): no such file"):
        expand_args_files(["--megatron-args-file", str(tmp_path / "run.args")])


def test_command_line_args_file_is_found_in_the_cwd_then_in_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = expand_args_files(["--megatron-args-file", "configs/qwen3-8b-256k.args"])
    assert shipped[shipped.index("--libra-config") + 1] == str(REPO / "configs" / "libra" / "256k.yaml")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "qwen3-8b-256k.args").write_text("--mine 1\n")
    assert expand_args_files(["--megatron-args-file", "configs/qwen3-8b-256k.args"]) == ["--mine", "1"]


@pytest.mark.parametrize("script", ["torchrun_single_node.sh", "torchrun_multi_node.sh", "slurm_libra.sbatch",
                                    "cpu_pretrain.sh"])
def test_scripts_are_bash_clean(script):
    result = subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_multi_node_script_requires_its_rendezvous_variables(tmp_path):
    result = subprocess.run(["bash", str(REPO / "scripts" / "torchrun_multi_node.sh"), "cfg.args"],
                            capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert result.returncode != 0 and "NNODES" in result.stderr


def test_torchrun_script_runs_in_the_users_directory_with_the_config_as_given(tmp_path):
    """No cd into the repository: the user's relative --data-path/--save keep meaning their directory."""
    recorder = tmp_path / "python"
    recorder.write_text("#!/bin/sh\necho CALL WORLD_SIZE=$WORLD_SIZE\npwd\nprintf '%s\\n' \"$@\"\n")
    recorder.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(recorder), "MEGATRON_LM_PATH": "/opt/Megatron-LM"}
    result = subprocess.run(["bash", str(REPO / "scripts" / "torchrun_single_node.sh"), "configs/qwen3-8b-256k.args",
                             "--data-path", "data/text", "--save", "ckpt"],
                            capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    check, run = [call.splitlines()[1:] for call in result.stdout.split("CALL ")[1:]]
    assert result.stdout.startswith("CALL WORLD_SIZE=8\n")  # --check-only once, for the whole job's world size
    assert check[1:3] == [str(REPO / "scripts" / "pretrain_gpt_libra.py"), "--check-only"]
    assert check[-6:] == run[-6:]
    lines = run
    assert lines[0] == str(tmp_path)
    assert lines[lines.index("-m") + 1] == "torch.distributed.run"
    assert str(REPO / "scripts" / "pretrain_gpt_libra.py") in lines
    assert lines[-6:] == ["--megatron-args-file", "configs/qwen3-8b-256k.args", "--data-path", "data/text",
                          "--save", "ckpt"]


def _flag(argv, name, cast=int):
    """Last value of ``name`` in argv (later flags win, as in argparse)."""
    values = [argv[i + 1] for i, item in enumerate(argv) if item == name]
    return cast(values[-1]) if values else None


def test_all_six_qwen3_configs_exist():
    names = {p.stem for p in RUN_CONFIGS}
    assert names == {f"qwen3-{m}-{s}" for m in ("8b", "30b-a3b", "235b-a22b") for s in ("256k", "1m")}


@pytest.mark.parametrize("config", RUN_CONFIGS, ids=lambda p: p.stem)
def test_run_config_libra_knobs_validate_at_its_smallest_job(config):
    """The YAML named by each run config is valid for that model and layout (DP = the stated minimum)."""
    argv = expand_args_files(["--megatron-args-file", str(config)])
    cfg = LibraConfig.from_yaml(str(REPO / _flag(argv, "--libra-config", str)))
    gpus = int(re.search(r"smallest job is (\d+) GPUs", config.read_text()).group(1))
    tp, pp, cp = (_flag(argv, f) for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                           "--context-parallel-size"))
    dp = gpus // (tp * pp * cp)
    assert dp * tp * pp * cp == gpus and dp % cfg.pool_size == 0
    resolved = cfg.validate(num_attention_heads=_flag(argv, "--num-attention-heads") // tp,
                            num_query_groups=_flag(argv, "--num-query-groups") // tp, data_parallel_size=dp,
                            context_parallel_size=cp, seq_length=_flag(argv, "--seq-length"),
                            micro_batch_size=_flag(argv, "--micro-batch-size"),
                            global_batch_size=_flag(argv, "--global-batch-size"))
    # the simulator's choices (docs/launcher.md "Knob choice", docs/exchange.md, docs/runtime.md): P=8 as in the
    # paper, adaptive tiles, prefix KV fetch, dense placement, K/V relay; H=2, B=2048, tau=0.01 at 256K; H=2,
    # B=4096, tau=0.01 at 1M; M=auto: every chunk owns its K/V head (K/V heads per TP rank / H, at least 1)
    knobs = ("auto", 2, 2048, 0.01) if config.stem.endswith("256k") else ("auto", 2, 4096, 0.01)
    assert (cfg.pool_size, cfg.num_chunks, cfg.head_split, cfg.block_size, cfg.tau) == (8,) + knobs
    # by hand: 8B 8 K/V heads at TP=2 (256K) / TP=4 (1M); 30B 4 at TP=1; 235B 4 at TP=4 (a shard inside one)
    want_m = {"qwen3-8b-256k": 2, "qwen3-8b-1m": 1, "qwen3-30b-a3b-256k": 2, "qwen3-30b-a3b-1m": 2,
              "qwen3-235b-a22b-256k": 1, "qwen3-235b-a22b-1m": 1}[config.stem]
    assert resolved.num_chunks == want_m and resolved == cfg.replace(num_chunks=want_m)
    # the simulator at the config's --model preset and --tp prices the same heads per TP rank and the same M
    assert simulated_run(config.stem, str(REPO / _flag(argv, "--libra-config", str)), tp=tp,
                         seq_length=_flag(argv, "--seq-length"), global_batch_size=_flag(argv, "--global-batch-size"),
                         dp=dp, cp=cp, pp=pp) == (
        _flag(argv, "--num-attention-heads") // tp, _flag(argv, "--num-query-groups") // tp,
        _flag(argv, "--kv-channels"), _flag(argv, "--num-layers"), want_m)
    assert (cfg.tiling.value, cfg.kv_fetch.value, cfg.tile_placement.value) == ("adaptive", "prefix", "dense")
    assert cfg.kv_relay.value == "auto"


def test_libra_yaml_files_hold_only_known_keys():
    for path in (REPO / "configs" / "libra").glob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        LibraConfig.from_mapping(data["libra"], source=str(path))


def test_patches_load_as_libra_megatron_patches_from_a_checkout_that_is_not_installed():
    """scripts/pretrain_gpt_libra.py from a plain checkout (``-S``: no site-packages, so no installed or editable
    libra_megatron): the launcher loads patches/ as libra_megatron.patches, never as a top-level 'patches'."""
    code = (
        "import sys\n"
        "from libra_megatron.launch import import_patches\n"
        "patches = import_patches()\n"
        "import libra_megatron.patches._base as base\n"
        "print(patches.__name__, len(patches.PATCH_POINTS), base.__name__, 'patches' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True,
                            env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["libra_megatron.patches", "5", "libra_megatron.patches._base", "False"]


def _versioned(root, version):
    major, minor, patch = version.split(".")
    (root / "megatron" / "core" / "package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\n")
    return root


def test_release_flag_asks_the_getter_for_that_release(fake_megatron, tmp_path):
    _versioned(fake_megatron, "0.19.1")
    asked = []

    def getter(environ):
        asked.append(environ.get("LIBRA_MEGATRON_LM_RELEASE"))
        return fake_megatron

    plan = parse_launch_args(["--megatron-lm-release", "core_v0.19.0", "--num-layers", "2"], environ={},
                             getter=getter)
    assert asked == ["core_v0.19.0"] and plan.megatron_lm_path == fake_megatron
    assert plan.megatron_argv == ["--num-layers", "2"]


def test_release_flag_that_contradicts_the_given_tree_is_an_error(fake_megatron):
    _versioned(fake_megatron, "0.16.1")
    with pytest.raises(ValueError, match=r"^--megatron-lm-release core_v0.19.0, but the Megatron-LM tree .* \(from "
                                         r"\$MEGATRON_LM_PATH\) is version 0.16.1; drop one of them$"):
        parse_launch_args(["--megatron-lm-release", "core_v0.19.0"], environ={"MEGATRON_LM_PATH": str(fake_megatron)})


def test_scripts_hand_their_command_line_to_the_getter_which_reads_only_the_release():
    from libra_megatron.megatron_lm import release_flag

    assert release_flag(["--megatron-args-file", "x.args", "--megatron-lm-release", "core_v0.19.0", "--lr", "1"]) \
        == "core_v0.19.0"
    assert release_flag(["--megatron-lm-release=core_v0.16.1"]) == "core_v0.16.1"
    assert release_flag(["--help", "--lr", "1"]) is None
