"""autotune: sweeps that run the trainer, analyze its traces and feed the findings back.

Will hold the search space (YAML), the trial runner (the trainer as a subprocess, `torchrun` when the
world size is above one), the trace-guided strategy that reads tracelens findings, and the results
store. Not built yet (issue "Auto-tune sweeps"); nothing here pretends otherwise.

May import: trainer (only as a subprocess), tracelens, reports.
"""
