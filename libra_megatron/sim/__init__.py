"""Corpus simulator: replays VRSP and TAP over every GBS window of a length trace (§5).

Imports only ``libra_megatron.plan`` and ``libra_megatron.config`` (matplotlib lazily, for plots).
Entry points: ``python -m libra_megatron.sim`` (``__main__.main``) and ``run_simulation``.
"""

from ..plan.model import CalibrationTable, StepTimeModel
from .runner import MODEL_PRESETS, ModelDims, SimResult, SimSpec, run_simulation

__all__ = ["CalibrationTable", "StepTimeModel", "MODEL_PRESETS", "ModelDims", "SimResult", "SimSpec", "run_simulation"]
