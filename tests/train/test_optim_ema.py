"""Schedules, parameter groups, decoupled weight decay, EMA, configs and recipes."""

from __future__ import annotations

import math

import pytest
import torch
from train_helpers import assert_close_weights

from helpers import DEVICES
from vitkit import create_model
from vitkit.configs import RECIPES, OptimConfig, TrainConfig, get_recipe
from vitkit.errors import ConfigError
from vitkit.models.vit import ViTConfig
from vitkit.train.ema import EMA
from vitkit.train.optim import apply_decoupled_sgd_decay, build_optimizer, decays, lr_at, param_groups


def test_lr_schedules_by_formula() -> None:
    kw = {"base_lr": 1.0, "total_steps": 110, "warmup_steps": 10}
    assert [lr_at(s, schedule="cosine", **kw) for s in range(3)] == [0.1, 0.2, 0.3]  # linear warmup, never 0
    assert lr_at(9, schedule="cosine", **kw) == 1.0
    assert lr_at(10, schedule="cosine", **kw) == 1.0  # decay starts at the peak
    assert lr_at(60, schedule="cosine", **kw) == pytest.approx(0.5)  # half way: cos(pi/2)
    assert lr_at(35, schedule="cosine", **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(60, schedule="linear", **kw) == pytest.approx(0.5)
    assert lr_at(60, schedule="linear", end_lr=0.2, **kw) == pytest.approx(0.6)
    assert lr_at(109, schedule="linear", **kw) == pytest.approx(0.01)  # the last step: almost end_lr
    assert lr_at(500, schedule="constant", **kw) == 1.0
    assert lr_at(0, base_lr=2.0, total_steps=5, warmup_steps=0, schedule="cosine") == 2.0
    with pytest.raises(ConfigError, match="unknown schedule"):
        lr_at(20, schedule="step", **kw)


def test_no_weight_decay_on_norms_biases_and_embeddings() -> None:
    model = create_model("Ti/16", image_size=32, depth=2, num_classes=5, representation_size=8)
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    by_name = {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}
    assert set(by_name) == {n for n, _ in model.named_parameters()}
    decayed = sorted(n for n, wd in by_name.items() if wd > 0)
    assert decayed == sorted(
        ["patch_embed.proj.weight", "pre_logits.0.weight", "head.weight"]
        + [f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")]
    )
    for name in ("cls_token", "pos_embed", "norm.weight", "blocks.0.norm1.bias", "head.bias"):
        assert by_name[name] == 0.0 and not decays(name, dict(model.named_parameters())[name])


def test_adamw_decay_is_decoupled_and_sgd_decay_matches() -> None:
    """With zero gradients, AdamW only decays: p <- p * (1 - lr * wd). SGD's decoupled decay does the same."""
    for name in ("adamw", "sgd"):
        lin = torch.nn.Linear(3, 2)
        w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
        opt = build_optimizer(lin, OptimConfig(name=name, lr=0.5, weight_decay=0.1, momentum=0.9))
        for p in lin.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        apply_decoupled_sgd_decay(opt)
        torch.testing.assert_close(lin.weight, w0 * (1 - 0.5 * 0.1))
        torch.testing.assert_close(lin.bias, b0)  # no decay on biases


def test_ema_math_and_swap() -> None:
    lin = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    ema = EMA(lin, decay=0.9)
    values = [2.0, 4.0, -1.0]
    expected = 1.0
    for v in values:
        with torch.no_grad():
            lin.weight.fill_(v)
        ema.update(lin)
        expected = 0.9 * expected + 0.1 * v
    torch.testing.assert_close(ema.shadow["weight"], torch.full((1, 2), expected))
    with ema.swapped_in(lin):
        torch.testing.assert_close(lin.weight, torch.full((1, 2), expected))
    assert torch.equal(lin.weight, torch.full((1, 2), -1.0))  # swapped back
    warm = EMA(lin, decay=0.999, warmup=True)
    assert warm.current_decay() == pytest.approx(0.1)  # (1 + 0) / (10 + 0)
    warm.updates = 10_000
    assert warm.current_decay() == 0.999


@pytest.mark.parametrize("device", DEVICES)
def test_ema_update_of_all_tensors_at_once_equals_one_by_one(device: str) -> None:
    """The averages are updated by one foreach kernel: bit for bit the tensor-by-tensor lerp_ it replaced."""
    model = create_model("Ti/16", image_size=32, depth=2, num_classes=3).to(device)
    ema = EMA(model, decay=0.99, warmup=True)
    ref = {k: v.clone() for k, v in ema.shadow.items()}
    for step in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        w = 1.0 - ema.current_decay()
        ema.update(model)
        for name, p in model.named_parameters():
            ref[name].lerp_(p, w)
        assert all(torch.equal(ema.shadow[k], ref[k]) for k in ref), step


def test_config_round_trip_and_overrides() -> None:
    cfg = get_recipe("deit-i1k")
    again = TrainConfig.from_dict(cfg.to_dict())
    assert again == cfg and isinstance(again.aug.crop_scale, tuple)
    cfg2 = cfg.override(**{"optim.lr": 0.5, "aug.augreg": "medium2", "epochs": 3})
    assert cfg2.optim.lr == 0.5 and cfg2.epochs == 3 and cfg.optim.lr == 1e-3
    aug = cfg2.aug.resolved()
    assert (aug.randaug_layers, aug.randaug_magnitude, aug.mixup) == (2, 15.0, 0.5)
    with pytest.raises(ConfigError, match=r"unknown config field 'optim\.lrr'"):
        cfg.override(**{"optim.lrr": 1})
    with pytest.raises(ConfigError, match="unknown field"):
        TrainConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(ConfigError, match="unknown AugReg level"):
        cfg.override(**{"aug.augreg": "extreme"}).validate()
    with pytest.raises(ConfigError, match=r"config\.attention: 'flash' is not one of 'auto', 'fused', 'explicit'"):
        cfg.override(attention="flash")
    with pytest.raises(ConfigError, match=r"config\.optim\.name: 'lamb'"):
        cfg.override(**{"optim.name": "lamb"})


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_is_a_valid_config(name: str) -> None:
    cfg = get_recipe(name)
    cfg.validate()
    assert cfg.recipe == name


def test_paper_recipes_match_the_tables() -> None:
    jft = get_recipe("paper-pretrain", variant="H/14", dataset="jft300m")
    assert (jft.optim.lr, jft.optim.weight_decay, jft.epochs, jft.data.batch_size) == (3e-4, 0.1, 14.0, 4096)
    i21k = get_recipe("paper-pretrain")
    assert (i21k.optim.lr, i21k.optim.weight_decay, i21k.model.overrides["dropout"]) == (1e-3, 0.03, 0.1)
    assert (i21k.optim.warmup_steps, i21k.optim.schedule, i21k.optim.clip_norm) == (10_000, "linear", 1.0)
    scratch = get_recipe("paper-imagenet")
    assert (scratch.optim.lr, scratch.optim.weight_decay, scratch.epochs) == (3e-3, 0.3, 300.0)
    ft = get_recipe("paper-finetune", task="imagenet")
    assert (ft.optim.name, ft.optim.momentum, ft.optim.weight_decay, ft.steps) == ("sgd", 0.9, 0.0, 20_000)
    assert ft.data.batch_size == 512 and ft.data.image_size == (384, 384) and ft.optim.schedule == "cosine"
    plain = get_recipe("plain-vit-s16")
    assert plain.model.overrides["classifier"] == "gap" and plain.model.overrides["pos_embed"] == "sincos2d"


def test_adamw_runs_fused_and_equals_the_plain_loop() -> None:
    """build_optimizer picks PyTorch's fused AdamW on CPU; over steps with decayed and undecayed groups and a
    changing lr it gives the per-tensor loop's weights and moments to float rounding."""
    tiny = {"patch_size": 4, "image_size": 8, "in_channels": 1, "hidden_size": 16, "depth": 2, "num_heads": 2}
    torch.manual_seed(0)
    model = create_model(ViTConfig(), mlp_dim=32, num_classes=10, **tiny)
    torch.nn.init.normal_(model.head.weight, std=0.1)  # a zero head would give the blocks zero gradients
    twin = create_model(ViTConfig(), mlp_dim=32, num_classes=10, **tiny)
    twin.load_state_dict(model.state_dict())
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = OptimConfig(name="adamw", lr=3e-3, weight_decay=0.05)
    fused = build_optimizer(model, cfg)
    assert fused.defaults["fused"] is True
    groups = param_groups(twin.named_parameters(), cfg.weight_decay)
    plain = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False, fused=False)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    for step in range(4):
        for net, opt in ((model, fused), (twin, plain)):
            for g in opt.param_groups:
                g["lr"] = 3e-3 * (1 - step / 4)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    assert_close_weights(dict(twin.named_parameters()), dict(model.named_parameters()))
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert not torch.equal(p, start[name]), name  # every parameter moved
        if not name.endswith("qkv.bias"):  # its key part is rounding noise (see assert_close_weights)
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(fused.state[p][key], plain.state[q][key], rtol=1e-4, atol=1e-8)
