"""Metrics against scikit-learn, and ReaL-style label-set files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import confusion_matrix as sk_confusion
from sklearn.metrics import recall_score, top_k_accuracy_score

from vitkit.errors import DataError
from vitkit.evaluate.metrics import (
    compute_metrics,
    confusion_matrix,
    read_label_sets,
    real_accuracy,
    topk_correct,
)


@pytest.fixture
def preds() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 7, size=300)
    logits = rng.normal(size=(300, 7))
    logits[np.arange(300), labels] += rng.uniform(0, 2.5, size=300)  # better than chance, not perfect
    return logits, labels


def test_metrics_match_sklearn(preds: tuple[np.ndarray, np.ndarray]) -> None:
    logits, labels = preds
    m = compute_metrics(logits, labels)
    K = list(range(7))
    np.testing.assert_array_equal(m.confusion, sk_confusion(labels, logits.argmax(1), labels=K))
    np.testing.assert_array_equal(confusion_matrix(labels, logits.argmax(1), 7), m.confusion)
    assert m.top1 == pytest.approx(top_k_accuracy_score(labels, logits, k=1, labels=K))
    assert m.top5 == pytest.approx(top_k_accuracy_score(labels, logits, k=5, labels=K)) and m.k == 5
    for k in (2, 3):
        assert topk_correct(logits, labels, k).mean() == pytest.approx(top_k_accuracy_score(labels, logits, k=k))
    np.testing.assert_allclose(m.per_class, recall_score(labels, logits.argmax(1), average=None, labels=K))
    assert m.support.tolist() == np.bincount(labels, minlength=7).tolist()
    assert 0.3 < m.top1 < 0.95 and m.num_examples == 300


def test_absent_classes_and_few_classes() -> None:
    logits = np.array([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    m = compute_metrics(logits, np.array([0, 0]))
    assert m.k == 3 and m.top5 == 1.0 and m.top1 == 0.5
    assert m.per_class[0] == 0.5 and np.isnan(m.per_class[1]) and np.isnan(m.per_class[2])
    d = m.to_dict(["a", "b", "c"])
    assert d["per_class"]["b"] == {"accuracy": None, "support": 0}  # type: ignore[index]
    assert "top3" in d
    with pytest.raises(DataError, match="no examples"):
        compute_metrics(np.zeros((0, 3)), np.zeros(0))


def test_real_accuracy_skips_empty_sets() -> None:
    acc, n = real_accuracy(np.array([1, 2, 0, 4]), [[1, 3], [], [2], [4]])
    assert (acc, n) == (pytest.approx(2 / 3), 3)
    m = compute_metrics(np.eye(3), np.array([0, 1, 2]), label_sets=[[0], [2], []])
    assert m.real == 0.5 and m.real_count == 2 and m.top1 == 1.0


def test_label_files_in_every_format(tmp_path: Path) -> None:
    names = ["cat", "dog", "emu"]
    (tmp_path / "l.json").write_text(json.dumps([[0], [], [1, "emu"]]))
    assert read_label_sets(tmp_path / "l.json", 3, names) == [[0], [], [1, 2]]
    (tmp_path / "d.json").write_text(json.dumps({"2": [1], "b.png": ["cat"]}))
    files = ["x/a.png", "x/b.png", "x/c.png"]
    assert read_label_sets(tmp_path / "d.json", 3, names, files) == [[], [0], [1]]
    (tmp_path / "l.csv").write_text("key,labels\n0,1 2\nx/c.png,\n1,dog\n")
    assert read_label_sets(tmp_path / "l.csv", 3, names, files) == [[1, 2], [1], []]


@pytest.mark.parametrize(
    ("content", "suffix", "match"),
    [
        ("[[0], [1]]", ".json", "2 label sets for a dataset of 3"),
        ('{"7": [0]}', ".json", "index 7 out of range"),
        ('{"zz.png": [0]}', ".json", "neither an example index nor a file name"),
        ("[[0], [5], []]", ".json", "class index 5 out of range"),
        ('[["cow"], [], []]', ".json", "unknown class name 'cow'"),
        ("{oops", ".json", "not valid JSON"),
        ("a,b\n0,1\n", ".csv", "header 'key,labels'"),
    ],
)
def test_bad_label_files_name_the_problem(tmp_path: Path, content: str, suffix: str, match: str) -> None:
    p = tmp_path / f"labels{suffix}"
    p.write_text(content)
    with pytest.raises(DataError, match=match):
        read_label_sets(p, 3, ["cat", "dog", "emu"])


def test_missing_label_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such label file"):
        read_label_sets(tmp_path / "nope.json", 3)
