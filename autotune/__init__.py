"""autotune: sweeps that run the trainer, analyze its traces and feed the findings back.

    space.py    the search space (YAML): knobs, baseline, fixed overrides, constraints, objective, budget
    runner.py   one trial = one trainer run (subprocess; torchrun when nproc > 1) + its tracelens analysis
    policy.py   the guided policy: findings and signals -> ranked one-knob moves (pure)
    sweep.py    strategies (guided, grid, random, tpe) and resume by replay
    store.py    the results store (SQLite, atomic writes)
    tpe.py      Optuna TPE strategy (optional dependency)

Entry point: ``tracelens autotune SPACE.yaml -o OUT [--strategy ...] [--resume]``; docs/autotune.md.
May import: trainer (only as a subprocess), tracelens, reports.
"""
