"""Statistics across positions for notebook 03's drift comparisons: bootstrap intervals of a ratio or a mean of
per-position statistics — positions resampled, or whole sequences (the independent unit: positions of one sentence
share its context) — and how often a small subset of positions would show a large gap between two models' maxima.
Re-exported by :mod:`lora_lab.experiments.merge_precision`."""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["bootstrap_ratio_ci", "sequence_bootstrap_ratio_ci", "sequence_bootstrap_mean_ci",
           "share_of_subsets_with_gap"]



def bootstrap_ratio_ci(
    a: torch.Tensor, b: torch.Tensor, n_boot: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """Ratio mean(a) / mean(b) of two paired per-position statistics, with a percentile bootstrap CI
    (positions resampled with replacement, pairs kept together). Returns (ratio, low, high)."""
    a, b = a.flatten().double(), b.flatten().double()
    if a.shape != b.shape or a.numel() < 2:
        raise ValueError(f"need two paired samples of equal size >= 2, got {tuple(a.shape)} and {tuple(b.shape)}")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, a.numel(), (n_boot, a.numel()), generator=g)
    ratios = a[idx].mean(1) / b[idx].mean(1)
    return (float(a.mean() / b.mean()), *_percentile_interval(ratios, level))


def _per_sequence_sums(values: Sequence[torch.Tensor], mask: torch.Tensor | None) -> tuple[list[torch.Tensor], int]:
    """Per-sequence sums of each (batch x seq) tensor over the positions where ``mask`` is set and every value is
    finite (e.g. a loss is NaN at the last position), and the number of sequences that keep a position."""
    first = values[0]
    if first.dim() != 2:
        raise ValueError(f"per-position statistics must be batch x seq, got shape {tuple(first.shape)}")
    for v in values[1:]:
        if v.shape != first.shape:
            raise ValueError(f"paired statistics differ in shape: {tuple(first.shape)} vs {tuple(v.shape)}")
    keep = torch.ones(first.shape, dtype=torch.bool) if mask is None else mask.detach().cpu().bool()
    if keep.shape != first.shape:
        raise ValueError(f"mask of shape {tuple(keep.shape)} does not fit statistics of shape {tuple(first.shape)}")
    vals = [v.detach().cpu().double() for v in values]
    for v in vals:
        keep = keep & torch.isfinite(v)
    used = keep.any(1)
    if int(used.sum()) < 2:
        raise ValueError(f"a bootstrap over sequences needs at least 2 sequences with positions, got {int(used.sum())}")
    sums = [v.masked_fill(~keep, 0.0).sum(1)[used] for v in vals]
    return sums + [keep.sum(1)[used].double()], int(used.sum())


def _percentile_interval(stats: torch.Tensor, level: float) -> tuple[float, float]:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    tail = (1 - level) / 2
    lo, hi = torch.quantile(stats, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return float(lo), float(hi)


def sequence_bootstrap_ratio_ci(
    a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None, n_boot: int = 2000, level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Ratio mean(a) / mean(b) of two paired per-position statistics (batch x seq) over the positions in ``mask``,
    with a percentile bootstrap CI that resamples whole **sequences** (rows) with replacement.

    Positions of one sequence share their context, so they are not independent draws; the sequence is the unit
    that is. Returns (ratio, low, high)."""
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    (sa, sb, _), n_seq = _per_sequence_sums([a, b], mask)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n_seq, (n_boot, n_seq), generator=g)
    ratios = sa[idx].sum(1) / sb[idx].sum(1)
    return (float(sa.sum() / sb.sum()), *_percentile_interval(ratios, level))


def sequence_bootstrap_mean_ci(
    values: torch.Tensor, mask: torch.Tensor | None = None, n_boot: int = 2000, level: float = 0.95, seed: int = 0,
) -> tuple[float, float, float]:
    """Mean of a per-position statistic (batch x seq) over the positions in ``mask``, with a percentile bootstrap
    CI that resamples whole sequences. Returns (mean, low, high)."""
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    (sv, count), n_seq = _per_sequence_sums([values], mask)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n_seq, (n_boot, n_seq), generator=g)
    means = sv[idx].sum(1) / count[idx].sum(1)
    return (float(sv.sum() / count.sum()), *_percentile_interval(means, level))


def share_of_subsets_with_gap(
    a: torch.Tensor, b: torch.Tensor, subset: int, factor: float, n_draws: int = 2000, seed: int = 0
) -> float:
    """Share of random position subsets of size ``subset`` on which max(a) >= factor * max(b).

    Answers: how often would a sample of that many positions (the article had 82) show a gap as
    large as ``factor`` between two models whose position-wise drifts are ``a`` and ``b``?
    """
    a, b = a.flatten().double(), b.flatten().double()
    if a.shape != b.shape:
        raise ValueError(f"paired samples differ in size: {tuple(a.shape)} vs {tuple(b.shape)}")
    if not 0 < subset <= a.numel():
        raise ValueError(f"subset size {subset} must be in [1, {a.numel()}]")
    g = torch.Generator().manual_seed(seed)
    hits = 0
    for _ in range(n_draws):
        idx = torch.randperm(a.numel(), generator=g)[:subset]
        hits += bool(a[idx].max() >= factor * b[idx].max())
    return hits / n_draws
