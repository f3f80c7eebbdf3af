"""``vitkit serve --calibration DIR``: OpenVINO's int8 is calibrated on the user's images, preprocessed like a
request; a bad folder or an option that would go unused is one line and exit status 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("fastapi")
from serve_helpers import CLASSES, image_bytes, make_checkpoint

from helpers import run_cli
from vitkit.checkpoints import load_checkpoint
from vitkit.errors import DataError
from vitkit.images import load_image
from vitkit.inference import backends
from vitkit.serve.served_model import calibration_batch


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("serve-calibration") / "tiny")


def image_folder(root: Path) -> list[Path]:
    """An ImageFolder-like tree of 5 images (two formats, one class folder nested) plus files that are not
    images by name or are hidden; the image paths, sorted."""
    (root / "cat").mkdir(parents=True)
    (root / "dog" / "more").mkdir(parents=True)
    (root / ".cache").mkdir()
    files = [root / "cat" / "a.png", root / "cat" / "b.jpg", root / "dog" / "c.png", root / "dog" / "more" / "d.png"]
    files.append(root / "top.png")
    for i, f in enumerate(files):
        f.write_bytes(image_bytes(i, size=(50 + 10 * i, 40), fmt="JPEG" if f.suffix == ".jpg" else "PNG"))
    (root / "README.txt").write_text("not an image")
    (root / ".hidden.png").write_bytes(image_bytes(9))
    (root / ".cache" / "x.png").write_bytes(image_bytes(10))
    return sorted(files)


def test_bad_calibration_folders_are_one_line_naming_the_option(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    only_text = tmp_path / "text"
    only_text.mkdir()
    (only_text / "notes.txt").write_text("no images here")
    empty_image = tmp_path / "empty"
    empty_image.mkdir()
    (empty_image / "zero.png").write_bytes(b"")
    a_file = tmp_path / "one.png"
    a_file.write_bytes(image_bytes(0))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "x.png").write_bytes(b"\x89PNG\r\n\x1a\n but not really")
    cases = [
        (tmp_path / "missing", "no such folder"),
        (a_file, "not a folder"),
        (only_text, "no image files"),
        (empty_image, "zero.png: empty file"),
        (broken, "x.png"),  # decoded at start-up, after the checkpoint: still one line
    ]
    for folder, why in cases:
        argv = ["serve", str(ckpt), "--backend", "openvino", "--precision", "int8", "--calibration", str(folder)]
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and out == "", (folder, err)
        assert len(err.strip().splitlines()) == 1 and "--calibration" in err and why in err, (folder, err)


def test_calibration_with_a_backend_that_does_not_calibrate_is_refused(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    image_folder(tmp_path / "imgs")
    for extra in (["--precision", "int8"], ["--backend", "openvino", "--precision", "bf16"]):
        code, _, err = run_cli(capsys, "serve", str(ckpt), *extra, "--calibration", str(tmp_path / "imgs"))
        assert code == 2 and len(err.strip().splitlines()) == 1 and "--calibration: only OpenVINO's int8" in err


def test_an_evenly_spread_share_of_a_large_folder_is_decoded_and_preprocessed(tmp_path: Path) -> None:
    """More files than the limit: every len/limit-th file (each class of a sorted tree gets its share), decoded
    and transformed exactly as a served request is; the rest is not even opened."""
    pre = load_checkpoint(make_checkpoint(tmp_path / "tiny")).meta.preprocess
    files = []
    for i in range(7):
        files.append(tmp_path / f"{i}.png")
        Image.fromarray(np.full((40, 60, 3), 30 * i, np.uint8)).save(files[-1])
    files[5].write_bytes(b"corrupt, but never picked")
    x = calibration_batch(files, pre, limit=3)  # picks 0, 2, 4 (7 // 3 = 2 apart)
    assert x.shape == (3, 3, *pre.image_size)
    want = torch.stack([pre.to_tensor(Image.open(files[i]).convert("RGB")) for i in (0, 2, 4)])
    torch.testing.assert_close(x, want)
    with pytest.raises(DataError, match=r"--calibration: .*5\.png"):
        calibration_batch(files, pre, limit=7)


def test_serve_calibrates_openvino_int8_on_the_given_folder(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if not backends.engine_available("openvino"):
        pytest.skip("openvino is not installed")
    pytest.importorskip("nncf")
    import uvicorn

    files = image_folder(tmp_path / "imgs")
    seen: list[torch.Tensor] = []
    real_nncf_int8 = backends._nncf_int8

    def spy(ov_model: Any, calibration: torch.Tensor) -> Any:
        seen.append(calibration.clone())
        return real_nncf_int8(ov_model, calibration)

    served_apps: list[Any] = []
    monkeypatch.setattr(backends, "_nncf_int8", spy)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: served_apps.append(self.config.app))
    argv = ["serve", str(ckpt), "--backend", "openvino", "--precision", "int8", "--max-batch", "2"]
    code, _, err = run_cli(capsys, *argv, "--calibration", str(tmp_path / "imgs"))
    assert code == 0, err
    assert "bundled" not in err and "openvino" in err and len(served_apps) == 1
    pre = load_checkpoint(ckpt).meta.preprocess
    [x] = seen  # the 5 images of the tree, hidden and non-image names left out, preprocessed like requests
    torch.testing.assert_close(x, torch.stack([pre.to_tensor(load_image(f)) for f in files]))

    from fastapi.testclient import TestClient

    with TestClient(served_apps[0]) as client:  # the int8 model it calibrated answers
        r = client.post("/predict", content=files[0].read_bytes(), headers={"content-type": "image/png"})
        assert r.status_code == 200 and r.json()["top"][0]["label"] in CLASSES

    seen.clear()
    code, _, err = run_cli(capsys, *argv)
    assert code == 0 and "note: --backend openvino --precision int8" in err and "--calibration DIR" in err
    assert [t.shape[0] for t in seen] == [32]  # the bundled 24 photos and 8 digits
