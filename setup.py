"""The one compiled module, BuildChunk's common case (service/compute/fastpath.c); everything else is in pyproject.toml.

A C compiler and the Python headers build it during ``pip install`` (both are on a fresh machine and in the
image's build stage). It is optional: where it cannot be built, the install goes on without it and the service
serves every request through numpy, saying so once at start (service/compute/backends.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "indexer_service.service.compute._fastpath",
            sources=["service/compute/fastpath.c"],
            # Generated from the proto by `make protos`; listed so that it ships in the sdist and a regenerated
            # header rebuilds the extension.
            depends=["protos/indexer/v1/indexer_wire.h"],
            optional=True,
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
        )
    ]
)
