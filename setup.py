"""The compiled modules, each the per-call path's hot part of its twin in Python (everything else is in pyproject.toml):
BuildChunk's common case (service/compute/fastpath.c) and the response budget's books (service/overload/budget.c).

A C compiler and the Python headers build them during ``pip install`` (both are on a fresh machine and in the
image's build stage). They are optional: where one cannot be built, the install goes on without it; without the fast
path the service serves every request through numpy, saying so once at start (service/compute/backends.py), and
without the books their Python twin keeps them (service/overload/books.py).
"""

from setuptools import Extension, setup

COMPILE_ARGS = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"]

setup(
    ext_modules=[
        Extension(
            "indexer_service.service.compute._fastpath",
            sources=["service/compute/fastpath.c"],
            # Generated from the proto by `make protos`; listed so that it ships in the sdist and a regenerated
            # header rebuilds the extension.
            depends=["protos/indexer/v1/indexer_wire.h"],
            optional=True,
            extra_compile_args=COMPILE_ARGS,
        ),
        Extension(
            "indexer_service.service.overload._budget",
            sources=["service/overload/budget.c"],
            optional=True,
            extra_compile_args=COMPILE_ARGS,
        ),
    ]
)
