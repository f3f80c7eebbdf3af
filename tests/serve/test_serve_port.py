"""``vitkit serve`` and ``vitkit demo`` on a port another program listens on: one line naming --port, exit 2,
before the model loads or any banner (issue 25, item 15). Run as the user runs them: subprocesses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_helpers import make_checkpoint

from helpers import SRC


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("port") / "tiny")


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port on 127.0.0.1 that another program listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(("command", "extra"), [("serve", "fastapi"), ("demo", "gradio")])
def test_a_taken_port_is_one_line_naming_port(ckpt: Path, taken_port: int, command: str, extra: str) -> None:
    pytest.importorskip(extra)
    cmd = [sys.executable, "-m", "vitkit", command, str(ckpt), "--port", str(taken_port)]
    r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(SRC)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert r.stderr.splitlines() == [
        f"vitkit {command}: error: --port {taken_port}: 127.0.0.1:{taken_port} is already in use by another program; "
        "choose another --port"
    ]


def test_a_host_that_is_not_this_machine_is_one_line(ckpt: Path) -> None:
    pytest.importorskip("fastapi")
    cmd = [sys.executable, "-m", "vitkit", "serve", str(ckpt), "--host", "192.0.2.1"]  # TEST-NET-1: nobody's
    r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(SRC)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "vitkit serve: error: --host 192.0.2.1: not an address of this machine"
    ], r.stderr
