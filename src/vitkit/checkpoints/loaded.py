"""What every checkpoint format produces: a config, a state dict in vitkit's layout, and metadata."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vitkit.checkpoints.keymap import Rule, to_state_dict
from vitkit.checkpoints.preprocess import Preprocess
from vitkit.checkpoints.torch_files import to_numpy
from vitkit.errors import CheckpointError
from vitkit.models.posembed import sincos_2d
from vitkit.models.vit import VisionTransformer, ViTConfig


@dataclass
class CheckpointMeta:
    """Everything about a checkpoint that is not weights."""

    format: str  # "vitkit", "official", ...
    source: str  # the path it was read from
    preprocess: Preprocess
    class_names: list[str] | None = None
    provenance: dict[str, Any] = field(default_factory=dict)


@dataclass
class Checkpoint:
    """A foreign checkpoint converted to vitkit's state-dict layout (not yet in a model)."""

    cfg: ViTConfig
    state: dict[str, torch.Tensor]
    meta: CheckpointMeta


@dataclass
class Loaded:
    """A ready model plus its metadata (what ``load_checkpoint`` returns)."""

    model: VisionTransformer
    meta: CheckpointMeta

    def label(self, index: int) -> str:
        names = self.meta.class_names
        return names[index] if names and index < len(names) else f"class {index}"


def empty_model(cfg: ViTConfig) -> VisionTransformer:
    """A model with uninitialised storage (no random init): for loading weights into."""
    with torch.device("meta"):
        model = VisionTransformer(cfg)
    model.to_empty(device="cpu")
    model.init_buffers()
    return model


def model_numel(cfg: ViTConfig) -> int:
    """Values in the state dict of a model with ``cfg``, computed without allocating it (a one-block model
    on the meta device, plus ``depth - 1`` more blocks)."""
    with torch.device("meta"):
        one = VisionTransformer(dataclasses.replace(cfg, depth=1))
    total = sum(t.numel() for t in one.state_dict().values())
    block = sum(t.numel() for t in one.blocks[0].state_dict().values())
    return total + (cfg.depth - 1) * block


def check_fits_file(cfg: ViTConfig, numel_in_file: int, source: str) -> None:
    """Refuse a config that describes a much bigger model than the tensors the checkpoint holds, before
    building it (a hostile ``"hidden_size": 40000`` would otherwise allocate tens of GB). Up to twice the file
    is let through, so that a file missing a tensor or two is refused by the key map naming them."""
    need = model_numel(cfg)
    if need > 2 * numel_in_file + 2 * cfg.hidden_size:
        raise CheckpointError(
            f"{source}: the config describes a model of {need:,} values but the file holds only "
            f"{numel_in_file:,}; not allocating it (config and weights do not match)"
        )


#: A checkpoint's preprocessing may feed images up to this many times its model's image size per side (more
#: tokens than the model was built for, resampled position embeddings); more is refused when it is read
MAX_PREPROCESS_SCALE = 2


def check_preprocess(cfg: ViTConfig, pre: Preprocess, source: str) -> None:
    """Refuse a preprocessing size the model cannot take, when the checkpoint is read: each side a multiple of
    the model's patch stride, and at most :data:`MAX_PREPROCESS_SCALE` times the model's image size (a
    ``[4000, 4000]`` for a 224 px model would make one image tens of thousands of tokens)."""
    (h, w), (mh, mw), stride = pre.image_size, cfg.image_size, cfg.stride
    if h % stride or w % stride:
        raise CheckpointError(
            f"{source}: preprocessing image size {h}x{w} is not a multiple of the model's patch size {stride}"
        )
    if h > MAX_PREPROCESS_SCALE * mh or w > MAX_PREPROCESS_SCALE * mw:
        raise CheckpointError(
            f"{source}: preprocessing image size {h}x{w} is more than {MAX_PREPROCESS_SCALE} times the model's "
            f"{mh}x{mw} per side"
        )


@contextlib.contextmanager
def refusing(source: str) -> Iterator[None]:
    """A ValueError or TypeError in the block (a value a reader's ViTConfig or Preprocess refuses) as one
    CheckpointError naming ``source``."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{source}: {e}") from None


def convert(
    cfg: ViTConfig,
    weights: Mapping[str, torch.Tensor | np.ndarray],
    source: str,
    rules: Callable[[ViTConfig], Sequence[Rule]],
    ignore: Callable[[str], bool] = lambda k: False,
) -> dict[str, torch.Tensor]:
    """A reader's weights (tensors or arrays) in vitkit's layout: ``cfg`` checked against the file's size first
    (:func:`check_fits_file`; ``rules(cfg)`` may be as long as the config's depth), then every rule applied and
    checked (:func:`vitkit.checkpoints.keymap.to_state_dict`, ``ignore`` naming the keys no rule needs)."""
    numel = sum(v.numel() if isinstance(v, torch.Tensor) else int(v.size) for v in weights.values())
    check_fits_file(cfg, numel, source)
    arrays = {k: to_numpy(v) if isinstance(v, torch.Tensor) else v for k, v in weights.items()}
    return to_state_dict(rules(cfg), arrays, expected_state(cfg), source=source, ignore=ignore)


def expected_state(cfg: ViTConfig) -> dict[str, torch.Tensor]:
    """The state dict a model with ``cfg`` expects, as meta tensors (shapes and dtypes, no memory)."""
    with torch.device("meta"):
        return VisionTransformer(cfg).state_dict()


def export_state(model: VisionTransformer) -> dict[str, torch.Tensor]:
    """The model's state dict on the CPU (detached), for writing in another layout."""
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def with_learned_posemb(cfg: ViTConfig, state: dict[str, torch.Tensor]) -> tuple[ViTConfig, dict[str, torch.Tensor]]:
    """For formats without fixed sin-cos embeddings: the same function with the table stored as a learned one.

    The class token never gets a sin-cos embedding, so its slot is zero: outputs are unchanged.
    """
    if cfg.pos_embed == "learned":
        return cfg, state
    gh, gw = cfg.grid_size
    table = sincos_2d((gh, gw), cfg.hidden_size)  # (1, N, D)
    if cfg.classifier == "token":
        table = torch.cat([torch.zeros(1, 1, cfg.hidden_size), table], dim=1)
    return dataclasses.replace(cfg, pos_embed="learned"), {**state, "pos_embed": table}


def is_square(n: int) -> bool:
    """Whether ``n`` position entries can be a square grid of patches (a positive perfect square)."""
    return n > 0 and int(np.sqrt(n)) ** 2 == n


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 of a state dict's names, dtypes, shapes and values: the identity of a model's weights, whatever
    file or format they came from (two loads of one checkpoint agree; any changed value, resolution or head
    does not)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(state[name].shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def require(condition: bool, target: str, why: str) -> None:
    """Refuse an export the target format cannot represent exactly."""
    if not condition:
        raise CheckpointError(f"cannot write {target}: {why}")


def require_unseen(cfg: ViTConfig, target: str, rope: str | None = None, fc_norm: bool = False) -> None:
    """Refuse what no parameter shows, so a writer's key map cannot catch it (``keymap.from_state_dict`` refuses
    every parameter it has no place for): a RoPE other than ``rope``, and the final norm on the pooled vector
    (``fc_norm``) where the target has none."""
    if cfg.rope != rope:
        require(False, target, f"it computes {f'RoPE {rope!r}' if rope else 'no RoPE'}; this model has {cfg.rope!r}")
    require(fc_norm or not cfg.fc_norm, target, "its final LayerNorm is on the tokens, not the pooled vector (fc_norm)")
