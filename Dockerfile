# capture-proxy as a sidecar container next to an inference engine.
#
#   docker build -t capture-proxy .
#   docker run -d --name capture-proxy -p 8080:8080 -v capture-store:/data \
#       -e CAPTURE_PROXY_BACKEND=http://vllm:8000 \
#       -e CAPTURE_PROXY_CAPTURES_TOKEN="$(openssl rand -hex 32)" capture-proxy
#
# The image listens on 0.0.0.0, so it refuses to start without CAPTURE_PROXY_CAPTURES_TOKEN
# (the read API can delete captures) unless told CAPTURE_PROXY_ALLOW_UNAUTHENTICATED_READ_API=true.
#
# Only what `serve` needs is installed (no tokenizer stack, no pyarrow: the bulk export's Arrow
# stream is written by capture_proxy/core/arrow_ipc.py). For exact_tokens mode with a local
# tokenizer directory (setting `tokenizer`), build with --build-arg EXTRAS="[postgres,tokenizer]".
#
# The base image is a build argument: any Debian-like image with Python 3.11+ and its venv
# module (the default official slim image, or a locally built one where no registry is
# reachable; scripts/container-test builds localhost/debian-py:bookworm-slim with debootstrap).
ARG BASE=python:3.12-slim-bookworm
# Extras: [postgres] (the shared store's driver, for replicas); add ",tokenizer" for
# exact-token mode with a local tokenizer directory.
ARG EXTRAS="[postgres]"

# Build stage: install the package and its runtime dependencies (no test tools) into a venv,
# with the PostgreSQL store's driver (extra `postgres`) for replicas on a shared store; then
# drop what serving never runs: pip, setuptools, bytecode caches and the packages' own test
# suites (numpy's are 17 MB).
FROM ${BASE} AS build
ARG EXTRAS
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A C compiler and Python's headers for the compiled chunk scan (setup.py; the build stage
# only: the runtime stage copies the venv). Where apt cannot reach its mirror the image is
# built without it and serve says so at start (streamed chunks then take the Python path).
RUN if command -v apt-get >/dev/null && ! command -v gcc >/dev/null; then \
        (apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev \
            $(python3 -c 'import sysconfig, os; print("" if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else "python3-dev")') \
            >/dev/null && rm -rf /var/lib/apt/lists/*) \
        || echo "no C compiler: the compiled chunk scan is not built" >&2; \
    fi
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY capture_proxy ./capture_proxy
COPY harness_notes ./harness_notes
RUN python3 -m venv /opt/capture-proxy \
 && /opt/capture-proxy/bin/pip install --no-compile ".${EXTRAS}" \
 && (/opt/capture-proxy/bin/pip uninstall -y setuptools || true) \
 && /opt/capture-proxy/bin/pip uninstall -y pip \
 && find /opt/capture-proxy -name '__pycache__' -prune -exec rm -rf {} + \
 && find /opt/capture-proxy/lib -type d -name tests -path '*/site-packages/*' -prune -exec rm -rf {} +

# Runtime stage: the base image plus the venv; no build tools, no source tree.
FROM ${BASE}
COPY --from=build /opt/capture-proxy /opt/capture-proxy
RUN (getent group capture >/dev/null || groupadd --system --gid 10001 capture) \
 && useradd --system --uid 10001 --gid capture --home-dir /data --no-create-home \
        --shell /usr/sbin/nologin capture \
 && mkdir -p /data /etc/capture-proxy \
 && chown capture:capture /data
ENV PATH=/opt/capture-proxy/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/data \
    CAPTURE_PROXY_HOST=0.0.0.0 \
    CAPTURE_PROXY_PORT=8080 \
    CAPTURE_PROXY_STORE=/data/capture-store
# Optional settings file: mount one here and set CAPTURE_PROXY_CONFIG=/etc/capture-proxy/capture-proxy.toml
# (flags and CAPTURE_PROXY_* variables still win over it).
VOLUME ["/data"]
USER capture
WORKDIR /data
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python3", "-c", "import os, sys, urllib.request; port = os.environ.get('CAPTURE_PROXY_PORT', '8080'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["capture-proxy", "serve"]
