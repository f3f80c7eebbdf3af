"""Hugging Face DINOv3 ViT folders (model_type dinov3_vit), both ways, against transformers' own DINOv3ViTModel on
random weights: tiny models with and without the gated MLP, registers, key bias; ViT-S/16 at its real shape;
other image sizes (RoPE tables recomputed); bit-exact writes; one-line refusals naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import rel_err, run_cli
from vitkit import hardware
from vitkit.checkpoints import detect_format, load_checkpoint, save_checkpoint
from vitkit.errors import CheckpointError

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DINOv3ViTModel"):
    pytest.skip("this transformers has no DINOv3ViTModel", allow_module_level=True)

TOL = 1e-5
MEASURED: dict[str, float] = {}
TINY = {"hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 3, "intermediate_size": 96,
        "image_size": 32, "patch_size": 8}  # fmt: skip
CASES: dict[str, dict[str, Any]] = {
    "reg4": {"num_register_tokens": 4},
    "swiglu_reg2": {"use_gated_mlp": True, "hidden_act": "silu", "num_register_tokens": 2, "intermediate_size": 64},
    "keybias_noreg": {"key_bias": True, "layerscale_value": 0.1, "rope_theta": 50.0},
    "nobias_tanh": {
        "query_bias": False,
        "value_bias": False,
        "hidden_act": "gelu_pytorch_tanh",
        "num_register_tokens": 1,
    },
}
# ViT-S/16 DINOv3 (facebook/dinov3-vits16-pretrain-lvd1689m's config.json)
VITS16 = {"hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 6, "intermediate_size": 1536,
          "patch_size": 16, "image_size": 224, "num_register_tokens": 4, "layer_norm_eps": 1e-5}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _report_measured() -> Any:
    yield
    print("\nmax relative error:", {k: f"{v:.2e}" for k, v in sorted(MEASURED.items())})


def hf_model(kw: dict[str, Any], base: dict[str, Any] = TINY) -> Any:
    """A DINOv3ViTModel with random values everywhere (unit layer scales and zero biases would hide bugs)."""
    torch.manual_seed(0)
    model = transformers.DINOv3ViTModel(transformers.DINOv3ViTConfig(**{**base, **kw}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.05)
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)
            if "lambda1" in name:
                p.add_(0.5)
    return model.eval()


def _check(name: str, ours: torch.Tensor, theirs: torch.Tensor, tol: float = TOL) -> None:
    err = rel_err(ours, theirs)
    MEASURED[name] = max(MEASURED.get(name, 0.0), err)
    assert err <= tol, (name, err)


def _compare(model: torch.nn.Module, ref: Any, x: torch.Tensor, name: str) -> None:
    with torch.no_grad():
        out = ref(pixel_values=x)
        _check(f"{name} pooled", model(x), out.pooler_output)
        _check(f"{name} tokens", model.forward_features(x), out.last_hidden_state)


@pytest.mark.parametrize("case", list(CASES))
def test_dinov3_matches_transformers(tmp_path: Path, case: str) -> None:
    ref = hf_model(CASES[case])
    ref.save_pretrained(tmp_path / "hf")
    assert detect_format(tmp_path / "hf") == "hf"
    ckpt = load_checkpoint(tmp_path / "hf")
    model, cfg = ckpt.model.eval(), ckpt.model.cfg
    assert cfg.rope == "dinov3" and cfg.pos_embed == "none" and cfg.num_classes == 0
    assert cfg.num_registers == CASES[case].get("num_register_tokens", 0)
    assert cfg.mlp == ("swiglu" if CASES[case].get("use_gated_mlp") else "plain")
    torch.manual_seed(1)
    for size in ((32, 32), (48, 24), (64, 64)):  # native, non-square, larger: transformers' RoPE at each grid
        _compare(model, ref, torch.randn(2, 3, *size), case)


def test_real_shape_vits16_at_224(tmp_path: Path) -> None:
    ref = hf_model({}, VITS16)
    ref.save_pretrained(tmp_path / "hf")
    model = load_checkpoint(tmp_path / "hf").model.eval()
    assert model.cfg.image_size == (224, 224) and model.cfg.num_registers == 4 and not model.cfg.key_bias
    torch.manual_seed(1)
    _compare(model, ref, torch.randn(1, 3, 224, 224), "vits16 224")


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _hub_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in state.items()}


@pytest.mark.parametrize("case", ["reg4", "swiglu_reg2", "keybias_noreg"])
def test_round_trip_is_bit_exact(tmp_path: Path, case: str) -> None:
    ref = hf_model(CASES[case])
    ref.save_pretrained(tmp_path / "hf")
    first = load_checkpoint(tmp_path / "hf")
    save_checkpoint(first.model, tmp_path / "out", "hf", meta=first.meta)
    again, info = transformers.DINOv3ViTModel.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    written = _hub_names(load_file(str(tmp_path / "out" / "model.safetensors")))
    original = _hub_names(load_file(str(tmp_path / "hf" / "model.safetensors")))
    assert not written.pop("embeddings.mask_token").any()  # the masked-modelling token: written as zeros
    del original["embeddings.mask_token"]
    _same_tensors(written, original)
    x = torch.randn(2, 3, 40, 32)
    with torch.no_grad():
        out, theirs = again.eval()(pixel_values=x), ref(pixel_values=x)
    assert torch.equal(out.last_hidden_state, theirs.last_hidden_state)
    second = load_checkpoint(tmp_path / "out")
    _same_tensors(second.model.state_dict(), first.model.state_dict())
    assert second.model.cfg == first.model.cfg


def test_preprocessing_config_is_read_and_written(tmp_path: Path) -> None:
    ref = hf_model({"image_size": 64})
    ref.save_pretrained(tmp_path / "hf")
    assert load_checkpoint(tmp_path / "hf").meta.preprocess.interpolation == "bilinear"  # the processor's default
    doc = {
        "image_processor_type": "DINOv3ViTImageProcessorFast",
        "size": {"height": 64, "width": 64},
        "resample": 2,
        "rescale_factor": 1 / 255,
        "image_mean": [0.43, 0.411, 0.296],
        "image_std": [0.213, 0.156, 0.143],
    }
    (tmp_path / "hf" / "preprocessor_config.json").write_text(json.dumps(doc))
    loaded = load_checkpoint(tmp_path / "hf")
    pre = loaded.meta.preprocess
    assert pre.image_size == (64, 64) and pre.resize == "squash" and pre.mean == (0.43, 0.411, 0.296)
    save_checkpoint(loaded.model, tmp_path / "out", "hf", meta=loaded.meta)
    written = json.loads((tmp_path / "out" / "preprocessor_config.json").read_text())
    assert written["image_processor_type"] == "DINOv3ViTImageProcessorFast"
    assert written["size"] == doc["size"] and not written["do_center_crop"] and written["image_std"] == doc["image_std"]


def _edit_config(folder: Path, **changes: Any) -> None:
    doc = json.loads((folder / "config.json").read_text())
    doc.update(changes)
    (folder / "config.json").write_text(json.dumps(doc))


def test_bad_folders_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = hf_model(CASES["reg4"])
    cases = {
        "gated_gelu": ({"use_gated_mlp": True}, "hidden_act 'gelu' with use_gated_mlp"),
        "qv": ({"value_bias": False}, "query_bias True with value_bias False"),
        "proj": ({"proj_bias": False}, "proj_bias false"),
        "mlp_bias": ({"mlp_bias": False}, "mlp_bias false"),
        "act": ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        "registers": ({"num_register_tokens": 3}, r"reg_token: expected \(1, 3, 48\), got \(1, 4, 48\)"),
        "keybias": ({"key_bias": True}, "missing keys: layer.0.attention.k_proj.bias"),
    }
    for case, (changes, match) in cases.items():
        ref.save_pretrained(tmp_path / case)
        _edit_config(tmp_path / case, **changes)
        out = tmp_path / f"{case}-out"
        capsys.readouterr()  # save_pretrained's progress bar
        code, _, err = run_cli(capsys, "convert", str(tmp_path / case), str(out), "--to", "vitkit")
        assert code == 2 and len(err.strip().splitlines()) == 1, (case, err)
        with pytest.raises(CheckpointError, match=match):
            load_checkpoint(tmp_path / case)
        assert not out.exists()
    ref.save_pretrained(tmp_path / "truncated")
    weights = load_file(str(tmp_path / "truncated" / "model.safetensors"))
    weights["embeddings.register_tokens"] = weights["embeddings.register_tokens"][..., :-1].contiguous()
    save_file(weights, str(tmp_path / "truncated" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"reg_token: expected \(1, 4, 48\), got \(1, 4, 47\)") as info:
        load_checkpoint(tmp_path / "truncated")
    assert "\n" not in str(info.value)


def test_a_vitkit_rope_model_is_written_as_dinov3_and_heads_are_refused(tmp_path: Path) -> None:
    ref = hf_model(CASES["swiglu_reg2"])
    ref.save_pretrained(tmp_path / "hf")
    model = load_checkpoint(tmp_path / "hf").model
    save_checkpoint(model, tmp_path / "out", "hf")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "dinov3_vit"
    model.reset_head(3)
    with pytest.raises(CheckpointError, match="DINOv3ViTModel has no classifier"):
        save_checkpoint(model, tmp_path / "out2", "hf")
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("precision", ["fp32", "auto"])  # the checkpoint's own model; the fast path
def test_embed_defaults_to_the_class_token(tmp_path: Path, capsys: pytest.CaptureFixture[str], precision: str) -> None:
    import numpy as np
    from PIL import Image

    ref = hf_model(CASES["swiglu_reg2"])
    ref.save_pretrained(tmp_path / "hf")
    rng = np.random.default_rng(0)
    (tmp_path / "img").mkdir()
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (40 + 8 * i, 48, 3), dtype=np.uint8)).save(tmp_path / "img" / f"{i}.png")
    out = tmp_path / "feats.npy"
    code, _, err = run_cli(capsys, "embed", str(tmp_path / "hf"), str(tmp_path / "img"), "--out", str(out),
                           "--precision", precision, "--workers", "0")  # fmt: skip
    assert code == 0, err
    pre = load_checkpoint(tmp_path / "hf").meta.preprocess
    names = json.loads((tmp_path / "feats.ids.json").read_text())
    names = names["ids"] if isinstance(names, dict) else names
    pixels = torch.stack([pre(Image.open(tmp_path / "img" / Path(str(n)).name).convert("RGB")) for n in names])
    with torch.no_grad():
        theirs = ref(pixel_values=pixels).pooler_output  # DINOv3ViTModel's pooled class token
    # "auto" serves bf16 where the CPU computes it natively (AVX512_BF16, AMX): bf16's rounding, not fp32's
    bf16 = precision == "auto" and hardware.has_native_bf16()
    _check(f"embed {precision}", torch.from_numpy(np.load(out)), theirs, 3e-2 if bf16 else TOL)


def test_registry_counts_equal_transformers_models() -> None:
    from vitkit.checkpoints.families import loader_config, param_count, registry_config
    from vitkit.hub import families

    # facebookresearch/dinov3's model table, rounded to millions there
    published = {"vits16": 21e6, "vits16plus": 29e6, "vitb16": 86e6, "vitl16": 300e6, "vith16plus": 840e6,
                 "vit7b16": 6716e6}  # fmt: skip
    entries = [e for e in families.entries() if e.family == "dinov3" and e.format == "hf"]
    assert len(entries) == 6
    # timm's names of the same models: the same counts, less the (zero) q/v biases timm drops without "_qkvb"
    hf_by_width = {(registry_config(e).hidden_size, registry_config(e).mlp): e.params for e in entries}
    timm = [e for e in families.entries() if e.family == "dinov3" and e.format == "timm_eva"]
    assert len(timm) == 14
    for e in timm:
        cfg = registry_config(e)
        biases = 0 if cfg.qkv_bias else 2 * cfg.hidden_size * cfg.depth
        assert e.params + biases == hf_by_width[(cfg.hidden_size, cfg.mlp)], e.name
    for e in entries:
        assert not e.refused and e.embedding == "class token" and e.format == "hf"
        assert loader_config(e) == registry_config(e) and param_count(registry_config(e)) == e.params
        config = transformers.DINOv3ViTConfig(**{k: v for k, v in e.config.items() if k != "model_type"})
        with torch.device("meta"):
            model = transformers.DINOv3ViTModel(config)
        theirs = sum(p.numel() for p in model.parameters()) - model.embeddings.mask_token.numel()
        assert theirs == e.params, e.name
        size = e.name.split("-")[1]
        assert abs(e.params / published[size] - 1) < 0.05, (e.name, e.params)
