"""Per-rank body for the TP-broadcast test (module level for run_distributed)."""


def broadcast_sample_body(rank, world_size):
    import torch
    import torch.distributed as dist

    from libra_megatron.megatron.hooks import _broadcast_sample

    sample = None
    if rank == 0:
        sample = {
            "tokens": torch.arange(12, dtype=torch.int64).reshape(1, 12),
            "labels": torch.arange(1, 13, dtype=torch.int64).reshape(1, 12),
            "loss_mask": torch.tensor([[1.0] * 10 + [0.0] * 2]),
            "libra_pool_segments": torch.tensor([[[5, 7, -1], [12, -1, -1]]], dtype=torch.int64),
            "libra_pool_position": torch.tensor([1], dtype=torch.int64),
            "unrelated_key": "not broadcast",
        }
    out = _broadcast_sample(sample, dist.group.WORLD, 0)
    return {key: value.tolist() for key, value in out.items()}
