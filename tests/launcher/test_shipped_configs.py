"""The shipped Qwen3 run configs (configs/qwen3-*.args) against the real Megatron-LM, once per release
(core_v0.16.1, core_v0.19.0: the ``megatron_lm_path`` fixture).

1. Full size: Megatron's own parse_args + validate_args at each config's smallest job, then Libra's checks
   (``check_supported_layout``, the Libra config against the per-TP-rank heads the planner sees), and the
   Qwen3 settings the model needs (dropout 0, RMSNorm eps 1e-6, the run's --spec, explicit expert TP).
2. Scaled down (``config_workers``): layers, hidden sizes and expert counts only, plus the listed CPU
   substitutions; the model built with the config's --spec and one Libra forward + backward on 2 gloo ranks,
   against the same step with plain per-sample attention (once per model).

Megatron-LM comes from ``libra_megatron.megatron_lm.get_megatron_lm()``; without it these tests skip, except
under CI (``CI`` set), where they fail.
"""
import os
import re
import sys

import pytest

from .megatron_lm import REPO, emulate_hopper_for_argument_validation, launcher_import_set_up, release_config_args

RUN_CONFIGS = sorted((REPO / "configs").glob("qwen3-*.args"))
SCALED_FLAGS = {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--moe-ffn-hidden-size", "--num-experts"}


@pytest.fixture(scope="module")
def megatron_lm(megatron_lm_path):
    root = megatron_lm_path  # the getter's tree of the test's release; fails under CI, skips elsewhere
    previous = os.environ.get("MEGATRON_LM_PATH")
    os.environ["MEGATRON_LM_PATH"] = root  # read by put_megatron_lm_on_path, here and in worker processes
    yield root
    if previous is None:
        os.environ.pop("MEGATRON_LM_PATH", None)
    else:
        os.environ["MEGATRON_LM_PATH"] = previous


def _smallest_job(config):
    return int(re.search(r"smallest job is (\d+) GPUs", config.read_text()).group(1))


# ------------------------------------------------------------------ 1. full size, in this process
@pytest.fixture
def libra_parse_args(megatron_lm, monkeypatch):
    """Megatron-LM's parse_args with the patch points installed (LibraHooks); undone afterwards."""
    from .megatron_lm import put_megatron_lm_on_path

    put_megatron_lm_on_path()
    import libra_megatron.patches as patches
    from libra_megatron.megatron.hooks import LibraHooks

    patcher = patches.install_all(LibraHooks())

    def parse(argv):
        import megatron.training.arguments as arguments
        import megatron.training.initialize as initialize

        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"] + argv)
        return getattr(initialize, "parse_args", arguments.parse_args)()  # core_v0.16's caller's name, or 0.19's

    yield parse
    patcher.undo()


@pytest.mark.parametrize("config", RUN_CONFIGS, ids=lambda p: p.stem)
def test_config_passes_megatron_and_libra_validation_at_its_smallest_job(config, libra_parse_args, monkeypatch):
    from megatron.training.arguments import validate_args

    from libra_megatron.config import LibraConfig
    from libra_megatron.launch import expand_args_files
    from libra_megatron.megatron.args import libra_config_from_args
    from libra_megatron.megatron.hooks import check_supported_layout
    from libra_megatron.megatron.model_checks import check_model

    emulate_hopper_for_argument_validation(monkeypatch)
    monkeypatch.chdir(REPO)
    gpus = _smallest_job(config)
    monkeypatch.setenv("WORLD_SIZE", str(gpus))
    args = libra_parse_args(expand_args_files(["--megatron-args-file", str(config)] + release_config_args())
                            + ["--train-iters", "10", "--mock-data"])
    args.world_size = gpus
    validate_args(args, {})
    tp = args.tensor_model_parallel_size
    assert gpus == args.data_parallel_size * tp * args.pipeline_model_parallel_size * args.context_parallel_size
    assert args.data_parallel_size == 8 and args.micro_batch_size == 1
    # Qwen3 (config.json): no dropout, RMSNorm eps 1e-6; Libra's attention refuses dropout
    assert (args.attention_dropout, args.hidden_dropout, args.layernorm_epsilon) == (0.0, 0.0, 1e-6)
    assert args.normalization == "RMSNorm" and args.qk_layernorm and args.untie_embeddings_and_output_weights
    assert args.spec == ["libra_megatron.megatron.spec", "libra_gpt_spec"]
    if args.num_experts:
        assert args.moe_grouped_gemm and args.expert_tensor_parallel_size == 1
    check_supported_layout(args)
    cfg = libra_config_from_args(args)
    check_supported_layout(args, cfg)
    shipped = LibraConfig.from_yaml(str(REPO / args.libra_config))
    # num_chunks: auto resolves to the K/V heads of one head shard on one TP rank (at least 1); the rest as shipped
    want_m = max(1, args.num_query_groups // tp // shipped.head_split)
    assert isinstance(cfg.num_chunks, int) and cfg == shipped.replace(num_chunks=want_m)
    # the full-size TransformerConfig from every flag of the config (none dropped), its attention settings and
    # the --spec object: what --check-only and the run's start-up build (model_checks.check_model)
    model = check_model(args, validate=False)
    assert (model.num_layers, model.hidden_size, model.num_attention_heads) == (
        args.num_layers, args.hidden_size, args.num_attention_heads)
    assert model.recompute_granularity == "full" and model.num_moe_experts == args.num_experts
    # the planner sees this TP rank's heads: the knobs must divide those too
    cfg.validate(num_attention_heads=args.num_attention_heads // tp, num_query_groups=args.num_query_groups // tp,
                 data_parallel_size=args.data_parallel_size, context_parallel_size=args.context_parallel_size,
                 seq_length=args.seq_length, global_batch_size=args.global_batch_size)
    # the simulator prices what this run runs: the config's --model preset at its --tp gives the heads of one TP
    # rank, the resolved M and the layers Megatron-LM parsed (no drift between sim/spec.py and configs/models)
    from .simulated_run import simulated_run

    assert simulated_run(config.stem, str(REPO / args.libra_config), tp=tp, seq_length=args.seq_length,
                         global_batch_size=args.global_batch_size, dp=args.data_parallel_size,
                         cp=args.context_parallel_size, pp=args.pipeline_model_parallel_size) == (
        args.num_attention_heads // tp, args.num_query_groups // tp, args.kv_channels, args.num_layers,
        cfg.num_chunks)


@pytest.mark.parametrize("config", RUN_CONFIGS, ids=lambda p: p.stem)
def test_check_only_passes_the_config_at_full_size_without_a_gpu(config, megatron_lm, monkeypatch, capsys):
    """``--check-only`` in-process, exactly as a user on a login node runs it (no GPU in this process)."""
    import torch
    import torch.distributed as dist

    from libra_megatron import launch

    assert not torch.cuda.is_available()
    monkeypatch.setattr(sys, "path", list(sys.path))  # the launcher puts Megatron-LM first on it
    monkeypatch.setenv("WORLD_SIZE", str(_smallest_job(config)))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # what the torchrun scripts export
    with pytest.raises(SystemExit) as done:
        launch.main(["--check-only", "--megatron-args-file", str(config)] + release_config_args(),
                    before_megatron_import=launcher_import_set_up())
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert done.value.code == 0, line
    assert not dist.is_initialized()
    layers = re.search(r"^--num-layers (\d+)$", _model_args(config), re.M).group(1)
    assert line.startswith(f"libra_megatron.launch: start-up checks passed (world size {_smallest_job(config)} = ")
    assert f"full-size TransformerConfig: {layers} layers" in line and "CUDA not checked (no GPU visible" in line


def _model_args(config):
    include = re.search(r"^--megatron-args-file (models/\S+)$", config.read_text(), re.M).group(1)
    return (config.parent / include).read_text()


def test_cpu_substitutions_keep_what_transformer_config_validates(megatron_lm, monkeypatch):
    """Every CPU substitution of the scaled-down step applied to the FULL-SIZE config (sizes kept): Megatron-LM's
    validate_args and TransformerConfig still accept it, as they accept the config itself (the test above), so no
    substitution is what makes a config build. The rules of the flags it drops (recompute, fusions, TE, grouped
    GEMM) are checked at full size above."""
    from megatron.training.arguments import validate_args

    from libra_megatron.launch import expand_args_files
    from libra_megatron.megatron.args import parse_megatron_args
    from libra_megatron.megatron.model_checks import build_transformer_config

    from .config_workers import scaled_config_argv

    emulate_hopper_for_argument_validation(monkeypatch)
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for config in RUN_CONFIGS:
        full = expand_args_files(["--megatron-args-file", str(config)])
        argv, changed = scaled_config_argv(full, moe="--num-experts" in full, scale=False)
        assert not set(changed) & SCALED_FLAGS, config.stem
        args = parse_megatron_args(REPO / "pretrain_gpt.py", argv + ["--mock-data"])
        validate_args(args, {})
        model = build_transformer_config(args)
        assert model.num_layers == int(re.search(r"^--num-layers (\d+)$", _model_args(config), re.M).group(1))


# ------------------------------------------------------------------ 2. scaled down, 2 gloo ranks
@pytest.fixture(scope="module")
def stepped(megatron_lm, tmp_path_factory):
    """Every config, scaled down, through start-up, model build and one step (one 2-rank gloo job)."""
    from libra_megatron.megatron.corpus import build_indexed_dataset_from_trace
    from libra_megatron.plan.traces import find_trace
    from libra_megatron.testing.dist import run_distributed

    from .config_workers import VOCAB_WITHOUT_EOD, config_step

    # Real Wikipedia document lengths (median 347 tokens: one to a few documents per 256-token sequence),
    # synthetic tokens below the NullTokenizer's EOD id.
    prefix = str(tmp_path_factory.mktemp("corpus") / "wiki")
    build_indexed_dataset_from_trace(find_trace("wikipedia-flexsp.txt"), prefix, vocab_size=VOCAB_WITHOUT_EOD + 1,
                                     eod=VOCAB_WITHOUT_EOD, max_docs=400)
    work = str(tmp_path_factory.mktemp("runs"))
    references = [c.stem for c in RUN_CONFIGS if c.stem.endswith("-256k")]
    results = run_distributed(config_step, 2, str(REPO), [str(c) for c in RUN_CONFIGS], prefix, work, references,
                              timeout=600, env={"MEGATRON_LM_PATH": megatron_lm})
    return results


def test_each_config_builds_its_model_with_libra_attention_in_every_layer(stepped):
    for rank in stepped:
        for name, r in rank.items():
            moe = "a3b" in name or "a22b" in name
            assert r["num_layers"] == 2 and r["num_libra_attention"] == 2, name
            assert r["mlp"] == ("MoELayer" if moe else "MLP"), name
            assert r["vocab_rows"] == 151936 and r["param_dtype"] == "torch.bfloat16", name
            assert (r["norm_epsilon"], r["attention_dropout"], r["hidden_dropout"]) == (1e-6, 0.0, 0.0), name
            assert r["libra_pool_size"] == 2, name
            assert r["recompute"] == ("full", "uniform", 1), name  # the configs' recompute runs in the step


def test_only_size_flags_and_listed_cpu_substitutions_change(stepped):
    from .config_workers import CPU_SUBSTITUTIONS

    for name, r in stepped[0].items():
        unexpected = set(r["changed"]) - SCALED_FLAGS - set(CPU_SUBSTITUTIONS)
        assert not unexpected, f"{name}: {sorted(unexpected)} changed"
        assert {"--num-layers", "--hidden-size"} <= set(r["changed"]), name


def test_one_libra_step_matches_plain_attention_for_every_config(stepped):
    """bf16 model: loss within 1e-2 and grad norm within 5e-2 relative of plain per-sample attention. A model's
    256K and 1M configs scale down to the same model and data, so they share the 256K run's reference. Every
    step runs a Libra plan that moves Q/KV/O between the ranks (Algorithm 2's placement: at these 256-token
    sequences the shipped dense placement prices every tile home faster, see ``CPU_SUBSTITUTIONS``)."""
    for rank in stepped:
        exchanged = {}
        for name, r in rank.items():
            libra, plain = r["libra"], rank[name.replace("-1m", "-256k")]["plain"]
            assert libra["finite"] and plain["finite"] and libra["params_without_grad"] == 0, name
            assert abs(libra["loss"] - plain["loss"]) <= 1e-2 * abs(plain["loss"]), (name, libra, plain)
            assert abs(libra["grad_norm"] - plain["grad_norm"]) <= 5e-2 * plain["grad_norm"], (name, libra, plain)
            assert libra["loss"] > 5.0, (name, libra)  # ~ln(151936) = 11.9 at init: a real LM loss, not zero
            assert libra["plans"] > 0, (name, libra)  # the step ran a Libra plan on every rank
            exchanged[name] = libra["plan_bytes_sent"] > 0
        assert all(exchanged.values()), exchanged  # TAP moved tiles: every config's step exchanged Q/KV/O
