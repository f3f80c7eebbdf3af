from __future__ import annotations

import math

import pytest
import torch

from helpers import meta_model, randomize_
from vitkit.errors import ConfigError
from vitkit.models import VARIANTS, VisionTransformer, ViTConfig, count_parameters, create_model, list_models

# Parameter counts of the official vit_jax models at 224 px with a 1000-class head (no pre-logits).
OFFICIAL_COUNTS = {
    "Ti/16": 5_717_416,
    "S/16": 22_050_664,
    "B/16": 86_567_656,
    "B/32": 88_224_232,
    "L/16": 304_326_632,
    "L/32": 306_535_400,
    "H/14": 632_045_800,
}


def official_param_formula(size: str, patch: int, image: int = 224, classes: int = 1000, channels: int = 3) -> int:
    """Parameters of the official Flax model, summed module by module from its definition."""
    v = VARIANTS[size]
    D, L, M = v["hidden_size"], v["depth"], v["mlp_dim"]
    n = (image // patch) ** 2
    embedding = patch * patch * channels * D + D
    cls, pos = D, (n + 1) * D
    attention = 4 * (D * D + D)  # query, key, value, out: kernels + biases (heads x head_dim = D)
    mlp = D * M + M + M * D + D
    norms = 2 * 2 * D
    encoder_norm = 2 * D
    head = D * classes + classes
    return embedding + cls + pos + L * (attention + mlp + norms) + encoder_norm + head


@pytest.mark.parametrize("name", list(OFFICIAL_COUNTS))
def test_parameter_counts_match_official(name: str) -> None:
    assert count_parameters(meta_model(name)) == OFFICIAL_COUNTS[name]


@pytest.mark.parametrize("name", list_models())
def test_parameter_counts_every_variant(name: str) -> None:
    size, patch = name.split("/")  # 224 is a multiple of every patch size (8, 14, 16, 32)
    assert count_parameters(meta_model(name)) == official_param_formula(size, int(patch))
    at_384 = meta_model(name, image_size=384 if int(patch) != 14 else 392, num_classes=10)
    assert count_parameters(at_384) == official_param_formula(size, int(patch), at_384.cfg.image_size[0], 10)


def test_paper_table1_sizes() -> None:
    # Paper Table 1, in whole millions (truncated): B 86M, H 632M (224 px, patch 16 / 14). Its "307M" for
    # Large is not what the official code builds (304,326,632, tested exactly above).
    assert count_parameters(meta_model("B/16")) // 1_000_000 == 86
    assert count_parameters(meta_model("H/14")) // 1_000_000 == 632
    assert count_parameters(meta_model("L/16")) // 1_000_000 == 304


def test_variant_names_accepted_in_several_spellings() -> None:
    for name in ("B/16", "ViT-B/16", "b_16", "vit_b16"):
        assert meta_model(name).cfg.name == "B/16"
    with pytest.raises(ConfigError, match="unknown model"):
        create_model("Q/16")


def test_pre_logits_and_gap_variants_param_counts() -> None:
    base = count_parameters(meta_model("B/16"))
    rep = count_parameters(meta_model("B/16", representation_size=768))
    assert rep - base == 768 * 768 + 768
    gap = count_parameters(meta_model("B/16", classifier="gap"))
    assert base - gap == 768 + 768  # no class token, one position slot fewer
    sincos = count_parameters(meta_model("B/16", pos_embed="sincos2d"))
    assert base - sincos == 197 * 768  # the table is a buffer, not a parameter


def tiny(**kw: object) -> VisionTransformer:
    cfg: dict[str, object] = {
        "image_size": 32,
        "patch_size": 8,
        "hidden_size": 48,
        "depth": 2,
        "num_heads": 3,
        "mlp_dim": 96,
        "num_classes": 5,
    }
    cfg.update(kw)
    return VisionTransformer(ViTConfig(**cfg))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"classifier": "gap"},
        {"pos_embed": "sincos2d"},
        {"pos_embed": "sincos2d", "classifier": "gap"},
        {"representation_size": 24, "gelu": "tanh"},
        {"qkv_bias": False},
    ],
)
def test_fused_attention_equals_explicit(kw: dict[str, object]) -> None:
    model = randomize_(tiny(**kw)).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        fused = model(x)
        inter = model.forward_intermediates(x)
    torch.testing.assert_close(inter.logits, fused, rtol=1e-5, atol=1e-6)
    assert len(inter.attentions) == 2
    T = 16 + (1 if kw.get("classifier", "token") == "token" else 0)
    for a in inter.attentions:
        assert a.shape == (3, 3, T, T)
        torch.testing.assert_close(a.sum(-1), torch.ones(3, 3, T))
    assert len(inter.hidden_states) == 3


def test_attention_probs_match_a_reference_computation() -> None:
    model = randomize_(tiny()).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        inter = model.forward_intermediates(x)
        blk = model.blocks[0]
        z = blk.norm1(inter.hidden_states[0])
        D, h = 48, 3
        W, b = blk.attn.qkv.weight, blk.attn.qkv.bias
        q, k = z @ W[:D].T + b[:D], z @ W[D : 2 * D].T + b[D : 2 * D]
        q = q.reshape(2, -1, h, D // h).transpose(1, 2)
        k = k.reshape(2, -1, h, D // h).transpose(1, 2)
        ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D // h), dim=-1)
    torch.testing.assert_close(inter.attentions[0], ref, rtol=1e-5, atol=1e-6)


def test_non_square_and_dynamic_resolution() -> None:
    model = randomize_(tiny(image_size=(32, 48))).eval()
    assert model.pos_embed is not None and model.pos_embed.shape == (1, 1 + 4 * 6, 48)
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 48)).shape == (2, 5)
        # another resolution: the position grid is resampled on the fly, which must equal resizing the model
        x = torch.randn(2, 3, 64, 40)
        dynamic = model(x)
        model.resize_image((64, 40))
        assert model.pos_embed.shape == (1, 1 + 8 * 5, 48)
        torch.testing.assert_close(model(x), dynamic)
    with pytest.raises(ValueError, match="not a multiple"):
        model(torch.randn(1, 3, 60, 40))
    with pytest.raises(ValueError, match="expected images"):
        model(torch.randn(1, 1, 64, 40))


def test_sincos_model_any_resolution() -> None:
    model = randomize_(tiny(pos_embed="sincos2d", classifier="gap")).eval()
    with torch.no_grad():
        y = model(torch.randn(1, 3, 24, 56))
    assert y.shape == (1, 5)


@pytest.mark.parametrize("kw", [{}, {"classifier": "gap", "representation_size": 16}, {"pos_embed": "sincos2d"}])
def test_gradients_reach_every_parameter(kw: dict[str, object]) -> None:
    model = randomize_(tiny(dropout=0.1, attention_dropout=0.1, drop_path=0.1, **kw)).train()
    loss = model(torch.randn(4, 3, 32, 32)).logsumexp(-1).mean()
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, name


def test_tiny_model_overfits_one_batch() -> None:
    torch.manual_seed(0)
    model = tiny(num_classes=4)
    x, y = torch.randn(8, 3, 32, 32), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    assert loss.item() < 0.01
    assert (model(x).argmax(-1) == y).all()


def test_official_initialisation() -> None:
    model = create_model("S/16")
    assert model.head.weight.abs().sum() == 0 and model.head.bias.abs().sum() == 0
    assert model.cls_token is not None and model.cls_token.abs().sum() == 0
    assert model.pos_embed is not None and abs(model.pos_embed.std().item() - 0.02) < 0.001
    D = 384
    qkv = model.blocks[0].attn.qkv.weight
    bound = math.sqrt(6.0 / (D + D))  # Xavier uniform over each D x D kernel, not over the fused 3D x D
    assert qkv.abs().max() <= bound and qkv.abs().max() > 0.99 * bound
    assert model.blocks[0].attn.qkv.bias.abs().sum() == 0
    fc1 = model.blocks[0].mlp.fc1
    assert fc1.weight.abs().max() <= math.sqrt(6.0 / (D + 1536))
    assert 0 < fc1.bias.abs().max() < 1e-5  # normal(1e-6)
    conv = model.patch_embed.proj.weight  # LeCun normal: std 1/sqrt(fan_in) after truncation
    assert abs(conv.std().item() * math.sqrt(16 * 16 * 3) - 1.0) < 0.02
    head_bias = create_model("Ti/16", head_bias_init=-10.0).head.bias
    assert torch.all(head_bias == -10.0)


def test_config_round_trip_and_validation() -> None:
    cfg = ViTConfig(image_size=(32, 48), patch_size=8, hidden_size=48, num_heads=3, depth=1, mlp_dim=8)
    assert ViTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="divisible by num_heads"):
        ViTConfig(hidden_size=50, num_heads=3)
    with pytest.raises(ValueError, match="not a multiple of patch size"):
        ViTConfig(image_size=230)
    with pytest.raises(ValueError, match="unknown ViT config keys: bogus"):
        ViTConfig.from_dict({"bogus": 1})


def test_reset_head_drops_pre_logits_and_zero_inits() -> None:
    model = randomize_(tiny(representation_size=24))
    model.reset_head(7)
    assert model.cfg.num_classes == 7 and model.cfg.representation_size is None
    assert isinstance(model.pre_logits, torch.nn.Identity)
    assert model.head.weight.shape == (7, 48) and model.head.weight.abs().sum() == 0
    model.reset_head(0)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 48)


def test_features_and_head_api() -> None:
    model = randomize_(tiny(representation_size=24)).eval()
    x = torch.randn(2, 3, 32, 32)
    tokens = model.forward_features(x)
    assert tokens.shape == (2, 17, 48)
    assert model.forward_head(tokens, pre_logits=True).shape == (2, 24)
    torch.testing.assert_close(model.forward_head(tokens), model(x))
