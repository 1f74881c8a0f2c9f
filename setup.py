"""Build declaration for fastckpt's optional native I/O extension.

All project metadata lives in pyproject.toml; this file only declares the C
extension.  ``optional=True``: if it cannot be compiled (no compiler, or no
``xxhash.h`` -- ``apt-get install libxxhash-dev``) installation still succeeds
and fastckpt uses its pure-Python I/O backend.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "fastckpt._native_ext",
            sources=["native/fastckpt_io.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ],
)
