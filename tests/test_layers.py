"""The layers of mpfp16 (pyproject.toml's [tool.importlinter] contracts) hold: no module
imports from a layer above its own, so there is no import circle between layers."""

import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_lint_imports(root) -> subprocess.CompletedProcess:
    """``lint-imports`` (import-linter, the venv's, next to this Python) on the package
    under ``root``, with ``root``'s pyproject.toml."""
    lint_imports = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    assert os.path.exists(lint_imports), "lint-imports is missing: pip install -e '.[dev]' (import-linter)"
    return subprocess.run([lint_imports, "--no-cache", "--no-logo"], cwd=root, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(root)})


def test_the_import_contracts_are_kept():
    proc = run_lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout


def test_an_upward_import_breaks_them(tmp_path):
    """The contracts have teeth: in a copy of the package, the rank helpers importing the
    optimizer break both the layers and the rank helpers' own contract; the optimizer
    importing a store's module breaks the stores' boundary."""
    shutil.copytree(os.path.join(REPO, "mpfp16"), tmp_path / "mpfp16", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO, "pyproject.toml"), tmp_path)
    ranks = tmp_path / "mpfp16" / "parallel" / "ranks.py"
    ranks.write_text(ranks.read_text() + "\n\ndef _upward():\n    from ..optimizer import FP16Optimizer\n")
    optimizer = tmp_path / "mpfp16" / "optimizer.py"
    optimizer.write_text(optimizer.read_text() + "\n\ndef _inside():\n    from .stores.local import LocalStore\n")
    proc = run_lint_imports(tmp_path)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "mpfp16 imports downward only BROKEN" in proc.stdout
    assert "mpfp16.parallel.ranks imports nothing from mpfp16 BROKEN" in proc.stdout
    assert "FP16Optimizer knows the stores only as the mpfp16.stores package BROKEN" in proc.stdout
