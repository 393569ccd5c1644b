"""The compiled part of the capture core (pyproject.toml holds the rest of the metadata).

``capture_proxy.core._chunkscan`` scans a streamed chunk of vLLM's (chat and completions) in one
pass over its bytes
(``capture_proxy/core/chunk_scan.py`` says when it is used). It is optional: where no C compiler
or Python headers are found, the build goes on without it and the proxy takes its Python path
(the same results, more CPU per streamed token); ``capture-proxy serve`` says so when it starts,
and ``scripts/setup`` when it installs.
"""

import hashlib
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "capture_proxy/core/_chunkscan.c"
# The module knows the source it was built from: ``chunk_scan`` leaves a module built from
# another source (a pull without scripts/setup, a rebuild that failed) for the Python path.
SOURCE_SHA256 = hashlib.sha256(Path(__file__).with_name("capture_proxy").joinpath(
    "core", "_chunkscan.c").read_bytes()).hexdigest()  # fmt: skip

setup(
    ext_modules=[
        Extension(
            "capture_proxy.core._chunkscan",
            [SOURCE],
            define_macros=[("CHUNKSCAN_SOURCE_SHA256", f'"{SOURCE_SHA256}"')],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit"],
            optional=True,
        )
    ]
)
