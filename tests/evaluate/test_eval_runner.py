"""The evaluation runners on small in-memory datasets that follow vitkit's data interface."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from eval_helpers import PRE, ListDataset, StreamDataset, make_dataset, make_model
from vitkit.errors import DataError
from vitkit.evaluate.evaluate import align_labels, evaluate_dataset, write_eval_report
from vitkit.evaluate.fewshot import fewshot_dataset
from vitkit.evaluate.metrics import compute_metrics
from vitkit.inference.features import ExtractOptions, extract
from vitkit.models.vit import VisionTransformer

QUIET = ExtractOptions(progress=False)


def direct_logits(model: VisionTransformer, ds: ListDataset) -> np.ndarray:
    with torch.no_grad():
        return model(torch.stack([PRE.to_tensor(img) for img in ds.images])).numpy()


def test_eval_equals_metrics_of_a_direct_forward(tmp_path: Path) -> None:
    model, ds = make_model(), make_dataset(23)
    report = evaluate_dataset(model, ds, PRE, opts=ExtractOptions(batch_size=5, progress=False))
    want = compute_metrics(direct_logits(model, ds), np.array(ds._labels), 3)
    assert report.metrics.top1 == pytest.approx(want.top1)
    np.testing.assert_array_equal(report.metrics.confusion, want.confusion)
    paths = write_eval_report(report, tmp_path)
    rows = list(csv.reader(paths["confusion_csv"].open()))
    assert rows[0] == ["true \\ predicted", "c0", "c1", "c2"]
    np.testing.assert_array_equal(np.array([r[1:] for r in rows[1:]], dtype=int), want.confusion)
    doc = json.loads(paths["metrics"].read_text())
    assert doc["top1"] == pytest.approx(want.top1) and doc["num_examples"] == 23
    assert paths["confusion_png"].stat().st_size > 1000


def test_class_names_in_another_order_are_remapped() -> None:
    model, ds = make_model(), make_dataset(30)
    base = evaluate_dataset(model, ds, PRE, class_names=["c0", "c1", "c2"], opts=QUIET)
    # the same images, but the dataset calls class 0 "c2" and class 2 "c0": labels must be remapped
    swapped = ListDataset(ds.images, [2 - y for y in ds._labels], ["c2", "c1", "c0"], expose=False)
    again = evaluate_dataset(model, swapped, PRE, class_names=["c0", "c1", "c2"], opts=QUIET)
    assert again.metrics.top1 == base.metrics.top1 and "remapped" in again.notes[0]
    np.testing.assert_array_equal(again.metrics.confusion, base.metrics.confusion)
    assert align_labels(["a", "b", "c"], ["x", "y", "z"], 3)[0] is None
    with pytest.raises(DataError, match="the dataset has 3 classes but the model's head has 4"):
        evaluate_dataset(make_model(4), ds, PRE, opts=QUIET)


def test_real_label_file_through_the_runner(tmp_path: Path) -> None:
    model, ds = make_model(), make_dataset(10)
    preds = direct_logits(model, ds).argmax(1)
    sets = [[int(p)] if i % 2 else [] for i, p in enumerate(preds)]  # odd examples: prediction accepted
    sets[1] = [(int(preds[1]) + 1) % 3]  # except one
    (tmp_path / "real.json").write_text(json.dumps(sets))
    report = evaluate_dataset(model, ds, PRE, label_file=tmp_path / "real.json", opts=QUIET)
    assert report.metrics.real == pytest.approx(4 / 5) and report.metrics.real_count == 5


def test_features_are_pre_logits_in_any_dataset_form() -> None:
    model, ds = make_model(representation_size=12), make_dataset(9)
    got = extract(model, ds, PRE, logits=True, features=True, opts=ExtractOptions(batch_size=4, progress=False))
    x = torch.stack([PRE.to_tensor(img) for img in ds.images])
    with torch.no_grad():
        want = model.forward_head(model.forward_features(x), pre_logits=True).numpy()
    assert got.features is not None and got.features.shape == (9, 12)
    np.testing.assert_allclose(got.features, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.logits, direct_logits(model, ds), rtol=1e-5, atol=1e-6)  # type: ignore[arg-type]
    streamed = extract(
        model, StreamDataset(ds), PRE, logits=False, features=True, opts=ExtractOptions(batch_size=4, progress=False)
    )
    np.testing.assert_allclose(streamed.features, got.features, rtol=1e-5, atol=1e-6)  # type: ignore[arg-type]
    assert streamed.indices.tolist() == list(range(9)) and streamed.labels.tolist() == ds._labels
    some = extract(model, ds, PRE, logits=False, features=True, indices=[7, 2], opts=QUIET)
    np.testing.assert_allclose(some.features, got.features[[7, 2]], rtol=1e-5, atol=1e-6)  # type: ignore[index]


def test_fewshot_extracts_only_the_shots_when_labels_are_known() -> None:
    model = make_model()
    train, test = make_dataset(40, seed=1), make_dataset(12, seed=2)
    full = fewshot_dataset(model, train, test, PRE, shots=(1, 3), seeds=(0, 1), opts=QUIET)
    exposed = ListDataset(train.images, train._labels, train.classes, expose=True)
    calls: list[int] = []
    original = exposed.__class__.__getitem__

    def counting(self: ListDataset, i: int) -> tuple[Image.Image, int]:
        calls.append(i)
        return original(self, i)

    exposed.__class__ = type("Counting", (ListDataset,), {"__getitem__": counting})
    subset = fewshot_dataset(model, exposed, test, PRE, shots=(1, 3), seeds=(0, 1), opts=QUIET)
    assert subset.accuracy == full.accuracy
    assert len(set(calls)) <= 2 * 3 * 3 < len(train)  # at most seeds x max shots x classes decoded
    with pytest.raises(DataError, match="test split has 4"):
        fewshot_dataset(model, train, make_dataset(8, K=4), PRE, shots=(1,), opts=QUIET)
