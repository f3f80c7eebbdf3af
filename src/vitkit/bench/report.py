"""What ``vitkit bench``'s numbers say: each vitkit runner's speed over its peers (peers that compute another
function left out, with the reason), and the result as a text table."""

from __future__ import annotations

import math
from typing import Any

# A peer whose logits are this far from fp32's (relative error), and farther than PEER_ERR_FACTOR x vitkit's own
# at that precision, computes a different function (OpenVINO's NNCF int8 on a random-weight model: rel err 0.38,
# top-1 agreement 0.375): it is reported, but not a peer to be faster than
PEER_MAX_REL_ERR = 0.1
PEER_ERR_FACTOR = 5.0
OURS = ("vitkit", "vitkit-fast")  # the runners' impl names that are vitkit's; every other impl is a peer


def _invalid_peers(rows: list[dict[str, Any]]) -> None:
    """Mark (``left_out``, with the reason) the peer rows whose outputs fail the bound above."""
    for p in rows:
        agree = p.get("agreement_vs_fp32")
        if p["impl"] in OURS or not agree:
            continue
        ours = [
            r["agreement_vs_fp32"]["rel_err"]
            for r in rows
            if r["impl"] in OURS and r["precision"] == p["precision"] and r.get("agreement_vs_fp32")
        ]
        bound = max([PEER_MAX_REL_ERR, *(PEER_ERR_FACTOR * e for e in ours)])
        if agree["rel_err"] > bound:
            p["left_out"] = (
                f"relative error {agree['rel_err']:.2g} against fp32 (> {bound:.2g}), top-1 agreement "
                f"{agree['top1_agreement']:.3f}: it computes a different function, not a peer to compare speed with"
            )


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each vitkit row: speed over the peer at the same precision, and over the peer's fastest run of the same
    kind (floating point or int8; with or without activation checkpointing). Peers whose outputs are not the
    model's function (:func:`_invalid_peers`) are left out, with the reason in their row."""
    _invalid_peers(rows)
    peers = [r for r in rows if r["impl"] not in OURS and "left_out" not in r]
    if not peers:
        return
    for r in rows:
        if r["impl"] not in OURS:
            continue
        same = [p for p in peers if p["precision"] == r["precision"] and "+ckpt" not in p["runner"]]
        if "+ckpt" in r["runner"]:
            same = [p for p in peers if p["precision"] == r["precision"] and "+ckpt" in p["runner"]] or same
        comparable = [
            p
            for p in peers
            if ("+ckpt" in p["runner"]) == ("+ckpt" in r["runner"])
            and (p["precision"] == "int8") == (r["precision"] == "int8")  # floating point vs int8
        ]
        best = max(comparable or peers, key=lambda p: p["img_per_s"])
        r["speedup_vs_peer_same_precision"] = r["img_per_s"] / same[0]["img_per_s"] if same else None
        r["speedup_vs_peers"] = {p["runner"]: r["img_per_s"] / p["img_per_s"] for p in same}
        r["speedup_vs_peer_best"] = r["img_per_s"] / best["img_per_s"]
        r["peer_best"] = best["runner"]


def format_report(result: dict[str, Any]) -> str:
    """A human-readable table of ``run_bench``'s result."""
    spec = result["spec"]
    lines = [
        f"{result['model_name']} {spec['task']} @ {spec['image_size']}px ({result['tokens']} tokens), batch "
        f"{spec['batch_size']}, {result['machine'].get('cpu') or result['machine'].get('gpu')} "
        f"({result['machine'].get('threads', 1)} threads), {result['gflops_per_image']:.2f} GFLOP/image forward",
    ]
    for kind, p in result["peaks"].items():
        lines.append(
            f"  peak {kind}: {p['flops'] / 1e9:.0f} G{'OP' if kind == 'int8' else 'FLOP'}/s ({p['method']}, "
            f"{p['threads']} threads{'; ' + p['detail'] if p['method'] in ('fma-loop', 'amx-matmul') else ''})"
        )
    for kind, p in result.get("vendor_peaks", {}).items():
        lines.append(
            f"  vendor dense peak {kind}: {p['flops'] / 1e12:.0f} TFLOP/s ({p['detail']}); rows carry "
            "fraction_of_vendor_peak in the JSON"
        )
    real = any("agreement_real_images" in r for r in result["results"])
    head = f"  {'runner':<44}{'img/s':>8}{'best':>8}{'IQR':>15}{'GFLOP/s':>9}{'%peak':>7}{'cpu':>5}{'mem MiB':>9}"
    if spec["task"] == "inference":
        head += f"{'b1 ms':>8}{'rel err':>9}{'top1':>7}" + (f"{'real t1':>8}" if real else "")
    head += f"{'x same':>8}{'x best':>8}"
    lines.append(head)
    for r in result["results"]:
        t = r["timing"]
        ips_iqr = f"{spec['batch_size'] / t['q3_s']:.2f}-{spec['batch_size'] / t['q1_s']:.2f}"
        mem = r["memory"]["delta_mib"]
        line = (
            f"  {r['runner']:<44}{r['img_per_s']:>8.2f}{r['img_per_s_best']:>8.2f}{ips_iqr:>15}"
            f"{r['achieved_flops'] / 1e9:>9.0f}"
            f"{100 * r['fraction_of_peak']:>6.0f}%{t['cpu_util']:>5.2f}{_fmt(mem, '.0f'):>9}"
        )
        if spec["task"] == "inference":
            agree = r.get("agreement_vs_fp32", {})
            line += (
                f"{_fmt(r.get('latency_b1_ms'), '.1f'):>8}{_fmt(agree.get('rel_err'), '.1e'):>9}"
                f"{_fmt(agree.get('top1_agreement'), '.3f'):>7}"
            )
            if real:
                line += f"{_fmt(r.get('agreement_real_images', {}).get('top1_agreement'), '.3f'):>8}"
        line += (
            f"{_fmt(r.get('speedup_vs_peer_same_precision'), '.2f'):>8}{_fmt(r.get('speedup_vs_peer_best'), '.2f'):>8}"
        )
        lines.append(line)
    if any("speedup_vs_peer_best" in r for r in result["results"]):
        lines.append(
            "  x same: speed over the peer at the same precision; x best: over the peer's fastest run here "
            "(float vs float, int8 vs int8)"
        )
    for r in result["results"]:
        if "left_out" in r:
            lines.append(f"  {r['runner']}: left out of x same / x best: {r['left_out']}")
    for r in result["results"]:
        if r["impl"] == "vitkit-fast" and "kernels" in r:
            lines.append(f"  {r['runner']}: {r['kernels']['describe']}")
    for r in result["results"]:
        if r["impl"] == "vitkit-fast" and r.get("speedup_vs_peers") and r["peer_best"] != r["runner"]:
            each = ", ".join(f"{v:.2f}x {k}" for k, v in r["speedup_vs_peers"].items())
            lines.append(f"  {r['runner']}: {each}")
    lines.append(
        "  %peak: achieved FLOP/s over the peak above (training counts 3x the forward FLOPs); cpu: CPU "
        "share the process got (<0.9: the machine was busy); mem: peak memory increase of one call; rel err, "
        "top1: against fp32 vitkit on the timed batch (real t1: on real images)"
    )
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)
