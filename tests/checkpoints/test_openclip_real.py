"""OpenCLIP state dicts against open_clip itself (skipped when ``open_clip`` is not installed; it is not a
dependency): open_clip's own ``ViT-B-32-quickgelu`` (OpenAI's architecture) and ``ViT-B-32`` (exact GELU), random
weights, saved as open_clip saves them with the ``open_clip_config.json`` its hub repositories carry; vitkit's
forward against ``encode_image``. open_clip is imported with torchvision (its data transforms) and ftfy (its text
tokenizer) stubbed, as timm is in timm_real.py."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from timm_real import _StubFinder

from helpers import rel_err
from vitkit.checkpoints import detect_format, load_checkpoint


def import_open_clip() -> types.ModuleType | None:
    if importlib.util.find_spec("open_clip") is None:
        return None
    finder = _StubFinder()
    real_tv = importlib.util.find_spec("torchvision") is not None
    stub_ftfy = importlib.util.find_spec("ftfy") is None
    if not real_tv:
        sys.meta_path.insert(0, finder)
    if stub_ftfy:
        sys.modules["ftfy"] = types.ModuleType("ftfy")
    try:
        return importlib.import_module("open_clip")
    finally:
        if not real_tv:
            sys.meta_path.remove(finder)
            for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
                del sys.modules[name]
        if stub_ftfy:
            del sys.modules["ftfy"]


oc = import_open_clip()
pytestmark = pytest.mark.skipif(oc is None, reason="open_clip is not installed")


@pytest.mark.parametrize("name", ["ViT-B-32-quickgelu", "ViT-B-32"])
def test_open_clip_models_load_exactly(tmp_path: Path, name: str) -> None:
    assert oc is not None
    torch.manual_seed(0)
    ref: Any = oc.create_model(name, pretrained=None).eval()
    with torch.no_grad():
        for p in ref.visual.parameters():  # open_clip initialises LayerNorms to 1/0 and proj to scaled normals
            p.add_(torch.randn_like(p) * 0.02)
    torch.save(ref.state_dict(), tmp_path / "open_clip_pytorch_model.bin")
    doc = {"model_cfg": oc.get_model_config(name), "preprocess_cfg": {"mean": list(oc.OPENAI_DATASET_MEAN),
           "std": list(oc.OPENAI_DATASET_STD), "interpolation": "bicubic"}}  # fmt: skip
    (tmp_path / "open_clip_config.json").write_text(json.dumps(doc))
    path = tmp_path / "open_clip_pytorch_model.bin"
    assert detect_format(path) == "openclip"
    model = load_checkpoint(path).model.eval()
    assert model.cfg.gelu == ("quick" if "quickgelu" in name else "exact")
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        err = rel_err(model(x), ref.encode_image(x))
    print(f"open_clip {name}: {err:.2e}")
    assert err <= 1e-5
