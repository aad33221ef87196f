"""Start-up checks on what Megatron-LM builds from the flags, all before any distributed start.

``check_model(args, device_capability)`` runs, on the args ``parse_args`` returned:

1. Megatron-LM's own ``validate_args`` (quietly; an assertion becomes a one-line ValueError). Without a GPU
   (``--check-only`` on a login node) its two device queries -- ``get_device_arch_version`` (the
   CUDA_DEVICE_MAX_CONNECTIONS rule before Blackwell) and ``torch.cuda.get_device_capability`` (grouped GEMM
   needs sm80+) -- are answered with ``device_capability`` for the duration of the call, and the launcher says
   so; with a GPU they ask the GPU.
2. the full-size ``TransformerConfig`` (``core_transformer_config_from_args``, what ``gpt_builder`` builds the
   model from; its ``__post_init__`` holds most of Megatron's model rules, e.g. "Do not set
   --moe-layer-recompute with full recompute granularity"). No weights are allocated.
3. every attention setting of that config that ``LibraCoreAttention`` does not implement (``ATTENTION_RULES``,
   derived from what megatron-core 0.16.1's ``DotProductAttention`` and ``TEDotProductAttention`` consume;
   the accepted ones and why are in docs/launcher.md).
4. the ``--spec MODULE NAME`` object, resolved the way ``gpt_builders.py`` does (``import_module``), and that
   it puts ``LibraCoreAttention`` into the layers.

``on_model_parallel_ready`` runs 2-4 again inside the run, on the args Megatron validated itself.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import linecache
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Tuple

__all__ = ["AttentionRule", "ATTENTION_RULES", "check_attention_config", "validate_megatron_args",
           "build_transformer_config", "resolve_spec", "check_model", "device_capability_answers"]


# ---------------------------------------------------------------------------------------- attention settings
@dataclass(frozen=True)
class AttentionRule:
    """A TransformerConfig attention field LibraCoreAttention does not implement: refused unless ``accepted``."""

    field: str
    flag: str
    accepted: Callable[[Any], bool]
    why: str

    def problem(self, config: Any) -> Optional[str]:
        value = getattr(config, self.field, None)
        if self.accepted(value):
            return None
        shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else getattr(value, "name", value)
        return f"{self.flag} {shown}: {self.why}"


ATTENTION_RULES: Tuple[AttentionRule, ...] = (
    AttentionRule("window_size", "--window-size", lambda v: v is None,
                  "sliding-window attention is not implemented by LibraCoreAttention (its plans and kernels are "
                  "full causal per document); drop --window-size (and --window-attn-skip-freq)"),
    AttentionRule("softmax_type", "--softmax-type", lambda v: v == "vanilla",
                  "LibraCoreAttention implements the vanilla softmax only (no off-by-one or learnable offset); "
                  "use --softmax-type vanilla"),
    AttentionRule("qk_clip", "--qk-clip", lambda v: not v,
                  "QK-clip needs the max attention logit from the attention kernel, which Libra's kernels do not "
                  "return"),
    AttentionRule("log_max_attention_logit", "--log-max-attention-logit", lambda v: not v,
                  "the max attention logit is not returned by Libra's kernels"),
    AttentionRule("batch_invariant_mode", "--batch-invariant-mode", lambda v: not v,
                  "Libra's tile placement changes which key blocks a kernel call reduces together, so its attention "
                  "is not batch-invariant"),
    AttentionRule("use_kitchen_attention", "--use-kitchen-attention", lambda v: not v,
                  "Kitchen attention would replace the core attention that Libra replaces; drop one of them"),
    AttentionRule("experimental_attention_variant", "--experimental-attention-variant", lambda v: v is None,
                  "the attention variant's module would be replaced by the --spec's LibraCoreAttention (the "
                  "variant would silently not run)"),
    AttentionRule("attention_backend", "--attention-backend", lambda v: getattr(v, "name", v) == "auto",
                  "selects Transformer Engine's attention kernels, which LibraCoreAttention does not use; choose "
                  "Libra's kernel with --libra-kernel-backend"),
    AttentionRule("fp8_dot_product_attention", "fp8_dot_product_attention", lambda v: not v,
                  "Libra's kernels run attention in the input dtype (bf16/fp16), not FP8"),
    AttentionRule("cp_comm_type", "--cp-comm-type", lambda v: v in (None, "p2p", ["p2p"]),
                  "Libra's plan decides every context-parallel transfer of core attention (pools exchange tiles); "
                  "leave --cp-comm-type at its default p2p"),
)
"""Refused TransformerConfig attention settings (accepted ones and the reasons: docs/launcher.md)."""


def check_attention_config(config: Any) -> None:
    """ValueError (one line naming the flag) for the first attention setting LibraCoreAttention does not run.
    ``config``: a TransformerConfig, or Megatron's args (the fields have the same names there)."""
    for rule in ATTENTION_RULES:
        problem = rule.problem(config)
        if problem:
            raise ValueError(problem)


# ---------------------------------------------------------------------------------------- Megatron-LM calls
@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Megatron prints its arguments and warnings on rank 0; a start-up check prints one line at most."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


@contextlib.contextmanager
def device_capability_answers(capability: Optional[Tuple[int, int]]) -> Iterator[None]:
    """While inside: ``validate_args``' device queries answer ``capability`` (None: ask the GPU). Restored after."""
    if capability is None:
        yield
        return
    import torch
    import megatron.training.arguments as arguments

    saved = (arguments.get_device_arch_version, torch.cuda.get_device_capability)
    arguments.get_device_arch_version = lambda: capability[0]
    torch.cuda.get_device_capability = lambda *_a, **_k: tuple(capability)
    try:
        yield
    finally:
        arguments.get_device_arch_version, torch.cuda.get_device_capability = saved


def _assertion_text(err: AssertionError) -> str:
    """An assertion's message, else the asserting source line (Megatron asserts many rules without one)."""
    if str(err).strip():
        return str(err).strip()
    frame = traceback.extract_tb(err.__traceback__)[-1]
    line = linecache.getline(frame.filename, frame.lineno).strip() or "(no source)"
    return f"{line} ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"


def validate_megatron_args(args: argparse.Namespace, capability: Optional[Tuple[int, int]] = None) -> None:
    """Megatron-LM's ``validate_args(args)`` (fills in derived fields, as in the run). ValueError on a rule."""
    from megatron.training.arguments import validate_args

    try:
        with _quiet(), device_capability_answers(capability):
            validate_args(args, {})
    except AssertionError as err:
        raise ValueError(f"Megatron-LM's validate_args refused the flags: {_assertion_text(err)}") from err


def build_transformer_config(args: argparse.Namespace) -> Any:
    """The full-size ``TransformerConfig`` Megatron-LM builds the model from (validated args; no weights)."""
    from megatron.training.arguments import core_transformer_config_from_args

    try:
        with _quiet():
            return core_transformer_config_from_args(args)
    except (AssertionError, ValueError) as err:
        text = _assertion_text(err) if isinstance(err, AssertionError) else str(err).strip()
        raise ValueError(f"Megatron-LM's TransformerConfig refused the flags: {text}") from err


def resolve_spec(args: argparse.Namespace) -> Any:
    """The ``--spec MODULE NAME`` object as ``gpt_builders.py`` gets it (``vars(import(MODULE))[NAME]``), checked
    to put LibraCoreAttention into the layers. ValueError naming the flag when it cannot be had."""
    from .spec import spec_uses_libra_attention

    spec = getattr(args, "spec", None)
    if spec is None or len(spec) != 2:
        raise ValueError(f"--spec {' '.join(spec or [])}: give a module and a name, e.g. --spec "
                         f"libra_megatron.megatron.spec libra_gpt_spec")
    module_name, name = spec
    try:
        module = __import__(module_name, globals(), locals(), [name])
    except ImportError as err:
        raise ValueError(f"--spec {module_name} {name}: module {module_name} cannot be imported ({err})") from err
    if name not in vars(module):
        raise ValueError(f"--spec {module_name} {name}: {module_name} has no attribute {name!r}")
    found = vars(module)[name]
    if not spec_uses_libra_attention(found):
        raise ValueError(f"--spec {module_name} {name}: the spec has no LibraCoreAttention (the Libra batch path "
                         f"would run Megatron's attention on Libra's batches); use libra_megatron.megatron.spec "
                         f"libra_gpt_spec or wrap it with libra_gpt_layer_spec")
    return found


def check_model(args: argparse.Namespace, capability: Optional[Tuple[int, int]] = None, validate: bool = True) -> Any:
    """validate_args (``validate``: False for args Megatron-LM validated itself), the full-size TransformerConfig,
    its attention settings and the --spec (module docstring). Returns the TransformerConfig. ``args`` is
    validated in place (as Megatron-LM does)."""
    check_attention_config(args)  # the same field names: refused before Megatron's own rules for them need TE
    if validate:
        validate_megatron_args(args, capability)
    config = build_transformer_config(args)
    check_attention_config(config)
    resolve_spec(args)
    return config
