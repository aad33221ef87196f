"""LibraConfig: the knobs of Libra (P, H, B, M, tau) and the algorithm choices, validated against a model.

Pure Python (no torch, no megatron): the planner, the simulator and the Megatron glue all read it.
Every violation raises ``ValueError`` naming the arithmetic and where the value came from: a value read
from a YAML file is named by its key and ``file:line`` (``pool_size (configs/x.yaml:3)``), one set by a
tool's own flag (``from_flags``) by that flag (``--pool-size``), any other by its Megatron flag and key
(``--libra-pool-size (pool_size)``). A config remembers this per key; ``replace`` forgets it for the keys
it changes, so a ``--libra-*`` flag that overrides the file is named as that flag.

YAML format (``from_yaml``; ``to_yaml`` writes the first form): the keys under one top-level ``libra:``
key, or all at top level -- not both. Unknown, duplicate and missing keys, syntax errors, bytes that are
not UTF-8 and non-finite numbers are errors naming ``file:line``. A file with no keys is an error (to run
with every default, leave ``--libra-config`` out).
"""
from __future__ import annotations

import difflib
import enum
import math
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional, Tuple, Union

__all__ = [
    "LibraConfig",
    "SequencePlacement",
    "TilePlacement",
    "PackingMode",
    "KernelBackendName",
    "TokenLayoutKind",
    "SaveModeName",
    "TilingPolicy",
    "KvFetch",
    "flag_name",
    "AUTO_CHUNKS",
    "chunks_value",
    "heads_per_tensor_parallel_rank",
]


class SequencePlacement(str, enum.Enum):
    """How the GBS packed sequences of one optimizer step are grouped into pools (§4.2)."""

    CONTIGUOUS = "contiguous"  # sampler order, no balancing (VRSP off)
    ALG1 = "alg1"  # the paper's exact-cardinality LPT, Algorithm 1
    REFINED = "refined"  # Algorithm 1 followed by pairwise-swap refinement; never worse than ALG1
    SYNC = "sync"  # balance what the step waits for: lane totals, then each lane's microbatches (plan.sequences.lanes);
    # per instance (REFINED) where an EP group ties lanes


class TilePlacement(str, enum.Enum):
    """How SH-Tiles are assigned to the P*CP workers of one pool (§4.3.2)."""

    HOME = "home"  # no migration: every tile runs at its Q-home (TAP off)
    ALG2 = "alg2"  # the paper's communication-aware greedy, Algorithm 2
    REFINED = "refined"  # Algorithm 2 then local moves that lower max load, never worse than ALG2
    TIME = "time"  # Algorithm 2 then moves that lower the slowest worker's compute + exposed comm (plan.tiles.timeaware)
    DENSE = "dense"  # Algorithm 2, its node export, time-aware moves: the fastest whole layer (placement._run_dense)


class PackingMode(str, enum.Enum):
    """How raw documents become fixed-token packed sequences (simulator / synthetic data only)."""

    MEGATRON = "megatron"  # shuffle, concatenate, cut every L tokens (GPTDataset)
    BEST_FIT = "best_fit"  # best-fit-decreasing bins of L tokens; documents > L are cut


class KernelBackendName(str, enum.Enum):
    """Attention kernel used by the runtime operator (see ``runtime/kernels``)."""

    AUTO = "auto"  # fp16/bf16 on CUDA: flash-attn if it imports, else torch_flash; otherwise torch
    FLASH = "flash"  # flash-attn 2.6-2.8 varlen kernels
    TORCH_FLASH = "torch_flash"  # torch's own FlashAttention varlen kernels (aten::_flash_attention_*)
    TORCH = "torch"  # exact reference (fp32/fp64 compute), any device


class SaveModeName(str, enum.Enum):
    """What the Libra operator keeps for backward (docs/runtime.md, "Save vs re-exchange")."""

    AUTO = "auto"  # per pool plan: arranged if the predicted worst-rank bytes fit activation_budget_gb
    ARRANGED = "arranged"  # keep the destination-side Q, K|V, O, lse: no extra backward traffic
    REFETCH = "refetch"  # keep local q, k, v, out and lse; backward re-sends Q, K|V, O


class TokenLayoutKind(str, enum.Enum):
    """How a packed sequence of L tokens is split over the CP ranks of its CP group."""

    CONTIGUOUS = "contiguous"  # rank c holds [c*L/CP, (c+1)*L/CP)
    ZIGZAG = "zigzag"  # Megatron's 2*CP chunks: rank c holds chunks c and 2*CP-1-c

    def num_cp_chunks(self, cp: int) -> int:
        """CP chunks a packed sequence is cut into: 2*CP for zigzag with CP > 1, else CP (the one statement of
        the rule: ``plan.layout.TokenLayout``, the Megatron batch and the simulator read it here)."""
        return 2 * cp if self is TokenLayoutKind.ZIGZAG and cp > 1 else cp


class TilingPolicy(str, enum.Enum):
    """How sequences are cut into SH-Tile blocks (§4.3.1)."""

    UNIFORM = "uniform"  # the paper: blocks of B tokens (also cut at CP chunk boundaries)
    ADAPTIVE = "adaptive"  # uniform, then blocks heavier than half of Alg. 2's C are halved (at most 3 times)


class KvRelay(str, enum.Enum):
    """Whether exchange plans relay K/V between nodes (``plan.exchange``, "Relay"; issue 14)."""

    OFF = "off"  # every destination fetches its K/V from the home worker (the paper)
    AUTO = "auto"  # one destination per node fetches a home run its node needs several times and forwards it
    # over the node's links, unless the Pipeliner timeline prices the pool's slowest worker slower with it


class KvFetch(str, enum.Enum):
    """Which K/V rows a destination fetches for the documents its tiles read (§4.3.3)."""

    GROUP = "group"  # the paper: every referenced KV group complete
    PREFIX = "prefix"  # only the causal prefix [doc start, last query row of its hosted tiles)


_FLAGS = {
    "pool_size": "--libra-pool-size",
    "head_split": "--libra-head-split",
    "block_size": "--libra-block-size",
    "num_chunks": "--libra-num-chunks",
    "tau": "--libra-tau",
    "sequence_placement": "--libra-sequence-placement",
    "tile_placement": "--libra-tile-placement",
    "packing": "--libra-packing",
    "kernel_backend": "--libra-kernel-backend",
    "token_layout": "--libra-token-layout",
    "save_mode": "--libra-save-mode",
    "activation_budget_gb": "--libra-activation-budget-gb",
}


def flag_name(key: str) -> str:
    """The command-line flag that sets config field ``key``."""
    return _FLAGS.get(key, "--libra-" + key.replace("_", "-"))


_Label = Tuple[str, str]  # how messages name a key: (full name, short name inside arithmetic)


def _name(key: str, label: Optional[_Label] = None) -> str:
    """How a message names config key ``key``: its label (YAML ``key (file:line)``, a tool's own flag), else
    ``--libra-flag (key)``."""
    return label[0] if label else f"{flag_name(key)} ({key})"


def _short(key: str, label: Optional[_Label] = None) -> str:
    """The short name of ``key`` inside arithmetic (``num_attention_heads/head_split``)."""
    return label[1] if label else flag_name(key)


def _yaml_label(key: str, where: str) -> _Label:
    return f"{key} ({where})", key


AUTO_CHUNKS = "auto"  # num_chunks: auto (LibraConfig.chunks_for)


def chunks_value(text: str) -> Union[int, str]:
    """A command-line M: ``auto`` or an integer (argparse ``type``; its ValueError names the value)."""
    return AUTO_CHUNKS if text == AUTO_CHUNKS else int(text)


def heads_per_tensor_parallel_rank(count: int, flag: str, tp: int, tp_flag: str) -> int:
    """``count`` heads (query heads or K/V groups) of the model split over ``tp`` tensor-parallel ranks, as
    Megatron-LM splits them: what one rank's Libra operator plans over and runs. ValueError names ``flag`` and
    ``tp_flag`` when ``tp`` does not divide ``count``."""
    if count % tp:
        raise ValueError(f"{flag} {count} must be divisible by {tp_flag} {tp} (each tensor-parallel rank runs "
                         f"{flag} / {tp_flag} heads; {count} % {tp} = {count % tp})")
    return count // tp


@dataclass(frozen=True)
class LibraConfig:
    """Libra knobs. Field names are the YAML keys; each has a ``--libra-*`` flag (see ``flag_name``)."""

    pool_size: int = 1
    """P: DP replicas per sequence pool (pool = P*CP workers). P | DP. P=1 disables cross-group exchange."""
    head_split: int = 1
    """H: query heads are cut into H equal shards (SH-Tiles, Eq. 5). H | num_attention_heads."""
    block_size: int = 4096
    """B: tokens per sequence block of an SH-Tile. Blocks never straddle two Q-homes (cut there too)."""
    num_chunks: Union[int, str] = 4
    """M: Pipeliner head chunks per tile (§4.4). M | num_attention_heads/H. Paper default 4. ``auto``: as many
    chunks as one head shard of one TP rank has K/V heads (at least 1), so that every chunk owns its K/V head and
    sends its dK|dV home in bf16 right after its own compute (``chunks_for``; resolved by ``validate``)."""
    tau: float = 0.03
    """Load slack of Algorithm 2: target C = (1+tau)*mean worker load. Paper default 0.03."""
    sequence_placement: SequencePlacement = SequencePlacement.SYNC
    """Inter-pool placement of packed sequences: contiguous | alg1 | refined | sync (balance lane totals and
    each lane's microbatches, per instance where EP ties lanes; ``plan.sequences.lanes``)."""
    tile_placement: TilePlacement = TilePlacement.ALG2
    """Intra-pool SH-Tile placement: home | alg2 | refined | time (Alg. 2, then moves that lower the predicted
    slowest worker's compute + exposed comm under ``plan.model.timing``'s default rates; never slower than alg2 there)."""
    packing: PackingMode = PackingMode.MEGATRON
    """Packing used by the simulator and synthetic corpora; GPTDataset training always packs megatron-style."""
    kernel_backend: KernelBackendName = KernelBackendName.AUTO
    """Attention kernel of the runtime operator: auto | flash | torch."""
    token_layout: TokenLayoutKind = TokenLayoutKind.ZIGZAG
    """CP token layout of each packed sequence: contiguous | zigzag (Megatron's 2*CP split)."""
    save_mode: SaveModeName = SaveModeName.AUTO
    """What the operator keeps for backward: auto | arranged | refetch (auto decides per pool plan)."""
    activation_budget_gb: float = 16.0
    """GiB per GPU that save_mode=auto lets the kept destination tensors use for one microbatch, summed over
    the layers of this pipeline stage whose tensors are alive at once (all of them; with Megatron-LM's
    --recompute-granularity full, the recomputed ones: ``plan.model.memory.saved_layers``), as the planner
    predicts them for the pool's worst rank; above it: refetch."""
    tiling: TilingPolicy = TilingPolicy.ADAPTIVE
    """SH-Tile blocks: uniform (the paper) | adaptive (blocks above C/2 of Alg. 2 are halved, >= B/8 tokens)."""
    kv_fetch: KvFetch = KvFetch.PREFIX
    """K/V a destination fetches per document: group (the paper, whole) | prefix (causal prefix only)."""
    kv_relay: KvRelay = KvRelay.OFF
    """K/V relay between nodes: off (the paper) | auto (per pool plan, when the timeline prices it no slower)."""

    def __post_init__(self) -> None:
        _coerce_enums(self)
        self._validate_standalone()

    # ------------------------------------------------------------------ where values came from
    def _labels(self) -> Dict[str, _Label]:
        return self.__dict__.get("_key_labels", {})

    def _name(self, key: str) -> str:
        return _name(key, self._labels().get(key))

    def _short(self, key: str) -> str:
        return _short(key, self._labels().get(key))

    @classmethod
    def _build(cls, values: Mapping[str, Any], labels: Mapping[str, _Label]) -> "LibraConfig":
        """``cls(**values)`` that knows, already while validating, how to name each value's source."""
        config = cls.__new__(cls)
        object.__setattr__(config, "_key_labels", dict(labels))
        config.__init__(**values)
        return config

    @classmethod
    def from_flags(cls, values: Mapping[str, Any], flags: Mapping[str, str]) -> "LibraConfig":
        """Config set by a tool's own flags: errors name ``flags[key]`` (``--pool-size``), not ``--libra-*``."""
        return cls._build(values, {key: (flag, flag) for key, flag in flags.items()})

    # ------------------------------------------------------------------ validation
    def _validate_standalone(self) -> None:
        for key in ("pool_size", "head_split", "block_size", "num_chunks"):
            value = getattr(self, key)
            if key == "num_chunks" and value == AUTO_CHUNKS:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                also = f" or {AUTO_CHUNKS}" if key == "num_chunks" else ""
                raise ValueError(f"{self._name(key)} must be a positive integer{also}, got {value!r}")
        for key in ("tau", "activation_budget_gb"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{self._name(key)} must be a finite number >= 0, got {value!r}")

    def validate(
        self,
        *,
        num_attention_heads: int,
        num_query_groups: Optional[int] = None,
        data_parallel_size: int = 1,
        context_parallel_size: int = 1,
        seq_length: Optional[int] = None,
        micro_batch_size: int = 1,
        global_batch_size: Optional[int] = None,
    ) -> "LibraConfig":
        """Check the knobs against a model and parallel layout (heads of one TP rank); returns self, or with
        ``num_chunks: auto`` a copy whose M is resolved (``chunks_for``). Raises ValueError."""
        hq = num_attention_heads
        hkv = num_query_groups or hq
        if hq % hkv:
            raise ValueError(f"num_query_groups {hkv} must divide num_attention_heads {hq}")
        if self.num_chunks == AUTO_CHUNKS:
            return self._with_chunks(self.chunks_for(hq, hkv)).validate(
                num_attention_heads=hq, num_query_groups=hkv, data_parallel_size=data_parallel_size,
                context_parallel_size=context_parallel_size, seq_length=seq_length,
                micro_batch_size=micro_batch_size, global_batch_size=global_batch_size)
        if data_parallel_size % self.pool_size:
            raise ValueError(
                f"{self._name('pool_size')} {self.pool_size} must divide the data-parallel size "
                f"{data_parallel_size} ({data_parallel_size} % {self.pool_size} = "
                f"{data_parallel_size % self.pool_size})"
            )
        if hq % self.head_split:
            raise ValueError(
                f"{self._name('head_split')} {self.head_split} must divide num_attention_heads {hq}"
            )
        heads_per_shard = hq // self.head_split
        if heads_per_shard % self.num_chunks:
            raise ValueError(
                f"{self._name('num_chunks')} {self.num_chunks} must divide num_attention_heads/"
                f"{self._short('head_split')} = {hq}/{self.head_split} = {heads_per_shard}"
            )
        self._validate_gqa_pieces(hq, hkv)
        if micro_batch_size != 1:
            raise ValueError(
                f"Libra requires --micro-batch-size 1 (one packed sequence per microbatch), got {micro_batch_size}"
            )
        if global_batch_size is not None:
            self._validate_batch(global_batch_size, data_parallel_size, micro_batch_size)
        if seq_length is not None:
            self._validate_layout(seq_length, context_parallel_size)
        return self

    def chunks_for(self, num_attention_heads: int, num_query_groups: Optional[int] = None) -> int:
        """M for these heads (one TP rank's): the knob itself, or for ``auto`` the K/V heads of one head shard,
        ``num_query_groups // head_split``, at least 1 (a shard inside one K/V head: one chunk). It divides the
        query heads of a shard whenever H divides the query heads."""
        if self.num_chunks != AUTO_CHUNKS:
            return self.num_chunks
        return max(1, (num_query_groups or num_attention_heads) // self.head_split)

    def _with_chunks(self, num_chunks: int) -> "LibraConfig":
        """This config with M resolved; M keeps the label of where ``auto`` came from."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return type(self)._build({**values, "num_chunks": num_chunks}, self._labels())

    def _validate_gqa_pieces(self, hq: int, hkv: int) -> None:
        piece = hq // (self.head_split * self.num_chunks)  # query heads per chunk piece
        group = hq // hkv  # query heads sharing one kv head
        if piece % group and group % piece:
            raise ValueError(
                f"query heads per chunk piece num_attention_heads/({self._short('head_split')}*"
                f"{self._short('num_chunks')}) = {hq}/({self.head_split}*{self.num_chunks}) = {piece} "
                f"must be a multiple or a divisor of the GQA group size {hq}/{hkv} = {group}"
            )
        H = self.head_split
        if H % hkv and hkv % H:
            raise ValueError(
                f"{self._short('head_split')} {H} and num_query_groups {hkv}: one must divide the other "
                f"({H} % {hkv} = {H % hkv}, {hkv} % {H} = {hkv % H}), so that a head shard covers whole kv heads "
                f"or lies inside one"
            )

    def _validate_batch(self, gbs: int, dp: int, mbs: int) -> None:
        if gbs % (dp * mbs):
            raise ValueError(f"--global-batch-size {gbs} must be divisible by DP*mbs = {dp}*{mbs}")
        if gbs % self.pool_size:
            raise ValueError(
                f"--global-batch-size {gbs} must be divisible by {self._name('pool_size')} {self.pool_size}"
            )

    def _validate_layout(self, seq_length: int, cp: int) -> None:
        chunks = self.token_layout.num_cp_chunks(cp)
        if seq_length % chunks:
            raise ValueError(
                f"--seq-length {seq_length} must be divisible by {chunks} CP chunks "
                f"({self._name('token_layout')}={self.token_layout.value}, CP={cp})"
            )

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], *, source: str = "config",
                     lines: Optional[Mapping[str, int]] = None) -> "LibraConfig":
        """Config from ``{key: value}`` read from ``source``; errors name ``source`` (``:line`` from ``lines``)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: expected a mapping of Libra keys, got {type(data).__name__}")
        lines = lines or {}
        where = {k: f"{source}:{lines[k]}" if k in lines else source for k in data}
        known = [f.name for f in fields(cls)]
        for key in data:
            if key not in known:
                raise ValueError(f"{where[key]}: unknown Libra key {key!r}{_did_you_mean(key, known)}; "
                                 f"known keys (at top level or under 'libra:'): {', '.join(known)}")
            value = data[key]
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{_name(key, _yaml_label(key, where[key]))} must be a finite number, got {value!r}")
        return cls._build(dict(data), {k: _yaml_label(k, w) for k, w in where.items()})

    @classmethod
    def from_yaml(cls, path: str, *, flag: Optional[str] = None) -> "LibraConfig":
        """Config from a YAML file (format: module docstring). ``flag`` (``--libra-config``) prefixes file errors."""
        from .config_yaml import read_libra_yaml

        data, lines = read_libra_yaml(path, flag)
        return cls.from_mapping(data, source=str(path), lines=lines)

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.value if isinstance(value, enum.Enum) else value
        return out

    def to_yaml(self, path: Optional[str] = None) -> str:
        import yaml

        text = yaml.safe_dump({"libra": self.to_dict()}, sort_keys=False)
        if path is not None:
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)
        return text

    def replace(self, **changes: Any) -> "LibraConfig":
        """A copy with ``changes``; the changed keys forget their YAML origin (a ``--libra-*`` flag set them)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = sorted(set(changes) - set(values))
        if unknown:
            raise TypeError(f"LibraConfig.replace: unknown field(s) {unknown}")
        labels = {k: v for k, v in self._labels().items() if k not in changes}
        return type(self)._build({**values, **changes}, labels)


def _did_you_mean(key: Any, known) -> str:
    close = difflib.get_close_matches(str(key), known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_ENUM_FIELDS = {
    "sequence_placement": SequencePlacement,
    "tile_placement": TilePlacement,
    "packing": PackingMode,
    "kernel_backend": KernelBackendName,
    "token_layout": TokenLayoutKind,
    "save_mode": SaveModeName,
    "tiling": TilingPolicy,
    "kv_fetch": KvFetch,
    "kv_relay": KvRelay,
}


def _coerce_enums(cfg: LibraConfig) -> None:
    for key, kind in _ENUM_FIELDS.items():
        value = getattr(cfg, key)
        if isinstance(value, kind):
            continue
        try:
            object.__setattr__(cfg, key, kind(value))
        except (ValueError, TypeError):
            choices = ", ".join(m.value for m in kind)
            raise ValueError(f"{cfg._name(key)} must be one of {{{choices}}}, got {value!r}") from None
