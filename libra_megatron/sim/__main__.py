"""``python -m libra_megatron.sim`` / ``libra-sim``: choose P, H, B, tau, M for a corpus (§5; review objections 2, 4).

Example (the traces ship in ``data/traces/`` of the checkout):
    python -m libra_megatron.sim --trace data/traces/linux-6.12-files.qwen.txt \
        --seq-len 262144 --gbs 128 --dp 32 --cp 8 --libra-config configs/libra/256k.yaml \
        --model qwen3-30b-a3b --json out.json --plots plots/
``--libra-config FILE`` takes the run's Libra YAML as the defaults of the knobs (``sim.libra_yaml``); explicit
flags (``--pool-size 4 8 16 --head-split 1 2 4``: a grid) override it.

Everything is checked before the simulation starts, in this order: every flag (``spec_from_args``, the
``--calibration`` file included), the outputs (``--json``: its folder exists and takes a new file;
``--plots``: an existing writable folder, or a new one whose parent exists -- created only at the end),
the traces (``plan.traces``: files, UTF-8, one integer per line) and the run's cost (``spec.check_run_cost``:
packing memory under ``--memory-limit-gib``). A bad input exits 2 with one line ``libra-sim: error: ...``
(``libra_megatron.cli``); ``--debug`` or ``LIBRA_DEBUG=1`` shows the traceback. Nothing is written unless
the run succeeds.

Adding an option: put it in the right ``_add_*_args`` group with ``_grid_option`` (a swept list of numbers),
``_choice_option`` (values of an enum, optionally swept) or ``group.add_argument`` with a ``help``, check
it in ``spec._validate_spec`` (ValueError naming the flag), and pass it on in ``spec_from_args``.
"""

from __future__ import annotations

import argparse
import enum
import importlib.util
import json
import os
import sys
from typing import Callable, List, Optional, Sequence, Type, Union

from ..cli import ArgumentParser, DefaultsHelpFormatter, add_debug_argument, run_cli
from ..config import (KvFetch, KvRelay, LibraConfig, PackingMode, SaveModeName, SequencePlacement, TilePlacement,
                      TilingPolicy, TokenLayoutKind, chunks_value, heads_per_tensor_parallel_rank)
from ..paths import check_output_dir, check_output_file
from ..plan.packing import BYTES_PER_DOCUMENT, BYTES_PER_SEGMENT
from ..plan.traces import load_traces
from ..plan.model import (DEFAULT_ADD_GBPS, DEFAULT_ATTN_TFLOPS, DEFAULT_COLLECTIVE_US, DEFAULT_COPY_GBPS,
                          DEFAULT_COPY_LAUNCH_US, DEFAULT_ELEMENTWISE_GBPS, DEFAULT_GATHER_GBPS, DEFAULT_PLACE_GBPS,
                          DEFAULT_WIDEN_GBPS,
                          DEFAULT_GPUS_PER_NODE, DEFAULT_INTER_MESSAGE_US, DEFAULT_INTER_NODE_GBPS,
                          DEFAULT_INTRA_MESSAGE_US, DEFAULT_INTRA_NODE_GBPS, DEFAULT_KERNEL_LAUNCH_US,
                          CalibrationTable, KernelFit, StepTimeModel, resolve_calibration)
from .hybrid_cp import HybridCpBaseline, subprocess_scheduler
from .libra_yaml import LIBRA_CONFIG_FLAG, check_yaml_knobs, parse_with_libra_config, relay_on
from .report import ProgressBar, format_table
from .runner import run_simulation
from .spec import DTYPE_BYTES, MIN_SEQ_LEN, MODEL_LAYERS, MODEL_PRESETS, ModelDims, SimSpec, check_jobs
from .fig12 import check_fig12_spec, format_fig12, run_fig12
from .sync import format_sync

__all__ = ["build_parser", "parse_args", "spec_from_args", "check_outputs", "run", "main"]

TOOL = "libra-sim"


def _grid_option(group, flag: str, kind: Callable, default: Sequence, help: str, metavar: Optional[str] = None) -> None:
    """A swept knob: one or more values, every candidate of the grid takes one."""
    group.add_argument(flag, type=kind, nargs="+", default=list(default), metavar=metavar or kind.__name__.upper(),
                       help=help)


def _choice_option(group, flag: str, enum_cls: Type[enum.Enum], default: enum.Enum, help: str,
                   grid: bool = False) -> None:
    """An enum-valued option: the choices and the default are shown as their values (``megatron``)."""
    values = [m.value for m in enum_cls]
    group.add_argument(flag, choices=values, nargs="+" if grid else None,
                       default=[default.value] if grid else default.value, help=help)


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("corpus and parallel layout")
    g.add_argument("--trace", action="append", required=True, metavar="PATH",
                   help="document-length trace (UTF-8 text, '#' comments, one length per line); repeat to pool "
                        "several")
    _choice_option(g, "--packing", PackingMode, PackingMode.MEGATRON,
                   "megatron: shuffle, concatenate, cut; best_fit: BFD, last bins padded")
    g.add_argument("--seq-len", type=int, required=True, help=f"L, tokens per packed sequence (>= {MIN_SEQ_LEN})")
    g.add_argument("--gbs", type=int, required=True, help="global batch size in packed sequences (window size)")
    g.add_argument("--dp", type=int, required=True, help="data-parallel size")
    g.add_argument("--cp", type=int, required=True, help="context-parallel size")
    g.add_argument("--seed", type=int, default=1234, help="packing shuffle seed")
    g.add_argument("--max-windows", type=int, default=None, metavar="N",
                   help="only the first N GBS windows (default: all); with megatron packing only the documents "
                        "they need are packed")
    g.add_argument("--memory-limit-gib", type=float, default=2.0, metavar="GIB",
                   help="refuse a run whose packing is estimated to need more memory than this")


def _add_sync_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("synchronisation model (sim/sync.py: who waits for whom in a step)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages; each lane of P replicas runs 1F1B")
    g.add_argument("--vpp", type=int, default=1, help="model chunks per stage (> 1: Megatron's interleaved schedule)")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size: each TP rank plans and runs --num-heads / TP query and --num-kv-heads "
                        "/ TP K/V heads (Megatron's split, both must divide); also places EP groups by rank order")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size (EP groups across lanes tie them)")
    g.add_argument("--etp", type=int, default=1, help="expert tensor-parallel size")
    g.add_argument("--backward-ratio", default=None, help=argparse.SUPPRESS)  # removed: a one-line error
    g.add_argument("--other-seconds", type=float, default=0.0,
                   help="non-attention forward seconds per microbatch and stage, in the per-layer unit of the "
                        "attention times (equal for every packed sequence; 0: attention only)")


def _add_libra_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Libra grid and knobs")
    g.add_argument(LIBRA_CONFIG_FLAG, default=None, metavar="FILE",
                   help="a Libra YAML (configs/libra/256k.yaml): its knobs become the defaults of the flags below "
                        "(pool_size, head_split, block_size, num_chunks, tau, tiling, kv_fetch, sequence_placement, "
                        "tile_placement, token_layout, packing, kv_relay, save_mode, activation_budget_gb; "
                        "LibraConfig's default for a key it leaves out); explicit flags override it")
    _grid_option(g, "--pool-size", int, [8], "P values (each divides --dp)")
    _grid_option(g, "--head-split", int, [1], "H values")
    _grid_option(g, "--block-size", int, [4096], "B values (tokens)")
    _grid_option(g, "--num-chunks", chunks_value, [4], "M values, Pipeliner head chunks, or auto (the K/V heads of "
                 "a head shard)", metavar="M")
    _grid_option(g, "--tau", float, [0.03], "Algorithm 2 load slack values (finite, >= 0)")
    _choice_option(g, "--tiling", TilingPolicy, TilingPolicy.ADAPTIVE,
                   "SH-Tile blocks: uniform (the paper) or adaptive (heavy blocks halved); several = a grid axis", grid=True)
    _choice_option(g, "--kv-fetch", KvFetch, KvFetch.PREFIX,
                   "KV a destination fetches: group (the paper, whole) or prefix (causal prefix); several = a grid axis",
                   grid=True)
    _choice_option(g, "--token-layout", TokenLayoutKind, TokenLayoutKind.ZIGZAG,
                   "CP token layout of a packed sequence: zigzag (Megatron's 2*CP chunks) or contiguous")
    _choice_option(g, "--sequence-placement", SequencePlacement, SimSpec.sequence_placement,
                   "inter-pool placement of the 'libra' variant (sync: lane totals under the sync model)")
    _choice_option(g, "--tile-placement", TilePlacement, TilePlacement.ALG2,
                   "intra-pool tile placement of the 'libra' and DistCA variants")
    g.add_argument("--wlb-cap-factor", type=float, default=1.25,
                   help="WLB-LLM baseline: token cap of a re-packed sequence = factor * --seq-len")
    g.add_argument("--no-distca", action="store_true", help="skip the DistCA (P = DP) baseline")
    g.add_argument("--megatron-hybrid-cp", action="store_true",
                   help="add Megatron-LM's hybrid-CP balancer (BalancedCPScheduler, run by megatron-core in a "
                        "subprocess) as a baseline on the same windows")
    g.add_argument("--megatron-max-seqlen-per-rank", type=int, default=None, metavar="N",
                   help="its --max-seqlen-per-dp-cp-rank (default: --seq-len / --cp)")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("attention shape (a --model preset, or all of --num-heads/--num-kv-heads/--head-dim)")
    g.add_argument("--model", choices=sorted(MODEL_PRESETS), default=None,
                   help="attention shape preset (explicit --num-heads etc. override its values)")
    g.add_argument("--num-heads", type=int, default=None, help="query heads of the model (--tp divides them)")
    g.add_argument("--num-kv-heads", type=int, default=None,
                   help="key/value heads of the model (divides --num-heads; --tp divides them)")
    g.add_argument("--head-dim", type=int, default=None, help="head dimension")
    g.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="activation dtype (bytes moved)")
    g.add_argument("--num-layers", type=int, default=None,
                   help="transformer layers (default: the --model preset's, else 1); save_mode auto budgets "
                        "the ones of a stage (ceil(layers / --pp)) whose tensors are alive at once")
    g.add_argument("--recompute-num-layers", type=int, default=1, metavar="N",
                   help="Megatron-LM's full uniform recompute of N layers at a time, as the shipped configs run it "
                        "(--recompute-num-layers 1): save_mode auto budgets N layers; 0 = no recompute, every "
                        "layer of the stage keeps its tensors")


def _add_cost_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("time model (see docs: assumptions, overridable)")
    g.add_argument("--attn-tflops", type=float, default=DEFAULT_ATTN_TFLOPS, help="effective attention TFLOP/s per GPU")
    g.add_argument("--intra-node-gbps", type=float, default=DEFAULT_INTRA_NODE_GBPS,
                   help="GB/s per GPU to same-node peers")
    g.add_argument("--inter-node-gbps", type=float, default=DEFAULT_INTER_NODE_GBPS, help="GB/s per GPU to other nodes")
    g.add_argument("--gpus-per-node", type=int, default=DEFAULT_GPUS_PER_NODE,
                   help="GPUs per node (decides which links are intra-node)")
    for flag, default, what in (("--collective-us", DEFAULT_COLLECTIVE_US, "latency of every all_to_all call"),
                                ("--intra-message-us", DEFAULT_INTRA_MESSAGE_US, "latency of every same-node message"),
                                ("--inter-message-us", DEFAULT_INTER_MESSAGE_US, "latency of every inter-node message"),
                                ("--kernel-launch-us", DEFAULT_KERNEL_LAUNCH_US, "cost of every attention kernel call"),
                                ("--copy-launch-us", DEFAULT_COPY_LAUNCH_US, "cost of every gather / scatter call"),
                                ("--gather-gbps", DEFAULT_GATHER_GBPS, "GB/s of row gathers (read + write)"),
                                ("--place-gbps", DEFAULT_PLACE_GBPS, "GB/s of index_put_ row placements (read + write)"),
                                ("--add-gbps", DEFAULT_ADD_GBPS, "GB/s of index_add_ fp32 row sums (read + write)"),
                                ("--widen-gbps", DEFAULT_WIDEN_GBPS, "GB/s of casts to a wider dtype (bf16 -> fp32)"),
                                ("--elementwise-gbps", DEFAULT_ELEMENTWISE_GBPS, "GB/s of cat, fill and narrowing casts"),
                                ("--copy-gbps", DEFAULT_COPY_GBPS, "GB/s of plain copies: an all_to_all's self segment")):
        g.add_argument(flag, type=float, default=default, help=f"{what} (whole-layer model; plan/model/rates.py "
                                                               f"has the source of the default)")
    g.add_argument("--no-local-first", action="store_true",
                   help="price the plans without the Pipeliner's local split (every entry after its chunk's "
                        "dispatch arrived) instead of the runtime's local-first schedule, for comparison")
    _choice_option(g, "--kv-relay", KvRelay, KvRelay.AUTO,
                   "auto: exchange plans relay K/V between nodes as the runtime's kv_relay: auto does; off: every "
                   "destination fetches from the home worker")
    g.add_argument("--no-kv-relay", dest="kv_relay", action="store_const", const=KvRelay.OFF.value,
                   help="the same as --kv-relay off")
    _choice_option(g, "--save-mode", SaveModeName, LibraConfig.save_mode,
                   "what the operator keeps for backward, priced in the backward: arranged, refetch (Q, K|V, O "
                   "sent again), auto (per pool: arranged iff the worst rank's bytes x the layers alive at once fit "
                   "--activation-budget-gb, plan.model.memory.choose_save_mode)")
    g.add_argument("--activation-budget-gb", type=float, default=LibraConfig.activation_budget_gb, metavar="GIB",
                   help="save_mode auto's budget per GPU and microbatch over the layers alive at once")
    g.add_argument("--calibration", default=None, metavar="PATH|NAME",
                   help="measured per-shape kernel table: a JSON file (benchmarks/gpu/device_check.py writes one) or a "
                        "table shipped in data/calibration (h200-torch-fa2: one H200, torch's FlashAttention-2 "
                        "kernel; docs/gpu.md); default: the constant --attn-tflops rate")


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("output (written only when the run succeeds)")
    g.add_argument("--json", default=None, metavar="PATH",
                   help="write the full report as JSON (the folder must exist; an existing file is replaced)")
    g.add_argument("--dump-orders", default=None, metavar="PATH",
                   help="write JSON lines, one per window (and P): dp, pool_size, ga, seq_docs (document lengths "
                        "of every packed sequence, sampler order) and the placed order")
    g.add_argument("--plots", default=None, metavar="DIR",
                   help="write PNG plots into DIR (created at the end if missing; its parent must exist)")
    g.add_argument("--fig12", action="store_true",
                   help="instead of the candidate table: the paper's Fig. 12 (per-microbatch attention forward, "
                        "Ulysses vs Libra, over Libra's per-window mean) for the one configuration given; --json "
                        "and --plots write its JSON and fig12_microbatch_forward.png (sim/fig12.py)")
    g.add_argument("--jobs", type=int, default=1, metavar="N", help="simulate windows in N processes, N <= CPUs (same results)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_debug_argument(g)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=TOOL, description=__doc__.splitlines()[0], allow_abbrev=False,
                            formatter_class=DefaultsHelpFormatter)
    _add_workload_args(parser)
    _add_sync_args(parser)
    _add_libra_args(parser)
    _add_model_args(parser)
    _add_cost_args(parser)
    _add_output_args(parser)
    return parser


def _model_dims(args: argparse.Namespace) -> ModelDims:
    explicit = (args.num_heads, args.num_kv_heads, args.head_dim)
    if args.model is not None:
        hq, hkv, d = MODEL_PRESETS[args.model]
        hq, hkv, d = (x if x is not None else y for x, y in zip(explicit, (hq, hkv, d)))
    elif None in explicit:
        raise ValueError("give --model, or all of --num-heads, --num-kv-heads and --head-dim")
    else:
        hq, hkv, d = explicit
    for value, flag in ((hq, "--num-heads"), (hkv, "--num-kv-heads"), (d, "--head-dim"), (args.tp, "--tp")):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    rank_hq = heads_per_tensor_parallel_rank(hq, "--num-heads", args.tp, "--tp")
    rank_hkv = heads_per_tensor_parallel_rank(hkv, "--num-kv-heads", args.tp, "--tp")
    return ModelDims(rank_hq, rank_hkv, d, DTYPE_BYTES[args.dtype])


def _calibration(value: Optional[str]) -> Optional[Union[CalibrationTable, KernelFit]]:
    return resolve_calibration(value) if value is not None else None


def _num_layers(args: argparse.Namespace) -> int:
    layers = args.num_layers
    if layers is None:
        layers = MODEL_LAYERS.get(args.model, 1)
    if layers < 1:
        raise ValueError(f"--num-layers must be a positive integer, got {layers}")
    return layers


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The simulator's flags, with ``--libra-config FILE``'s knobs as defaults (``sim.libra_yaml``)."""
    args, config = parse_with_libra_config(build_parser(), argv)
    args.libra_config_obj = config
    return args


def spec_from_args(args: argparse.Namespace) -> SimSpec:
    """Turn parsed flags into a validated ``SimSpec`` (ValueError names the flag, or the YAML key and file)."""
    if args.backward_ratio is not None:
        raise ValueError("--backward-ratio was removed: the sync model takes every pool's priced backward seconds "
                         "(plan.exchange.plan_layer_timing, forward then backward as the runtime runs them) instead "
                         "of a ratio; leave the flag out")
    dims = _model_dims(args)
    check_yaml_knobs(getattr(args, "libra_config_obj", None), args, dims.num_q_heads, dims.num_kv_heads)
    cost = StepTimeModel(head_dim=dims.head_dim, attn_tflops=args.attn_tflops, intra_node_gbps=args.intra_node_gbps,
                         inter_node_gbps=args.inter_node_gbps, gpus_per_node=args.gpus_per_node,
                         calibration=_calibration(args.calibration), local_first=not args.no_local_first,
                         kv_relay=relay_on(args.kv_relay), collective_us=args.collective_us,
                         intra_message_us=args.intra_message_us, inter_message_us=args.inter_message_us,
                         kernel_launch_us=args.kernel_launch_us, copy_launch_us=args.copy_launch_us,
                         copy_gbps=args.copy_gbps, gather_gbps=args.gather_gbps, place_gbps=args.place_gbps,
                         add_gbps=args.add_gbps, widen_gbps=args.widen_gbps, elementwise_gbps=args.elementwise_gbps)
    check_jobs(args.jobs)
    return SimSpec(
        seq_len=args.seq_len, global_batch_size=args.gbs, data_parallel_size=args.dp, context_parallel_size=args.cp,
        pool_sizes=tuple(args.pool_size), head_splits=tuple(args.head_split), block_sizes=tuple(args.block_size),
        dims=dims, cost=cost, chunk_counts=tuple(args.num_chunks), taus=tuple(args.tau),
        tilings=tuple(TilingPolicy(t) for t in args.tiling), kv_fetches=tuple(KvFetch(f) for f in args.kv_fetch),
        token_layout=TokenLayoutKind(args.token_layout), sequence_placement=SequencePlacement(args.sequence_placement),
        tile_placement=TilePlacement(args.tile_placement), packing=PackingMode(args.packing), seed=args.seed,
        max_windows=args.max_windows, wlb_cap_factor=args.wlb_cap_factor, distca=not args.no_distca,
        memory_limit_gib=args.memory_limit_gib, pipeline_parallel_size=args.pp, virtual_pipeline_size=args.vpp,
        tensor_parallel_size=args.tp, expert_parallel_size=args.ep, expert_tensor_parallel_size=args.etp,
        other_seconds=args.other_seconds, dump_orders=args.dump_orders is not None,
        save_mode=SaveModeName(args.save_mode), activation_budget_gb=args.activation_budget_gb,
        num_layers=_num_layers(args), recompute_num_layers=args.recompute_num_layers,
        libra_config=getattr(args, "libra_config", None),
    ).validate()


def _hybrid_cp(args: argparse.Namespace) -> Optional[HybridCpBaseline]:
    """The Megatron-LM hybrid-CP baseline the flags ask for (None without ``--megatron-hybrid-cp``)."""
    cap = args.megatron_max_seqlen_per_rank
    if cap is not None and not args.megatron_hybrid_cp:
        raise ValueError("--megatron-max-seqlen-per-rank needs --megatron-hybrid-cp")
    if cap is not None and cap < 1:
        raise ValueError(f"--megatron-max-seqlen-per-rank must be a positive integer, got {cap}")
    return HybridCpBaseline(subprocess_scheduler(), cap) if args.megatron_hybrid_cp else None


def check_outputs(args: argparse.Namespace) -> None:
    """``--json`` and ``--plots`` can be written (and matplotlib is there for plots); creates nothing."""
    if args.json is not None:
        check_output_file(args.json, f"--json {args.json}")
    if args.dump_orders is not None:
        check_output_file(args.dump_orders, f"--dump-orders {args.dump_orders}")
    if args.plots is not None:
        check_output_dir(args.plots, f"--plots {args.plots}")
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plots needs matplotlib: pip install 'libra_megatron[sim]'")


def _load_traces(paths: List[str], spec: SimSpec):
    """The pooled traces, read no further than the documents ``--memory-limit-gib`` can pack."""
    per_document = BYTES_PER_DOCUMENT + BYTES_PER_SEGMENT + 8  # packing's share plus the int64 length itself
    limit = int(spec.memory_limit_gib * (1 << 30)) // per_document
    reason = f" in all --trace files; packing them needs more than --memory-limit-gib {spec.memory_limit_gib:g}"
    return load_traces(paths, max_documents=limit, limit_reason=reason)


def _write_outputs(args: argparse.Namespace, result, report: dict) -> None:
    if args.json:
        text = json.dumps(report, indent=1)
        with open(args.json, "w", encoding="utf-8") as handle:
            handle.write(text)
    if args.dump_orders:
        with open(args.dump_orders, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(line) + "\n" for line in result.orders_dump)
    if args.plots:
        from .plots import write_plots  # lazy: matplotlib only when asked

        for path in write_plots(result, report, args.plots):
            print(f"wrote {path}")


def _check_fig12_args(args: argparse.Namespace, spec: SimSpec) -> None:
    """``--fig12`` runs one configuration and no other baseline: refuse the flags it would not honour."""
    if not args.fig12:
        return
    check_fig12_spec(spec)
    for flag, given in (("--dump-orders", args.dump_orders is not None), ("--megatron-hybrid-cp", args.megatron_hybrid_cp)):
        if given:
            raise ValueError(f"--fig12 does not run {flag} (it prices Ulysses and Libra only); leave {flag} out")


def _run_fig12(args: argparse.Namespace, spec: SimSpec, doc_lens, progress) -> int:
    report = run_fig12(doc_lens, spec, jobs=args.jobs, progress=progress).to_json()
    report["assumptions"]["traces"] = [os.fspath(p) for p in args.trace]
    print(format_fig12(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(report, indent=1))
    if args.plots:
        from .plots import write_fig12_plot  # lazy: matplotlib only when asked

        print(f"wrote {write_fig12_plot(report, args.plots)}")
    return 0


def run(argv: Optional[Sequence[str]] = None) -> int:
    """The simulator; bad input raises ValueError naming the flag or file (``main`` turns it into one line)."""
    args = parse_args(argv)
    spec = spec_from_args(args)
    _hybrid_cp(args)  # flag errors before any work
    _check_fig12_args(args, spec)
    check_outputs(args)
    doc_lens = _load_traces(args.trace, spec)  # checks every path before reading any
    progress = ProgressBar(enabled=not args.no_progress and sys.stderr.isatty())
    if args.fig12:
        return _run_fig12(args, spec, doc_lens, progress)
    result = run_simulation(doc_lens, spec, progress=progress, jobs=args.jobs, megatron_hybrid_cp=_hybrid_cp(args))
    report = result.to_json()
    report["assumptions"]["traces"] = [os.fspath(p) for p in args.trace]
    print(format_table(report))
    print(format_sync(next(c for c in report["candidates"] if all(c[k] == report["recommended"][k]
                                                                  for k in ("pool_size", "head_split", "block_size",
                                                                            "tau", "num_chunks", "tiling", "kv_fetch")))))
    _write_outputs(args, result, report)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point (``libra-sim``): one line ``libra-sim: error: ...`` and exit 2 on bad input."""
    run_cli(TOOL, run, argv)


if __name__ == "__main__":
    main()
