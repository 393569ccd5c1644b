"""The compiled part of the capture core (pyproject.toml holds the rest of the metadata).

``capture_proxy.core._chunkscan`` scans a streamed chunk of vLLM's (chat and completions) in one
pass over its bytes
(``capture_proxy/core/chunk_scan.py`` says when it is used). It is optional: where no C compiler
or Python headers are found, the build goes on without it and the proxy takes its Python path
(the same results, more CPU per streamed token); ``capture-proxy serve`` says so when it starts,
and ``scripts/setup`` when it installs.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "capture_proxy.core._chunkscan",
            ["capture_proxy/core/_chunkscan.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit"],
            optional=True,
        )
    ]
)
