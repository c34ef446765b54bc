"""trainer: a DeepSeek-style MoE trainer on torch.distributed.

Routed + shared experts, top-k router with aux loss, DP/EP (and later PP) on a device mesh, the MoE
optimizations as toggles, a profiling window, and the run directory that tracelens reads.

May import: kernels, torch.
"""
