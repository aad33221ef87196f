"""Every shipped run config, scaled down, through the real Megatron-LM start-up, model build and one step on CPU.

``scaled_config_argv`` turns a config into a 2-rank CPU command line by changing only (a) the model's layer
count, hidden sizes and expert count and (b) what a CPU gloo job cannot run, each listed in
``CPU_SUBSTITUTIONS`` with the reason; every other flag of the config reaches Megatron-LM unchanged.
``config_step`` (the per-rank body, module level so ``run_distributed`` can pickle it) then does what
``python -m libra_megatron.launch`` does up to ``pretrain``: patch points installed with ``LibraHooks``,
Megatron's parse_args/validate_args/global vars, the patched ``initialize_model_parallel`` (Libra's config
check, pool groups, planner), the model from ``gpt_builders.gpt_builder`` with the config's own ``--spec``,
Megatron's dataset provider + the patched loader, and ``pretrain_gpt.forward_step`` + ``loss_func`` +
backward with the step's Libra plan and, once per model, with plain per-sample attention (the reference).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Tuple

from libra_megatron.megatron_lm import release_line

from .megatron_lm import active_release, put_megatron_lm_on_path

SEQ_LEN = 256
SCALED_LAYERS = 2
SCALED_HIDDEN = 128
SCALED_EXPERTS = 16
VOCAB_WITHOUT_EOD = 151935  # NullTokenizer adds the EOD id: 151936 rows, Qwen3's padded vocabulary

# flag -> (value or None to drop it, why a CPU gloo job needs the change)
CPU_SUBSTITUTIONS: Dict[str, Tuple[object, str]] = {
    "--transformer-impl": ("local", "Transformer Engine kernels are CUDA-only; the local backend runs on CPU"),
    "--moe-grouped-gemm": (None, "grouped GEMM kernels (TE / grouped_gemm) are CUDA-only"),
    "--cross-entropy-loss-fusion": (None, "Transformer Engine's fused cross entropy is CUDA-only"),
    "--cross-entropy-fusion-impl": (None, "(see --cross-entropy-loss-fusion)"),
    "--tokenizer-type": ("NullTokenizer", "the Qwen3 tokenizer would be downloaded from the Hugging Face hub"),
    "--tokenizer-model": (None, "(see --tokenizer-type)"),
    "--vocab-size": (VOCAB_WITHOUT_EOD, "NullTokenizer's size: the same 151936 embedding rows (core_v0.19: +1, "
                                        "see null_tokenizer_vocab_size)"),
    "--seq-length": (SEQ_LEN, "256K/1M tokens per sequence do not fit a CPU test"),
    "--max-position-embeddings": (SEQ_LEN, "(see --seq-length)"),
    "--tensor-model-parallel-size": (1, "gloo has no reduce-scatter for sequence-parallel TP; 2 ranks"),
    "--sequence-parallel": (None, "(see --tensor-model-parallel-size)"),
    "--pipeline-model-parallel-size": (1, "2 ranks"),
    "--context-parallel-size": (1, "2 ranks: DP=2 so that a pool of P=2 exchanges tiles"),
    "--global-batch-size": (2, "one microbatch per rank"),
    "--libra-pool-size": (2, "P=8 needs DP to be a multiple of 8; DP=2 here"),
    "--libra-block-size": (64, "B=4096 > L would make each sequence one tile; B/L as small as at 256K keeps TAP busy"),
    "--libra-tile-placement": ("alg2", "at 256-token sequences the shipped dense placement prices every tile home "
                                       "faster (a tile's Q costs more link time than its attention) and would move "
                                       "nothing; Algorithm 2 moves tiles, so every config's step exchanges Q/KV/O"),
    "--moe-token-dispatcher-type": ("allgather", "the alltoall dispatcher creates a torch.cuda.Stream"),
    "--expert-model-parallel-size": (1, "the allgather dispatcher needs reduce-scatter over EP, which gloo lacks"),
    "--expert-tensor-parallel-size": (1, "(see --expert-model-parallel-size)"),
    "--num-workers": (0, "no DataLoader worker processes inside the test's gloo ranks"),
}
VALUELESS = {"--moe-grouped-gemm", "--cross-entropy-loss-fusion", "--sequence-parallel"}
# Megatron-LM flags only a test needs (data, no CUDA-only fusions); none of them is in any config.
TEST_ONLY_FLAGS = ["--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-bias-dropout-fusion",
                   "--use-cpu-initialization", "--train-iters", "4", "--seed", "1234"]


def null_tokenizer_vocab_size() -> int:
    """--vocab-size for 151936 rows, EOD 151935: core_v0.16's NullTokenizer adds the EOD id, core_v0.19's
    counts it in (the same rule as ``megatron_lm.tiny_model_args``)."""
    return VOCAB_WITHOUT_EOD + (0 if release_line(active_release()) == "0.16" else 1)


def _scaled_value(flag: str, value: str, hidden: int) -> str:
    """Layers, hidden sizes (all by SCALED_HIDDEN / hidden) and expert counts, scaled down."""
    if flag == "--num-layers":
        return str(SCALED_LAYERS)
    if flag == "--num-experts":
        return str(SCALED_EXPERTS)
    if flag in ("--hidden-size", "--ffn-hidden-size", "--moe-ffn-hidden-size"):
        return str(max(8, int(value) * SCALED_HIDDEN // hidden))
    return value


def _pairs(argv: List[str]) -> List[Tuple[str, List[str]]]:
    """[(flag, values)] in order; values are the tokens up to the next flag."""
    out: List[Tuple[str, List[str]]] = []
    for token in argv:
        if token.startswith("--"):
            out.append((token, []))
        else:
            out[-1][1].append(token)
    return out


def scaled_config_argv(config_argv: List[str], moe: bool, scale: bool = True) -> Tuple[List[str], Dict[str, str]]:
    """(CPU argv, {flag: what changed}) for a config's expanded argv; see the module docstring. ``scale=False``:
    the CPU substitutions only, model sizes kept (the full-size TransformerConfig check of the substitutions)."""
    pairs = _pairs(config_argv)
    hidden = int(next(v[0] for f, v in pairs if f == "--hidden-size"))
    out, changed, seen = [], {}, set()
    for flag, values in pairs:
        seen.add(flag)
        if flag in CPU_SUBSTITUTIONS:
            value = null_tokenizer_vocab_size() if flag == "--vocab-size" else CPU_SUBSTITUTIONS[flag][0]
            changed[flag] = f"{' '.join(values) or 'set'} -> {value if value is not None else 'dropped'}"
            if value is not None:
                out += [flag, str(value)]
            continue
        scaled = [_scaled_value(flag, v, hidden) for v in values] if scale else values
        if scaled != values:
            changed[flag] = f"{' '.join(values)} -> {' '.join(scaled)}"
        out += [flag] + scaled
    for flag, (value, _) in CPU_SUBSTITUTIONS.items():  # substitutions the config does not set itself
        value = null_tokenizer_vocab_size() if flag == "--vocab-size" else value
        if flag not in seen and value is not None and flag not in VALUELESS:
            if flag.startswith("--expert") and not moe:
                continue
            out += [flag, str(value)]
            changed[flag] = f"unset -> {value}"
    return out + TEST_ONLY_FLAGS, changed


def config_step(rank: int, world_size: int, repo: str, configs: List[str], data_prefix: str, work: str,
                with_reference: List[str]) -> dict:
    """Per rank: every config in turn (fresh args, groups, model); results by config name. The plain-attention
    reference step runs for the configs named in ``with_reference`` (it depends only on the scaled model and
    the data, which a model's 256K and 1M configs share)."""
    import os

    os.chdir(repo)  # the configs name their includes and YAML relative to the repository root
    put_megatron_lm_on_path()
    return {Path(c).stem: _one_config(world_size, c, data_prefix, f"{work}/{Path(c).stem}",
                                      Path(c).stem in with_reference) for c in configs}


def _one_config(world_size, config, data_prefix, work, reference):
    from megatron.core import parallel_state
    from megatron.training.global_vars import unset_global_variables

    hooks, patcher, args, changed = _start(world_size, config, data_prefix, work)
    try:
        out = {"changed": changed, "spec": list(args.spec), "norm_epsilon": args.layernorm_epsilon,
               "attention_dropout": args.attention_dropout, "hidden_dropout": args.hidden_dropout,
               "recompute": (args.recompute_granularity, args.recompute_method, args.recompute_num_layers)}
        out.update(_build_and_step(hooks, args, reference))
        return out
    finally:
        parallel_state.destroy_model_parallel()  # patched: closes the planner, destroys the pool groups
        unset_global_variables()
        patcher.undo()


def _start(world_size, config, data_prefix, work):
    """Hooks installed, the config's scaled argv parsed/validated/set globally, model-parallel + pools ready."""
    import torch

    from libra_megatron.launch import expand_args_files
    from libra_megatron.testing.cpu_shims import (apply_megatron_cpu_shims, emulate_cuda_rng_on_cpu,
                                                  use_installed_dataset_helpers)

    apply_megatron_cpu_shims()
    emulate_cuda_rng_on_cpu()  # the configs' full activation recompute saves/restores the "CUDA" RNG state
    use_installed_dataset_helpers()  # a core_v0.19 tree has no compiled dataset helpers of its own
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    import libra_megatron.patches as patches
    from megatron.core import parallel_state
    from megatron.training.global_vars import set_global_variables

    from libra_megatron.megatron.hooks import LibraHooks

    config_argv = expand_args_files(["--megatron-args-file", config])
    argv, changed = scaled_config_argv(config_argv, moe="--num-experts" in config_argv)
    hooks = LibraHooks()
    patcher = patches.install_all(hooks)
    sys.argv = ["pretrain_gpt.py"] + argv + ["--data-path", data_prefix, "--split", "100,0,0",
                                             "--data-cache-path", work + "/cache"]
    # the patched name Megatron-LM's caller uses: initialize_megatron's (core_v0.16), parse_and_validate_args' (0.19)
    args = getattr(initialize, "parse_args", arguments.parse_args)()
    args.world_size = world_size
    arguments.validate_args(args, {})
    set_global_variables(args, build_tokenizer=True)
    torch.manual_seed(args.seed)
    parallel_state.initialize_model_parallel(  # patched: Libra start-up runs right after it
        1, 1, context_parallel_size=1, expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    return hooks, patcher, args, changed


def _build_and_step(hooks, args, reference: bool) -> dict:
    import gpt_builders
    import megatron.training.training as training
    import pretrain_gpt

    from libra_megatron.megatron.attention import LibraCoreAttention

    model = gpt_builders.gpt_builder(args, True, True)  # --spec libra_megatron.megatron.spec libra_gpt_spec
    layers = list(model.decoder.layers)
    out = {"num_libra_attention": sum(isinstance(m, LibraCoreAttention) for m in model.modules()),
           "num_layers": len(layers), "mlp": type(layers[0].mlp).__name__,
           "param_dtype": str(next(model.parameters()).dtype), "vocab_rows": model.embedding.word_embeddings.weight.shape[0],
           "libra_pool_size": hooks.config.pool_size}
    train_ds, _, _ = pretrain_gpt.train_valid_test_datasets_provider([8, 0, 0])
    out["libra"] = _forward_backward(model, pretrain_gpt, training, train_ds, hooks)
    if reference:
        out["plain"] = _forward_backward(model, pretrain_gpt, training, train_ds, hooks, drop_plan=True)
    return out


def _forward_backward(model, pretrain_gpt, training, train_ds, hooks, drop_plan=False) -> dict:
    """One microbatch through pretrain_gpt.forward_step + loss_func and backward: loss, gradient stats and the
    bytes this step's plan sent between the pool's ranks and the Libra plans it ran (both summed over ranks).
    ``forward_step``'s globals are swapped by the patch point for the running release and restored afterwards."""
    import dataclasses

    import torch
    import torch.distributed as dist

    from libra_megatron.patches._base import active_release
    from libra_megatron.patches.get_batch import swap_get_batch

    model.zero_grad(set_to_none=True)
    data = iter(training.build_pretraining_data_loader(train_ds, 0))  # the patched (Libra) loader
    sent, planned = [], []

    def make_recorded(original):
        get_batch = hooks.make_get_batch(original)

        def recorded(data_iterator, vp_stage=None):
            *rest, packed = get_batch(data_iterator, vp_stage)
            sent.append(0 if packed.libra_plan is None else sum(packed.libra_plan.bytes_sent))
            planned.append(packed.libra_plan is not None)
            return (*rest, dataclasses.replace(packed, libra_plan=None) if drop_plan else packed)

        return recorded

    saved = {name: vars(pretrain_gpt)[name] for name in ("get_batch", "PackedSeqParams") if name in vars(pretrain_gpt)}
    swap_get_batch(pretrain_gpt.forward_step, make_recorded, active_release())
    try:
        output, loss_fn = pretrain_gpt.forward_step(data, model)
        loss, num_tokens, report = loss_fn(output)
        (loss / num_tokens).backward()
    finally:
        vars(pretrain_gpt).update(saved)
    totals = torch.tensor([float(report["lm loss"][0]), float(report["lm loss"][1]), float(sum(sent)),
                           float(sum(planned))], dtype=torch.float64)
    dist.all_reduce(totals)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))
    return {"loss": float(totals[0] / totals[1]), "grad_norm": norm, "plan_bytes_sent": float(totals[2]),
            "plans": float(totals[3]),
            "params_without_grad": sum(g is None for g in grads),
            "finite": all(bool(torch.isfinite(g).all()) for g in grads if g is not None)}
