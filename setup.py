"""Build of the one compiled module, the loader's fast path (`tracelens/io/_kineto_fast.c`).

Everything else is declared in pyproject.toml. The extension is optional: where no C compiler is
available the install still succeeds and the loader uses its msgspec path (same tables, ~2x slower
cold loads); `tracelens --version` says which one is in use.
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
        )
    ]
)
