"""CPU end-to-end training run: a tiny Qwen3-shaped megatron-core GPTModel on gloo, with and without Libra.

    python -m libra_megatron.megatron.train_cpu --dp 4 --pool-size 2 --steps 20 --seq-len 256 --compare

Model: megatron-core ``GPTModel`` (RoPE, qk-layernorm, GQA, RMSNorm, SwiGLU, tied embeddings) built from
``spec.libra_local_qk_spec`` -- so every core attention is ``LibraCoreAttention`` in both runs.
Data: a real corpus in Megatron's indexed format (``corpus.py``: the Python stdlib tokenized with the
Qwen2 BPE, or document lengths of a real trace with synthetic tokens), a megatron-core ``GPTDataset``
over it, and per-sample document segments from ``segments.gpt_sample_segments`` (index metadata only).

Every rank reads its microbatches through ``sampler.LibraGlobalBatchSampler`` + ``LibraPoolDataset``
(window v = dataset indices [v*GBS, (v+1)*GBS), Megatron's "single" order) and shards them with
``batch.build_libra_batch``. The two modes differ only in placement and attention execution:
    libra     the sampler's VRSP (Algorithm 1 + refinement) reorders the window's sequences into
              pools of P consecutive DP ranks; each pool's SH-Tiles are placed by TAP (Algorithm 2) in the
              background planner; LibraCoreAttention executes the plan with ``libra_attn_func``.
    baseline  sampler with sequence_placement=contiguous and P = 1 (Megatron's order), no pools; CP = 1: plain per-sample causal attention (no plan);
              CP > 1: the same operator with a P = 1, tile_placement=home plan (plain CP attention).
Loss: sum of per-token losses over the whole global batch / its total loss tokens, so reordering the
window cannot change it. Gradients of the summed loss are all-reduced (sum) over all DP x CP ranks with the
loss-token count, then divided by it. Optimizer: Adam (fp32).

Shapes per microbatch (mbs = 1, L = --seq-len, t = L / CP): tokens/labels/position_ids (1, t) int64,
loss_mask (1, t) float32, model output: per-token loss (1, t) float32.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..plan.traces import find_trace

__all__ = ["RunConfig", "PreparedData", "prepare_data", "run_training", "compare_runs", "main"]

DEFAULT_TRACE = "wikipedia-flexsp.txt"  # resolved with plan.traces.find_trace
PARITY_RTOL = 1e-4  # fp32: per-step loss and grad norm of Libra vs baseline, relative


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs; the same record is sent to every rank."""

    dp: int = 4
    cp: int = 1
    pool_size: int = 2
    steps: int = 10
    seq_len: int = 256
    grad_accum: int = 2  # microbatches per DP rank per step (mbs = 1): GBS = dp * grad_accum
    libra: bool = True
    seed: int = 1234
    lr: float = 1e-3
    num_layers: int = 2
    hidden: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_split: int = 2
    num_chunks: int = 1
    block_size: int = 64
    tau: float = 0.03
    vocab: int = 1024  # model vocabulary: corpus ids are remapped to the vocab-1 most frequent + UNK
    token_layout: str = "zigzag"
    data: str = "stdlib"  # stdlib | trace
    workdir: str = ""  # corpus + index cache ("" = $TMPDIR/libra_train_cpu)
    trace: str = DEFAULT_TRACE
    max_files: Optional[int] = None  # stdlib: first N .py files
    max_docs: Optional[int] = 20000  # trace: first N documents

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
            sequence_placement=SequencePlacement.REFINED if on else SequencePlacement.CONTIGUOUS,
            tile_placement=TilePlacement.ALG2 if on else TilePlacement.HOME, kernel_backend="torch",
            token_layout=self.token_layout,
        )
        return LibraConfig.from_flags(values, _CONFIG_FLAGS).validate(
            num_attention_heads=self.num_heads, num_query_groups=self.num_kv_heads, data_parallel_size=self.dp,
            context_parallel_size=self.cp, seq_length=self.seq_len, global_batch_size=self.global_batch)


_CONFIG_FLAGS = {key: "--" + key.replace("_", "-") for key in ("pool_size", "head_split", "block_size", "num_chunks")}


@dataclass(frozen=True, eq=False)
class PreparedData:
    """Built once in the parent: the corpus on disk and the corpus-id -> model-id table (int64)."""

    info: object  # corpus.CorpusInfo
    remap: np.ndarray


# =============================================================================== data
def prepare_data(cfg: RunConfig) -> PreparedData:
    """Build the corpus and the GPTDataset indices once (ranks then hit the caches).

    data="stdlib": the Python stdlib, Qwen2-tokenized, ids remapped to ``cfg.vocab`` (the vocab-1 most
    frequent + UNK). data="trace": real document lengths (first ``max_docs`` of ``trace``) with synthetic
    ids in [0, cfg.vocab), EOD = vocab-1.
    """
    from . import corpus

    workdir = cfg.workdir or os.path.join(tempfile.gettempdir(), "libra_train_cpu")
    if cfg.data == "stdlib":
        info = corpus.build_indexed_dataset_from_python_stdlib(os.path.join(workdir, "stdlib"), max_files=cfg.max_files)
    elif cfg.data == "trace":
        trace = cfg.trace if os.path.isfile(cfg.trace) else find_trace(cfg.trace)
        name = os.path.splitext(os.path.basename(trace))[0]
        info = corpus.build_indexed_dataset_from_trace(trace, os.path.join(workdir, f"trace-{name}-v{cfg.vocab}"),
                                                       vocab_size=cfg.vocab, eod=cfg.vocab - 1, seed=cfg.seed,
                                                       max_docs=cfg.max_docs)
    else:
        raise ValueError(f"--data must be 'stdlib' or 'trace', got {cfg.data!r}")
    _open_dataset(cfg, info)
    return PreparedData(info, _vocab_remap(info, cfg.vocab))


def _open_dataset(cfg: RunConfig, info):
    from . import corpus

    return corpus.build_gpt_dataset(info.prefix, cfg.seq_len, cfg.steps * cfg.global_batch, seed=cfg.seed,
                                    vocab_size=info.vocab_size, eod=info.eod)


def _vocab_remap(info, vocab: int) -> np.ndarray:
    """int64 lookup corpus id -> model id: the ``vocab-1`` most frequent corpus ids keep a rank, the rest UNK.

    Keeps the tiny model's embedding small while training on the real token stream; EOD is always kept.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if info.vocab_size <= vocab:
        return np.arange(info.vocab_size, dtype=np.int64)
    counts = np.zeros(info.vocab_size, dtype=np.int64)
    ds = IndexedDataset(info.prefix)
    for i in range(len(ds)):
        counts += np.bincount(np.asarray(ds[i], dtype=np.int64), minlength=info.vocab_size)
    counts[info.eod] = counts.max() + 1
    keep = np.argsort(-counts, kind="stable")[: vocab - 1]
    remap = np.full(info.vocab_size, vocab - 1, dtype=np.int64)
    remap[keep] = np.arange(keep.size, dtype=np.int64)
    return remap


def _window_metrics(cfg: RunConfig, sampler, window: int) -> Dict[str, float]:
    """Inter-pool R-1 of the window at the Libra pool size: sampler order (before) vs this run's order."""
    from .metrics import inter_pool_metrics

    pre = sampler.window_indices(window).tolist()
    run = sampler.plan_window(window)
    where = {int(s): i for i, s in enumerate(pre)}
    order = np.array([where[int(s)] for s in run.sample_indices], dtype=np.int64)
    segments = [None] * len(pre)
    for i, seg in zip(order.tolist(), run.segments):
        segments[i] = seg
    return inter_pool_metrics(segments, order, cfg.pool_size)


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
        apply_rope_fusion=False, context_parallel_size=cfg.cp, params_dtype=torch.float32,
    )


def _build_model(cfg: RunConfig):
    import torch
    from megatron.core.models.gpt import GPTModel

    from .spec import libra_local_qk_spec

    torch.manual_seed(cfg.seed)  # identical init on every rank and in both modes
    return GPTModel(config=_tiny_qwen3_config(cfg), transformer_layer_spec=libra_local_qk_spec,
                    vocab_size=cfg.vocab, max_sequence_length=cfg.seq_len, position_embedding_type="rope",
                    rotary_base=1000000, share_embeddings_and_output_weights=True)


class _Rank:
    """Per-process state of one run: groups, sampler, planner, model, optimizer."""

    def __init__(self, cfg: RunConfig, data: PreparedData):
        import torch
        from megatron.core import parallel_state as ps

        from ..plan.layout import HeadLayout, TokenLayout
        from ..testing.cpu_shims import apply_megatron_cpu_shims
        from . import groups
        from .planner import BackgroundPlanner
        from .sampler import LibraGlobalBatchSampler, LibraPoolDataset

        apply_megatron_cpu_shims()
        ps.initialize_model_parallel(1, 1, context_parallel_size=cfg.cp)
        self.cfg, self.lib, self.remap = cfg, cfg.libra_config(), torch.from_numpy(data.remap)
        groups.initialize_pool_groups(self.lib.pool_size)
        self.dp_rank, self.cp_rank = ps.get_data_parallel_rank(), ps.get_context_parallel_rank()
        dataset = _open_dataset(cfg, data.info)
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
            self.planner = BackgroundPlanner(self.lib, layout, heads, worker=groups.get_pool_rank())
            self.planner.warm_up()
        self.model = _build_model(cfg)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=cfg.lr)

    def close(self) -> None:
        from megatron.core import parallel_state as ps

        from . import groups

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
            loss, tokens = self._forward_backward(key, plan)
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

    def _forward_backward(self, key, plan):
        """Forward + backward of the summed per-token loss of one microbatch; (loss sum, loss tokens)."""
        from .batch import LibraPackedSeqParams, build_libra_batch
        from .sampler import decode_pool_segments

        sample = self.samples[key]
        pool_segs = decode_pool_segments(sample["libra_pool_segments"])
        position = int(sample["libra_pool_position"])
        batch = build_libra_batch(sample, pool_segs[position], self.cfg.cp, self.cp_rank, self.lib.token_layout)
        cu = batch["cu_seqlens"] if self.cfg.cp == 1 else None  # CP > 1 always runs a plan
        carrier = LibraPackedSeqParams(  # sbhd: RoPE over packed-sequence positions, CP-sliced by megatron-core
            qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=self.cfg.seq_len,
            max_seqlen_kv=self.cfg.seq_len, libra_plan=plan, libra_pool_segments=pool_segs, libra_position=position)
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
            out.update(_pool_metrics(cfg, out.pop("pool_plans")))
            keys = out.pop("next_keys")
            records.append(out)
        return records
    finally:
        state.close()


def _pool_metrics(cfg: RunConfig, planned: list) -> Dict[str, float]:
    """Intra-pool max/mean at the Q-homes vs placed and planner latency (worst over all pools), bytes/layer."""
    import torch

    from .metrics import pool_plan_metrics

    rows = [pool_plan_metrics(p.pool_plan, p.latency_s) for p in planned]
    keys = ("intra_pool_max_over_mean_home", "intra_pool_max_over_mean_placed", "planner_latency_s")
    local = torch.tensor([max((r[k] for r in rows), default=0.0) for k in keys], dtype=torch.float64)
    torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX)
    out = {k: float(v) for k, v in zip(keys, local.tolist())}
    moved = torch.tensor([sum(r["bytes_q"] + r["bytes_kv"] + r["bytes_o"] for r in rows)], dtype=torch.float64)
    torch.distributed.all_reduce(moved)  # every pool's total is seen by its P*CP workers
    out["bytes_per_layer"] = float(moved[0]) / max(1, cfg.libra_config().pool_size * cfg.cp)
    return out


# =============================================================================== driver
def run_training(cfgs: Sequence[RunConfig], data: PreparedData, timeout: float = 900.0) -> List[List[List[dict]]]:
    """Spawn one gloo job and train every config in it (same world size); ``result[cfg][rank][step]``."""
    from ..testing.dist import run_distributed

    cfgs = tuple(cfgs)
    if len({c.world_size for c in cfgs}) != 1:
        raise ValueError(f"run_training: all configs need one world size, got {[c.world_size for c in cfgs]}")
    per_rank = run_distributed(_rank_main, cfgs[0].world_size, cfgs, data, timeout=timeout)
    return [[per_rank[r][i] for r in range(len(per_rank))] for i in range(len(cfgs))]


def compare_runs(libra: List[List[dict]], base: List[List[dict]]) -> Dict[str, float]:
    """Max relative loss / grad-norm differences over steps, and whether every step's sample multiset matches."""
    a, b = libra[0], base[0]
    rel = lambda x, y: abs(x - y) / max(abs(y), 1e-30)  # noqa: E731
    def multiset(run, i):  # one entry per DP replica: its CP ranks share the sample
        return sorted(s for rank in run if rank[i]["cp_rank"] == 0 for s in rank[i]["samples"])

    same = all(multiset(libra, i) == multiset(base, i) for i in range(len(a)))
    return {"max_rel_loss": max(rel(x["loss"], y["loss"]) for x, y in zip(a, b)),
            "max_rel_grad_norm": max(rel(x["grad_norm"], y["grad_norm"]) for x, y in zip(a, b)),
            "same_step_multisets": float(same), "steps": float(len(a))}


def _print_run(name: str, records: List[dict]) -> None:
    print(f"== {name}")
    print("step  loss        grad_norm   inter R-1 before -> after  intra max/mean home -> placed  "
          "KB/layer  plan_ms  wait_ms  step_s")
    for i, r in enumerate(records):
        print(f"{i:4d}  {r['loss']:.8f}  {r['grad_norm']:.8f}  {r['inter_pool_r1_before']:8.4f} -> "
              f"{r['inter_pool_r1_after']:7.4f}      {r['intra_pool_max_over_mean_home']:8.4f} -> "
              f"{r['intra_pool_max_over_mean_placed']:7.4f}       {r['bytes_per_layer'] / 1024:7.1f}  "
              f"{1e3 * r['planner_latency_s']:7.2f}  {1e3 * r['planner_wait_s']:7.2f}  {r['step_s']:6.2f}")


TOOL = "libra-train-cpu"


def parse_args(argv: Optional[Sequence[str]] = None):
    from ..cli import ArgumentParser, add_debug_argument

    p = ArgumentParser(prog=TOOL, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--pool-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--head-split", type=int, default=2)
    p.add_argument("--num-chunks", type=int, default=1)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", choices=("stdlib", "trace"), default="stdlib")
    p.add_argument("--max-files", type=int, default=400, help="stdlib corpus: first N .py files (0 = all)")
    p.add_argument("--trace", default=DEFAULT_TRACE, help="trace corpus: document-length file")
    p.add_argument("--max-docs", type=int, default=20000, help="trace corpus: first N documents")
    p.add_argument("--workdir", default="", help="corpus and index cache (default $TMPDIR/libra_train_cpu)")
    p.add_argument("--baseline", action="store_true", help="run only the baseline (no VRSP, no pools)")
    p.add_argument("--compare", action="store_true", help="run Libra and the baseline, print parity")
    add_debug_argument(p)
    return p.parse_args(argv)


def _check_args(args) -> None:
    """Before anything is built: counts are positive, the trace and the work folder are usable."""
    from ..paths import check_input_file, check_output_dir

    for flag in ("dp", "cp", "pool_size", "steps", "seq_len", "grad_accum", "head_split", "num_chunks",
                 "block_size", "vocab"):
        value = getattr(args, flag)
        if value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    if not (args.lr > 0 and args.lr < float("inf")):
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr!r}")
    if args.data == "trace":
        path = args.trace if os.path.sep in args.trace or os.path.exists(args.trace) else find_trace(args.trace)
        check_input_file(path, f"--trace {args.trace}")
    if args.workdir:
        check_output_dir(args.workdir, f"--workdir {args.workdir}")


def run(argv: Optional[Sequence[str]] = None) -> int:
    """The CPU training run; bad flags raise ValueError naming the flag (``main`` prints one line, exit 2)."""
    args = parse_args(argv)
    _check_args(args)
    cfg = RunConfig(dp=args.dp, cp=args.cp, pool_size=args.pool_size, steps=args.steps, seq_len=args.seq_len,
                    grad_accum=args.grad_accum, head_split=args.head_split, num_chunks=args.num_chunks,
                    block_size=args.block_size, vocab=args.vocab, lr=args.lr, seed=args.seed,
                    libra=not args.baseline, data=args.data, workdir=args.workdir, trace=args.trace,
                    max_files=args.max_files or None, max_docs=args.max_docs)
    cfg.libra_config()  # validate flags before building anything
    start = time.perf_counter()
    data = prepare_data(cfg)
    print(f"data: {args.data} corpus {data.info.num_documents} docs / {data.info.num_tokens} tokens, "
          f"{cfg.steps} steps x GBS {cfg.global_batch} x L {cfg.seq_len} ({time.perf_counter() - start:.1f}s)")
    print(f"config: {asdict(cfg)}")
    names = ["baseline"] if args.baseline else (["libra", "baseline"] if args.compare else ["libra"])
    start = time.perf_counter()
    results = run_training([replace(cfg, libra=(n == "libra")) for n in names], data)
    print(f"trained {len(names)} run(s) in one {cfg.world_size}-rank gloo job: {time.perf_counter() - start:.1f}s")
    runs = dict(zip(names, results))
    for name, per_rank in runs.items():
        _print_run(name, per_rank[0])
    if "libra" in runs and "baseline" in runs:
        parity = compare_runs(runs["libra"], runs["baseline"])
        print("parity: " + " ".join(f"{k}={v:.3g}" for k, v in parity.items()))
        ok = max(parity["max_rel_loss"], parity["max_rel_grad_norm"]) < PARITY_RTOL and parity["same_step_multisets"]
        print("PARITY OK" if ok else f"PARITY FAILED (tolerance {PARITY_RTOL})")
        return 0 if ok else 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m libra_megatron.megatron.train_cpu`` (``scripts/main.sh``): exit 2 with one line on bad input."""
    from ..cli import run_cli

    run_cli(TOOL, run, argv)


if __name__ == "__main__":
    main()
