"""The audit is an optional extra: the proxy's serve path never imports it, and without its
modules the command says what to install (exit 2)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AUDIT_SIDE = ("torch", "matplotlib", "capture_proxy.audit.run", "capture_proxy.audit.model")


def test_the_audit_extra_holds_torch_and_the_base_dependencies_do_not():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith(("torch", "matplotlib"))]
    audit = project["optional-dependencies"]["audit"]
    assert "capture-proxy[tokenizer]" in audit  # transformers
    assert [d for d in audit if d.startswith("torch")] == ["torch>=2.4"]


def test_the_serve_path_imports_nothing_of_the_audit(tmp_path):
    code = f"""
import sys
from capture_proxy.cli.parser import build_parser
from capture_proxy.app import build_proxy_app
from capture_proxy.config import Settings
from capture_proxy.store.sqlite import SQLiteStore
settings = Settings(backend="http://127.0.0.1:9", store={str(tmp_path)!r})
build_proxy_app(settings, SQLiteStore(settings.store))
build_parser().parse_args(["audit", "store", "--model", "m"])
print(sorted(m for m in {AUDIT_SIDE!r} if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_without_torch_the_command_names_the_extra(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    code = f"""
import sys
sys.modules["torch"] = None  # as if it were not installed
from capture_proxy.cli import main
sys.exit(main(["audit", {str(tmp_path)!r}, "--model", {str(tmp_path / "model")!r}]))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "capture-proxy audit: needs torch, which this installation lacks: "
        "pip install 'capture-proxy[audit]'"
    )
