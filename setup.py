"""The one compiled part: the F16 cast kernel (stagerd/engine/_halfcast.c). Everything else is in
pyproject.toml. `optional=True`: without a C compiler the install still succeeds, and the casts run in numpy
(the same bits, but F16 casts 30x slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "stagerd.engine._halfcast",
            sources=["stagerd/engine/_halfcast.c"],
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
