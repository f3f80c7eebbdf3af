"""``vitkit finetune --method linear|lp-ft|lora|full``: each a checkpoint every command loads, the linear head
against scikit-learn, LoRA's saved forms, exact resume, and one-line errors for options that do not apply."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from sklearn.linear_model import LogisticRegression
from train_helpers import Crash, assert_same_weights, tiny_config, weights

from helpers import run_cli
from vitkit import load_checkpoint
from vitkit.configs import TrainConfig, finetune_config
from vitkit.data.datasets import open_dataset
from vitkit.errors import CheckpointError
from vitkit.inference.features import ExtractOptions, extract
from vitkit.train import Trainer, feature_cache, train
from vitkit.train.probe import STD_EPS
from vitkit.train.state import list_states, read_state

QUIET = ExtractOptions(progress=False)

NAMES = ["five", "six", "seven", "eight", "nine"]  # the target task: new classes for the base's digits model


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A digits model with a pre-logits layer (which linear and lp-ft keep, and full and lora drop)."""
    arch = {**tiny_config().model.overrides, "representation_size": 12}
    run = tmp_path_factory.mktemp("base") / "run"
    train(tiny_config(**{"steps": 30, "epochs": None, "model.overrides": arch}), run, progress=False)
    return run


@pytest.fixture(scope="module")
def upper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Digits 5-9 under names of their own (so every method needs a new head), as an .npz."""
    path = tmp_path_factory.mktemp("data") / "upper.npz"
    arrays: dict[str, Any] = {"classes": np.asarray(NAMES)}
    for split in ("train", "test"):
        ds = open_dataset("digits", split)
        keep = ds.labels >= 5
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = ds.images[keep], ds.labels[keep] - 5
    np.savez(path, **arrays)
    return path


def adapt_config(base: Path, data: Path, method: str, cache: Path, **changes: Any) -> TrainConfig:
    cfg = finetune_config(str(base), str(data), "finetune-small", (8, 8), method=method)
    small = {"data.batch_size": 64, "data.workers": 0, "data.eval_batch_size": 512, "steps": 6}
    small |= {"optim.warmup_steps": 1, "checkpoint_every_steps": 2, "log_every_steps": 1}
    return cfg.override(**(small | {"adapt.feature_cache": str(cache)} | changes))


METHODS = {
    "linear": ("linear", {}),
    "lp-ft": ("lp-ft", {}),
    "lora": ("lora", {"adapt.lora_rank": 4}),
    "lora-adapters": ("lora", {"adapt.lora_rank": 4, "adapt.save_adapters": True}),
    "full": ("full", {}),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_gives_a_checkpoint_every_command_loads(
    base: Path, upper: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    method, extra = METHODS[name]
    run = tmp_path / "run"
    result = train(adapt_config(base, upper, method, tmp_path / "cache", **extra), run, progress=False)
    assert result.step == (0 if method == "linear" else 6)
    loaded = load_checkpoint(run)
    assert loaded.meta.class_names == NAMES and loaded.meta.preprocess.grayscale
    assert loaded.meta.format == ("lora" if name == "lora-adapters" else "vitkit")
    assert loaded.meta.provenance["method"] == method
    # the head conventions: linear and lp-ft keep the pre-logits layer their head was fitted on
    assert loaded.model.cfg.representation_size == (12 if method in ("linear", "lp-ft") else None)
    assert set(loaded.model.state_dict()) == set(load_checkpoint(base).model.state_dict()) - (
        set() if method in ("linear", "lp-ft") else {"pre_logits.0.weight", "pre_logits.0.bias"}
    )  # a plain ViT: no adapter names left
    # eval in the precision the run names: the accuracy the run reported (eval's default, auto, may compute in
    # bf16 where bf16 is faster, and says so: test_the_run_and_eval_name_the_precision_of_their_top1)
    assert result.val_precision == "fp32" and "computed in fp32" in result.summary()
    code, out, err = run_cli(
        capsys, "eval", str(run), "--data", str(upper), "--out", str(tmp_path / "e"), "--json", "--precision", "fp32"
    )
    assert code == 0, err
    assert json.loads(out)["top1"] == pytest.approx(result.final_top1, abs=1e-9)
    # predict: class names as labels
    img = tmp_path / "x.png"
    Image.fromarray(open_dataset("digits", "test").images[0]).save(img)
    code, out, err = run_cli(capsys, "predict", "-c", str(run), str(img), "--json", "--top-k", "3")
    assert code == 0, err
    assert {t["label"] for t in json.loads(out)["top"]} <= set(NAMES)
    # serve's engine
    from vitkit.serve.served_model import ServedModel

    served = ServedModel.from_checkpoint(run, precision="fp32", fast=False)
    assert served.class_names == NAMES
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(served.probabilities(x), loaded.model(x).softmax(-1))
    # export
    code, out, err = run_cli(capsys, "export", str(run), str(tmp_path / "m.onnx"))
    assert code == 0 and "max abs err" in out, err


@pytest.fixture(scope="module")
def linear_run(base: Path, upper: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    tmp = tmp_path_factory.mktemp("linear")
    return tmp / "run", train(adapt_config(base, upper, "linear", tmp / "cache"), tmp / "run", progress=False)


def test_the_run_and_eval_name_the_precision_of_their_top1(
    linear_run: tuple[Path, Any], upper: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], cpu_kind: str
) -> None:
    """On every CPU kind (``--precision auto`` deciding as there): the run names the precision of its reported
    top-1; eval's default names its own beside its top-1 (bf16 where bf16 wins), equal to the run's figure where
    that is fp32; ``--precision fp32`` is the reference and gives the run's figure on every kind."""
    run, result = linear_run
    assert f"test accuracy: {100 * result.final_top1:.2f}%" in result.summary() and result.val_precision == "fp32"
    code, out, err = run_cli(capsys, "eval", str(run), "--data", str(upper), "--out", str(tmp_path / "a"))
    assert code == 0, err
    auto = "bf16" if cpu_kind == "amx" else "fp32"
    assert f"--precision auto -> {auto}" in err and f"in {auto} (--precision fp32 gives the reference)" in out
    report = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert report["precision"] == auto and not report["reference"] and report["engine"].startswith("--precision auto")
    if auto == "fp32":
        assert report["top1"] == pytest.approx(result.final_top1, abs=1e-9)
    code, out, err = run_cli(
        capsys, "eval", str(run), "--data", str(upper), "--out", str(tmp_path / "f"), "--precision", "fp32"
    )
    assert code == 0, err
    assert out.splitlines()[1].endswith(" in fp32")  # the reference: no hint
    report = json.loads((tmp_path / "f" / "metrics.json").read_text())
    assert report["precision"] == "fp32" and report["reference"] and report["engine"].startswith("fp32 reference")
    assert report["top1"] == pytest.approx(result.final_top1, abs=1e-9)


def _features(model: Path, data: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    loaded = load_checkpoint(model)
    out = extract(
        loaded.model, open_dataset(data, split), loaded.meta.preprocess, logits=False, features=True, opts=QUIET
    )
    assert out.features is not None
    return out.features.astype(np.float64), out.labels


@pytest.mark.parametrize("l2", [1e-2, None])
def test_linear_head_equals_sklearn_logistic_regression(
    base: Path, upper: Path, tmp_path: Path, l2: float | None
) -> None:
    """The fitted head against scikit-learn's LogisticRegression on the same pre-logits features (computed here
    by ``extract`` on the base checkpoint, apart from the run's cache), standardised as the run does, with the
    same regularisation: l2 = 1 / (C N)."""
    result = train(
        adapt_config(base, upper, "linear", tmp_path / "cache", **{"adapt.l2": l2}), tmp_path / "r", progress=False
    )
    probe = json.loads((tmp_path / "r" / "probe.json").read_text())
    assert probe["l2_mode"] == ("fixed" if l2 else "auto")
    chosen = probe["l2"]
    x, y = _features(base, upper, "train")
    mean, std = x.mean(0), x.std(0) + STD_EPS
    ref = LogisticRegression(C=1.0 / (chosen * len(y)), tol=1e-12, max_iter=20_000).fit((x - mean) / std, y)
    head = load_checkpoint(tmp_path / "r").model.head
    coef = head.weight.detach().double().numpy() * std  # the model's head, unfolded
    np.testing.assert_allclose(coef, ref.coef_, atol=2e-4 * np.abs(ref.coef_).max())
    xt, yt = _features(tmp_path / "r", upper, "test")  # the run's model: its pre-logits features are the base's
    logits = torch.from_numpy(xt).float() @ head.weight.detach().T + head.bias.detach()
    proba = logits.double().softmax(-1).numpy()
    np.testing.assert_allclose(proba, ref.predict_proba((xt - mean) / std), atol=2e-4)
    assert result.final_top1 == pytest.approx(np.mean(proba.argmax(1) == yt))
    assert result.final_top1 > 0.5  # chance is 0.1


def test_linear_resumes_from_the_chunks_an_interrupted_run_stored(
    base: Path, upper: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(feature_cache, "CHUNK", 200)
    n_train, n_test = (len(open_dataset(upper, split)) for split in ("train", "test"))
    assert 600 < n_train < 800 and n_test <= 200  # 4 training chunks, 1 test chunk
    calls: list[int] = []
    real = feature_cache.extract

    def extract_then_crash(*args: Any, **kwargs: Any) -> Any:
        calls.append(len(kwargs["indices"]))
        if len(calls) == 3:
            raise Crash
        return real(*args, **kwargs)

    ref = train(adapt_config(base, upper, "linear", tmp_path / "ref-cache"), tmp_path / "ref", progress=False)
    monkeypatch.setattr(feature_cache, "extract", extract_then_crash)
    cfg = adapt_config(base, upper, "linear", tmp_path / "cache", **{"adapt.feature_epochs": 1})
    with pytest.raises(Crash):
        train(cfg, tmp_path / "cut", progress=False)
    calls.clear()
    monkeypatch.setattr(feature_cache, "extract", real)
    monkeypatch.setattr(feature_cache, "extract", lambda *a, **k: calls.append(len(k["indices"])) or real(*a, **k))
    resumed = train(resume=tmp_path / "cut", progress=False)
    last = n_train - 600
    assert calls == [200, last, 200, 200, 200, last, n_test]  # the clean pass's chunks 3-4 (1-2 came from the
    # cache), the augmented pass, the test split
    again = train(cfg, tmp_path / "whole", progress=False)  # from scratch, every chunk from the cache
    assert_same_weights(weights(tmp_path / "cut" / "model"), weights(tmp_path / "whole" / "model"))
    assert resumed.final_top1 == again.final_top1
    assert ref.final_top1 is not None  # (without the augmented pass: another fit, another key)


def _crash_at(step: int) -> Any:
    def hook(trainer: Trainer, rec: dict[str, float]) -> None:
        if trainer.step == step:
            raise Crash

    return hook


@pytest.mark.parametrize("method", ["lp-ft", "lora"])
def test_resume_after_a_crash_equals_the_uninterrupted_run(
    base: Path, upper: Path, tmp_path: Path, method: str
) -> None:
    extra = {"adapt.lora_rank": 4, "adapt.lora_dropout": 0.1} if method == "lora" else {}
    cfg = adapt_config(base, upper, method, tmp_path / "cache", **extra)
    ref = train(cfg, tmp_path / "ref", progress=False)
    trainer = Trainer(cfg, tmp_path / "cut", progress=False)
    with pytest.raises(Crash):
        trainer.fit(on_step=_crash_at(5))
    trainer.close()
    assert [s for s, _ in list_states(tmp_path / "cut" / "checkpoints")] == [2, 4]
    resumed = train(resume=tmp_path / "cut", progress=False)
    assert resumed.steps[0]["step"] == 5
    assert [r["loss"] for r in resumed.steps] == [r["loss"] for r in ref.steps[4:]]
    assert_same_weights(weights(tmp_path / "ref" / "model"), weights(tmp_path / "cut" / "model"))


def test_lora_selection_keeps_a_copy_of_what_trains_only(base: Path, upper: Path, tmp_path: Path) -> None:
    """The best step's weights are kept apart (and in the training state) for the adapters and head alone: the
    frozen base never changes (a copy of it was 88 MiB at S/16, 340 at B/16). The kept model is still whole."""
    cfg = adapt_config(base, upper, "lora", tmp_path / "cache", **{"adapt.lora_rank": 4, "adapt.select": True})
    result = train(cfg, tmp_path / "run", progress=False)
    assert result.selected_step is not None
    (_, path), *_ = reversed(list_states(tmp_path / "run" / "checkpoints"))
    kept = [k.removeprefix("best/") for k in read_state(path)[0] if k.startswith("best/")]
    assert kept and all("lora_" in k or k.startswith("head.") for k in kept), kept
    assert len(load_checkpoint(tmp_path / "run").model.state_dict()) > len(kept)


def test_lp_ft_starts_from_the_linear_head_and_resumes_before_its_first_state(
    base: Path, upper: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lin = train(adapt_config(base, upper, "linear", tmp_path / "cache"), tmp_path / "lin", progress=False)
    cfg = adapt_config(base, upper, "lp-ft", tmp_path / "cache")
    # the linear method fits on all of train; lp-ft on what its held-out slice leaves (without: the same images)
    with Trainer(cfg.override(**{"adapt.select": False}), tmp_path / "probe", progress=False) as t:
        t._linear_probe_head()
        head = {k: v.clone() for k, v in t.net.head.state_dict().items()}
    linear_head = load_checkpoint(tmp_path / "lin").model.head.state_dict()
    assert_same_weights(head, linear_head)  # stage 1 is the linear method's head, from the same features
    first_loss = train(cfg, tmp_path / "ref", progress=False).steps[0]["loss"]
    assert abs(first_loss - np.log(5)) > 0.01  # a zero head's uniform guess would cost log(5) exactly
    assert json.loads((tmp_path / "ref" / "probe.json").read_text())["method"] == "lp-ft"
    assert lin.final_top1 is not None

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise Crash

    cfg2 = cfg.override(**{"adapt.feature_cache": str(tmp_path / "cold")})
    with monkeypatch.context() as patch:  # (undo() would also drop --cpu-kind's fakes)
        patch.setattr(feature_cache, "extract", crash)
        with pytest.raises(Crash):
            train(cfg2, tmp_path / "cut", progress=False)
    train(resume=tmp_path / "cut", progress=False)  # no training state yet: starts over from config.json
    assert_same_weights(weights(tmp_path / "ref" / "model"), weights(tmp_path / "cut" / "model"))


def test_lora_trains_only_adapters_and_head_and_saves_them_apart(base: Path, upper: Path, tmp_path: Path) -> None:
    """bf16: on an AVX-512 BF16 CPU the training kernels' GEMMs are on, and the adapters still train."""
    extra = {"adapt.lora_rank": 4, "precision": "bf16", "optim.lr": 0.1}
    train(adapt_config(base, upper, "lora", tmp_path / "c", **extra), tmp_path / "merged", progress=False)
    cfg = adapt_config(base, upper, "lora", tmp_path / "c", **extra, **{"adapt.save_adapters": True})
    train(cfg, tmp_path / "apart", progress=False)
    state = {k[len("model/") :]: v for k, v in _last_state(tmp_path / "apart").items() if k.startswith("model/")}
    start = load_checkpoint(base).model.state_dict()
    for name, value in state.items():
        if ".base_layer." in name:  # frozen: exactly the pretrained weights
            assert torch.equal(value, start[name.replace(".base_layer", "")]), name
    assert any(".lora_B." in n and v.abs().max() > 0 for n, v in state.items())  # B started at zero
    folder = tmp_path / "apart" / "model"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["config.json", "adapter_config.json", "adapter_model.safetensors", "head.safetensors"]
    )
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4  # peft's own config file
    apart, merged = load_checkpoint(folder), load_checkpoint(tmp_path / "merged")
    for k, v in merged.model.state_dict().items():  # the same training, saved two ways
        torch.testing.assert_close(apart.model.state_dict()[k], v, rtol=1e-6, atol=1e-6)


def test_adapters_refuse_a_base_that_changed(base: Path, upper: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "base"
    shutil.copytree(base, copy)
    cfg = adapt_config(copy, upper, "lora", tmp_path / "c", **{"adapt.save_adapters": True, "steps": 2})
    train(cfg, tmp_path / "r", progress=False)
    load_checkpoint(tmp_path / "r")  # fine while the base is as it was
    loaded = load_checkpoint(copy)
    with torch.no_grad():
        loaded.model.blocks[0].mlp.fc1.weight.add_(0.01)
    from vitkit.checkpoints import vitkit_format

    vitkit_format.save(loaded.model, copy / "model", preprocess=loaded.meta.preprocess,
                       class_names=loaded.meta.class_names, overwrite=True)  # fmt: skip
    with pytest.raises(CheckpointError, match="not the one these adapters were trained on"):
        load_checkpoint(tmp_path / "r")


def _last_state(run: Path) -> dict[str, torch.Tensor]:
    from vitkit.train.state import read_state

    return read_state(list_states(run / "checkpoints")[-1][1])[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--method", "linear", "--lora-rank", "4"], "--lora-rank applies to --method lora, not --method linear"),
        (["--method", "lora", "--l2", "0.1"], "--l2 applies to --method linear or lp-ft, not --method lora"),
        (["--save-adapters"], "--save-adapters applies to --method lora, not --method full"),
        (["--method", "lora", "--feature-precision", "bf16"], "--feature-precision applies to --method linear or"),
        (["--method", "linear", "--precision", "bf16"], "--feature-precision the precision of its features"),
        (["--method", "linear", "--lr", "0.1"], "--lr does not apply to --method linear"),
        (["--method", "linear", "--steps", "5"], "--steps does not apply to --method linear"),
        (["--method", "lora", "--lora-targets", "qkv,head"], "argument --lora-targets: head: choose from qkv"),
        (["--method", "lora", "--lora-dropout", "1"], "argument --lora-dropout: must be in [0, 1)"),
        (["--method", "lora", "--lora-rank", "0"], "argument --lora-rank: must be positive"),
        (["--method", "linear", "--l2", "-1"], "argument --l2: must be positive"),
        (["--method", "probe"], "argument --method: invalid choice"),
        (["--method", "lora", "--set", "adapt.lora_alpha=0"], "adapt.lora_alpha must be a positive number"),
    ],
)
def test_bad_options_are_one_line(
    base: Path, upper: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, _, err = run_cli(capsys, "finetune", str(base), "--data", str(upper), "--out", str(tmp_path / "r"), *argv)
    assert code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_finetune_command_linear_then_another_l2_reuses_the_features(
    base: Path, upper: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = [str(base), "--data", str(upper), "--method", "linear", "--feature-cache", str(tmp_path / "cache")]
    code, out, err = run_cli(capsys, "finetune", *common, "--out", str(tmp_path / "a"), "--quiet")
    assert code == 0, err
    assert "linear head: l2" in out and "test accuracy:" in out and "own 8x8 px features" in err
    code, out, err = run_cli(capsys, "finetune", *common, "--l2", "0.5", "--out", str(tmp_path / "b"), "--quiet")
    assert code == 0 and "l2 0.5 (fixed)" in out, err
    chunks = sorted((tmp_path / "cache").glob("*/chunk-*.safetensors"))
    assert len(chunks) == 2  # train and test, computed once and read back by the second run
    a, b = load_checkpoint(tmp_path / "a").model, load_checkpoint(tmp_path / "b").model
    assert not torch.equal(a.head.weight, b.head.weight)
    assert_same_weights(
        {k: v for k, v in a.state_dict().items() if not k.startswith("head.")},
        {k: v for k, v in b.state_dict().items() if not k.startswith("head.")},
    )  # the backbone is the checkpoint's, untouched


def test_a_feature_cache_others_can_write_is_refused_before_any_work(
    base: Path, upper: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A head is fitted on whatever the cache holds: like vitkit's download cache, a folder another user could
    change is refused (one line naming it), and a new one is created private (0700)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by everyone, no sticky bit
    argv = [str(base), "--data", str(upper), "--method", "linear", "--quiet"]
    code, _, err = run_cli(capsys, "finetune", *argv, "--feature-cache", str(shared), "--out", str(tmp_path / "r"))
    assert code == 2 and "feature cache" in err and str(shared) in err and "others" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "r").exists() and not any(shared.iterdir())
    code, _, err = run_cli(capsys, "finetune", *argv, "--feature-cache", str(tmp_path / "new" / "cache"),
                           "--out", str(tmp_path / "r2"))  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "new" / "cache").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_linear_on_features_of_the_fast_path(
    base: Path, upper: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], precision: str
) -> None:
    """--feature-precision bf16 / int8: the head is fitted on the fast path's features (cached under their own
    key) and classifies about as well as on the fp32 ones."""
    common = [str(base), "--data", str(upper), "--method", "linear", "--feature-cache", str(tmp_path / "c"), "--quiet"]
    code, _, err = run_cli(capsys, "finetune", *common, "--out", str(tmp_path / "fp32"))
    assert code == 0, err
    code, _, err = run_cli(capsys, "finetune", *common, "--feature-precision", precision, "--out", str(tmp_path / "b"))
    assert code == 0, err
    keys = [json.loads(p.read_text())["precision"] for p in (tmp_path / "c").glob("*/key.json")]
    assert sorted(keys) == sorted([precision, precision, "fp32", "fp32"])  # train and test splits, each precision
    acc32, acc16 = (json.loads((tmp_path / r / "probe.json").read_text())["val_top1"] for r in ("fp32", "b"))
    assert acc16 == pytest.approx(acc32, abs=0.03) and acc16 > 0.5
    assert load_checkpoint(tmp_path / "b").meta.class_names == NAMES


# ---- model selection on held-out data (adapt.select) ------------------------------------------------------


def _heldout_top1(model_dir: Path, data: Path, seed: int, fraction: float = 0.1) -> float:
    """Top-1 of a saved model on the slice of ``data``'s training split that a run with ``seed`` holds out."""
    from vitkit.data.subset import split_off

    parts = split_off(open_dataset(data, "train"), fraction, seed)
    assert parts is not None
    loaded = load_checkpoint(model_dir)
    got = extract(loaded.model, parts[1], loaded.meta.preprocess, opts=ExtractOptions(batch_size=512, progress=False))
    assert got.logits is not None
    return float((got.logits.argmax(1) == got.labels).mean())


def _selection(run: Path) -> list[dict[str, float]]:
    import csv

    with open(run / "selection.csv") as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]


def test_lp_ft_never_ends_below_the_linear_head_it_started_from(base: Path, upper: Path, tmp_path: Path) -> None:
    """A learning rate that wrecks the fine-tuning stage: the run keeps the linear head of step 0, and model/
    (what every command loads) is that head's model, measured again on the held-out slice."""
    cfg = adapt_config(base, upper, "lp-ft", tmp_path / "cache", **{"optim.lr": 3.0, "optim.clip_norm": None})
    result = train(cfg, tmp_path / "run", progress=False)
    rows = _selection(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]  # step 0, then every ceil(6 / 20) = 1 step
    assert max(r["val_top1"] for r in rows[1:]) < rows[0]["val_top1"]  # fine-tuning made it worse here...
    assert result.selected_step == 0  # ...so the linear head is kept
    assert _heldout_top1(tmp_path / "run" / "model", upper, seed=0) == pytest.approx(rows[0]["val_top1"], abs=1e-9)
    prov = load_checkpoint(tmp_path / "run").meta.provenance
    assert prov["selected_step"] == 0 and prov["step"] == 6 and prov["selected_on"] == "train[heldout] (71 images)"
    assert "kept the weights of step 0 of 6" in result.summary()


@pytest.mark.parametrize("method", ["full", "lora"])
def test_model_is_the_best_step_on_the_held_out_slice(base: Path, upper: Path, tmp_path: Path, method: str) -> None:
    extra = {"adapt.lora_rank": 4} if method == "lora" else {}
    cfg = adapt_config(base, upper, method, tmp_path / "cache", seed=3, steps=12, **{"adapt.eval_every_steps": 4})
    result = train(cfg.override(**extra), tmp_path / "run", progress=False)
    rows = _selection(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 4, 8, 12]
    best = max(rows, key=lambda r: (r["val_top1"], -r["val_loss"]))
    assert result.selected_step == best["step"] and result.best_top1 == best["val_top1"]
    assert load_checkpoint(tmp_path / "run").meta.provenance["selected_step"] == best["step"]
    assert _heldout_top1(tmp_path / "run" / "model", upper, seed=3) == pytest.approx(best["val_top1"], abs=1e-9)
    assert not (tmp_path / "run" / "best").exists()  # model/ is the selected weights: no second copy


def test_the_held_out_slice_is_stratified_and_never_trained_on(base: Path, upper: Path, tmp_path: Path) -> None:
    cfg = adapt_config(base, upper, "full", tmp_path / "cache")
    with Trainer(cfg, tmp_path / "run", progress=False) as t:
        assert t.select_set is not None and t.val_set is not None and t.val_set.split == "test"
        train_idx, held_idx = t.train_set.indices, t.select_set.indices  # type: ignore[attr-defined]
    whole = open_dataset(upper, "train")
    assert len(train_idx) + len(held_idx) == len(whole) and not set(train_idx) & set(held_idx)
    counts = np.bincount(whole.labels[held_idx], minlength=5)
    totals = np.bincount(whole.labels, minlength=5)
    assert np.all(counts == np.round(0.1 * totals))  # a tenth of every class


def test_a_data_set_with_a_validation_split_selects_on_it(base: Path, upper: Path, tmp_path: Path) -> None:
    z = dict(np.load(upper))
    z["val_images"], z["val_labels"] = z["test_images"][:50], z["test_labels"][:50]
    data = tmp_path / "with_val.npz"
    np.savez(data, **z)
    cfg = adapt_config(base, data, "full", tmp_path / "cache")
    with Trainer(cfg, tmp_path / "run", progress=False) as t:
        assert t.select_set is not None and t.select_set.split == "val" and len(t.select_set) == 50
        assert len(t.train_set) == len(open_dataset(upper, "train"))  # all of train is trained on


def test_a_class_of_one_image_trains_on_everything_and_keeps_the_last_step(
    base: Path, upper: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    z = dict(np.load(upper))
    keep = np.concatenate([np.flatnonzero(z["train_labels"] != 4), np.flatnonzero(z["train_labels"] == 4)[:1]])
    z["train_images"], z["train_labels"] = z["train_images"][keep], z["train_labels"][keep]
    np.savez(tmp_path / "one.npz", **z)
    result = train(adapt_config(base, tmp_path / "one.npz", "full", tmp_path / "cache"), tmp_path / "r", progress=False)
    assert result.selected_step is None and result.step == 6
    assert "nothing to select the weights on; the last step's are kept" in capsys.readouterr().err


# ---- the default schedule, sized by the data -------------------------------------------------------------


@pytest.mark.parametrize(
    ("images", "batch", "epochs", "steps", "warmup"),
    [
        (646, 64, 30.0, None, 3.0),  # the digits transfer: 10 steps an epoch, 300 steps
        (25, 8, 100.0, None, 10.0),  # five shots of five classes: 3 steps an epoch, capped at 100 epochs
        (5, 5, 100.0, None, 10.0),  # the batch never passes the data
        (20_000, 64, 5.0, None, 0.5),  # 312 steps an epoch: at least 5 epochs
        (60_000, 512, None, 10_000, 0.0),  # the paper's CIFAR steps
        (2_000_000, 512, None, 20_000, 0.0),  # the paper's ImageNet steps
    ],
)
def test_the_default_schedule_is_sized_by_the_data(
    images: int, batch: int, epochs: float | None, steps: int | None, warmup: float
) -> None:
    from vitkit.configs.recipes import finetune_for_data

    cfg, why = finetune_for_data(images, (16, 16), "ckpt", "data")
    assert (cfg.data.batch_size, cfg.epochs, cfg.steps, cfg.optim.warmup_epochs) == (batch, epochs, steps, warmup)
    assert cfg.data.image_size == (16, 16) and f"{images:,}" in why
    if steps is not None:
        assert cfg.optim.warmup_steps == 500 and cfg.optim.lr == 0.01  # the paper's
    cfg.validate()


def test_finetune_prints_the_schedule_it_chose_and_runs_at_the_backbone_resolution(
    base: Path, upper: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["finetune", str(base), "--data", str(upper), "--out", str(tmp_path / "r"), "--quiet", "--steps", "3"]
    code, out, err = run_cli(capsys, *argv, "--set", "data.workers=0")
    assert code == 0, err
    lines = [line for line in err.splitlines() if "schedule:" in line]
    assert len(lines) == 1, err
    line = lines[0]
    for needle in ("30 epochs = 300 steps of batch 64", "warm-up 30 steps", "lr 0.03", "8x8 px (the checkpoint's own)",
                   "sized for 646 training images", "71 more held out"):  # fmt: skip
        assert needle in line, line
    doc = json.loads((tmp_path / "r" / "config.json").read_text())
    assert doc["data"]["image_size"] == [8, 8] and doc["steps"] == 3 and doc["adapt"]["select"]
    assert "kept the weights of step" in out
    # the paper's recipe by name, exactly
    paper = finetune_config(str(base), str(upper), "paper-finetune")
    assert (paper.steps, paper.data.batch_size, paper.optim.lr, paper.optim.warmup_steps) == (500, 512, 0.01, 100)
    assert paper.data.image_size == (12, 12)  # 8 px x 384/224, to the stride
    assert paper.aug.crop_scale == (0.05, 1.0) and paper.aug.flip
