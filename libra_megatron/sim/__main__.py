"""``python -m libra_megatron.sim`` / ``libra-sim``: choose P, H, B, tau, M for a corpus (§5; review objections 2, 4).

Example (the traces ship in ``data/traces/`` of the checkout):
    python -m libra_megatron.sim --trace data/traces/linux-6.12-files.qwen.txt \
        --seq-len 262144 --gbs 128 --dp 32 --cp 8 --pool-size 4 8 16 --head-split 1 2 4 \
        --block-size 4096 8192 --model qwen3-30b-a3b --json out.json --plots plots/
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from ..config import PackingMode, SequencePlacement, TilePlacement, TokenLayoutKind
from ..plan.traces import load_traces
from .cost import CalibrationTable, CostModel
from .report import ProgressBar, format_table
from .runner import DTYPE_BYTES, MODEL_PRESETS, ModelDims, SimSpec, run_simulation

__all__ = ["build_parser", "spec_from_args", "main"]


def _enum_arg(enum_cls, flag: str):
    def parse(text: str):
        try:
            return enum_cls(text)
        except ValueError:
            choices = ", ".join(e.value for e in enum_cls)
            raise argparse.ArgumentTypeError(f"{flag} must be one of {choices}, got {text!r}") from None
    return parse


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("corpus and parallel layout")
    g.add_argument("--trace", action="append", required=True, metavar="PATH",
                   help="document-length trace ('#' comments, one length per line); repeat to pool several")
    g.add_argument("--packing", type=_enum_arg(PackingMode, "--packing"), default=PackingMode.MEGATRON,
                   help="megatron (shuffle, concatenate, cut) | best_fit (BFD, last bins padded)")
    g.add_argument("--seq-len", type=int, required=True, help="L, tokens per packed sequence")
    g.add_argument("--gbs", type=int, required=True, help="global batch size in packed sequences (window size)")
    g.add_argument("--dp", type=int, required=True, help="data-parallel size")
    g.add_argument("--cp", type=int, required=True, help="context-parallel size")
    g.add_argument("--seed", type=int, default=1234, help="packing shuffle seed")
    g.add_argument("--max-windows", type=int, default=None, help="only the first N GBS windows (quick runs)")


def _add_libra_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Libra grid and knobs")
    g.add_argument("--pool-size", type=int, nargs="+", default=[8], help="P values (each divides --dp)")
    g.add_argument("--head-split", type=int, nargs="+", default=[1], help="H values")
    g.add_argument("--block-size", type=int, nargs="+", default=[4096], help="B values (tokens)")
    g.add_argument("--num-chunks", type=int, nargs="+", default=[4], help="M values, Pipeliner head chunks")
    g.add_argument("--tau", type=float, nargs="+", default=[0.03], help="Algorithm 2 load slack values")
    g.add_argument("--token-layout", type=_enum_arg(TokenLayoutKind, "--token-layout"), default=TokenLayoutKind.ZIGZAG)
    g.add_argument("--sequence-placement", type=_enum_arg(SequencePlacement, "--sequence-placement"),
                   default=SequencePlacement.REFINED, help="inter-pool placement of the 'libra' variant")
    g.add_argument("--tile-placement", type=_enum_arg(TilePlacement, "--tile-placement"),
                   default=TilePlacement.ALG2, help="intra-pool tile placement of the 'libra' and DistCA variants")
    g.add_argument("--wlb-cap-factor", type=float, default=1.25,
                   help="WLB-LLM baseline: token cap of a re-packed sequence = factor * --seq-len")
    g.add_argument("--no-distca", action="store_true", help="skip the DistCA (P = DP) baseline")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("attention shape (a --model preset, or all of --num-heads/--num-kv-heads/--head-dim)")
    g.add_argument("--model", choices=sorted(MODEL_PRESETS), default=None)
    g.add_argument("--num-heads", type=int, default=None)
    g.add_argument("--num-kv-heads", type=int, default=None)
    g.add_argument("--head-dim", type=int, default=None)
    g.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")


def _add_cost_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("time model (see docs: assumptions, overridable)")
    g.add_argument("--attn-tflops", type=float, default=400.0, help="effective attention TFLOP/s per GPU")
    g.add_argument("--intra-node-gbps", type=float, default=300.0, help="GB/s per GPU to same-node peers")
    g.add_argument("--inter-node-gbps", type=float, default=50.0, help="GB/s per GPU to other nodes")
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--calibration", default=None, metavar="PATH", help="measured per-shape kernel table (JSON)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="libra-sim", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_workload_args(parser)
    _add_libra_args(parser)
    _add_model_args(parser)
    _add_cost_args(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON")
    out.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots into DIR")
    out.add_argument("--jobs", type=int, default=1, help="simulate windows in N processes (same results)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
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
    for value, flag in ((hq, "--num-heads"), (hkv, "--num-kv-heads"), (d, "--head-dim")):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    return ModelDims(hq, hkv, d, DTYPE_BYTES[args.dtype])


def spec_from_args(args: argparse.Namespace) -> SimSpec:
    """Turn parsed flags into a validated ``SimSpec`` (ValueError names the flag)."""
    dims = _model_dims(args)
    calibration = CalibrationTable.from_json(args.calibration) if args.calibration else None
    cost = CostModel(head_dim=dims.head_dim, attn_tflops=args.attn_tflops, intra_node_gbps=args.intra_node_gbps,
                     inter_node_gbps=args.inter_node_gbps, gpus_per_node=args.gpus_per_node,
                     num_chunks=args.num_chunks[0], calibration=calibration)
    return SimSpec(
        seq_len=args.seq_len, global_batch_size=args.gbs, data_parallel_size=args.dp, context_parallel_size=args.cp,
        pool_sizes=tuple(args.pool_size), head_splits=tuple(args.head_split), block_sizes=tuple(args.block_size),
        dims=dims, cost=cost, chunk_counts=tuple(args.num_chunks), taus=tuple(args.tau), token_layout=args.token_layout,
        sequence_placement=args.sequence_placement, tile_placement=args.tile_placement, packing=args.packing,
        seed=args.seed, max_windows=args.max_windows, wlb_cap_factor=args.wlb_cap_factor, distca=not args.no_distca,
    ).validate()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI entry point. Bad flag values raise ValueError naming the flag (argparse errors exit 2)."""
    args = build_parser().parse_args(argv)
    spec = spec_from_args(args)
    doc_lens = load_traces(args.trace)
    progress = ProgressBar(enabled=not args.no_progress and sys.stderr.isatty())
    result = run_simulation(doc_lens, spec, progress=progress, jobs=args.jobs)
    report = result.to_json()
    report["assumptions"]["traces"] = [os.fspath(p) for p in args.trace]
    print(format_table(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
    if args.plots:
        from .plots import write_plots  # lazy: matplotlib only when asked

        for path in write_plots(result, report, args.plots):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
