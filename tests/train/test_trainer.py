"""The training loop end to end: overfitting, learning, exact resume, accumulation, non-finite losses."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from train_helpers import Crash, assert_close_weights, assert_same_weights, tiny_config, weights

from helpers import DEVICES
from vitkit import load_checkpoint
from vitkit.errors import ConfigError, DataError
from vitkit.train import Trainer, train
from vitkit.train.state import list_states, read_state
from vitkit.train.trainer import NonFiniteLossError


def test_overfits_one_batch(tmp_path: Path) -> None:
    """16 images, no augmentation, one batch per step: the model must memorise them (loss -> ~0, 100%)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (16, 8, 8), dtype=np.uint8)  # noise: only memorisation can fit it
    labels = np.arange(16) % 4
    data = tmp_path / "one_batch.npz"
    np.savez(data, train_images=images, train_labels=labels, val_images=images, val_labels=labels)
    cfg = tiny_config(
        **{"data.source": str(data), "data.batch_size": 16, "aug.crop": "resize", "aug.pad": 0},
        **{"model.overrides": {"patch_size": 4, "hidden_size": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64}},
        **{"optim.weight_decay": 0.0, "optim.schedule": "constant", "optim.warmup_steps": 0, "epochs": 150},
    )
    result = train(cfg, tmp_path / "run", progress=False)
    assert result.steps[0]["loss"] == pytest.approx(math.log(4), rel=1e-3)  # zero head: uniform predictions
    assert result.steps[-1]["loss"] < 0.01
    assert result.final_top1 == 1.0


def test_loss_decreases_on_digits_and_run_folder(tmp_path: Path) -> None:
    result = train(tiny_config(**{"epochs": 3, "optim.lr": 0.01}), tmp_path / "run", progress=False)
    losses = [r["train_loss"] for r in result.epochs]
    assert losses[0] > losses[1] > losses[2]
    assert result.final_top1 is not None and result.final_top1 > 0.3  # chance is 0.1
    assert result.val_split == "test" and result.final_metrics["val_count"] == 359
    run_dir = tmp_path / "run"
    for name in ("config.json", "metrics.csv", "steps.csv", "curves.png", "model", "best", "checkpoints"):
        assert (run_dir / name).exists(), name
    assert any((run_dir / "tb").iterdir())  # TensorBoard events (tensorboard is in the dev environment)
    with (run_dir / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    assert float(rows[-1]["val_top1"]) == pytest.approx(result.final_top1)
    assert json.loads((run_dir / "config.json").read_text())["epochs"] == 3
    # the run folder loads as a checkpoint, with class names and the grayscale preprocessing
    loaded = load_checkpoint(run_dir)
    assert loaded.meta.class_names == [str(i) for i in range(10)] and loaded.meta.preprocess.grayscale
    assert loaded.meta.preprocess.image_size == (8, 8) and loaded.model.cfg.in_channels == 1


def _losses(steps: list[dict[str, float]]) -> list[tuple[int, float, float]]:
    return [(int(r["step"]), r["loss"], r["lr"]) for r in steps]


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: the count cannot drop")
def test_a_run_whose_thread_count_dropped_says_it_is_not_bit_reproducible(tmp_path: Path) -> None:
    """What the trainer's CpuShare does on a busy machine (one thread fewer for a few steps, then back) is told in
    the run's summary, since sums split by the thread count round differently; the count is back at the end, and a
    run at one count says nothing of it."""
    start = torch.get_num_threads()

    def busy(trainer: Trainer, rec: dict[str, float]) -> None:
        assert trainer.cpu_share is not None
        trainer.cpu_share.set(start - 1 if trainer.step in (3, 4) else start, others=1.0)

    cfg = tiny_config(epochs=1)
    busy_run = Trainer(cfg, tmp_path / "busy", progress=False).fit(on_step=busy)
    assert torch.get_num_threads() == start
    assert any(f"used {start - 1} of its {start} threads" in n for n in busy_run.notes), busy_run.notes
    assert "not bit for bit" in busy_run.summary()
    quiet = train(cfg, tmp_path / "quiet", progress=False)
    assert not any("threads" in n for n in quiet.notes)


@pytest.mark.parametrize("device", DEVICES)
def test_resume_after_crash_mid_epoch_equals_uninterrupted_run(tmp_path: Path, device: str) -> None:
    """Every random path on (dropout, stochastic depth, RandAugment, Mixup/CutMix, EMA): kill at step 15
    (mid-epoch 2, last checkpoint at 12), resume, and compare everything exactly (on a GPU too: the same kernels
    on the same inputs in one process)."""
    cfg = tiny_config(
        device=device,
        **{"model.overrides": {**tiny_config().model.overrides, "dropout": 0.1, "drop_path": 0.2}},
        **{"aug.randaug_layers": 2, "aug.randaug_magnitude": 5, "aug.mixup": 0.4, "aug.cutmix": 1.0},
        **{"aug.label_smoothing": 0.1, "ema_decay": 0.9, "checkpoint_every_steps": 4},
    )
    ref = train(cfg, tmp_path / "ref", progress=False)
    assert ref.step == 22  # 2 epochs x 11 steps

    def crash(trainer: Trainer, rec: dict[str, float]) -> None:
        if trainer.step == 15:
            raise Crash

    trainer = Trainer(cfg, tmp_path / "cut", progress=False)
    with pytest.raises(Crash):
        trainer.fit(on_step=crash)
    before = trainer.history
    trainer.close()
    assert [s for s, _ in list_states(tmp_path / "cut" / "checkpoints")] == [11, 12]

    resumed = train(resume=tmp_path / "cut", progress=False)
    assert resumed.steps[0]["step"] == 13
    assert _losses(before[:12] + resumed.steps) == _losses(ref.steps)
    assert _losses(before[12:15]) == _losses(resumed.steps[:3])  # the lost steps recomputed identically
    assert_same_weights(weights(tmp_path / "ref" / "model"), weights(tmp_path / "cut" / "model"))
    # with EMA on, the saved model holds the averaged weights, not the raw ones
    final = read_state(list_states(tmp_path / "ref" / "checkpoints")[-1][1])[0]
    ema = {k[len("ema/") :]: v for k, v in final.items() if k.startswith("ema/")}
    assert_same_weights(weights(tmp_path / "ref" / "model"), ema)
    assert not torch.equal(final["model/head.weight"], ema["head.weight"])
    assert resumed.final_top1 == ref.final_top1
    for name in ("metrics.csv", "steps.csv"):
        a = [
            {k: v for k, v in r.items() if k != "images_per_s"}
            for r in csv.DictReader((tmp_path / "ref" / name).open())
        ]
        b = [
            {k: v for k, v in r.items() if k != "images_per_s"}
            for r in csv.DictReader((tmp_path / "cut" / name).open())
        ]
        assert a == b, name


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation_equals_the_big_batch(tmp_path: Path, device: str) -> None:
    """Two micro-batches of 64 give the same steps as one batch of 128 (same samples, mean-reduced). In full fp32
    (tf32=False): with TF32 on a GPU the two runs differ by TF32's rounding (4e-5 in a weight), not float's."""
    cfg = tiny_config(**{"steps": 6, "epochs": None, "aug.mixup": 0.0, "device": device, "tf32": False})
    one = train(cfg, tmp_path / "one", progress=False)
    two = train(cfg.override(accum_steps=2), tmp_path / "two", progress=False)
    np.testing.assert_allclose([r["loss"] for r in two.steps], [r["loss"] for r in one.steps], rtol=1e-5)
    assert_close_weights(weights(tmp_path / "one" / "model"), weights(tmp_path / "two" / "model"))


def test_activation_checkpointing_recomputes_the_blocks_and_trains_the_same(tmp_path: Path) -> None:
    """grad_checkpointing=True: each block runs twice per micro-batch (forward, then recomputed in the
    backward pass) and the steps equal those without it."""
    cfg = tiny_config(**{"steps": 4, "epochs": None})
    for on in (False, True):
        with Trainer(cfg.override(grad_checkpointing=on), tmp_path / f"probe-{on}", progress=False) as t:
            calls: list[int] = []
            t.net.blocks[0].norm1.register_forward_hook(lambda *_, c=calls: c.append(1))
            micro = next(iter(t.loader.epoch(0, 0)))
            t.train_step(micro)
            assert len(calls) == (2 if on else 1) * len(micro)
    plain = train(cfg, tmp_path / "plain", progress=False)
    ckpt = train(cfg.override(grad_checkpointing=True), tmp_path / "ckpt", progress=False)
    np.testing.assert_allclose([r["loss"] for r in ckpt.steps], [r["loss"] for r in plain.steps], rtol=1e-5)
    assert_close_weights(weights(tmp_path / "plain" / "model"), weights(tmp_path / "ckpt" / "model"))


def test_attention_kernel_choice_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU "auto" picks the explicit softmax (faster backward) unless its probabilities pass 1 GiB (the rule,
    where the built-in kernels win their race: vitkit.train.training_path; tests/train/test_training_tune.py the
    race)."""
    from vitkit.inference import tune
    from vitkit.models.vit import Attention

    monkeypatch.setattr(tune, "default_timer", lambda fns: {k: 10.0 + i for i, k in enumerate(fns)})

    cfg = tiny_config(**{"steps": 6, "epochs": None, "device": "cpu"})  # the CPU's choice, whatever else is here
    with Trainer(cfg, tmp_path / "probe", progress=False) as auto:
        assert all(not m.fused for m in auto.net.modules() if isinstance(m, Attention))
        auto.evaluate()  # evaluation runs the fused kernel, then training steps go back to the explicit one
        assert all(not m.fused for m in auto.net.modules() if isinstance(m, Attention))
    # 1025 tokens x batch 128 x 2 heads x 2 layers: the probabilities (2.2 GB) would pass the 1 GiB budget
    with Trainer(cfg.override(**{"data.image_size": [128, 128]}), tmp_path / "long", progress=False) as long:
        assert all(m.fused for m in long.net.modules() if isinstance(m, Attention))


def test_attention_kernel_choice_on_a_gpu() -> None:
    """The fused (flash) kernel on a GPU at every length; an explicit choice is kept on every device (the
    decision alone: no GPU is needed to make it)."""
    from vitkit.models.vit import ViTConfig
    from vitkit.train.trainer import explicit_attention

    short = ViTConfig(image_size=(8, 8), patch_size=4, hidden_size=16, depth=2, num_heads=2, mlp_dim=32)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert explicit_attention("auto", cpu, short, 128) and not explicit_attention("auto", cuda, short, 128)
    for device in (cpu, cuda):
        assert explicit_attention("explicit", device, short, 128)
        assert not explicit_attention("fused", device, short, 128)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_kernels_train_the_same_function(tmp_path: Path, device: str) -> None:
    """The explicit softmax and the fused kernel give the same steps (in full fp32: tf32=False)."""
    cfg = tiny_config(**{"steps": 6, "epochs": None, "device": device, "tf32": False})
    explicit = train(cfg.override(attention="explicit"), tmp_path / "explicit", progress=False)
    fused = train(cfg.override(attention="fused"), tmp_path / "fused", progress=False)
    np.testing.assert_allclose([r["loss"] for r in fused.steps], [r["loss"] for r in explicit.steps], rtol=1e-5)
    assert_close_weights(weights(tmp_path / "explicit" / "model"), weights(tmp_path / "fused" / "model"))


def test_non_finite_loss_stops_with_the_step_or_is_skipped(tmp_path: Path) -> None:
    cfg = tiny_config(**{"steps": 5, "epochs": None})

    def poison(trainer: Trainer, rec: dict[str, float]) -> None:
        if trainer.step == 2:  # corrupt a weight: every later loss is NaN
            with torch.no_grad():
                trainer.net.head.weight[0, 0] = float("nan")  # type: ignore[index]

    t = Trainer(cfg, tmp_path / "stop", progress=False)
    with pytest.raises(NonFiniteLossError, match="at step 2"):
        t.fit(on_step=poison)
    t.close()
    t = Trainer(cfg.override(skip_nonfinite=True), tmp_path / "skip", progress=False)
    result = t.fit(on_step=poison)
    t.close()
    assert result.skipped_steps == 3 and result.step == 5
    assert [math.isfinite(r["loss"]) for r in result.steps] == [True, True, False, False, False]


def test_bad_image_in_training_data_names_the_file(
    tmp_path: Path, sample_jpeg: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "data"
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(root / c / f"{i}.png")
    (root / "b" / "bad.jpg").write_bytes(sample_jpeg.read_bytes()[:1000])
    cfg = tiny_config(**{"data.source": str(root), "data.batch_size": 9, "data.grayscale": False, "epochs": 1})
    with pytest.raises(DataError, match=r"bad\.jpg: corrupt or truncated"):
        train(cfg, tmp_path / "run", progress=False)
    capsys.readouterr()
    result = train(cfg.override(**{"data.skip_bad": True, "data.batch_size": 8}), tmp_path / "run2", progress=False)
    assert result.step == 1
    note = f"note: {root} [train]: skipped 1 bad item(s), kept 8 (first: {root / 'b' / 'bad.jpg'}: corrupt"
    assert capsys.readouterr().err.startswith(note)  # said once, by the one process


def test_run_folder_is_never_overwritten(tmp_path: Path) -> None:
    cfg = tiny_config(**{"steps": 1, "epochs": None, "data.val_split": None})
    train(cfg, tmp_path / "r", progress=False)
    with pytest.raises(ConfigError, match="already holds a run"):
        train(cfg, tmp_path / "r", progress=False)


@pytest.mark.parametrize("device", DEVICES)
def test_finetune_from_a_run_at_a_higher_resolution(tmp_path: Path, device: str) -> None:
    arch = {**tiny_config().model.overrides, "representation_size": 8}
    base = tiny_config(**{"steps": 3, "epochs": None, "model.overrides": arch, "device": device})
    train(base, tmp_path / "pre", progress=False)
    pre = load_checkpoint(tmp_path / "pre").model
    rng = np.random.default_rng(0)
    data = tmp_path / "new.npz"  # new classes: the head must be replaced
    images = rng.integers(0, 255, (24, 8, 8), dtype=np.uint8)
    np.savez(data, images=images, labels=np.arange(24) % 3, classes=np.asarray(["x", "y", "z"]))
    cfg = base.override(
        **{"model.init_from": str(tmp_path / "pre"), "model.name": None, "model.overrides": {}},
        **{"data.source": str(data), "data.image_size": [16, 16], "data.batch_size": 8, "optim.name": "sgd"},
        **{"data.val_split": None},
    )
    t = Trainer(cfg, tmp_path / "ft", progress=False)
    head = t.net.head
    assert isinstance(head, torch.nn.Linear) and head.weight.shape == (3, 16)  # pre-logits dropped: D -> 3
    assert not head.weight.any() and not head.bias.any()
    assert isinstance(t.net.pre_logits, torch.nn.Identity)
    assert t.net.cfg.image_size == (16, 16) and t.net.pos_embed is not None
    assert t.net.pos_embed.shape == (1, 1 + 16, 16)  # class token + 4x4 grid (was 2x2)
    assert pre.pos_embed is not None and t.net.pos_embed.device.type == device
    # compared on one device: the checkpoint loads on the CPU, the run holds its model on its own device
    torch.testing.assert_close(t.net.pos_embed[:, :1].cpu(), pre.pos_embed[:, :1])
    torch.testing.assert_close(t.net.patch_embed.proj.weight.cpu(), pre.patch_embed.proj.weight)  # type: ignore[union-attr]
    t.fit()
    t.close()
    loaded = load_checkpoint(tmp_path / "ft")
    assert loaded.meta.provenance["fine_tuned_from"] == str(tmp_path / "pre")
    assert loaded.meta.class_names == ["x", "y", "z"] and loaded.meta.preprocess.image_size == (16, 16)
