"""``data``, ``data_path``, ``data_dtype``: the input pipeline, refused.

A synthetic run reads no file; a memmap run reads its batch on the host each step, and another data set routes its
tokens differently (the expert loads, hence the EP ranks' imbalance). Neither is in a trace of the other.
"""

from __future__ import annotations

from .base import Mechanism, register


@register
class Data(Mechanism):
    name = "data"
    keys = ("data", "data_path", "data_dtype")
    order = 203.0
    summary = "refused: another input pipeline's reads and routing are not in the trace"
    refuses = ("another input pipeline: its host reads and its tokens' routing (expert loads) are not in this run's "
               "trace; profile a run on that data")
