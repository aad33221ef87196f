"""Per-GPU memory estimate of a Megatron-LM run config (an args file), for the headers of ``configs/*.args``.

    python scripts/estimate_memory.py configs/qwen3-8b-256k.args [--dp N]    # print the header block
    python scripts/estimate_memory.py --write configs/qwen3-*.args            # refresh the config headers

Everything is read from the config itself (nested ``--megatron-args-file`` includes expanded, the Libra
YAML of ``--libra-config`` for P and tau). Units: bytes, printed in GiB (2**30). What is counted, per GPU,
for the PP stage that needs the most:

- **params**: the stage's parameters. Dense (non-expert) weights are split over TP, expert weights over
  EP x ETP (``--expert-tensor-parallel-size``, default TP); the embedding sits on the first stage, the
  final norm and the untied output layer on the last. 2 B each in bf16, 4 B in fp32.
- **grads**: Megatron's main-grad buffer: 4 B per local parameter (with ``--bf16``, validate_args turns
  on fp32 gradient accumulation), not sharded.
- **optimizer**: Adam = fp32 master copy + m + v = 12 B per parameter in bf16 (8 B in fp32). With
  ``--use-distributed-optimizer`` dense state is sharded over DP x CP and expert state over the expert
  data-parallel group (world / (PP x EP x ETP)).
- **activations**: tensors autograd keeps (2 B elements in bf16, 4 B in fp32). With ``--recompute-granularity full`` (uniform, n =
  ``--recompute-num-layers``) every n-layer chunk keeps its input (t_sp x h) for each microbatch in flight
  (1F1B: PP microbatches on the first stage), plus the saved tensors of the n layers being recomputed;
  without recompute, every layer's saved tensors for each microbatch in flight. One layer saves: two
  RMSNorm inputs/outputs (4 t_sp h), the QKV output (t (hq+2hkv) d / TP), the attention output (t hq d / TP),
  and for a dense MLP the fc1 and SwiGLU outputs (3 t f / TP); for an MoE MLP the fp32 router logits and
  probabilities (8 t_sp E bytes), the k routed copies of each token before and after the experts
  (2 t_sp k ETP h) and the experts' fc1/SwiGLU outputs (3 t_sp k f_moe). Tokens per GPU t = L / CP
  (mbs = 1); t_sp = t / TP with ``--sequence-parallel``, else t.
- **logits**: last stage, t x V / TP elements: the bf16 output (2 B) plus the fp32 softmax Megatron's
  vocab-parallel cross entropy keeps for backward (4 B; in fp32 the softmax reuses the output: 4 B); with ``--cross-entropy-loss-fusion
  --cross-entropy-fusion-impl te`` only the bf16 output (Transformer Engine's kernel writes the gradient
  into it in place).
- **Libra saved attention**: what ``libra_attn_func`` keeps for backward under ``SaveMode.ARRANGED``
  for each layer whose saved tensors are alive (the recomputed ones): arranged Q and O of the tiles the
  GPU hosts, (1 + tau) x the local share t hq d / TP each (TAP balances FLOPs to within tau; tokens are
  assumed to follow), fp32 log-sum-exp, and the arranged K|V of one whole packed sequence L (2 L hkv d / TP:
  a hosted block fetches its document's KV group whole, §4.3.1). Replaces the q/k/v/o the stock core
  attention would keep.

Not counted: allocator fragmentation, NCCL/communication buffers, backward temporaries, CUDA context
(keep >= 10-15% headroom). The DP size is the smallest job's, DP = P (the Libra pool size), unless --dp.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from libra_megatron.cli import ArgumentParser, add_debug_argument, run_cli  # noqa: E402

GIB = float(1 << 30)
HEADER_BEGIN = "# Memory per GPU, estimated by scripts/estimate_memory.py (GiB; assumptions in that script):"
HEADER_PREFIX = "#   "
# Rows of the tokenizer's vocabulary before Megatron pads it (--make-vocab-size-divisible-by x TP). Qwen3's
# tokenizer has 151,643 regular ids + 26 special ones; padded that is config.json's vocab_size 151,936.
TOKENIZER_VOCAB = {"Qwen/Qwen3-": 151669}
COMPONENTS = ("params", "grads", "optimizer", "activations", "logits", "libra")
LABELS = {"params": "params", "grads": "grads", "optimizer": "optimizer", "activations": "activations",
          "logits": "logits", "libra": "Libra saved attention"}


# =============================================================================== reading a config
def parse_flags(tokens: Sequence[str]) -> Dict[str, object]:
    """``--flag value`` -> {"flag": "value"}, bare ``--flag`` -> {"flag": True}; the last occurrence wins."""
    flags: Dict[str, object] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            i += 1
            continue
        name, eq, value = token[2:].partition("=")
        name = name.replace("-", "_")
        if eq:
            flags[name] = value
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            flags[name] = tokens[i + 1]
            i += 2
        else:
            flags[name] = True
            i += 1
    return flags


def read_config(path: str) -> List[str]:
    """The Megatron command line of an args file, includes expanded (the launcher's own expansion)."""
    from libra_megatron.launch import expand_args_files

    return expand_args_files(["--megatron-args-file", str(path)])


def _resolve(path: str, config_path: str) -> Path:
    for base in (Path.cwd(), Path(config_path).resolve().parent, REPO_ROOT):
        candidate = base / path
        if candidate.is_file():
            return candidate
    raise ValueError(f"--libra-config {path}: no such file (config {config_path})")


@dataclass(frozen=True)
class Shape:
    """The numbers the estimate needs, taken from the flags (names as Megatron's)."""

    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    num_experts: int
    moe_ffn: int
    topk: int
    seq_len: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    sequence_parallel: bool
    bf16: bool
    distributed_optimizer: bool
    recompute_layers: int  # 0 = no recompute
    untied: bool
    bias: bool
    swiglu: bool
    qk_layernorm: bool
    libra: bool
    tau: float
    logit_bytes: int  # bytes per (token, vocab/TP) logit element, see the module docstring


def _int(flags: Dict[str, object], name: str, default: Optional[int] = None) -> int:
    value = flags.get(name, default)
    if value is None or value is True:
        raise ValueError(f"--{name.replace('_', '-')} is required by the estimate")
    return int(value)


def padded_vocab(flags: Dict[str, object], tp: int) -> int:
    """Megatron's padded vocabulary: the tokenizer's size rounded up to make-vocab-size-divisible-by x TP."""
    if "vocab_size" in flags:
        raw = _int(flags, "vocab_size")
    else:
        model = str(flags.get("tokenizer_model", ""))
        raw = next((n for prefix, n in TOKENIZER_VOCAB.items() if model.startswith(prefix)), None)
        if raw is None:
            raise ValueError(f"--tokenizer-model {model!r}: vocabulary size unknown to the estimate; "
                             f"add --vocab-size to the config")
    multiple = _int(flags, "make_vocab_size_divisible_by", 128) * tp
    return int(math.ceil(raw / multiple) * multiple)


def shape_from_flags(flags: Dict[str, object], config_path: str, dp: Optional[int] = None) -> Shape:
    """Read a Shape from parsed flags; DP defaults to the Libra pool size (the smallest job)."""
    tp, pp, cp = (_int(flags, n, 1) for n in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                              "context_parallel_size"))
    libra, tau, pool = _libra_knobs(flags, config_path)
    heads = _int(flags, "num_attention_heads")
    recompute = 0
    if flags.get("recompute_granularity") == "full":
        if flags.get("recompute_method", "uniform") != "uniform":
            raise ValueError("--recompute-method: the estimate models 'uniform' full recompute only")
        recompute = _int(flags, "recompute_num_layers", 1)
    elif flags.get("recompute_granularity") not in (None, True):
        raise ValueError(f"--recompute-granularity {flags['recompute_granularity']}: the estimate models "
                         f"'full' or no recompute")
    hidden = _int(flags, "hidden_size")
    if dp is None and not libra:
        raise ValueError(f"{config_path}: no --libra-config to take the pool size (the smallest DP) from; pass --dp")
    return Shape(
        num_layers=_int(flags, "num_layers"), hidden=hidden, ffn=_int(flags, "ffn_hidden_size", 4 * hidden),
        heads=heads, kv_heads=_int(flags, "num_query_groups", heads) if flags.get("group_query_attention") else heads,
        head_dim=_int(flags, "kv_channels", hidden // heads), vocab=padded_vocab(flags, tp),
        num_experts=_int(flags, "num_experts", 0), moe_ffn=_int(flags, "moe_ffn_hidden_size", 0),
        topk=_int(flags, "moe_router_topk", 2), seq_len=_int(flags, "seq_length"), tp=tp, pp=pp, cp=cp,
        ep=_int(flags, "expert_model_parallel_size", 1), etp=_int(flags, "expert_tensor_parallel_size", tp),
        dp=int(dp or pool), sequence_parallel=bool(flags.get("sequence_parallel")) and tp > 1,
        bf16=bool(flags.get("bf16")), distributed_optimizer=bool(flags.get("use_distributed_optimizer")),
        recompute_layers=recompute, untied=bool(flags.get("untie_embeddings_and_output_weights")),
        bias=not flags.get("disable_bias_linear"), swiglu=bool(flags.get("swiglu")),
        qk_layernorm=bool(flags.get("qk_layernorm")), libra=libra, tau=tau, logit_bytes=_logit_bytes(flags),
    )


def _logit_bytes(flags: Dict[str, object]) -> int:
    """bf16: output 2 B (+ 4 B fp32 softmax unless TE's fused kernel); fp32: the softmax reuses the output."""
    if not flags.get("bf16"):
        return 4
    fused_te = flags.get("cross_entropy_loss_fusion") and flags.get("cross_entropy_fusion_impl") == "te"
    return 2 if fused_te else 6


def _libra_knobs(flags: Dict[str, object], config_path: str):
    """(Libra on?, tau, pool size) from --libra-config and --libra-* flags (flags win, as in the launcher)."""
    from libra_megatron.config import LibraConfig

    cfg = LibraConfig()
    if "libra_config" in flags:
        cfg = LibraConfig.from_yaml(str(_resolve(str(flags["libra_config"]), config_path)))
    tau = float(flags.get("libra_tau", cfg.tau))
    pool = int(flags.get("libra_pool_size", cfg.pool_size))
    on = "libra_config" in flags or any(k.startswith("libra_") for k in flags)
    return on, tau, pool


# =============================================================================== the estimate
def _check_layout(s: Shape) -> None:
    if s.num_layers % s.pp:
        raise ValueError(f"--num-layers {s.num_layers} must be divisible by --pipeline-model-parallel-size {s.pp}")
    if s.recompute_layers and (s.num_layers // s.pp) % s.recompute_layers:
        raise ValueError(f"layers per stage {s.num_layers}/{s.pp} must be divisible by --recompute-num-layers "
                         f"{s.recompute_layers}")
    if s.num_experts:
        if (s.dp * s.cp * s.tp) % (s.ep * s.etp):
            raise ValueError(f"EP x ETP = {s.ep}x{s.etp} must divide DP x CP x TP = {s.dp}x{s.cp}x{s.tp}")
        if s.num_experts % s.ep:
            raise ValueError(f"--num-experts {s.num_experts} must be divisible by EP {s.ep}")


def layer_params(s: Shape) -> Dict[str, float]:
    """Parameters of one transformer layer on one GPU: {"dense": ..., "expert": ...}."""
    h, d, tp = s.hidden, s.head_dim, s.tp
    qkv = (s.heads + 2 * s.kv_heads) * d
    dense = 2 * h + (2 * d if s.qk_layernorm else 0)  # two RMSNorm weights (+ q/k norms)
    dense += (h * qkv + s.heads * d * h) / tp + ((qkv / tp + h) if s.bias else 0)
    expert = 0.0
    if s.num_experts:
        dense += s.num_experts * h  # router, replicated
        per_expert = (3 if s.swiglu else 2) * h * s.moe_ffn / s.etp
        expert = s.num_experts / s.ep * per_expert
    else:
        up = 2 * s.ffn if s.swiglu else s.ffn
        dense += (h * up + s.ffn * h) / tp + ((up / tp + h) if s.bias else 0)
    return {"dense": dense, "expert": expert}


def stage_params(s: Shape, stage: int) -> Dict[str, float]:
    """Parameters of PP stage ``stage`` on one GPU (embedding on the first, norm + output on the last)."""
    per_layer = layer_params(s)
    n = s.num_layers // s.pp
    dense, expert = n * per_layer["dense"], n * per_layer["expert"]
    table = s.vocab * s.hidden / s.tp
    if stage == 0:
        dense += table
    if stage == s.pp - 1:
        dense += s.hidden + (table if (s.untied or s.pp > 1) else 0)
    return {"dense": dense, "expert": expert}


def layer_activation_bytes(s: Shape) -> float:
    """Bytes one layer keeps for backward, bf16, core attention excluded (see the module docstring)."""
    t = s.seq_len / s.cp
    t_sp = t / s.tp if s.sequence_parallel else t
    h, d, a = s.hidden, s.head_dim, _elem(s)
    attention = 2 * t_sp * h * a + t * (s.heads + 2 * s.kv_heads) * d / s.tp * a + t * s.heads * d / s.tp * a
    if s.num_experts:
        routed = t_sp * s.topk * s.etp
        mlp = 2 * t_sp * h * a + 8 * t_sp * s.num_experts + routed * (2 * h + 3 * s.moe_ffn / s.etp) * a
    else:
        mlp = 2 * t_sp * h * a + 3 * t * s.ffn / s.tp * a
    return attention + mlp


def core_attention_bytes(s: Shape) -> float:
    """Bytes the core attention of one layer keeps: Libra ARRANGED, or a stock kernel's q, k, o, lse."""
    t = s.seq_len / s.cp
    hq, hkv, d, a = s.heads / s.tp, s.kv_heads / s.tp, s.head_dim, _elem(s)
    if s.libra:
        share = (1 + s.tau) * t
        return 2 * share * hq * d * a + 4 * share * hq + 2 * s.seq_len * hkv * d * a
    return t * (2 * hq + hkv) * d * a + 4 * t * hq


def _elem(s: Shape) -> int:
    """Bytes of one activation element: bf16 or fp32."""
    return 2 if s.bf16 else 4


def stage_memory(s: Shape, stage: int) -> Dict[str, float]:
    """Bytes per GPU of PP stage ``stage``, by component (COMPONENTS)."""
    p = stage_params(s, stage)
    local = p["dense"] + p["expert"]
    dense_shards = s.dp * s.cp if s.distributed_optimizer else 1
    expert_shards = (s.dp * s.cp * s.tp) // (s.ep * s.etp) if s.distributed_optimizer else 1
    state = 12 if s.bf16 else 8
    n = s.num_layers // s.pp
    in_flight = s.pp - stage  # 1F1B: microbatches whose activations a stage holds at once
    t = s.seq_len / s.cp
    t_sp = t / s.tp if s.sequence_parallel else t
    live = s.recompute_layers or n  # layers whose saved tensors exist at once
    if s.recompute_layers:
        checkpoints = in_flight * (n // s.recompute_layers) * t_sp * s.hidden * _elem(s)
        activations = checkpoints + live * layer_activation_bytes(s)
        attention = live * core_attention_bytes(s)
    else:
        activations = in_flight * n * layer_activation_bytes(s)
        attention = in_flight * n * core_attention_bytes(s)
    return {
        "params": local * (2 if s.bf16 else 4),
        "grads": local * 4,
        "optimizer": state * (p["dense"] / dense_shards + p["expert"] / expert_shards),
        "activations": activations,
        "logits": (t * s.vocab / s.tp * s.logit_bytes) if stage == s.pp - 1 else 0.0,
        "libra": attention if s.libra else 0.0,
        "core_attention": 0.0 if s.libra else attention,
    }


def estimate(s: Shape) -> List[Dict[str, float]]:
    """Per-stage memory (bytes by component; stock core attention counted under activations)."""
    _check_layout(s)
    out = []
    for stage in range(s.pp):
        mem = stage_memory(s, stage)
        mem["activations"] += mem.pop("core_attention")
        mem["total"] = sum(mem[k] for k in COMPONENTS)
        out.append(mem)
    return out


# =============================================================================== header text
def header_lines(config_path: str, dp: Optional[int] = None) -> List[str]:
    """The header block of ``config_path``: a title line, one line per PP stage, one line of assumptions."""
    s = shape_from_flags(parse_flags(read_config(config_path)), config_path, dp)
    stages = estimate(s)
    lines = [HEADER_BEGIN]
    for i, mem in enumerate(stages):
        parts = ", ".join(f"{LABELS[k]} {mem[k] / GIB:.1f}" for k in COMPONENTS)
        lines.append(f"{HEADER_PREFIX}PP stage {i}: {parts}; total {mem['total'] / GIB:.1f} GiB")
    world = s.dp * s.cp * s.tp * s.pp
    recompute = f"full recompute of {s.recompute_layers} layer(s) at a time" if s.recompute_layers else "no recompute"
    lines.append(f"{HEADER_PREFIX}assumes DP={s.dp} ({world} GPUs), L/CP={s.seq_len // s.cp} tokens per CP rank, "
                 f"{'bf16 params + fp32 main grads' if s.bf16 else 'fp32'}, "
                 f"{'distributed ' if s.distributed_optimizer else ''}Adam,")
    lines.append(f"{HEADER_PREFIX}{recompute}, {s.pp} microbatch(es) in flight on stage 0 (1F1B)")
    return lines


def replace_header(text: str, lines: List[str]) -> str:
    """``text`` with its estimate block (HEADER_BEGIN and the ``#   `` lines after it) replaced by ``lines``,
    or ``lines`` inserted after the leading comment block when it has none."""
    rows = text.splitlines()
    if HEADER_BEGIN in rows:
        start = rows.index(HEADER_BEGIN)
        end = start + 1
        while end < len(rows) and rows[end].startswith(HEADER_PREFIX):
            end += 1
    else:
        start = end = next((i for i, r in enumerate(rows) if not r.startswith("#")), len(rows))
    return "\n".join(rows[:start] + lines + rows[end:]) + "\n"


def current_header(text: str) -> List[str]:
    """The estimate block as it stands in a config file ([] when it has none)."""
    rows = text.splitlines()
    if HEADER_BEGIN not in rows:
        return []
    start = rows.index(HEADER_BEGIN)
    end = start + 1
    while end < len(rows) and rows[end].startswith(HEADER_PREFIX):
        end += 1
    return rows[start:end]


def _main(argv: List[str]) -> int:
    parser = ArgumentParser(prog="estimate_memory", description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("configs", nargs="+", help="run config args files (configs/qwen3-*.args)")
    parser.add_argument("--dp", type=int, default=None, help="data-parallel size (default: the Libra pool size)")
    parser.add_argument("--write", action="store_true", help="write the block into each config's header")
    add_debug_argument(parser)
    args = parser.parse_args(argv)
    for path in args.configs:
        lines = header_lines(path, args.dp)
        if args.write:
            text = Path(path).read_text(encoding="utf-8")
            Path(path).write_text(replace_header(text, lines), encoding="utf-8")
        if len(args.configs) > 1:
            print(f"== {path}")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    run_cli("estimate_memory", _main, sys.argv[1:])
