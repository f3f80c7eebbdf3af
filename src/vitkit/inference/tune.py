"""The CPU fast path's kernels chosen by measurement: ``tune_kernels(model, dtype, batch_size, int8)``.

The fast path's built-in rules (vitkit's C attention and LayerNorm where the CPU has AVX512_BF16, oneDNN GEMMs
with pre-packed weights, the VNNI int8 GEMM) were measured on AMD Zen 4/5 and on Xeons without usable AMX. On
Xeons with AMX, oneDNN's tile kernels behind PyTorch's own operators can beat them: there the plain model in
bf16 ran 1.20x the fast path (B/16, batch 32; the CPU performance issue). So, when an engine is built on a CPU,
each replaceable piece (:class:`~vitkit.inference.fast.Kernels`) is timed on the model's real shapes, a block at
the engine's batch size, one candidate at a time with the other pieces as built in, alternating call by call:

- attention: vitkit's C kernel, the explicit batched GEMMs, PyTorch's SDPA (its CPU flash kernel);
- LayerNorm: vitkit's C kernel, PyTorch's;
- GEMMs: oneDNN with pre-packed weights and fused epilogues, PyTorch's ``F.linear`` (int8: the VNNI kernel,
  oneDNN's).

An alternative replaces the built-in rule only when it is at least ``MIN_GAIN`` times faster (the rules also
decide the rounding; a close race is noise). Then the whole tuned fast path is timed against the plain model
cast to the same dtype, and where the plain model is ``MIN_GAIN`` times faster, it is what runs: the fast path
never loses to the plain model at the same precision (int8 has no plain peer to lose to: PyTorch's dynamic
quantisation ran at half the fast path's speed). Pieces whose block call takes under ``MIN_MEASURABLE_S`` are
not timed (tiny models: a race of microseconds is noise, and the pieces cost little there), and a race during
which the process got under ``MIN_CPU_SHARE`` of its cores (another process was running) keeps the built-in
rules and is not cached.

The result is kept, in milliseconds, in ``tuning.json`` beside vitkit's compiled kernels (the private
``vitkit.native.library_dir``), keyed by the CPU model and flags, PyTorch's version, the thread count, the
shapes, dtype and batch, so that a second start does not pay again. A damaged or foreign file is ignored
(and rewritten), never trusted beyond its checked fields.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import math
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitkit import hardware, native
from vitkit.errors import CheckpointError
from vitkit.fileio import write_file_atomic
from vitkit.inference.attention import load as load_fused_attention
from vitkit.inference.attention import load_amx as load_amx_attention
from vitkit.inference.attention import load_int8 as load_int8_attention
from vitkit.inference.fast import FastBlock, Kernels, block_parts, optimize_for_inference
from vitkit.inference.fp8 import CastModel
from vitkit.inference.gemm_int8 import load as load_int8_gemm
from vitkit.inference.layernorm import load as load_layernorm
from vitkit.models.vit import Block, VisionTransformer
from vitkit.timing import time_alternating

MIN_GAIN = 1.10  # an alternative (or the plain model) must be this much faster to replace the built-in rule
MIN_CPU_SHARE = 0.8  # a race run while other processes had the cores (a 4x slowdown, seen) decides nothing
MIN_MEASURABLE_S = 2e-3  # block calls faster than this are not raced (timer noise, and little to win)
REPEATS = 2  # timed calls per candidate (after one warm-up each); the best is kept
CACHE_NAME = "tuning.json"
CACHE_MAX_BYTES = 1 << 20  # a larger file is not read (it is not one vitkit wrote)
CACHE_MAX_ENTRIES = 256

# candidate -> ms per call of one block (or of the whole model for the "model" race)
Timer = Callable[[Mapping[str, Callable[[], Any]]], dict[str, float]]


@dataclass(frozen=True)
class Race:
    """One piece's measurement: the candidates' times (ms per block call) and the one kept."""

    piece: str
    times_ms: dict[str, float]
    winner: str
    builtin: str

    def describe(self) -> str:
        times = ", ".join(f"{k} {v:.2f}" for k, v in sorted(self.times_ms.items(), key=lambda kv: kv[1]))
        return f"{self.piece}={self.winner} ({times} ms)"


@dataclass(frozen=True)
class Tuning:
    """What :func:`tune_kernels` chose: the kernels, whether the plain model runs instead, and why."""

    kernels: Kernels = field(default_factory=Kernels)
    plain: bool = False  # the model itself, cast to the dtype, measured faster than the tuned fast path
    races: tuple[Race, ...] = ()
    source: str = "built-in rules"  # "measured", "cached", or why nothing was measured

    def summary(self) -> str:
        """A few words for an engine's one-line description: what runs."""
        if self.plain:
            return f"the plain model (measured faster than the fast path; {self.source})"
        changed = [r for r in self.races if r.piece != "model" and r.winner != r.builtin]
        if not changed:
            return f"kernels: {self.source}" if not self.races else f"built-in kernels won ({self.source})"
        return ", ".join(f"{r.piece}={r.winner}" for r in changed) + f" ({self.source})"

    def describe(self) -> str:
        """One line, e.g. ``kernels measured: attention=sdpa (sdpa 4.10, c 6.20 ms), ...; the fast path``."""
        if not self.races:
            return f"kernels: {self.source}"
        what = "; ".join(r.describe() for r in self.races)
        return f"kernels {self.source}: {what}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernels": {p: getattr(self.kernels, p) for p in Kernels.CHOICES},
            "plain": self.plain,
            "races": [
                {"piece": r.piece, "times_ms": r.times_ms, "winner": r.winner, "builtin": r.builtin} for r in self.races
            ],
        }

    @classmethod
    def from_dict(cls, d: Any) -> Tuning:
        """A cached entry, checked field by field (ValueError/TypeError/KeyError on anything else)."""
        if not isinstance(d, dict) or not isinstance(d["kernels"], dict) or not isinstance(d["plain"], bool):
            raise ValueError("not a tuning entry")
        names = {p: d["kernels"].get(p) for p in Kernels.CHOICES}
        if not all(v is None or isinstance(v, str) for v in names.values()):
            raise TypeError("not a string")
        kernels = Kernels(**names)
        races = []
        for r in d["races"]:
            times = {str(k): float(v) for k, v in r["times_ms"].items()}
            if not all(math.isfinite(v) and v >= 0 for v in times.values()) or len(times) > 8:
                raise ValueError("bad times")
            races.append(Race(str(r["piece"]), times, str(r["winner"]), str(r["builtin"])))
        return cls(kernels, d["plain"], tuple(races), "cached")


def candidates(dtype: torch.dtype, int8: bool) -> dict[str, tuple[str, ...]]:
    """The options of each piece on this CPU, the built-in rule first (pieces with one option are left out)."""
    bf16 = dtype == torch.bfloat16
    c_attention = bf16 and ((int8 and load_int8_attention() is not None) or load_fused_attention() is not None)
    amx = ("amx",) if bf16 and load_amx_attention() is not None else ()
    pieces: dict[str, tuple[str, ...]] = {
        "attention": ((*amx, "c") if not int8 else ("c", *amx)) + ("explicit", "sdpa")
        if c_attention
        else ("explicit", "sdpa"),
    }
    if bf16 and not int8 and load_layernorm() is not None:
        pieces["layernorm"] = ("c", "torch")
    if int8:
        if bf16 and load_int8_gemm() is not None:
            pieces["gemm"] = ("onednn", "vnni") if hardware.has_amx_int8() else ("vnni", "onednn")
    elif hardware.has_onednn_linear(dtype):
        pieces["gemm"] = ("packed", "plain")
    return pieces


def default_timer(fns: Mapping[str, Callable[[], Any]]) -> dict[str, float]:
    """ms per call of each fn: one warm-up each, then the best of ``REPEATS`` alternating calls (B/16 at batch
    32 on 2 cores: about 3 s for every race together, once per machine, model shape and batch: it is cached)."""
    for fn in fns.values():
        fn()
    timings = time_alternating(fns, REPEATS, torch.device("cpu"), torch.get_num_threads())
    timed = sum(sum(t.times) for t in timings.values())  # the CPU clock's share is meaningful over tens of ms
    if timed > 0.05 and min(t.cpu_util for t in timings.values()) < MIN_CPU_SHARE:  # another process took the cores
        return dict.fromkeys(fns, math.nan)
    return {k: min(t.times) * 1e3 for k, t in timings.items()}


def cache_key(model: VisionTransformer, dtype: torch.dtype, batch_size: int, int8: bool) -> str:
    """What a measurement depends on: the CPU, PyTorch, the thread count, the shapes, the dtype and the batch."""
    cfg = model.cfg
    cpu = hardware.cpu_model()
    flags = sorted(hardware.cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"})
    facts = [
        cpu,
        flags,
        platform.machine(),
        torch.__version__,
        torch.get_num_threads(),
        [cfg.hidden_size, cfg.num_heads, cfg.mlp_dim, cfg.num_tokens(), cfg.depth],
        str(dtype),
        int8,
        batch_size,
    ]
    return hashlib.sha256(json.dumps(facts, default=str).encode()).hexdigest()[:24]


def _cache_file() -> Path | None:
    where = native.library_dir()
    return None if where is None else where / CACHE_NAME


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size > CACHE_MAX_BYTES:
            return {}
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def cached(key: str, path: Path | None) -> Tuning | None:
    """The cached tuning for ``key`` (None when absent, or the entry fails its checks)."""
    if path is None:
        return None
    try:
        return Tuning.from_dict(_read_cache(path)[key])
    except (KeyError, ValueError, TypeError, AttributeError):
        return None


def _store(key: str, tuning: Tuning, path: Path | None) -> None:
    if path is None:
        return
    entries = {k: v for k, v in _read_cache(path).items() if isinstance(k, str)}
    entries.pop(key, None)
    entries[key] = tuning.to_dict()
    while len(entries) > CACHE_MAX_ENTRIES:  # oldest first out (dicts keep insertion order)
        entries.pop(next(iter(entries)))
    with contextlib.suppress(OSError, CheckpointError):  # unwritable: the next start measures again, nothing else
        write_file_atomic(path, lambda tmp: tmp.write_text(json.dumps(entries, indent=1)))


def tune_kernels(
    model: VisionTransformer,
    dtype: torch.dtype,
    batch_size: int,
    int8: bool = False,
    *,
    timer: Timer | None = None,
    cache: Path | bool | None = True,
) -> Tuning:
    """The fastest kernels for ``model`` at ``batch_size`` on this CPU, and whether the plain model beats them
    (see the module docstring). ``timer``: how candidates are timed (default: :func:`default_timer`; tests
    give their own). ``cache``: True for ``tuning.json`` in vitkit's kernel cache, a path, or False for none."""
    if next(model.parameters()).device.type != "cpu":
        return Tuning(source="built-in rules (not a CPU)")
    path = _cache_file() if cache is True else (cache or None)
    key = cache_key(model, dtype, batch_size, int8)
    found = cached(key, path)
    if found is not None:
        return found
    tuning = _measure(model, dtype, batch_size, int8, timer or default_timer)
    if tuning.source == "measured":
        _store(key, tuning, path)
    return tuning


def _measure(model: VisionTransformer, dtype: torch.dtype, batch: int, int8: bool, timer: Timer) -> Tuning:
    cfg = model.cfg
    rows = batch * cfg.num_tokens()
    block = model.blocks[0]
    assert isinstance(block, Block)
    x = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)  # not the caller's
    chosen: dict[str, str] = {}
    races: list[Race] = []
    with torch.inference_mode():
        for piece, options in candidates(dtype, int8).items():
            blocks = {opt: _block_with(block, dtype, rows, int8, Kernels(**{piece: opt})) for opt in options}
            fns = {opt: functools.partial(fast, x, batch) for opt, fast in blocks.items()}
            times = timer(fns)
            if any(math.isnan(t) for t in times.values()):
                return Tuning(source="built-in rules (the machine was busy while racing: nothing kept)")
            builtin = options[0]
            if times[builtin] * 1e-3 < MIN_MEASURABLE_S:
                return Tuning(source=f"built-in rules (a block takes {times[builtin]:.2f} ms: too small to race)")
            best = min(times, key=lambda k: times[k])
            winner = best if times[best] * MIN_GAIN <= times[builtin] else builtin
            chosen[piece] = winner
            races.append(Race(piece, times, winner, builtin))
        kernels = Kernels(**chosen)
        plain: bool | None = False
        if not int8:
            plain = _plain_wins(block, dtype, rows, batch, kernels, x, timer, races)
            if plain is None:
                return Tuning(source="built-in rules (the machine was busy while racing: nothing kept)")
    return Tuning(kernels, bool(plain), tuple(races), "measured")


def _block_with(block: Block, dtype: torch.dtype, rows: int, int8: bool, kernels: Kernels) -> nn.Module:
    """One FastBlock built with ``kernels`` (the built-in rules for the other pieces): InferenceViT's
    construction, for one block (a one-block model would copy the whole embedding)."""
    parts = block_parts(kernels, dtype, int8, cpu=True, pack=True)
    return FastBlock(copy.deepcopy(block), dtype, rows, pack=True, **parts).eval()


def _plain_wins(
    block: Block,
    dtype: torch.dtype,
    rows: int,
    batch: int,
    kernels: Kernels,
    x: torch.Tensor,
    timer: Timer,
    races: list[Race],
) -> bool | None:
    """Whether a block of the plain model in ``dtype`` runs ``MIN_GAIN`` times faster than the tuned fast path's
    block (the blocks are all but a few percent of the model's time; the rest is the same on both); None when the
    race was not run cleanly."""
    fast = _block_with(block, dtype, rows, False, kernels)
    plain = copy.deepcopy(block).eval().to(dtype)
    tokens = x.view(batch, -1, x.shape[-1])  # (B, T, D)
    times = timer({"fast path": lambda: fast(x, batch), "plain model": lambda: plain(tokens)})
    if any(math.isnan(t) for t in times.values()):
        return None
    wins = times["plain model"] * MIN_GAIN <= times["fast path"]
    races.append(Race("model", times, "plain model" if wins else "fast path", "fast path"))
    return wins


class PlainModel(CastModel):
    """The model itself cast to ``dtype`` (a copy), for inference: what runs where it beats the fast path.
    Same interface as the fast path's ``InferenceViT``: ``forward``, ``forward_features``, ``forward_head``,
    ``head``."""

    def __init__(self, model: VisionTransformer, dtype: torch.dtype) -> None:
        super().__init__(copy.deepcopy(model).eval().to(dtype), dtype)
        self.cfg = model.cfg


def build_fast(
    model: VisionTransformer,
    dtype: torch.dtype,
    batch_size: int,
    int8: bool = False,
    *,
    tune: bool = True,
    timer: Timer | None = None,
    cache: Path | bool | None = True,
) -> tuple[nn.Module, Tuning]:
    """What runs for a CPU fast precision: the fast path with the kernels :func:`tune_kernels` chose, or the plain
    model in ``dtype`` where that measured faster (``tune=False``: the built-in rules, as
    ``optimize_for_inference``). The engines (``--precision auto/bf16/fp32/int8``) and ``vitkit bench``'s
    ``vitkit-fast`` runner build through here; the second value says what was chosen and why."""
    tuning = tune_kernels(model, dtype, batch_size, int8, timer=timer, cache=cache) if tune else Tuning()
    if tuning.plain:
        return PlainModel(model, dtype), tuning
    fast = optimize_for_inference(model, dtype, int8=int8, batch_size=batch_size, kernels=tuning.kernels)
    return fast, tuning
