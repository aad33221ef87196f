"""Per-rank bodies of the Megatron-LM tests (module level: ``run_distributed`` pickles them by name).

``launched_step``: what ``python -m libra_megatron.launch`` sets up, driven by hand up to the point where
Megatron-LM's ``pretrain`` would need CUDA: hooks installed, Megatron's parse_args/validate_args/global
vars, the (patched) ``initialize_model_parallel`` (=> Libra config check, saved YAML, pool groups,
planner), the model from ``gpt_builders.gpt_builder`` with ``--spec libra_megatron.megatron.spec NAME``,
``pretrain_gpt.train_valid_test_datasets_provider`` (``--data-path``: documents with the real lengths of
the linux-6.12 trace, synthetic tokens), the patched
``build_pretraining_data_loader``, and ``pretrain_gpt.forward_step`` (with its get_batch swapped by the
patch) with its ``loss_func`` over one global batch, forward and backward (microbatch losses scaled as
megatron-core's no-pipelining schedule does; the schedule and the optimizer update are not run).
"""
import contextlib
import sys

from .megatron_lm import put_megatron_lm_on_path, tiny_model_args

SEQ_LEN = 1024
GBS = 4


class RecordingWriter:
    """TensorBoard-writer stand-in: records ``add_scalar`` calls."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        self.scalars[(tag, step)] = float(value)

    def flush(self):
        pass


def _start(world_size, save_dir, spec_name, libra_flags, data_prefix):
    """Hooks installed, args parsed/validated/set globally, model-parallel (+ pool groups) initialised."""
    import torch

    from libra_megatron.testing.cpu_shims import apply_megatron_cpu_shims, use_installed_dataset_helpers

    put_megatron_lm_on_path()
    apply_megatron_cpu_shims()
    use_installed_dataset_helpers()  # a core_v0.19 tree has no compiled dataset helpers of its own
    import libra_megatron.patches as patches
    from megatron.core import parallel_state
    import megatron.training.arguments as arguments
    import megatron.training.initialize as initialize
    from megatron.training.global_vars import set_global_variables

    from libra_megatron.megatron.hooks import LibraHooks

    hooks = LibraHooks()
    patcher = patches.install_all(hooks)
    model_args = [a for a in tiny_model_args() if a != "--mock-data"]
    sys.argv = (["pretrain_gpt.py"] + model_args
                + ["--data-path", data_prefix, "--split", "100,0,0", "--data-cache-path", save_dir + "/cache",
                   "--seq-length", str(SEQ_LEN), "--max-position-embeddings", str(SEQ_LEN),
                   "--global-batch-size", str(GBS), "--save", save_dir, "--save-interval", "1000",
                   "--spec", "libra_megatron.megatron.spec", spec_name] + libra_flags)
    # the (patched) name Megatron-LM's own caller uses: initialize_megatron's (core_v0.16), else
    # parse_and_validate_args' (core_v0.19)
    args = getattr(initialize, "parse_args", arguments.parse_args)()
    args.world_size = world_size
    arguments.validate_args(args, {})
    set_global_variables(args, build_tokenizer=True)
    torch.manual_seed(args.seed)
    parallel_state.initialize_model_parallel(1, 1)  # patched: Libra start-up runs right after it
    return hooks, patcher, args


def _microbatches(loader_iter, count):
    """(tokens, dataset sample index) of the next ``count`` microbatches."""
    items = [next(loader_iter) for _ in range(count)]
    return ([item["tokens"].reshape(-1).tolist() for item in items],
            [int(item["libra_sample_index"].reshape(-1)[0]) for item in items])


CARRIER_VARIANTS = {"sbhd": [], "thd": ["--reset-position-ids"]}


def launched_step(rank, world_size, save_dir, spec_name, libra_flags, data_prefix):
    """Both batch carriers in turn (default positions, then --reset-position-ids); results per carrier."""

    put_megatron_lm_on_path()
    out = {}
    for name, extra in CARRIER_VARIANTS.items():
        hooks, patcher, args = _start(world_size, f"{save_dir}/{name}", spec_name, libra_flags + extra,
                                      data_prefix)
        try:
            out[name] = _step(rank, world_size, hooks, args)
        finally:
            from megatron.core import parallel_state
            from megatron.training.global_vars import unset_global_variables

            parallel_state.destroy_model_parallel()  # patched: closes the planner, destroys pool groups
            unset_global_variables()
            patcher.undo()
    return out


def _step(rank, world_size, hooks, args):
    import torch.distributed as dist

    import gpt_builders
    import megatron.training.global_vars as global_vars
    import megatron.training.training as training
    import pretrain_gpt

    from libra_megatron.megatron.attention import LibraCoreAttention
    from libra_megatron.megatron.groups import get_pool_group
    from libra_megatron.megatron.segments import gpt_sample_segments

    out = {"config": hooks.config.to_dict(), "pool_size": dist.get_world_size(get_pool_group())}
    model = gpt_builders.gpt_builder(args, True, True)
    out["num_libra_attention"] = sum(isinstance(m, LibraCoreAttention) for m in model.modules())

    train_ds, _, _ = pretrain_gpt.train_valid_test_datasets_provider([GBS * 2, 0, 0])
    loader = training.build_pretraining_data_loader(train_ds, 0)  # the patched name training.py calls
    out["loader_type"] = type(loader).__name__
    ga = GBS // world_size
    out["window_tokens"], out["window_sample_index"] = _microbatches(iter(loader), ga)
    out["dataset_window"] = [train_ds[i]["tokens"].reshape(-1).tolist() for i in range(GBS)]
    out["window_segments"] = [gpt_sample_segments(train_ds, i).tolist() for i in range(GBS)]

    with _swapped(pretrain_gpt, hooks.make_get_batch):
        libra_get_batch = getattr(pretrain_gpt.get_batch, "libra_get_batch", pretrain_gpt.get_batch)  # six values
        out["batch"] = _describe_batch(libra_get_batch(iter(training.build_pretraining_data_loader(train_ds, 0)),
                                                       None))
        out["loss_libra"], out["grad_norm_libra"] = _forward_backward(model, pretrain_gpt, train_ds, training, ga)
    with _swapped(pretrain_gpt, lambda original: _without_plan(hooks.make_get_batch(original))):
        out["loss_local"], out["grad_norm_local"] = _forward_backward(model, pretrain_gpt, train_ds, training, ga)

    writer = RecordingWriter()
    global_vars._GLOBAL_TENSORBOARD_WRITER = writer
    args.consumed_train_samples = GBS  # what train() has counted when it logs iteration 1's window
    hooks.after_training_log(7)
    global_vars._GLOBAL_TENSORBOARD_WRITER = None
    out["tensorboard"] = {tag: v for (tag, step), v in writer.scalars.items() if step == 7}
    out["planner_metrics"] = hooks.planner.latest_metrics()
    return out


def _describe_batch(batch):
    tokens, labels, loss_mask, attention_mask, position_ids, packed = batch
    return {
        "tokens": tokens.reshape(-1).tolist(), "labels": labels.reshape(-1).tolist(),
        "position_ids": position_ids.reshape(-1).tolist(), "attention_mask_is_none": attention_mask is None,
        "cu_seqlens": packed.cu_seqlens_q.tolist(), "qkv_format": packed.qkv_format,
        "has_plan": packed.libra_plan is not None, "type": type(packed).__name__,
    }


@contextlib.contextmanager
def _swapped(pretrain_gpt, make_get_batch):
    """The patch point's swap of ``pretrain_gpt``'s globals for this release, undone afterwards."""
    from libra_megatron.patches._base import active_release
    from libra_megatron.patches.get_batch import swap_get_batch

    saved = {name: vars(pretrain_gpt)[name] for name in ("get_batch", "PackedSeqParams") if name in vars(pretrain_gpt)}
    swap_get_batch(pretrain_gpt.forward_step, make_get_batch, active_release())
    try:
        yield
    finally:
        vars(pretrain_gpt).update(saved)


def _forward_backward(model, pretrain_gpt, train_ds, training, num_microbatches):
    """One global batch through pretrain_gpt.forward_step + loss_func; global loss/token and grad norm.

    Microbatch losses are scaled as megatron-core's forward_backward_no_pipelining does (loss / tokens /
    num_microbatches); the schedule itself allocates a ``device="cuda"`` token counter, so it cannot run on CPU.
    """
    import torch
    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    data = iter(training.build_pretraining_data_loader(train_ds, 0))
    loss_sum, tokens = 0.0, 0.0
    for _ in range(num_microbatches):
        output, loss_fn = pretrain_gpt.forward_step(data, model)
        loss, num_tokens, report = loss_fn(output)
        (loss / num_tokens / num_microbatches).backward()
        loss_sum, tokens = loss_sum + float(report["lm loss"][0]), tokens + float(report["lm loss"][1])
    totals = torch.tensor([loss_sum, tokens], dtype=torch.float64)
    dist.all_reduce(totals)
    grads = [p.grad.detach().double().clone() for p in model.parameters() if p.grad is not None]
    for g in grads:
        dist.all_reduce(g)
    norm = float(torch.sqrt(sum((g * g).sum() for g in grads)))
    return float(totals[0] / totals[1]), norm


def _without_plan(get_batch):
    """Same batch, plain per-sample attention: the independent reference of the planned path."""
    import dataclasses

    def plain(data_iterator, vp_stage=None):
        *rest, packed = get_batch(data_iterator, vp_stage)
        return (*rest, dataclasses.replace(packed, libra_plan=None))

    return plain
