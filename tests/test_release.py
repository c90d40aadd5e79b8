"""What a citer looks for first agrees with itself: the licence setup.py declares is
the LICENSE file's, and CITATION.cff, CHANGELOG.md and mpfp16.__version__ name the
same release."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

import mpfp16

ROOT = Path(__file__).resolve().parent.parent


def test_the_licence_is_the_one_setup_py_declares():
    declared = re.search(r'license="([^"]+)"', (ROOT / "setup.py").read_text()).group(1)
    assert declared == "BSD-3-Clause"
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "Neither the name of the copyright holder" in text


def test_citation_changelog_and_version_name_one_release():
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert citation["cff-version"] == "1.2.0" and citation["type"] == "software"
    assert citation["license"] == "BSD-3-Clause" and citation["version"] == mpfp16.__version__
    assert all(ref["title"] and ref["year"] and ref["authors"] for ref in citation["references"])
    releases = re.findall(r"^## (\d+\.\d+\.\d+) — (\d{4}-\d{2}-\d{2})$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases[0] == (mpfp16.__version__, str(citation["date-released"]))
    assert [v for v, _ in releases] == sorted((v for v, _ in releases), key=lambda v: tuple(map(int, v.split("."))),
                                              reverse=True)
