"""The one inference engine: the fp32 reference is the model itself, the fast precisions compute the same
function (logits and pre-logits features) up to their rounding, the ONNX engines refuse features."""

from __future__ import annotations

import pytest
import torch

from helpers import randomize_, rel_err
from vitkit import hardware
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.errors import ConfigError
from vitkit.inference import policy
from vitkit.inference.engine import InferenceEngine
from vitkit.inference.int8 import has_onednn_int8
from vitkit.inference.policy import bf16_is_faster, resolve_precision  # the real one, before --cpu-kind fakes it
from vitkit.models import create_model
from vitkit.models.vit import VisionTransformer

PRE = Preprocess(image_size=48)


def _model(**overrides: object) -> VisionTransformer:
    kw: dict = {"num_classes": 11, "image_size": 48, "depth": 3, **overrides}
    return randomize_(create_model("Ti/16", **kw)).eval()  # type: ignore[return-value]


def _reference(model: VisionTransformer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        rep = model.forward_head(model.forward_features(x), pre_logits=True)  # (B, R)
        return rep, model(x)


def test_fp32_reference_is_the_model_bit_for_bit() -> None:
    model = _model(representation_size=24)
    x = torch.randn(5, 3, 48, 48)
    rep, logits = _reference(model, x)
    eng = InferenceEngine(model, PRE, precision="fp32")
    assert eng.plan.path != "fast" and eng.runner is model and "reference" in eng.describe()
    out = eng.forward(x, logits=True, features=True)
    assert torch.equal(out.logits, logits) and torch.equal(out.features, rep)  # type: ignore[arg-type]
    assert torch.equal(eng.probabilities(x), logits.softmax(-1))


PRECISION_TOL = [("fp32", 1e-5), ("bf16", 3e-2), ("int8", 6e-2)]


@pytest.mark.parametrize("overrides", [{"representation_size": 24}, {"classifier": "gap"}])
@pytest.mark.parametrize(("precision", "tol"), PRECISION_TOL)
def test_fast_path_features_and_logits_match_the_fp32_model(overrides: dict, precision: str, tol: float) -> None:
    """The fast path's pre-logits output against the model's forward_head(forward_features(x), pre_logits=True)."""
    if precision == "int8" and not has_onednn_int8():
        pytest.skip("int8 needs oneDNN")
    model = _model(**overrides)
    x = torch.randn(6, 3, 48, 48)
    rep, logits = _reference(model, x)
    if precision == "fp32":  # the fp32 fast path (a training run's validation pass; auto's pick on some CPUs)
        eng = InferenceEngine(model, PRE, precision="fp32", batch_size=6, fp32_reference=False)
    else:
        eng = InferenceEngine(model, PRE, precision=precision, batch_size=6)
    assert eng.plan.path == "fast" and eng.precision == precision and eng.runner is not model
    out = eng.forward(x, logits=True, features=True)
    assert out.features is not None and out.logits is not None
    assert out.features.dtype == torch.float32 and out.features.shape == rep.shape
    assert rel_err(out.features, rep) < tol
    assert rel_err(out.logits, logits) < tol
    assert rel_err(eng.features(x), rep) < tol


def test_engines_refuse_features_with_a_clear_error() -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = _model()
    eng = InferenceEngine(model, PRE, precision="fp32", backend="onnxruntime", batch_size=2)
    x = torch.randn(2, 3, 48, 48)
    assert rel_err(eng.logits(x), _reference(model, x)[1]) < 1e-4
    assert not eng.gives_features
    with pytest.raises(ConfigError, match=r"--backend onnxruntime computes logits only.*--backend torch"):
        eng.features(x)


def test_auto_precision_follows_the_measured_bf16_speed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policy, "bf16_is_faster", lambda device="cpu": True)
    assert resolve_precision("auto") == "bf16" and resolve_precision("auto", backend="onnxruntime") == "fp32"
    monkeypatch.setattr(policy, "bf16_is_faster", lambda device="cpu": False)
    assert resolve_precision("auto") == "fp32" and resolve_precision("int8") == "int8"
    with pytest.raises(ConfigError, match="--precision 'fp16'"):
        resolve_precision("fp16")
    monkeypatch.setattr(policy, "fp32_fast_path_pays", lambda device="cpu": True)
    eng = InferenceEngine(_model(), PRE, precision="auto", tune=False)  # fp32, but the fast path: not the reference
    assert eng.plan.path == "fast" and eng.precision == "fp32"
    assert eng.describe().startswith("--precision auto -> fp32; fp32 fast") and not eng.plan.full_decode
    monkeypatch.setattr(policy, "fp32_fast_path_pays", lambda device="cpu": False)  # an AVX2 CPU
    eng = InferenceEngine(_model(), PRE, precision="auto")
    assert eng.plan.path != "fast" and not eng.plan.full_decode and "slower on this CPU" in eng.describe()
    assert InferenceEngine(_model(), PRE, precision="fp32").plan.full_decode  # the reference decodes fully


AUTO_ON = {"avx2": ("fp32", False), "avx512": ("fp32", True), "amx": ("bf16", True)}  # (precision, fast path)


def test_auto_on_every_cpu_kind_computes_the_models_function(cpu_kind: str) -> None:
    """``--precision auto`` as each CPU kind decides it (conftest's ``cpu_kind``): the precision and path that
    kind gets, named in ``describe``, images decoded at reduced scale, logits and features within that
    precision's error of the fp32 model; an explicit fp32 stays the reference on every kind."""
    model = _model(representation_size=24)
    x = torch.randn(4, 3, 48, 48)
    rep, logits = _reference(model, x)
    precision, fast = AUTO_ON[cpu_kind]
    eng = InferenceEngine(model, PRE, precision="auto", batch_size=4)
    plan = eng.plan
    assert (eng.precision, plan.path == "fast", plan.full_decode) == (precision, fast, False)
    assert eng.describe().startswith(f"--precision auto -> {precision}; ")
    out = eng.forward(x, logits=True, features=True)
    tol = dict(PRECISION_TOL)[precision]
    assert rel_err(out.logits, logits) < tol and rel_err(out.features, rep) < tol  # type: ignore[arg-type]
    ref = InferenceEngine(model, PRE, precision="fp32")
    assert ref.plan.full_decode and torch.equal(ref.logits(x), logits)


def test_bf16_is_never_faster_without_bf16_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "has_native_bf16", lambda device="cpu": False)
    assert not bf16_is_faster("cpu")


POOLED = [("cls", 2), ("gap", -1), ("tokens", 1), (None, 2), ("cls", None), ("tokens", None)]


@pytest.mark.parametrize(("pool", "layer"), POOLED)
def test_features_at_a_named_layer_and_pooling_equal_the_models_intermediates(pool: str | None, layer: int | None):
    """``engine.features(x, layer=, pool=)``: the reference is the model's intermediates bit for bit; the fp32
    fast path (only the first ``layer`` blocks) equals it up to rounding; a GAP model's own pooling is its mean."""
    model = _model(classifier="gap")
    x = torch.randn(4, 3, 48, 48)
    with torch.no_grad():
        out = model.forward_intermediates(x, attention=False)
        depth = None if layer is None else (layer if layer > 0 else model.cfg.depth + 1 + layer)
        tokens = out.hidden_states[depth] if depth is not None else model.forward_features(x)
        want = {"cls": tokens[:, 0], "gap": tokens[:, model.cfg.num_prefix_tokens :].mean(1), "tokens": tokens,
                None: model.pool(tokens)}[pool]  # fmt: skip
    ref = InferenceEngine(model, PRE, precision="fp32")
    got = ref.features(x, layer=layer, pool=pool)
    assert got.dtype == torch.float32 and got.device.type == "cpu" and torch.equal(got, want)
    fast = InferenceEngine(model, PRE, precision="fp32", batch_size=4, fp32_reference=False, tune=False)
    assert fast.plan.path == "fast"
    assert rel_err(fast.features(x, layer=layer, pool=pool), want) < 1e-5
    with pytest.raises(ValueError, match="pool"):
        ref.features(x, pool="max")


def test_attentions_are_the_fp32_models_whatever_the_path() -> None:
    """``engine.attentions``: the fp32 model's attention probabilities and logits, also on a bf16 engine (whose
    fast path never materialises them)."""
    model = _model()
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        want = model.forward_intermediates(x)
    eng = InferenceEngine(model, PRE, precision="bf16", batch_size=2, tune=False)
    got = eng.attentions(x)
    assert len(got.attentions) == model.cfg.depth
    assert all(torch.equal(a, b) for a, b in zip(got.attentions, want.attentions, strict=True))
    assert got.logits is not None and want.logits is not None and torch.equal(got.logits, want.logits)
