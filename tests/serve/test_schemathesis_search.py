"""OpenAPI-driven fuzzing of the endpoints ``vitkit serve --index`` adds (``POST /search``, ``GET /search?id=``,
``GET /thumbnail?id=``), as ``test_schemathesis.py`` fuzzes the others: schemathesis reads the server's own
/openapi.json, sends real images (``schemathesis_hooks.py``), ids, out-of-range and undeclared inputs and methods,
and checks every answer against the schema; the server must stay up and answer no 5xx.

Slow: a real ``vitkit serve`` subprocess and a few hundred requests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from serve_helpers import image_bytes, make_checkpoint, metric, vitkit_server  # noqa: E402

from vitkit.cli import main  # noqa: E402

HOOKS = Path(__file__).with_name("schemathesis_hooks.py")
SEED = 20261202


@pytest.mark.slow
def test_schemathesis_finds_nothing_in_the_search_endpoints(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "tiny")
    images = tmp_path / "images"
    images.mkdir()
    for seed in range(6):
        (images / f"img{seed}.png").write_bytes(image_bytes(seed, (50 + seed, 40)))
    assert main(["index", str(images), "-c", str(ckpt), "--out", str(tmp_path / "index"), "--exact"]) == 0
    log = tmp_path / "serve.log"
    args = ["serve", str(ckpt), "--index", str(tmp_path / "index"), "--precision", "fp32", "--max-upload-mb", "1"]
    with vitkit_server([*args, "--max-pixels", "1000000", "--log-level", "warning"], log=log) as (url, proc):
        assert httpx.get(f"{url}/thumbnail", params={"id": str(images / "img1.png")}).status_code == 200
        st = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", "all", "--no-color"]
        st += ["--seed", str(SEED), "--max-examples", "80", "--request-timeout", "30"]
        st += ["--include-path-regex", "^/(search|thumbnail)$"]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS), "NO_COLOR": "1"}
        r = subprocess.run(st, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        report = r.stdout + r.stderr
        assert r.returncode == 0, report
        assert "No issues found" in report and "Selected: 3/7" in report and "Tested: 3" in report, report
        assert proc.poll() is None
        text = httpx.get(f"{url}/metrics", timeout=5).text
        statuses = {line.split('status="')[1][:3] for line in text.splitlines() if "vitkit_requests_total{" in line}
        assert not any(s.startswith("5") for s in statuses), statuses
        assert metric(text, "vitkit_requests_total", path="/thumbnail", status="404") >= 10
        assert metric(text, "vitkit_requests_total", path="/search", status="200") >= 20
    assert "Traceback" not in log.read_text()
