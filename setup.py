"""The compiled parts: the F16 cast kernel (stagerd/engine/_halfcast.c) and the tile-wise strided copy of
transposing gathers (stagerd/engine/_tiles.c). Everything else is in pyproject.toml. `optional=True`:
without a C compiler the install still succeeds, and both run in numpy (the same bytes, but F16 casts 30x
and transposes about 10x slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "stagerd.engine._halfcast",
            sources=["stagerd/engine/_halfcast.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "stagerd.engine._tiles",
            sources=["stagerd/engine/_tiles.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
