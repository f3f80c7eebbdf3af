"""Low-rank adapters (LoRA, Hu et al., ICLR 2022) on a ViT's projections, through the ``peft`` library.

An adapted Linear layer computes ``W x + b + (alpha / r) B A dropout(x)`` with the pretrained ``W``, ``b``
frozen and only ``A`` (r x in) and ``B`` (out x r, zero at the start) trained. :func:`add_lora` injects them
in place (``peft.inject_adapter_in_model``): the model stays a :class:`~vitkit.models.vit.VisionTransformer`
whose adapted layers are peft's ``lora.Linear`` (the original layer under ``base_layer``), so its state-dict
names gain ``.base_layer`` and ``.lora_A.default`` / ``.lora_B.default``. :func:`merge_lora` folds every
adapter into its weight (``W + (alpha / r) B A``) and puts the plain Linear back: the same function, a plain
model for every tool.

peft stays the format and the loader; the computation, with training kernels set
(``VisionTransformer.set_training_kernels``), is vitkit's own (:func:`fused_lora`, ``fused.lora_linear``): the
frozen base keeps the kernels' GEMM (fc1 its fused GELU, the adapter's share added before it), no weight
gradient is computed for it and nothing is kept for it; the adapter keeps its input and ``x A^T``. Without
kernels an adapted layer runs peft's forward.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from vitkit.errors import ConfigError, VitkitError
from vitkit.models.fused import LoraAdapter, lora_linear
from vitkit.models.kernel_api import TrainingKernels

# short target name -> the module it names in every block
TARGET_MODULES = {"qkv": "attn.qkv", "proj": "attn.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
ADAPTER = "default"  # peft's adapter name; one adapter per model
MAX_RANK = 4096  # far above any useful adapter (ranks of 4-64 are usual); a rank sizes every adapter matrix
M = TypeVar("M", bound=nn.Module)


@dataclass(frozen=True)
class LoraSpec:
    """Rank, scale (``alpha / rank``), dropout on the adapters' input, and which projections get adapters."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = tuple(TARGET_MODULES)

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 1 <= self.rank <= MAX_RANK:
            raise ConfigError(f"LoRA rank must be an integer in 1..{MAX_RANK}, got {self.rank!r}")
        for name, value in (("alpha", self.alpha), ("dropout", self.dropout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"LoRA {name} must be a finite number, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        unknown = [t for t in self.targets if t not in TARGET_MODULES]
        if unknown or not self.targets:
            raise ConfigError(
                f"LoRA targets: {unknown[0] if unknown else 'none given'}; choose from {', '.join(TARGET_MODULES)}"
            )
        object.__setattr__(self, "targets", tuple(self.targets))

    def pattern(self) -> str:
        """The regular expression peft matches module names against (the whole name): the chosen projections
        of every block, never the patch embedding's ``proj`` convolution."""
        names = "|".join(TARGET_MODULES[t].replace(".", r"\.") for t in self.targets)
        return rf"blocks\.\d+\.(?:{names})"

    def peft_config(self) -> Any:
        """The equivalent ``peft.LoraConfig``."""
        peft = _peft()
        return peft.LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=self.pattern(),
            bias="none",
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LoraSpec:
        rank = d["rank"]
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ConfigError(f"LoRA rank must be an integer, got {rank!r}")
        return cls(rank, float(d["alpha"]), float(d["dropout"]), tuple(d["targets"]))


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise VitkitError("LoRA needs the 'peft' package: pip install 'vitkit[adapt]'") from None
    return peft


def add_lora(model: M, spec: LoraSpec, seed: int | None = None) -> M:
    """Inject adapters into ``model`` in place and freeze everything but them and the head; returns ``model``.

    The head (and a pre-logits layer, if any) stays trainable: new classes need a new head. ``A`` starts
    Kaiming-uniform (peft's default; ``B`` at zero), drawn from ``seed`` when given (the global generator is
    left as it was), else from the global generator."""
    peft = _peft()
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        peft.inject_adapter_in_model(spec.peft_config(), model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(_is_adapter(name) or name.startswith(("head.", "pre_logits.")))
    return model


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_adapted(model: nn.Module) -> bool:
    """Whether ``model`` holds LoRA layers."""
    tuner = _peft().tuners.tuners_utils.BaseTunerLayer
    return any(isinstance(m, tuner) for m in model.modules())


@torch.no_grad()
def merge_lora(model: M) -> M:
    """Fold every adapter into its layer's weight and put the plain layer back, in place; returns ``model``."""
    tuner = _peft().tuners.tuners_utils.BaseTunerLayer
    adapted = [(name, m) for name, m in model.named_modules() if isinstance(m, tuner)]
    for name, layer in adapted:
        layer.merge(adapter_names=[ADAPTER])
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer.get_base_layer())
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def fused_lora(
    layer: nn.Module,
    x: torch.Tensor,
    kernels: TrainingKernels,
    *,
    gelu: bool = False,
    source: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``layer(x)`` (then exact GELU, with ``gelu``) through ``fused.lora_linear`` for a peft LoRA Linear whose
    one adapter is active and unmerged, on a frozen ``nn.Linear``; the output and GELU's input (see there).
    None for any other layer: it runs its own forward."""
    peft_layer: Any = layer  # its attributes are peft's LoraLayer's
    base, a, b = (getattr(layer, name, None) for name in ("base_layer", "lora_A", "lora_B"))
    if type(base) is not nn.Linear or not (isinstance(a, nn.ModuleDict) and isinstance(b, nn.ModuleDict)):
        return None
    if ADAPTER not in a or ADAPTER not in b or b[ADAPTER].bias is not None:
        return None
    if peft_layer.merged or peft_layer.disable_adapters or list(peft_layer.active_adapters) != [ADAPTER]:
        return None
    if ADAPTER in getattr(layer, "lora_variant", {}) or any(p.requires_grad for p in base.parameters()):
        return None  # DoRA and the like; a trained base needs its weight gradient: peft's forward
    weights: tuple[Any, Any] = (a[ADAPTER].weight, b[ADAPTER].weight)
    adapter = LoraAdapter(*weights, float(peft_layer.scaling[ADAPTER]), peft_layer.lora_dropout[ADAPTER])
    return lora_linear(x, base.weight, base.bias, adapter, kernels, gelu=gelu, source=source)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors in peft's file naming (``blocks.0.attn.qkv.lora_A.weight``, what
    ``peft.get_peft_model_state_dict`` returns), detached on the CPU."""
    peft = _peft()
    state = peft.get_peft_model_state_dict(model, adapter_name=ADAPTER)
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load :func:`adapter_state` tensors into an adapted model; every adapter must be given, nothing else."""
    peft = _peft()
    expected = adapter_state(model)
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has an unexpected tensor {extra[0]}"
        raise VitkitError(f"{source}: the adapters do not match the model ({what})")
    for k, v in expected.items():
        if state[k].shape != v.shape:
            raise VitkitError(f"{source}: adapter {k} has shape {tuple(state[k].shape)}, expected {tuple(v.shape)}")
    peft.set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
