"""The only package of libra_megatron that imports megatron (megatron-core 0.16.1, Megatron-LM core_v0.16.1).

Import-light on purpose: submodules (groups, sampler, segments, args, batch, corpus, attention, ...)
import megatron themselves, so ``import libra_megatron.megatron`` costs nothing.
"""
