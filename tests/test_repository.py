"""The repository holds everything its tests need: nothing reads the folder beside it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Spelled in pieces so that this file does not match itself.
OUTSIDE = re.compile("|".join([r"\.\./" + "shared", "shared" + "/fixtures", r'/ "' + 'shared"']))


def _sources() -> list[Path]:
    files = [
        p
        for d in ("tests", "capture_proxy", "harness_notes", "benchmarks")
        for p in (ROOT / d).rglob("*")
        if p.suffix in (".py", ".md", ".json", ".toml")
    ]
    files += [p for p in (ROOT / "scripts").iterdir() if p.is_file()]
    return [p for p in files if "fixtures" not in p.relative_to(ROOT).parts]


def test_no_file_refers_to_the_shared_folder_beside_the_repository():
    offenders = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in _sources()
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert offenders == []


def test_the_recorded_fixtures_are_in_the_repository(fixtures_dir):
    assert fixtures_dir.resolve().is_relative_to(ROOT)
    opencode = fixtures_dir / "opencode"
    for name in ("README.md", "step_limit_note.txt", "opencode.json", "configs/opencode.json"):
        assert (opencode / name).is_file(), name
    assert len(list((opencode / "logs").glob("*.jsonl"))) == 5


def test_a_build_folder_left_by_pip_install_is_not_linted_or_collected(tmp_path):
    """``pip install .`` leaves ``build/lib/`` in the checkout; ruff and pytest skip it."""
    import shutil
    import subprocess
    import sys

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy(ROOT / "pyproject.toml", checkout / "pyproject.toml")
    stale = checkout / "build" / "lib" / "capture_proxy"
    stale.mkdir(parents=True)
    (stale / "old.py").write_text("import os\nx=1;y=2\n")  # F401, E702
    (checkout / "build" / "lib" / "test_old.py").write_text("def test_x():\n    assert False\n")
    (checkout / "ok.py").write_text("X = 1\n")
    ruff = Path(sys.executable).parent / "ruff"
    lint = subprocess.run([str(ruff), "check", "."], cwd=checkout, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    collect = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=checkout,
        capture_output=True,
        text=True,
    )
    assert "test_old.py" not in collect.stdout, collect.stdout


#: The longest function the package may hold (STYLE: functions under 80 lines, docstring and
#: decorators included: the lines a reader must take in at once).
MAX_FUNCTION_LINES = 80


def test_no_function_of_the_package_is_longer_than_80_lines():
    import ast

    too_long = []
    for d in ("capture_proxy", "harness_notes"):
        for path in sorted((ROOT / d).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    first = min([node.lineno, *(dec.lineno for dec in node.decorator_list)])
                    lines = (node.end_lineno or node.lineno) - first + 1
                    if lines > MAX_FUNCTION_LINES:
                        too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert too_long == []
