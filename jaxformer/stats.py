"""The ground floor of the statistics: resampling for bootstrap intervals, shared by the scaling fits
(`jaxformer.scaling`) and µP's learning-rate transfer (`jaxformer.mup.optimum_shift`). No model code, no I/O.

A bootstrap resample of m seeds has (m − 1)/m of their variance, so a group's resampled mean varies less than its
standard error says (with 3 seeds, a third less) and intervals come out too narrow. `resampled` rescales each
resample's spread about its group's mean by √(m/(m − 1)) (in log space: losses are positive) to undo that.
"""
from __future__ import annotations

import numpy as np


def resample(groups, rng: np.random.Generator) -> np.ndarray:
    """Indices of one stratified resample: for each group (in order of first appearance), len(group) of its
    indices drawn with replacement."""
    groups = np.asarray(groups)
    parts = [rng.choice(np.flatnonzero(groups == g), size=int(np.sum(groups == g)), replace=True)
             for g in dict.fromkeys(groups.tolist())]
    return np.concatenate(parts)


def resampled(y, groups, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One stratified resample of positive values y [n] or [n, ...] (rows resampled whole, so what a row's
    columns share, one seed's runs at several learning rates, stays paired): -> (order, y'), y'[i] standing for
    row order[i]. Within each group of m rows, m drawn with replacement, their deviations from the group's mean
    log y scaled by √(m/(m−1)) (module docstring); NaN entries (runs not finished) stay NaN and are left out of
    the means."""
    ly, groups = np.log(np.asarray(y, np.float64)), np.asarray(groups)
    keys = list(dict.fromkeys(groups.tolist()))
    order = np.concatenate([np.flatnonzero(groups == k) for k in keys])
    counts = {k: int(np.sum(groups == k)) for k in keys}
    with np.errstate(invalid="ignore"):
        means = {k: np.nanmean(ly[groups == k], axis=0) if np.isfinite(ly[groups == k]).any() else
                 np.full(ly.shape[1:], np.nan) for k in keys}
    mean = np.stack([means[k] for k in groups[order]])
    m = np.asarray([counts[k] for k in groups[order]], np.float64).reshape((-1,) + (1,) * (ly.ndim - 1))
    scale = np.sqrt(m / np.maximum(m - 1, 1))
    return order, np.exp(mean + scale * (ly[resample(groups, rng)] - mean))
