"""The dependency floors in pyproject.toml: none admits a release with a published advisory that vitkit's
use reaches (issue 25, item 12), and the environment the tests run in satisfies every one of them."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"

# package -> the release that fixed the last advisory that applies to vitkit's use, and the advisories
FIXED = {
    "pillow": ("12.3.0", "CVE-2026-40192 (FITS decompression bomb, 12.2.0) and the 12.3.0 batch"),
    "filelock": ("3.20.3", "CVE-2025-68146, CVE-2026-22701 (lock files through symlinks)"),
    "tqdm": ("4.66.3", "CVE-2024-34062"),
    "starlette": ("1.3.1", "CVE-2026-48710 (Host header), CVE-2026-54282, CVE-2026-54283 (forms)"),
    "fastapi": ("0.109.1", "CVE-2024-24762; 0.136.3 is the first to admit starlette 1.x"),
    "python-multipart": ("0.0.31", "CVE-2026-53537..53540, CVE-2026-42561, CVE-2026-24486, CVE-2024-53981"),
    "h11": ("0.16.0", "CVE-2025-43859 (request smuggling through uvicorn)"),
    "gradio": ("6.16.0", "CVE-2026-28414/28415/28416, CVE-2026-48545, GHSA-j36p-7w88-g82j"),
    "transformers": ("5.3.0", "CVE-2026-4372"),
}
SERVED = {"fastapi", "starlette", "uvicorn", "h11", "python-multipart"}  # what `vitkit serve` runs on


def declared() -> dict[str, list[tuple[str, Requirement]]]:
    """Every requirement, by package name: (where it is declared, the requirement)."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    groups = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    found: dict[str, list[tuple[str, Requirement]]] = {}
    for group, reqs in groups.items():
        for text in reqs:
            req = Requirement(text)
            found.setdefault(req.name.lower().replace("_", "-"), []).append((group, req))
    return found


def floor(req: Requirement) -> Version | None:
    lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    return max(lows) if lows else None


@pytest.mark.parametrize("package", sorted(FIXED))
def test_no_floor_admits_a_release_with_a_known_advisory(package: str) -> None:
    fixed, advisories = FIXED[package]
    reqs = declared().get(package)
    assert reqs, f"{package} is not declared"
    for group, req in reqs:
        low = floor(req)
        assert low is not None and low >= Version(fixed), (
            f"{group}: {req} admits releases before {fixed} ({advisories})"
        )


def test_the_serve_extra_declares_what_it_imports_and_parses_with() -> None:
    groups = {name: {g for g, _ in reqs} for name, reqs in declared().items()}
    assert all("serve" in groups.get(name, set()) and "dev" in groups.get(name, set()) for name in SERVED), groups


def test_the_installed_versions_satisfy_every_floor() -> None:
    """The floors install here: what the tests ran against is inside every declared range."""
    outside = []
    for name, reqs in declared().items():
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an extra that is not installed here (the bench engines are, in CI)
        outside += [f"{req} (installed {version})" for _, req in reqs if not req.specifier.contains(version, True)]
    assert outside == []
