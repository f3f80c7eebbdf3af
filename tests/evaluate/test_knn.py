"""kNN classification (the DINO protocol) against scikit-learn's KNeighborsClassifier on the same features, in
blocks whose size is bounded by the chunk sizes (counted, not timed); ``vitkit knn`` and ``vitkit fewshot`` from
``vitkit embed`` outputs equal to computing the features."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sklearn.neighbors import KNeighborsClassifier

from helpers import randomize_, run_cli
from vitkit import save_pretrained
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.evaluate.knn import knn_classify, knn_evaluate
from vitkit.models import create_model

T = 0.07


def sklearn_knn(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, k: int) -> KNeighborsClassifier:
    """scikit-learn's classifier on cosine distance, each neighbour weighted exp(similarity / T)."""
    clf = KNeighborsClassifier(n_neighbors=k, metric="cosine", algorithm="brute", weights=lambda d: np.exp((1 - d) / T))
    return clf.fit(train_x, train_y)


@pytest.fixture(scope="module")
def digits_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = create_model("Ti/16", patch_size=4, image_size=8, hidden_size=32, depth=2, num_heads=2, mlp_dim=32,
                         num_classes=10)  # fmt: skip
    root = tmp_path_factory.mktemp("digits")
    return save_pretrained(randomize_(model).eval(), root / "model", preprocess=Preprocess(image_size=8),
                           class_names=[str(c) for c in range(10)])  # fmt: skip


def clustered(n: int, classes: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    centres = np.random.default_rng(classes).normal(size=(classes, dim))  # the same for a train and a test set
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    return (centres[y] + 1.5 * rng.normal(size=(n, dim))).astype(np.float32), y


@pytest.mark.parametrize(("k", "classes"), [(20, 10), (5, 3), (1, 7)])
def test_predictions_and_votes_equal_scikit_learns(k: int, classes: int) -> None:
    train_x, train_y = clustered(600, classes, 24, seed=k)
    test_x, test_y = clustered(200, classes, 24, seed=100 + k)
    ours = knn_classify(train_x, train_y, test_x, classes, k=k, temperature=T, query_chunk=64, bank_chunk=128)
    clf = sklearn_knn(train_x, train_y, test_x, k)
    np.testing.assert_array_equal(ours.predictions, clf.predict(test_x))
    proba = clf.predict_proba(test_x)  # the weighted votes, normalised per row
    np.testing.assert_allclose(ours.votes / ours.votes.sum(1, keepdims=True), proba, rtol=1e-4, atol=1e-6)
    # top-5: the classes in order of votes, as scikit-learn's probabilities rank them (ties: lower class first)
    want = np.argsort(-proba, axis=1, kind="stable")[:, : min(5, classes)]
    np.testing.assert_array_equal(ours.ranked, want)
    report = knn_evaluate(train_x, train_y, test_x, test_y, classes, k=k)
    assert report.top1 == pytest.approx(float((clf.predict(test_x) == test_y).mean()))
    assert 0.3 < report.top1 <= report.top5  # the clusters make it a real classification


def test_ties_go_to_the_lower_class_as_in_scikit_learn() -> None:
    """Neighbours at equal similarity with different labels: equal votes, the lower class wins on both sides."""
    rng = np.random.default_rng(0)
    base = rng.normal(size=(5, 8)).astype(np.float32)
    train_x = np.concatenate([base, base])  # every point twice
    train_y = np.array([3, 1, 2, 0, 4, 1, 3, 0, 2, 2])  # the two copies of a point labelled differently
    test_x = base + 1e-3 * rng.normal(size=base.shape).astype(np.float32)
    ours = knn_classify(train_x, train_y, test_x, 5, k=2, temperature=T)
    clf = sklearn_knn(train_x, train_y, test_x, 2)
    np.testing.assert_array_equal(ours.predictions, clf.predict(test_x))
    np.testing.assert_array_equal(ours.predictions, [1, 1, 0, 0, 2])  # the lower label of each pair


def test_blocks_are_bounded_by_the_chunk_sizes_whatever_the_bank() -> None:
    """A bank 40x the block's width: the similarities held at once are at most query_chunk x bank_chunk, and the
    result is that of one block over the whole bank."""
    train_x, train_y = clustered(20_000, 10, 16, seed=1)
    test_x, _ = clustered(300, 10, 16, seed=2)
    chunked = knn_classify(train_x, train_y, test_x, 10, query_chunk=32, bank_chunk=500)
    whole = knn_classify(train_x, train_y, test_x, 10, query_chunk=300, bank_chunk=20_000)
    assert chunked.largest_block <= 32 * 500 < whole.largest_block == 300 * 20_000
    np.testing.assert_array_equal(chunked.ranked, whole.ranked)
    np.testing.assert_allclose(chunked.votes, whole.votes, rtol=1e-6)


def test_knn_and_fewshot_from_embeddings_equal_computing_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, digits_ckpt: Path
) -> None:
    """``vitkit knn`` and ``vitkit fewshot`` given ``vitkit embed`` outputs of the two splits report what they
    report computing the features themselves (the fp32 model, the same batches)."""
    common = ["--precision", "fp32", "--batch-size", "64", "--workers", "0"]
    paths = {}
    for split, suffix in (("train", ".safetensors"), ("test", ".parquet")):
        paths[split] = tmp_path / f"{split}{suffix}"
        code, _, err = run_cli(capsys, "embed", str(digits_ckpt), "--data", "digits", "--split", split,
                               "--out", str(paths[split]), *common)  # fmt: skip
        assert code == 0, err
    cached = ["--train-embeddings", str(paths["train"]), "--test-embeddings", str(paths["test"]), "--json"]
    code, out, err = run_cli(capsys, "knn", *cached)
    assert code == 0, err
    from_files = json.loads(out)
    code, out, err = run_cli(capsys, "knn", str(digits_ckpt), "--data", "digits", *common, "--json")
    assert code == 0, err
    computed = json.loads(out)
    assert {k: v for k, v in from_files.items() if k != "features"} == {
        k: v for k, v in computed.items() if k != "features"
    }
    assert computed["top1"] > 0.3 and computed["num_train"] > 1000  # random features of digits still cluster

    shots = ["--shots", "1,5", "--seeds", "2", "--json"]
    code, out, err = run_cli(capsys, "fewshot", *cached, *shots)
    assert code == 0, err
    fs_files = json.loads(out)
    code, out, err = run_cli(capsys, "fewshot", str(digits_ckpt), "--data", "digits", *common, *shots)
    assert code == 0, err
    fs_computed = json.loads(out)
    assert fs_files["shots"] == fs_computed["shots"]


def test_knn_refuses_half_given_inputs_in_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, "knn", "--train-embeddings", str(tmp_path / "a.parquet"))
    assert code == 2 and "go together" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "knn", "--train-embeddings", str(tmp_path / "a.parquet"),
                           "--test-embeddings", str(tmp_path / "b.parquet"))  # fmt: skip
    assert code == 2 and "a.parquet" in err and len(err.strip().splitlines()) == 1


def test_knn_and_fewshot_refuse_embeddings_of_two_checkpoints(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, digits_ckpt: Path
) -> None:
    """A bank embedded by one checkpoint and test features by another (or in another precision): refused in
    one line naming the test file, before any search."""
    import torch

    torch.manual_seed(1)
    other = save_pretrained(randomize_(create_model("Ti/16", patch_size=4, image_size=8, hidden_size=32, depth=2,
                                                    num_heads=2, mlp_dim=32, num_classes=10)).eval(),
                            tmp_path / "other", preprocess=Preprocess(image_size=8))  # fmt: skip
    paths = {}
    for name, ckpt, precision in (("a", digits_ckpt, "fp32"), ("b", other, "fp32"), ("c", digits_ckpt, "bf16")):
        paths[name] = tmp_path / f"{name}.npy"
        code, _, err = run_cli(capsys, "embed", str(ckpt), "--data", "digits", "--split", "test", "--out",
                               str(paths[name]), "--precision", precision, "--workers", "0")  # fmt: skip
        assert code == 0, err
    for test, what in (("b", "checkpoint"), ("c", "precision")):
        for command in ("knn", "fewshot"):
            code, _, err = run_cli(capsys, command, "--train-embeddings", str(paths["a"]), "--test-embeddings",
                                   str(paths[test]))  # fmt: skip
            lines = err.strip().splitlines()
            assert code == 2 and len(lines) == 1 and str(paths[test]) in lines[0] and what in lines[0], err


def test_a_huge_label_in_embeddings_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """One row labelled 2e9 would size a (rows x 2e9) vote table: refused in one line naming the file."""
    from vitkit.outputs.arrays import EmbeddingWriter

    out = tmp_path / "bank.npy"
    w = EmbeddingWriter(out, {})
    w.write({"index": [0], "id": ["x"], "label": [2_000_000_000], "vector": np.ones((1, 4), np.float32)})
    w.close()
    for command in ("knn", "fewshot"):
        code, _, err = run_cli(capsys, command, "--train-embeddings", str(out), "--test-embeddings", str(out))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "label 2000000000" in lines[0] and str(out) in lines[0], err


def test_knn_leaves_out_and_counts_the_rows_of_images_embed_skipped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, digits_ckpt: Path
) -> None:
    """Embeddings made with ``embed --data ... --skip-bad`` hold a row for a corrupt image (no label, no vector):
    knn leaves it out, says so, and reports what it reports from the dataset with ``--skip-bad`` (issue 48)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for c in range(3):
            folder = tmp_path / "photos" / split / str(c)
            folder.mkdir(parents=True)
            for j in range(6):
                Image.fromarray((rng.random((8, 8, 3)) * 60 + 80 * c).astype(np.uint8)).save(folder / f"{j}.png")
    (tmp_path / "photos" / "train" / "1" / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    common = ["--precision", "fp32", "--workers", "0", "--skip-bad"]
    paths = {}
    for split in ("train", "test"):
        paths[split] = tmp_path / f"{split}.npy"
        code, _, err = run_cli(capsys, "embed", str(digits_ckpt), "--data", str(tmp_path / "photos"), "--split",
                               split, "--out", str(paths[split]), *common)  # fmt: skip
        assert code == 0, err
    cached = ["--train-embeddings", str(paths["train"]), "--test-embeddings", str(paths["test"]), "--json"]
    code, out, err = run_cli(capsys, "knn", *cached, "--k", "3")
    assert code == 0, err
    assert f"note: --train-embeddings {paths['train']}: left out 1 row(s) of images that failed" in err
    assert "broken.jpg" in err
    from_files = json.loads(out)
    code, out, err = run_cli(capsys, "knn", str(digits_ckpt), "--data", str(tmp_path / "photos"), *common,
                             "--k", "3", "--json")  # fmt: skip
    assert code == 0, err
    computed = json.loads(out)
    assert from_files["num_train"] == computed["num_train"] == 18, (from_files, computed, err)
    assert {k: v for k, v in from_files.items() if k != "features"} == {
        k: v for k, v in computed.items() if k != "features"
    }
