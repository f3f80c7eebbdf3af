"""vitkit's timm loader against the real ``timm`` package (imported with torchvision stubbed, see timm_real.py;
skipped when timm is not installed): non-square grids whose entry count is a square, ``no_embed_class``,
and position-embedding resampling as timm does it when a checkpoint is loaded at another resolution, and as its
resample_abs_pos_embed does it when called directly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from timm_real import import_timm

from helpers import randomize_, rel_err
from vitkit.checkpoints import load_checkpoint
from vitkit.errors import CheckpointError
from vitkit.models.posembed import resample_grid

vt = import_timm()
pytestmark = pytest.mark.skipif(vt is None, reason="timm is not installed")
ARGS = {"patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_ratio": 2.0, "num_classes": 5}


def timm_model(**kw: Any) -> torch.nn.Module:
    assert vt is not None
    return randomize_(vt.VisionTransformer(**{**ARGS, **kw})).eval()


def write(folder: Path, model: torch.nn.Module, model_args: dict[str, Any] | None) -> Path:
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    if model_args is not None:
        doc = {"architecture": "vit_custom", "model_args": {**ARGS, **model_args}}
        (folder / "config.json").write_text(json.dumps(doc))
    return folder / "model.safetensors"


def test_non_square_grid_with_a_square_entry_count(tmp_path: Path) -> None:
    """32x48 px, 8 px patches: 1 + 4 * 6 = 25 entries, which is also a 5x5 grid without class slot."""
    ref = timm_model(img_size=(32, 48))
    assert ref.pos_embed.shape[1] == 25
    x = torch.randn(2, 3, 32, 48)
    with pytest.raises(CheckpointError, match="either a 5x5 grid with no class slot"):
        load_checkpoint(write(tmp_path / "bare", ref, None))  # formerly read as 5x5 no_embed_class at 40x40
    loaded = load_checkpoint(write(tmp_path / "hub", ref, {"img_size": [32, 48]}))
    assert loaded.model.cfg.image_size == (32, 48)
    with torch.no_grad():
        assert rel_err(loaded.model(x), ref(x)) < 1e-5


@pytest.mark.parametrize("model_args", [{"img_size": 40, "no_embed_class": True}, {"img_size": 40}])
def test_no_embed_class_from_the_config(tmp_path: Path, model_args: dict[str, Any]) -> None:
    ref = timm_model(img_size=40, no_embed_class=True)  # 25 entries, all on the patches
    loaded = load_checkpoint(write(tmp_path / "hub", ref, model_args))
    x = torch.randn(2, 3, 40, 40)
    with torch.no_grad():
        assert rel_err(loaded.model(x), ref(x)) < 1e-5


def test_config_that_contradicts_the_weights_is_named(tmp_path: Path) -> None:
    ref = timm_model(img_size=32)
    with pytest.raises(CheckpointError, match=r"pos_embed has 17 entries, but the image size \(48, 48\)"):
        load_checkpoint(write(tmp_path / "hub", ref, {"img_size": 48}))


@pytest.mark.parametrize("new", [48, 16, (24, 40)])
def test_bicubic_resampling_is_timms(tmp_path: Path, new: int | tuple[int, int]) -> None:
    """timm loads a checkpoint at another resolution through checkpoint_filter_fn (bicubic, antialias=True);
    vitkit's pos_interpolation="bicubic" computes the same embedding, shrinking and enlarging."""
    assert vt is not None
    ref = timm_model(img_size=32)
    path = write(tmp_path / "hub", ref, {"img_size": 32})
    size = (new, new) if isinstance(new, int) else new
    target = timm_model(img_size=size)
    target.load_state_dict(vt.checkpoint_filter_fn(ref.state_dict(), target))
    loaded = load_checkpoint(path, image_size=size, pos_interpolation="bicubic").model
    torch.testing.assert_close(loaded.pos_embed, target.pos_embed, rtol=0, atol=2e-6)
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        assert rel_err(loaded(x), target(x)) < 1e-5


@pytest.mark.parametrize(
    ("old", "new", "prefix"), [((4, 6), (7, 3), 1), ((6, 4), (4, 6), 0), ((5, 5), (1, 9), 1), ((3, 7), (9, 14), 4)]
)
def test_bicubic_resampling_is_resample_abs_pos_embed(old: tuple[int, int], new: tuple[int, int], prefix: int) -> None:
    """resample_grid(..., "bicubic") against timm's resample_abs_pos_embed called directly: non-square old grids
    (which timm's loader never passes), one axis shrinking while the other grows, a one-row grid, the same token
    count in another shape, and no / several prefix tokens (kept as they are)."""
    assert vt is not None
    pe = torch.randn(1, prefix + old[0] * old[1], 8)
    ref = vt.resample_abs_pos_embed(pe, list(new), list(old), num_prefix_tokens=prefix)
    out = resample_grid(pe, old, new, prefix, "bicubic")
    assert torch.equal(out[:, :prefix], pe[:, :prefix])
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
