"""Test-only, Python 3.11: ``typing.override`` in every process the CPU harness starts.

``cpu_shims.allow_megatron_lm_0_17_on_python_3_11`` puts this folder on ``PYTHONPATH`` for a Megatron-LM
>= core_v0.17 tree, because processes that Megatron-LM starts with multiprocessing 'spawn' (core_v0.19's
checkpoint writer) re-import ``pretrain_gpt.py`` before any harness code runs in them.
"""
import typing

if not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override
