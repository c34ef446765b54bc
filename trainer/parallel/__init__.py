"""Parallelism on torch.distributed: process groups from a (dp, ep) device mesh, DP (FSDP2/DDP), EP."""

from trainer.parallel.dist import Dist, init_distributed, wrap_data_parallel, sync_expert_grads

__all__ = ["Dist", "init_distributed", "wrap_data_parallel", "sync_expert_grads"]
