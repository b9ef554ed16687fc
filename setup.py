"""The compiled parts: the F16 cast kernel (stagerd/engine/_halfcast.c), the tile-wise strided copy of
transposing gathers (stagerd/engine/_tiles.c), the torch-order sums of LoRA merges
(stagerd/engine/_torchsum.c) and the nesting-depth scan of pickles (stagerd/contract/_pickle_depth.c).
Everything else is in pyproject.toml. `optional=True`: without a C compiler the install still succeeds, and
each runs in numpy or Python (the same bytes and verdicts, but F16 casts 30x, transposes about 10x, float32
LoRA merges about 30x and the depth scan about 45x slower)."""

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
        Extension(
            "stagerd.engine._torchsum",
            sources=["stagerd/engine/_torchsum.c"],
            # No contraction: the unfused sum rounds each product before adding it, as torch's loop does.
            extra_compile_args=["-O3", "-ffp-contract=off"],
            libraries=["m"],
            optional=True,
        ),
        Extension(
            "stagerd.contract._pickle_depth",
            sources=["stagerd/contract/_pickle_depth.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
