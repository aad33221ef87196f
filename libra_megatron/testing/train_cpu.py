"""CPU end-to-end training run: a tiny Qwen3-shaped megatron-core GPTModel on gloo, with and without Libra.

    python -m libra_megatron.testing.train_cpu --compare [--json summary.json]      # scripts/main.sh

It lives in ``testing/`` because it runs megatron-core on CPU through the test harness (``cpu_shims``,
``dist.run_distributed``); product code never imports it.

Model: megatron-core ``GPTModel`` (RoPE, qk-layernorm, GQA, RMSNorm, SwiGLU, tied embeddings) built from
``spec.libra_local_qk_spec`` -- so every core attention is ``LibraCoreAttention`` in both runs.
Data (``--data``): a real corpus in Megatron's indexed format (``megatron/corpus.py``), a megatron-core
``GPTDataset`` over it, and per-sample document segments from ``segments.gpt_sample_segments``:
    trace    (default) documents of the real lengths of a shipped trace (``--trace``, Wikipedia: median
             347 tokens, tail to 1.8M), each length times ``--doc-scale``, filled with real text: the Python
             stdlib's Qwen2 tokens (``--tokens stdlib``) or seeded synthetic ids (``--tokens synthetic``).
             At L = 2048 most documents are shorter than a sequence while a few fill whole sequences, so
             sequences differ widely in attention work (sum of l^2): VRSP and TAP both have work to do.
    stdlib   the stdlib files themselves as documents.

Every rank reads its microbatches through ``sampler.LibraGlobalBatchSampler`` + ``LibraPoolDataset``
(window v = dataset indices [v*GBS, (v+1)*GBS), Megatron's "single" order) and shards them with
``batch.build_libra_batch``. The two modes differ only in placement and attention execution:
    libra     the sampler's VRSP (sync: lane totals, then each lane's microbatches) reorders the window's sequences into
              pools of P consecutive DP ranks; each pool's SH-Tiles are placed by TAP (Algorithm 2) in the
              background planner; LibraCoreAttention executes the plan with ``libra_attn_func``.
    baseline  sampler with sequence_placement=contiguous and P = 1 (Megatron's order), no pools; CP = 1:
              plain per-sample causal attention (no plan); CP > 1: the same operator with a P = 1,
              tile_placement=home plan (plain CP attention).
Loss: sum of per-token losses over the whole global batch / its total loss tokens, so reordering the
window cannot change it. Gradients of the summed loss are all-reduced (sum) over all DP x CP ranks with the
loss-token count, then divided by it. Optimizer: Adam (fp32).

Shapes per microbatch (mbs = 1, L = --seq-len, t = L / CP): tokens/labels/position_ids (1, t) int64,
loss_mask (1, t) float32, model output: per-token loss (1, t) float32.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..plan.model import DEFAULT_INTER_NODE_GBPS
from ..plan.traces import find_trace
from .train_data import PreparedData, open_dataset, prepare_data
from .train_report import PARITY_RTOL, compare_runs, parity_ok, print_run, print_summary, summarize

__all__ = ["RunConfig", "PreparedData", "prepare_data", "run_training", "compare_runs", "summarize", "parity_ok",
           "PARITY_RTOL", "main"]

DEFAULT_TRACE = "wikipedia-flexsp.txt"  # resolved with plan.traces.find_trace


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs; the same record is sent to every rank. Defaults: the main job."""

    dp: int = 4
    cp: int = 1
    pool_size: int = 2
    steps: int = 20
    seq_len: int = 2048
    grad_accum: int = 2  # microbatches per DP rank per step (mbs = 1): GBS = dp * grad_accum
    libra: bool = True
    seed: int = 1234
    lr: float = 1e-3
    num_layers: int = 2
    hidden: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_split: int = 2
    num_chunks: int = 2
    block_size: int = 256
    tau: float = 0.03
    vocab: int = 1024  # model vocabulary: corpus ids are remapped to the vocab-1 most frequent + UNK
    token_layout: str = "zigzag"
    data: str = "trace"  # trace | stdlib
    tokens: str = "stdlib"  # trace documents filled with: stdlib (real text) | synthetic
    doc_scale: float = 1.0  # trace lengths are multiplied by this (rounded, >= 1 token)
    workdir: str = ""  # corpus + index cache ("" = $TMPDIR/libra_train_cpu)
    trace: str = DEFAULT_TRACE
    max_files: Optional[int] = 400  # stdlib: first N .py files (None = all)
    max_docs: Optional[int] = 6000  # trace: first N documents
    kv_relay: str = "off"  # Libra runs: the K/V relay between nodes (off | auto)
    gpus_per_node: int = 0  # > 0: the planner prices the pool as ranks // gpus_per_node nodes (0: one node)
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS  # the planner's inter-node rate when gpus_per_node > 0

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    @property
    def global_batch(self) -> int:
        return self.dp * self.grad_accum

    def libra_config(self):
        from ..config import LibraConfig, SequencePlacement, TilePlacement

        on = self.libra
        values = dict(
            pool_size=self.pool_size if on else 1, head_split=self.head_split, block_size=self.block_size,
            num_chunks=self.num_chunks, tau=self.tau,
            sequence_placement=SequencePlacement.SYNC if on else SequencePlacement.CONTIGUOUS,
            tile_placement=TilePlacement.ALG2 if on else TilePlacement.HOME, kernel_backend="torch",
            token_layout=self.token_layout, kv_relay=self.kv_relay if on else "off",
        )
        return LibraConfig.from_flags(values, _CONFIG_FLAGS).validate(
            num_attention_heads=self.num_heads, num_query_groups=self.num_kv_heads, data_parallel_size=self.dp,
            context_parallel_size=self.cp, seq_length=self.seq_len, global_batch_size=self.global_batch)


_CONFIG_FLAGS = {key: "--" + key.replace("_", "-") for key in ("pool_size", "head_split", "block_size", "num_chunks")}


def _window_metrics(cfg: RunConfig, sampler, window: int) -> Dict[str, float]:
    """Inter-pool R-1 of the window at the Libra pool size: sampler order (before) vs this run's order."""
    from ..megatron.metrics import inter_pool_metrics

    pre = sampler.window_indices(window).tolist()
    run = sampler.plan_window(window)
    where = {int(s): i for i, s in enumerate(pre)}
    order = np.array([where[int(s)] for s in run.sample_indices], dtype=np.int64)
    segments = [None] * len(pre)
    for i, seg in zip(order.tolist(), run.segments):
        segments[i] = seg
    return inter_pool_metrics(segments, order, cfg.pool_size, cfg.dp)


# =============================================================================== per-rank training
def _tiny_qwen3_config(cfg: RunConfig):
    import torch
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden, num_attention_heads=cfg.num_heads,
        num_query_groups=cfg.num_kv_heads, kv_channels=cfg.hidden // cfg.num_heads, ffn_hidden_size=2 * cfg.hidden,
        normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
        attention_dropout=0.0, hidden_dropout=0.0, persist_layer_norm=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, context_parallel_size=cfg.cp, params_dtype=torch.float32, layernorm_epsilon=1e-6,
    )


def _build_model(cfg: RunConfig):
    import torch
    from megatron.core.models.gpt import GPTModel

    from ..megatron.spec import libra_local_qk_spec

    torch.manual_seed(cfg.seed)  # identical init on every rank and in both modes
    return GPTModel(config=_tiny_qwen3_config(cfg), transformer_layer_spec=libra_local_qk_spec,
                    vocab_size=cfg.vocab, max_sequence_length=cfg.seq_len, position_embedding_type="rope",
                    rotary_base=1000000, share_embeddings_and_output_weights=True)


class _Rank:
    """Per-process state of one run: groups, sampler, planner, model, optimizer."""

    def __init__(self, cfg: RunConfig, data: PreparedData):
        import torch
        from megatron.core import parallel_state as ps

        from ..megatron import groups
        from ..megatron.planner import BackgroundPlanner
        from ..megatron.sampler import LibraGlobalBatchSampler, LibraPoolDataset
        from ..plan.layout import HeadLayout, TokenLayout
        from .cpu_shims import apply_megatron_cpu_shims

        apply_megatron_cpu_shims()
        ps.initialize_model_parallel(1, 1, context_parallel_size=cfg.cp)
        self.cfg, self.lib, self.remap = cfg, cfg.libra_config(), torch.from_numpy(data.remap)
        groups.initialize_pool_groups(self.lib.pool_size, relay=self.lib.kv_relay.value == "auto")
        self.dp_rank, self.cp_rank = ps.get_data_parallel_rank(), ps.get_context_parallel_rank()
        dataset = open_dataset(cfg, data.info)
        self.sampler = LibraGlobalBatchSampler(
            dataset, len(dataset), 0, 1, cfg.global_batch, self.dp_rank, cfg.dp, self.lib.pool_size,
            self.lib.sequence_placement, "single", cfg.seed)
        self.keys = iter(self.sampler)
        self.samples = LibraPoolDataset(dataset)
        layout = TokenLayout(self.lib.token_layout, cfg.seq_len, cfg.cp)
        heads = HeadLayout(cfg.num_heads, cfg.num_kv_heads, cfg.hidden // cfg.num_heads, self.lib.head_split,
                           self.lib.num_chunks, elem_bytes=4)
        self.planner = None
        if cfg.libra or cfg.cp > 1:  # plans also run plain CP attention in the CP > 1 baseline
            # in a thread: this harness proves semantics with several ranks per core, where a planner process per
            # rank would only add processes; Megatron-LM runs plan in processes (test_pretrain_loop.py)
            self.planner = BackgroundPlanner(self.lib, layout, heads, worker=groups.get_pool_rank(),
                                             timing=_pool_nodes_timing(cfg, heads.head_dim), mode="thread")
            self.planner.warm_up()
        self.planned_keys: set = set()  # pools this rank has used before (a repeat is served from the cache)
        self.model = _build_model(cfg)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=cfg.lr)

    def close(self) -> None:
        from megatron.core import parallel_state as ps

        from ..megatron import groups

        if self.planner is not None:
            self.planner.close()
        groups.destroy_pool_groups()
        ps.destroy_model_parallel()

    # ------------------------------------------------------------------ one step
    def next_keys(self) -> list:
        """This rank's GA microbatch keys of the next window; handed to the planner at once (look-ahead)."""
        keys = [next(self.keys)[0] for _ in range(self.cfg.grad_accum)]
        if self.planner is not None:
            self.planner.submit_many([k.pool_segments for k in keys])
        return keys

    def step(self, keys: list, next_keys=None) -> Dict[str, object]:
        """One optimizer step over ``keys``; ``next_keys()`` is called after the first microbatch is planned."""
        import torch

        self.optimizer.zero_grad(set_to_none=False)
        loss_sum, num_tokens, waits, planned, upcoming = 0.0, 0.0, [], [], None
        for ga, key in enumerate(keys):
            plan, wait, pool = self._plan_for(key)
            waits.append(wait)
            if pool is not None:
                planned.append(pool)
            if ga == 0 and next_keys is not None:
                upcoming = next_keys()  # the next step plans while this one computes
            loss, tokens = self._forward_backward(key, plan, getattr(pool, "save_mode", None))
            loss_sum, num_tokens = loss_sum + loss, num_tokens + tokens
        totals = torch.tensor([loss_sum, num_tokens], dtype=torch.float64)
        torch.distributed.all_reduce(totals)
        grad_norm = self._allreduce_grads(float(totals[1]))
        self.optimizer.step()
        return {"loss": float(totals[0] / totals[1]), "grad_norm": grad_norm, "loss_tokens": float(totals[1]),
                "samples": [k.sample_index for k in keys], "cp_rank": self.cp_rank, "window": keys[0].window,
                "planner_wait_s": float(np.sum(waits)), "pool_plans": planned, "next_keys": upcoming}

    def _plan_for(self, key):
        """(RankPlan or None, seconds blocked in the planner, PlannedPool or None) of one microbatch."""
        plan, planned, wait = None, None, 0.0
        if self.planner is not None:
            start = time.perf_counter()
            planned = self.planner.get_pool(key.pool_segments)
            wait = time.perf_counter() - start
            plan = planned.pool_plan.exchange.for_rank(key.pool_position * self.cfg.cp + self.cp_rank)
        return plan, wait, planned

    def _forward_backward(self, key, plan, save_mode=None):
        """Forward + backward of the summed per-token loss of one microbatch; (loss sum, loss tokens)."""
        from ..megatron.batch import LibraPackedSeqParams, build_libra_batch
        from ..megatron.sampler import decode_pool_segments

        sample = self.samples[key]
        pool_segs = decode_pool_segments(sample["libra_pool_segments"])
        position = int(sample["libra_pool_position"])
        batch = build_libra_batch(sample, pool_segs[position], self.cfg.cp, self.cp_rank, self.lib.token_layout)
        cu = batch["cu_seqlens"] if self.cfg.cp == 1 else None  # CP > 1 always runs a plan
        carrier = LibraPackedSeqParams(  # sbhd: RoPE over packed-sequence positions, CP-sliced by megatron-core
            qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=self.cfg.seq_len,
            max_seqlen_kv=self.cfg.seq_len, libra_plan=plan, libra_pool_segments=pool_segs, libra_position=position,
            libra_kernel_backend=self.lib.kernel_backend.value,
            libra_save_mode=None if save_mode is None else save_mode.value)
        tokens, labels = (self.remap[batch[k].clamp(0, self.remap.numel() - 1)] for k in ("tokens", "labels"))
        per_token = self.model(tokens, batch["position_ids"], None, labels=labels, packed_seq_params=carrier)
        mask = batch["loss_mask"]
        loss_sum = (per_token.float() * mask).sum()
        loss_sum.backward()
        return float(loss_sum.detach()), float(mask.sum())

    def _allreduce_grads(self, total_tokens: float) -> float:
        """Sum gradients over all ranks, divide by the global loss-token count; returns the global grad norm."""
        import torch

        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        torch.distributed.all_reduce(flat)
        flat /= total_tokens
        offset = 0
        for p in self.params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
        return float(flat.double().norm())


def _rank_main(rank: int, world: int, cfgs: tuple, data: PreparedData) -> List[List[dict]]:
    """Body of every rank: train each config of ``cfgs`` in turn (fresh groups, model and optimizer)."""
    import torch

    torch.use_deterministic_algorithms(True)
    return [_train_one(cfg, data) for cfg in cfgs]


def _train_one(cfg: RunConfig, data: PreparedData) -> List[dict]:
    """Train ``cfg.steps`` steps on this rank; per-step records (loss/metrics are global, same on all ranks)."""
    state = _Rank(cfg, data)
    try:
        keys, records = state.next_keys(), []
        for s in range(cfg.steps):
            start = time.perf_counter()
            out = state.step(keys, state.next_keys if s + 1 < cfg.steps else None)
            out["step_s"] = time.perf_counter() - start
            out.update(_window_metrics(cfg, state.sampler, out["window"]))
            out.update(_pool_metrics(cfg, out.pop("pool_plans"), state.planned_keys))
            keys = out.pop("next_keys")
            records.append(out)
        return records
    finally:
        state.close()


def _pool_nodes_timing(cfg: RunConfig, head_dim: int):
    """The planner's time model with the pool's ranks on nodes of ``cfg.gpus_per_node`` (None: one node)."""
    if cfg.gpus_per_node < 1:
        return None
    from ..megatron import groups
    from ..plan.model import StepTimeModel

    nodes = tuple(r // cfg.gpus_per_node for r in groups.get_pool_ranks())
    return StepTimeModel(head_dim, gpus_per_node=cfg.gpus_per_node, worker_nodes=nodes,
                         inter_node_gbps=cfg.inter_node_gbps)


def _pool_metrics(cfg: RunConfig, planned: list, seen: set) -> Dict[str, object]:
    """This step's pools: intra-pool max/mean at the Q-homes vs placed (worst pool), attention bytes moved in
    the step, and planner latency of the pools planned for this step.

    ``planner_latency_s`` is the worst latency over ranks of the plans this step computed; a pool whose
    segments repeat an earlier step's is served from the planner's cache (no planning) and counted in
    ``pools_reused`` instead (at L = 256 nearly every pool is [[256], [256]], which is why the old table
    repeated one latency). ``plan_latencies_ms``: this rank's fresh plans, for the run's median.
    """
    import torch

    from ..megatron.metrics import pool_plan_metrics

    rows = [pool_plan_metrics(p.pool_plan, p.latency_s) for p in planned]
    fresh = []
    for pool in planned:
        if pool.key not in seen:
            fresh.append(pool.latency_s)
            seen.add(pool.key)
    keys = ("intra_pool_max_over_mean_home", "intra_pool_max_over_mean_placed")
    local = torch.tensor([max((r[k] for r in rows), default=0.0) for k in keys] + [max(fresh, default=0.0)],
                         dtype=torch.float64)
    torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX)
    out: Dict[str, object] = {k: float(v) for k, v in zip(keys + ("planner_latency_s",), local.tolist())}
    # Forward sends q + kv + o (Eq. 8 volumes), backward the same sizes (dO, dQ, dK|dV), in every layer.
    moved = torch.tensor([sum(r["bytes_q"] + r["bytes_kv"] + r["bytes_o"] for r in rows),
                          len(planned) - len(fresh)], dtype=torch.float64)
    torch.distributed.all_reduce(moved)  # every pool is seen by its P*CP workers
    workers = max(1, cfg.libra_config().pool_size * cfg.cp)
    out["bytes_per_step"] = 2 * cfg.num_layers * float(moved[0]) / workers
    out["pools_reused"] = int(round(float(moved[1]) / workers))
    out["relayed_plans"] = sum(p.pool_plan.exchange.relay_units is not None for p in planned)  # this rank's
    out["plan_latencies_ms"] = [1e3 * x for x in fresh]
    return out


# =============================================================================== driver
def run_training(cfgs: Sequence[RunConfig], data: PreparedData, timeout: float = 900.0) -> List[List[List[dict]]]:
    """Spawn one gloo job and train every config in it (same world size); ``result[cfg][rank][step]``."""
    from .dist import run_distributed

    cfgs = tuple(cfgs)
    if len({c.world_size for c in cfgs}) != 1:
        raise ValueError(f"run_training: all configs need one world size, got {[c.world_size for c in cfgs]}")
    per_rank = run_distributed(_rank_main, cfgs[0].world_size, cfgs, data, timeout=timeout)
    return [[per_rank[r][i] for r in range(len(per_rank))] for i in range(len(cfgs))]


TOOL = "libra-train-cpu"


def parse_args(argv: Optional[Sequence[str]] = None):
    from ..cli import ArgumentParser, add_debug_argument

    d = RunConfig()
    p = ArgumentParser(prog=TOOL, description=__doc__.split("\n")[0], allow_abbrev=False)
    for flag, value in (("--dp", d.dp), ("--cp", d.cp), ("--pool-size", d.pool_size), ("--steps", d.steps),
                        ("--seq-len", d.seq_len), ("--grad-accum", d.grad_accum), ("--head-split", d.head_split),
                        ("--num-chunks", d.num_chunks), ("--block-size", d.block_size), ("--vocab", d.vocab),
                        ("--seed", d.seed)):
        p.add_argument(flag, type=int, default=value)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--data", choices=("trace", "stdlib"), default=d.data)
    p.add_argument("--tokens", choices=("stdlib", "synthetic"), default=d.tokens,
                   help="what fills the trace's documents: real stdlib text or seeded synthetic ids")
    p.add_argument("--doc-scale", type=float, default=d.doc_scale, help="trace lengths are multiplied by this")
    p.add_argument("--trace", default=d.trace, help="trace corpus: a file, or a name in data/traces")
    p.add_argument("--max-docs", type=int, default=d.max_docs, help="trace corpus: first N documents")
    p.add_argument("--max-files", type=int, default=d.max_files, help="stdlib corpus: first N .py files (0 = all)")
    p.add_argument("--workdir", default="", help="corpus and index cache (default $TMPDIR/libra_train_cpu)")
    p.add_argument("--baseline", action="store_true", help="run only the baseline (no VRSP, no pools)")
    p.add_argument("--compare", action="store_true", help="run Libra and the baseline, print parity")
    p.add_argument("--json", default=None, help="write the closing summary (Libra run + parity) to this file")
    add_debug_argument(p)
    return p.parse_args(argv)


def _check_args(args) -> None:
    """Before anything is built: counts are positive, the trace and the work folder are usable."""
    from ..paths import check_input_file, check_output_dir

    for flag in ("dp", "cp", "pool_size", "steps", "seq_len", "grad_accum", "head_split", "num_chunks",
                 "block_size", "vocab", "max_docs"):
        value = getattr(args, flag)
        if value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    for flag in ("lr", "doc_scale"):
        value = getattr(args, flag)
        if not (value > 0 and value < float("inf")):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number > 0, got {value!r}")
    if args.data == "trace":
        path = args.trace if os.path.sep in args.trace or os.path.exists(args.trace) else find_trace(args.trace)
        check_input_file(path, f"--trace {args.trace}")
    if args.workdir:
        check_output_dir(args.workdir, f"--workdir {args.workdir}")
    if args.baseline and args.json:
        raise ValueError("--json summarises a Libra run; drop --baseline")


def _config_from_args(args) -> RunConfig:
    return RunConfig(dp=args.dp, cp=args.cp, pool_size=args.pool_size, steps=args.steps, seq_len=args.seq_len,
                     grad_accum=args.grad_accum, head_split=args.head_split, num_chunks=args.num_chunks,
                     block_size=args.block_size, vocab=args.vocab, lr=args.lr, seed=args.seed,
                     libra=not args.baseline, data=args.data, tokens=args.tokens, doc_scale=args.doc_scale,
                     workdir=args.workdir, trace=args.trace, max_files=args.max_files or None,
                     max_docs=args.max_docs)


def run(argv: Optional[Sequence[str]] = None) -> int:
    """The CPU training run: 0, or 1 when parity fails; bad flags raise ValueError naming the flag
    (``main`` prints one line, exit 2)."""
    args = parse_args(argv)
    _check_args(args)
    cfg = _config_from_args(args)
    cfg.libra_config()  # validate flags before building anything
    started = time.perf_counter()
    data = prepare_data(cfg)
    print(f"data: {data.description}; corpus {data.info.num_documents} docs / {data.info.num_tokens} tokens; "
          f"{cfg.steps} steps x GBS {cfg.global_batch} x L {cfg.seq_len} ({time.perf_counter() - started:.1f}s)")
    print(f"config: {asdict(cfg)}")
    names = ["baseline"] if args.baseline else (["libra", "baseline"] if args.compare else ["libra"])
    start = time.perf_counter()
    results = run_training([replace(cfg, libra=(n == "libra")) for n in names], data)
    print(f"trained {len(names)} run(s) in one {cfg.world_size}-rank gloo job: {time.perf_counter() - start:.1f}s")
    runs = dict(zip(names, results))
    for name, per_rank in runs.items():
        print_run(name, per_rank[0])
    if "libra" not in runs:
        return 0
    parity = compare_runs(runs["libra"], runs["baseline"]) if "baseline" in runs else None
    summary = summarize(runs["libra"], parity)
    summary.update(wall_s=time.perf_counter() - started, data=data.description, config=asdict(cfg))
    print_summary(summary)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=1)
        print(f"summary written to {args.json}")
    return 0 if parity is None or summary["parity_ok"] else 1


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m libra_megatron.testing.train_cpu`` (``scripts/main.sh``): exit 2 with one line on bad input."""
    from ..cli import run_cli

    run_cli(TOOL, run, argv)


if __name__ == "__main__":
    main()
