"""Parallelism on torch.distributed: process groups from a (dp, ep) device mesh, DP (FSDP2/DDP), PP stages.

The expert-parallel all-to-all is the MoE layer's own (`trainer/model/ep.py`): this package wraps and
splits models, so it sits above `trainer.model` and the model imports nothing from here.
"""

from trainer.parallel.dist import Dist, init_distributed, wrap_data_parallel, sync_expert_grads

__all__ = ["Dist", "init_distributed", "wrap_data_parallel", "sync_expert_grads"]
