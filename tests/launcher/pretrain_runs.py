"""Run Megatron-LM's ``pretrain_gpt.py`` -> ``pretrain()`` on CPU (the test harness) and read back what it logged.

``run_pretrain`` starts torchrun on ``python -m libra_megatron.testing.cpu_shims`` (what
``scripts/cpu_pretrain.sh`` runs) or the script itself, and returns what Megatron printed per iteration
(``lm loss``, ``grad norm``) and what its TensorBoard writer wrote (read with tensorboard's
``EventAccumulator``).

Megatron-LM core_v0.16.1 does not reset its printed-loss accumulator after the *first* iteration of a run
(``training_log``: ``should_reset = not is_first_iteration``), so the printed ``lm loss`` of a run's second
iteration is the mean of its first two; TensorBoard gets every iteration's own value. Runs that start at the
same iteration print comparable values; a resumed run is compared through TensorBoard.
"""
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .megatron_lm import REPO

TINY_CPU_ARGS = {"0.16": REPO / "configs" / "cpu" / "tiny-qwen3.args",
                 "0.19": REPO / "configs" / "cpu" / "tiny-qwen3-core_v0.19.args"}
"""Per release line: the same model, data and steps; only NullTokenizer's --vocab-size differs (256 ids, EOD 255)."""
TRAIN_ITERS = 4  # --train-iters in those files (checked by common_flags)


def common_flags(data_prefix: str, cache_dir: str, release: str = "core_v0.16.1") -> List[str]:
    """pretrain_gpt.py flags shared by the Libra and the plain run of ``release``: configs/cpu/tiny-qwen3*.args
    (the tiny Qwen3 shape, L=1024, GBS=8, 4 iterations) and a real indexed dataset."""
    from libra_megatron.launch import expand_args_files
    from libra_megatron.megatron_lm import release_line

    args_file = str(TINY_CPU_ARGS[release_line(release)])
    flags = expand_args_files(["--megatron-args-file", args_file])
    assert flags[flags.index("--train-iters") + 1] == str(TRAIN_ITERS)
    return ["--megatron-args-file", args_file, "--data-path", data_prefix, "--data-cache-path", cache_dir]


LIBRA_FLAGS = ["--no-create-attention-mask-in-dataloader", "--spec", "libra_megatron.megatron.spec",
               "libra_gpt_spec", "--libra-pool-size", "2", "--libra-block-size", "256",
               "--libra-kernel-backend", "torch"]
"""Libra on: the recommended spec (each layer built from the run's flags, here local layers with
LibraCoreAttention), P=2, 256-token SH-Tile blocks (so TAP has tiles to move at L=1024)."""


def resume_flags(checkpoint: str, train_iters: int) -> List[str]:
    """Flags that load ``checkpoint`` (Megatron's torch_dist format reshards to any TP/PP/DP) and train to
    ``train_iters``. RNG states are not loaded: they are saved per (PP, TP) rank, and the tiny model has no
    dropout, so nothing in training draws from them."""
    return ["--load", checkpoint, "--no-load-rng", "--train-iters", str(train_iters)]


def save_shared_checkpoint(flags: Sequence[str], workdir: Path, megatron_lm: str, train_iters: int,
                           nproc: int = 2) -> str:
    """Train plain Megatron-LM one iteration and save it (torch_dist) for runs of every layout to load.

    ``--train-iters`` is the loading runs' (Megatron's LR schedule in the checkpoint must match it); the run
    stops after iteration 1 with ``--exit-interval 1``. Returns the checkpoint folder."""
    checkpoint = str(workdir / "checkpoint")
    run_pretrain(nproc, list(flags) + ["--train-iters", str(train_iters), "--exit-interval", "1", "--save",
                                       checkpoint, "--save-interval", "1", "--ckpt-format", "torch_dist"],
                 workdir / "save", megatron_lm, without_libra=True).check()
    return checkpoint


@dataclass
class PretrainRun:
    """What one run printed and wrote."""

    returncode: int
    output: str
    printed: Dict[int, Dict[str, str]] = field(default_factory=dict)  # iteration -> {"lm loss", "grad norm"}
    scalars: Dict[str, Dict[int, float]] = field(default_factory=dict)  # TensorBoard tag -> {step: value}
    ledger: List[str] = field(default_factory=list)  # one "<pool key> <host> <pid> <seconds>" per planning call
    plan_files_left: List[str] = field(default_factory=list)  # the shared plan directory's files after the run

    def check(self) -> "PretrainRun":
        tail = "\n".join(self.output.splitlines()[-60:])
        assert self.returncode == 0, f"pretrain run failed (exit {self.returncode}):\n{tail}"
        return self

    def printed_value(self, iteration: int, key: str) -> float:
        return float(self.printed[iteration][key])


_ITERATION_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
_FIELD = re.compile(r" ([a-z ]+): ([-+0-9.eE]+) \|")


def parse_printed(output: str) -> Dict[int, Dict[str, str]]:
    """Megatron's per-iteration log line -> {iteration: {field: printed text}} (lm loss, grad norm, ...)."""
    out: Dict[int, Dict[str, str]] = {}
    for line in output.splitlines():
        match = _ITERATION_LINE.search(line)
        if match:
            out[int(match.group(1))] = {k.strip(): v for k, v in _FIELD.findall(" " + match.group(2))}
    return out


def read_scalars(tensorboard_dir: Path) -> Dict[str, Dict[int, float]]:
    """Every scalar tag of the event files under ``tensorboard_dir`` (tensorboard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def run_pretrain(nproc: int, flags: Sequence[str], workdir: Path, megatron_lm: str,
                 via_script: bool = False, without_libra: bool = False, timeout: int = 600) -> PretrainRun:
    """One torchrun of the CPU harness in ``workdir`` (``--tensorboard-dir`` there); output and scalars."""
    workdir.mkdir(parents=True, exist_ok=True)
    tensorboard = workdir / "tensorboard"
    harness_flags = (["--without-libra"] if without_libra else []) + list(flags)
    harness_flags += ["--tensorboard-dir", str(tensorboard)]
    if via_script:
        cmd = ["bash", str(REPO / "scripts" / "cpu_pretrain.sh"), "--nproc-per-node", str(nproc)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "libra_megatron.testing.cpu_shims"]
    ledger = workdir / "planner_ledger.txt"  # every planner process appends its planning calls (plan_store)
    share = workdir / "plan-share"  # the run's shared plan directory goes below it (plan_store)
    env = dict(os.environ, MEGATRON_LM_PATH=megatron_lm, PYTHONWARNINGS="ignore", LIBRA_PLANNER_LEDGER=str(ledger),
               LIBRA_PLAN_SHARE_DIR=str(share))
    result = subprocess.run(cmd + harness_flags, cwd=workdir, env=env, capture_output=True, text=True,
                            timeout=timeout)
    output = result.stdout + result.stderr
    (workdir / "output.log").write_text(output)
    scalars = read_scalars(tensorboard) if tensorboard.is_dir() else {}
    lines = ledger.read_text().splitlines() if ledger.is_file() else []
    left = sorted(str(p.relative_to(share)) for p in share.rglob("*")) if share.is_dir() else []
    return PretrainRun(result.returncode, output, parse_printed(output), scalars, lines, left)


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def max_relative_difference(run: PretrainRun, reference: PretrainRun, tag: str,
                            steps: Optional[Sequence[int]] = None) -> float:
    """Largest relative difference of TensorBoard ``tag`` over ``steps`` (default 1..TRAIN_ITERS)."""
    steps = list(range(1, TRAIN_ITERS + 1)) if steps is None else list(steps)
    return max(relative_difference(run.scalars[tag][s], reference.scalars[tag][s]) for s in steps)
