"""moespec: what the trainer and the analyzer must agree on, in one place.

The trainer runs a model from these definitions and the analyzer (tracelens) reads its runs and
predicts others with the same ones, so neither keeps a copy of the other's rules:

* ``moespec.config``: the trainer's config keys, defaults, YAML loading, overrides and validation.
* ``moespec.schedules``: pipeline schedules: names, torch classes, placement, action orders, bubble theory.
* ``moespec.layout``: the pipeline layout grammar (Megatron's), the automatic and uniform layouts.
* ``moespec.params``: parameter counts and model FLOPs per token of a config.
* ``moespec.devices``: the device table: datasheet ceilings, memory capacity, the MFU peak.
* ``moespec.gemm_shapes``: the routed experts' grouped-GEMM shapes per rank.
* ``moespec.backends``: the grouped-GEMM backend names of the config.
* ``moespec.placement``: expert placement by load (``ep_placement: balanced``): the algorithm and its loads file.
* ``moespec.yaml_bounded``: the one YAML loader for every file and value a user hands the project (bounded).

May import: the standard library and PyYAML (loaded on first use); never torch, numpy or pandas (a test
checks it), nor any other package of this repository.
"""
