"""Projections: predictions for configurations that did not run.

Analyses (``tracelens.analysis``) state facts about traces; the modules here predict: the step
decomposition's scaling labels and the what-if model (``whatif``: step time, tokens/s/GPU and peak
memory of a changed trainer config, component by component, from one measured run). They read
analysis tables and the trainer's config, never raw events, and say which parts were measured and
which modeled.
"""
