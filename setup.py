"""Build of the compiled modules: the loader's fast path (`tracelens/io/_kineto_fast.c`), the call tree's linking
(`tracelens/analysis/_tree.c`) and the critical path's walk (`tracelens/analysis/_walk.c`).

Everything else is declared in pyproject.toml. The extensions are optional: where no C compiler is
available the install still succeeds, the loader uses its msgspec path (same tables, ~2x slower
cold loads; `tracelens --version` says which one is in use), the call tree its numpy linking (the same
tree, ~85 ms more of a 200 MB trace's analysis) and the critical path its Python walk (the same segments,
~1.7 us a segment instead of ~0.05).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tracelens.io._kineto_fast",
            ["tracelens/io/_kineto_fast.c"],
            extra_compile_args=["-O2", "-std=c99", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                                "-Wno-cast-function-type", "-Wno-unused-parameter"],
            optional=True,
        ),
        Extension(
            "tracelens.analysis._tree",
            ["tracelens/analysis/_tree.c"],
            extra_compile_args=["-O2", "-std=c99", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
        Extension(
            "tracelens.analysis._walk",
            ["tracelens/analysis/_walk.c"],
            extra_compile_args=["-O2", "-std=c99", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        ),
    ]
)
