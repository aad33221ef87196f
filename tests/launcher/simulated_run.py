"""The simulator's spec of a shipped run config: its ``--model`` preset (the config's name without the length),
at the run's TP, layout and Libra YAML -- what ``python -m libra_megatron.sim`` prices for that run."""
from libra_megatron.sim.__main__ import parse_args, spec_from_args
from libra_megatron.sim.spec import chunks_for_split


def simulated_run(config_stem: str, libra_yaml: str, *, tp: int, seq_length: int, global_batch_size: int,
                  dp: int, cp: int, pp: int):
    """(heads per TP rank, K/V heads per TP rank, head dim, layers, M for ``auto`` at the YAML's H) the simulator
    prices for run config ``config_stem`` (``qwen3-8b-256k`` -> ``--model qwen3-8b``)."""
    spec = spec_from_args(parse_args([
        "--trace", "unused.txt", "--model", config_stem.rsplit("-", 1)[0], "--tp", str(tp), "--libra-config",
        libra_yaml, "--seq-len", str(seq_length), "--gbs", str(global_batch_size), "--dp", str(dp), "--cp", str(cp),
        "--pp", str(pp)]))
    head_split = spec.head_splits[0]
    return (spec.dims.num_q_heads, spec.dims.num_kv_heads, spec.dims.head_dim, spec.num_layers,
            chunks_for_split(spec, head_split, "auto"))
