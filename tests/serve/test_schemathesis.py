"""OpenAPI-driven fuzzing of ``vitkit serve`` (issue 25, item 8): schemathesis, the maintained tool, reads the
server's own /openapi.json and generates requests for every operation -- bodies in every declared media type
(real images of many modes, formats and shapes: ``schemathesis_hooks.py``), query strings in and out of range,
undeclared content types and methods -- and runs all its checks on every answer: no server error, status codes,
content types, headers and bodies as the schema declares them, schema-valid requests accepted, invalid ones
refused. Afterwards the server must still be up and have answered no 5xx.

Slow: a real ``vitkit serve`` subprocess and ~600 requests (about a minute with the tiny model).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from serve_helpers import make_checkpoint, metric, vitkit_server  # noqa: E402

HOOKS = Path(__file__).with_name("schemathesis_hooks.py")
SEED = 20250125  # fixed: the same requests on every run; change it to explore


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen[str], Path]]:
    """``vitkit serve`` on the tiny centre-crop checkpoint with small limits (1 MiB, 1 MP), its log in a file."""
    tmp = tmp_path_factory.mktemp("fuzz")
    ckpt = make_checkpoint(tmp / "tiny")
    log = tmp / "serve.log"
    args = ["serve", str(ckpt), "--precision", "fp32", "--max-upload-mb", "1", "--max-pixels", "1000000"]
    with vitkit_server([*args, "--log-level", "warning"], log=log) as (url, proc):
        yield url, proc, log


@pytest.mark.slow
def test_schemathesis_finds_nothing_and_the_server_stays_up(
    server: tuple[str, subprocess.Popen[str], Path], tmp_path: Path
) -> None:
    url, proc, log = server
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", "all"]
    cmd += ["--seed", str(SEED), "--max-examples", "300", "--request-timeout", "30", "--no-color"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS), "NO_COLOR": "1"}
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    report = r.stdout + r.stderr
    assert r.returncode == 0, report
    assert "No issues found" in report and "Selected: 4/4" in report and "Tested: 4" in report, report
    # still up, and never a server error
    assert proc.poll() is None
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    text = httpx.get(f"{url}/metrics", timeout=5).text
    statuses = {line.split('status="')[1][:3] for line in text.splitlines() if "vitkit_requests_total{" in line}
    assert not any(s.startswith("5") for s in statuses), statuses
    assert metric(text, "vitkit_requests_total", path="/predict", status="200") >= 200  # images were classified
    assert metric(text, "vitkit_requests_total", path="/predict", status="422") >= 10  # bad query strings refused
    assert "Traceback" not in log.read_text()
