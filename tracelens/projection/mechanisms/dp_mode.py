"""``dp_mode`` (FSDP2 <-> DDP): refused.

DDP all-reduces gradients in buckets during the backward and keeps full parameters (no gathers); FSDP2 gathers each
block's parameters and reduce-scatters its gradients. The collectives could be sized from the run's bandwidth table
(the layout mechanism does so for the experts), but the compute changes too and no trace here shows by how much:
under DDP autocast keeps a bf16 copy of each weight per step (the cast kernels and their cache), under FSDP2 the
parameters arrive already cast. A DDP and an FSDP run of the same config would measure it.
"""

from __future__ import annotations

from .base import Mechanism, register


@register
class DPMode(Mechanism):
    name = "dp_mode"
    keys = ("dp_mode",)
    order = 204.0
    summary = "refused: DDP's compute (autocast's weight casts) is not in an FSDP trace, and the reverse"
    refuses = ("FSDP <-> DDP: beside the collectives, the compute changes (DDP's autocast casts each weight every step, "
               "FSDP gathers them cast) and this run's trace shows only one; profile a run with the other mode")
