"""Declarative key maps between vitkit's state dict and a foreign checkpoint layout.

A format is described by a list of :class:`Rule` objects. Each rule names one of our parameters, the
foreign key(s) it comes from, and a pair of array functions: ``load`` (foreign arrays -> ours) and
``save`` (ours -> foreign arrays). Rules may contain ``{i}``, expanded over the blocks.

:func:`to_state_dict` converts a foreign mapping into a complete, shape-checked state dict and refuses any
partial load: missing foreign keys, foreign keys no rule consumed, and shape mismatches are all reported
together, each naming the parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from vitkit.errors import CheckpointError

Array = np.ndarray
LoadFn = Callable[..., Array]
SaveFn = Callable[[Array], Sequence[Array]]


@dataclass(frozen=True)
class Rule:
    """``ours`` <- load(*[foreign[k] for k in theirs]); foreign keys <- save(ours)."""

    ours: str
    theirs: tuple[str, ...]
    load: LoadFn
    save: SaveFn
    optional: bool = False  # for parameters that a format may legitimately omit

    def expand(self, i: int) -> Rule:
        return replace(self, ours=self.ours.format(i=i), theirs=tuple(t.format(i=i) for t in self.theirs))


def rule(ours: str, theirs: str | Sequence[str], load: LoadFn | None = None, save: SaveFn | None = None) -> Rule:
    """A rule; without functions the array is copied unchanged."""
    keys = (theirs,) if isinstance(theirs, str) else tuple(theirs)
    return Rule(ours, keys, load or (lambda a: a), save or (lambda a: (a,)))


# ---- array transforms shared by the formats ---------------------------------------------------------


def weight_bias(ours: str, theirs: str, bias: bool = True) -> list[Rule]:
    """A torch module's ``weight`` (and ``bias``) copied under another prefix: Linear, LayerNorm, conv."""
    return [rule(f"{ours}.weight", f"{theirs}.weight")] + ([rule(f"{ours}.bias", f"{theirs}.bias")] if bias else [])


def stacked(ours: str, theirs: Sequence[str]) -> Rule:
    """Separate tensors (q/k/v, gate/up) <-> one of ours, concatenated on the output axis."""
    n = len(theirs)
    return rule(ours, theirs, lambda *a: np.concatenate(a, axis=0), lambda w: np.split(w, n, axis=0))


def dense(prefix_ours: str, prefix_theirs: str, kernel: str = "kernel", bias: str = "bias") -> list[Rule]:
    """A Flax Dense (kernel (in, out)) <-> torch Linear (weight (out, in))."""
    return [
        rule(f"{prefix_ours}.weight", f"{prefix_theirs}/{kernel}", lambda k: k.T, lambda w: (w.T,)),
        rule(f"{prefix_ours}.bias", f"{prefix_theirs}/{bias}"),
    ]


def layernorm(prefix_ours: str, prefix_theirs: str, load: LoadFn | None = None) -> list[Rule]:
    """A Flax norm's scale and bias <-> torch's weight and bias (``load``: how both are read; else copied)."""
    return [
        rule(f"{prefix_ours}.weight", f"{prefix_theirs}/scale", load),
        rule(f"{prefix_ours}.bias", f"{prefix_theirs}/bias", load),
    ]


def group_norm(prefix_ours: str, prefix_theirs: str) -> list[Rule]:
    """Flax GroupNorm scale/bias (LayerNorm's names), stored (C,) or, in older checkpoints, (1, 1, 1, C)."""
    return layernorm(prefix_ours, prefix_theirs, channel_vector)


def channel_vector(a: Array) -> Array:
    """(C,) or (1, ..., 1, C) -> (C,); anything else is a shape error."""
    if a.ndim >= 1 and all(n == 1 for n in a.shape[:-1]):
        return a.reshape(-1)
    raise ValueError(f"expected (C,) or (1, 1, 1, C), got {a.shape}")


def conv_hwio(w: Array) -> Array:
    """Flax conv kernel (kh, kw, in, out) -> torch (out, in, kh, kw)."""
    return w.transpose(3, 2, 0, 1)


def conv_oihw(w: Array) -> tuple[Array]:
    return (w.transpose(2, 3, 1, 0),)


def heads_in(*kernels: Array) -> Array:
    """Flax q/k/v kernels (D, h, d) each -> fused torch weight (3D, D)."""
    return np.concatenate([k.reshape(k.shape[0], -1).T for k in kernels], axis=0)


def heads_in_bias(*biases: Array) -> Array:
    """Flax q/k/v biases (h, d) each -> fused (3D,)."""
    return np.concatenate([b.reshape(-1) for b in biases], axis=0)


def split_heads_in(num_heads: int, parts: int = 3) -> SaveFn:
    """Fused torch weight (parts * D, D) -> ``parts`` Flax kernels (D, h, d) (the inverse of :func:`heads_in`)."""

    def save(w: Array) -> list[Array]:
        D = w.shape[1]
        return [part.T.reshape(D, num_heads, D // num_heads) for part in np.split(w, parts, axis=0)]

    return save


def split_heads_in_bias(num_heads: int, parts: int = 3) -> SaveFn:
    def save(b: Array) -> list[Array]:
        return [part.reshape(num_heads, -1) for part in np.split(b, parts, axis=0)]

    return save


def heads_out(k: Array) -> Array:
    """Flax output kernel (h, d, D) -> torch weight (D, D)."""
    return k.reshape(-1, k.shape[-1]).T


def split_heads_out(num_heads: int) -> SaveFn:
    def save(w: Array) -> tuple[Array]:
        D = w.shape[0]
        return (w.T.reshape(num_heads, D // num_heads, D),)

    return save


def flax_attention(prefix_ours: str, prefix_theirs: str, num_heads: int) -> list[Rule]:
    """Flax MultiHeadDotProductAttention (query/key/value kernels (D, h, d), out (h, d, D)) <-> our fused qkv
    Linear and output projection."""
    qkv = ("query", "key", "value")
    return [
        rule(
            f"{prefix_ours}.qkv.weight",
            [f"{prefix_theirs}/{n}/kernel" for n in qkv],
            heads_in,
            split_heads_in(num_heads),
        ),
        rule(
            f"{prefix_ours}.qkv.bias",
            [f"{prefix_theirs}/{n}/bias" for n in qkv],
            heads_in_bias,
            split_heads_in_bias(num_heads),
        ),
        rule(f"{prefix_ours}.proj.weight", f"{prefix_theirs}/out/kernel", heads_out, split_heads_out(num_heads)),
        rule(f"{prefix_ours}.proj.bias", f"{prefix_theirs}/out/bias"),
    ]


def shape_reader(tensors: Mapping[str, Any], what: str, source: str) -> Callable[[str], tuple[int, ...]]:
    """``shape(key)``: a foreign tensor's shape as ints, or CheckpointError "not a complete {what}, missing {key}"."""

    def shape(key: str) -> tuple[int, ...]:
        if key not in tensors:
            raise CheckpointError(f"{source}: not a complete {what}, missing {key}")
        return tuple(int(n) for n in tensors[key].shape)

    return shape


# ---- applying a map ---------------------------------------------------------------------------------


def expand(rules: Sequence[Rule], depth: int) -> list[Rule]:
    """Rules with ``{i}`` are repeated for every block."""
    out: list[Rule] = []
    for r in rules:
        if "{i}" in r.ours:
            out.extend(r.expand(i) for i in range(depth))
        else:
            out.append(r)
    return out


def to_state_dict(
    rules: Sequence[Rule],
    foreign: Mapping[str, Array],
    expected: Mapping[str, torch.Tensor],
    *,
    source: str,
    ignore: Callable[[str], bool] = lambda k: False,
) -> dict[str, torch.Tensor]:
    """Convert ``foreign`` to our state dict, checking it against ``expected`` (the model's state dict).

    Raises CheckpointError listing every missing key, unused foreign key and shape mismatch.
    """
    missing: list[str] = []
    bad_shapes: list[str] = []
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    for r in rules:
        absent = [k for k in r.theirs if k not in foreign]
        if absent:
            if not r.optional:
                missing.extend(absent)
            continue
        used.update(r.theirs)
        try:
            arr = np.asarray(r.load(*[np.asarray(foreign[k]) for k in r.theirs]))
        except ValueError as e:  # reshape/concat failures: shapes inconsistent with each other
            bad_shapes.append(f"{r.ours} from {', '.join(r.theirs)}: {e}")
            continue
        if r.ours not in expected:
            bad_shapes.append(f"{r.ours}: the model has no such parameter")
            continue
        want = tuple(expected[r.ours].shape)
        if tuple(arr.shape) != want:
            shapes = ", ".join(f"{k} {tuple(np.shape(foreign[k]))}" for k in r.theirs)
            bad_shapes.append(f"{r.ours}: expected {want}, got {tuple(arr.shape)} (from {shapes})")
            continue
        out[r.ours] = torch.from_numpy(np.ascontiguousarray(arr)).to(expected[r.ours].dtype)
    unused = sorted(k for k in foreign if k not in used and not ignore(k))
    not_filled = sorted(k for k in expected if k not in out and not any(r.ours == k for r in rules if r.optional))
    problems = []
    if missing:
        problems.append(f"missing keys: {_short(missing)}")
    if bad_shapes:
        problems.append(f"shape mismatches: {_short(bad_shapes)}")
    if unused:
        problems.append(f"unexpected keys: {_short(unused)}")
    if not problems and not_filled:
        problems.append(f"parameters without a source: {_short(not_filled)}")
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems))
    return out


def from_state_dict(rules: Sequence[Rule], state: Mapping[str, torch.Tensor]) -> dict[str, Array]:
    """Our state dict -> the foreign mapping (the inverse of :func:`to_state_dict`). A parameter of ours that no
    rule writes is refused (the format has no place for it: the file would compute another function)."""
    unwritten = sorted(set(state) - {r.ours for r in rules})
    if unwritten:
        raise CheckpointError(f"cannot export: the format has no place for the model's {_short(unwritten)}")
    out: dict[str, Array] = {}
    for r in rules:
        if r.ours not in state:
            if r.optional:
                continue
            raise CheckpointError(f"cannot export: the model has no parameter {r.ours}")
        arr = state[r.ours].detach().cpu().float().numpy()
        parts = r.save(arr)
        if len(parts) != len(r.theirs):
            raise AssertionError(f"rule for {r.ours} produced {len(parts)} arrays for {len(r.theirs)} keys")
        for k, a in zip(r.theirs, parts, strict=True):
            out[k] = np.ascontiguousarray(a)
    return out


def _short(items: Sequence[str], limit: int = 8) -> str:
    items = list(items)
    head = ", ".join(items[:limit])
    return head + (f" (and {len(items) - limit} more)" if len(items) > limit else "")
