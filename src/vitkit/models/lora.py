"""Low-rank adapters (LoRA, Hu et al., ICLR 2022) on a ViT's projections, in peft's names and semantics.

An adapted Linear layer computes ``W x + b + (alpha / r) B A dropout(x)`` with the pretrained ``W``, ``b``
frozen and only ``A`` (r x in) and ``B`` (out x r, zero at the start) trained. :func:`add_lora` injects them
in place: the model stays a :class:`~vitkit.models.vit.VisionTransformer` whose adapted layers are
:class:`LoraLinear`, vitkit's copy of peft's ``lora.Linear`` with one adapter (the original layer under
``base_layer``, the same parameter names, initialisation, forward and merge), so its state-dict names gain
``.base_layer`` and ``.lora_A.default`` / ``.lora_B.default`` as under peft. :func:`merge_lora` folds every
adapter into its weight (``W + (alpha / r) B A``) and puts the plain Linear back: the same function, a plain
model for every tool.

peft is not imported (it imports transformers: about 150 MiB of memory for a training run); it stays the
on-disk format (:func:`adapter_state` gives its file names, ``checkpoints.lora_format`` its
``adapter_config.json``) and a loader of what vitkit saves, and ``LoraSpec.peft_config`` builds its config
where peft is installed. With training kernels set (``kernel_paths.set_training_kernels``) the computation
is :func:`fused_lora` (``fused.lora_linear``): the frozen base keeps the kernels' GEMM (fc1 its fused GELU, the
adapter's share added before it), no weight gradient is computed for it and nothing is kept for it; the
adapter keeps ``x A^T`` and its input, or recomputes that input from what the layer before keeps anyway (the
LayerNorm's input for qkv and fc1, fc1's GELU input for fc2). Without kernels an adapted layer runs its own
forward, peft's.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from vitkit.errors import ConfigError, VitkitError
from vitkit.models.fused import LoraAdapter, NormInput, lora_linear
from vitkit.models.kernel_api import TrainingKernels

# short target name -> the module it names in every block (SwiGLU's too: fc1 holds its gate and up projections
# stacked, fc2 is its down projection)
TARGET_MODULES = {"qkv": "attn.qkv", "proj": "attn.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
# short target name -> the modules it names in a MAP head (``attn_pool``, SigLIP): its attention's query and
# key-value projections, its output projection and its MLP, the same kinds of layer as a block's
POOL_MODULES = {"qkv": ("q", "kv"), "proj": ("proj",), "fc1": ("mlp.fc1",), "fc2": ("mlp.fc2",)}
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
        of every block and of a MAP head (``attn_pool``; a model without one has no such names), never the patch
        embedding's ``proj`` convolution."""
        names = "|".join(TARGET_MODULES[t].replace(".", r"\.") for t in self.targets)
        pool = "|".join(m.replace(".", r"\.") for t in self.targets for m in POOL_MODULES[t])
        return rf"blocks\.\d+\.(?:{names})|attn_pool\.(?:{pool})"

    def peft_config(self) -> Any:
        """The equivalent ``peft.LoraConfig`` (needs peft installed; vitkit itself never calls it: the folders it
        writes carry the same config as JSON, ``checkpoints.lora_format.adapter_config``)."""
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
        raise VitkitError("LoraSpec.peft_config needs the 'peft' package: pip install peft") from None
    return peft


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear`` with one low-rank adapter, in peft's names and semantics (``peft.tuners.lora.Linear``
    with one adapter, ``"default"``): ``base_layer``, ``lora_A[ADAPTER]`` (r x in) and ``lora_B[ADAPTER]``
    (out x r) bias-free Linears, ``lora_dropout[ADAPTER]`` (Dropout, or Identity at 0), ``scaling[ADAPTER]``
    (alpha / r), ``r`` and ``lora_alpha``. Its state dict is peft's (``base_layer.weight``,
    ``lora_A.default.weight``, ...); its forward is peft's: ``base(x) + B(A(dropout(x))) * scaling``, x first cast
    to A's dtype, the result cast back to the base's output dtype."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base_layer = base
        self.r = {ADAPTER: rank}
        self.lora_alpha = {ADAPTER: alpha}
        self.scaling = {ADAPTER: alpha / rank}
        self.lora_dropout = nn.ModuleDict({ADAPTER: nn.Dropout(p=dropout) if dropout > 0.0 else nn.Identity()})
        # peft's draws, in its order: both Linears' own init, then A again (Kaiming-uniform, a = sqrt(5)); B zero
        self.lora_A = nn.ModuleDict({ADAPTER: nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({ADAPTER: nn.Linear(rank, base.out_features, bias=False)})
        a, b = self.adapter_weights()
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        nn.init.zeros_(b)
        w = base.weight  # the adapter on the base's device, and in its dtype (a float one), as peft moves it
        dtype = w.dtype if w.dtype.is_floating_point else None
        for holder in (self.lora_A, self.lora_B):
            holder[ADAPTER] = holder[ADAPTER].to(w.device, dtype=dtype)
        self.in_features, self.out_features = base.in_features, base.out_features

    def adapter_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``lora_A[ADAPTER].weight`` (r, in) and ``lora_B[ADAPTER].weight`` (out, r)."""
        a, b = self.lora_A[ADAPTER].weight, self.lora_B[ADAPTER].weight
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """peft's ``lora.Linear.forward`` with one active, unmerged adapter."""
        result = self.base_layer(x)  # (..., out)
        dtype = self.adapter_weights()[0].dtype
        xa = x if x.dtype == dtype else x.to(dtype)
        update = self.lora_B[ADAPTER](self.lora_A[ADAPTER](self.lora_dropout[ADAPTER](xa))) * self.scaling[ADAPTER]
        return (result + update).to(result.dtype)  # (..., out)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scaling B A`` (out, in), as peft's ``get_delta_weight``: in fp32 for bf16/fp16 weights on a CPU."""
        a, b = self.adapter_weights()
        cast = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
        delta = ((b.float() @ a.float()) if cast else (b @ a)) * self.scaling[ADAPTER]
        return delta.to(b.dtype) if cast else delta

    def extra_repr(self) -> str:
        return f"r={self.r[ADAPTER]}, lora_alpha={self.lora_alpha[ADAPTER]}"


def add_lora(model: M, spec: LoraSpec, seed: int | None = None) -> M:
    """Inject adapters into ``model`` in place and freeze everything but them and the head; returns ``model``.

    Every Linear whose whole name matches ``spec.pattern()`` becomes a :class:`LoraLinear` around it, in the
    order of ``named_modules`` (peft's ``inject_adapter_in_model`` order, so a seed draws the same ``A`` as peft's
    from the same seed). The head (and a pre-logits layer, if any) stays trainable: new classes need a new head.
    ``A`` starts Kaiming-uniform (``B`` at zero), drawn from ``seed`` when given (the global generator is left as
    it was), else from the global generator."""
    pattern = re.compile(spec.pattern())
    targets = [(name, m) for name, m in model.named_modules() if pattern.fullmatch(name)]
    if not targets:
        raise VitkitError(f"LoRA: no layer of the model matches {spec.pattern()}")
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        for name, layer in targets:
            if type(layer) is not nn.Linear:
                raise VitkitError(f"LoRA: {name} is a {type(layer).__name__}, not a plain Linear layer")
            _replace(model, name, LoraLinear(layer, spec.rank, spec.alpha, spec.dropout))
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name or name.startswith(("head.", "pre_logits.")))
    return model


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)


def adapted_layers(model: nn.Module) -> list[tuple[str, LoraLinear]]:
    """Every :class:`LoraLinear` of ``model`` with its name, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLinear)]


@torch.no_grad()
def merge_lora(model: M) -> M:
    """Fold every adapter into its layer's weight (``W += scaling B A``, as peft's ``merge``) and put the plain
    layer back, in place; returns ``model``."""
    for name, layer in adapted_layers(model):
        base = layer.base_layer
        base.weight.data += layer.delta_weight()
        _replace(model, name, base)
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
    norm: NormInput | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``layer(x)`` (then exact GELU, with ``gelu``) through ``fused.lora_linear`` for a :class:`LoraLinear` on a
    frozen ``nn.Linear``; the output and GELU's input (see there; ``source`` and ``norm``: what x was computed
    from, for the backward pass to recompute it). None for any other layer: it runs its own forward."""
    if not isinstance(layer, LoraLinear) or type(layer.base_layer) is not nn.Linear:
        return None
    base = layer.base_layer
    if any(p.requires_grad for p in base.parameters()):
        return None  # a trained base needs its weight gradient: the layer's own forward
    adapter = LoraAdapter(*layer.adapter_weights(), float(layer.scaling[ADAPTER]), layer.lora_dropout[ADAPTER])
    return lora_linear(x, base.weight, base.bias, adapter, kernels, gelu=gelu, source=source, norm=norm)


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors in peft's file naming (``blocks.0.attn.qkv.lora_A.weight``: the state-dict name without
    the adapter's, what ``peft.get_peft_model_state_dict`` returns), detached on the CPU."""
    return {k: w.detach().cpu().contiguous() for k, w in _adapter_weights(model).items()}


def _adapter_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter's weights by their :func:`adapter_state` name, in module order (A before B)."""
    layers = adapted_layers(model)
    return {f"{n}.{part}.weight": getattr(m, part)[ADAPTER].weight for n, m in layers for part in ("lora_A", "lora_B")}


@torch.no_grad()
def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load :func:`adapter_state` tensors into an adapted model; every adapter must be given, nothing else."""
    expected = _adapter_weights(model)
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has an unexpected tensor {extra[0]}"
        raise VitkitError(f"{source}: the adapters do not match the model ({what})")
    for k, v in expected.items():
        if state[k].shape != v.shape:
            raise VitkitError(f"{source}: adapter {k} has shape {tuple(state[k].shape)}, expected {tuple(v.shape)}")
    for k, v in expected.items():
        v.copy_(state[k])
