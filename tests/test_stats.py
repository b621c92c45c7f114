"""The shared resampler (`jaxformer.stats`): rows of a [seeds, rates] table resampled whole (paired), each
column's resampled mean varying as its standard error (the √(m/(m−1)) rescaling), unfinished runs (NaN) kept out
of the means. The 1-D case is pinned in tests/test_scaling.py. Wrong versions caught: a plain resample (variance
(m−1)/m of the squared standard error), columns resampled independently (seed pairing lost), a NaN spreading
into a column's mean."""
from __future__ import annotations

import numpy as np

from jaxformer.stats import resampled


def test_rows_are_resampled_whole_and_each_columns_mean_varies_as_its_standard_error():
    y = np.exp(np.array([[0.0, 1.0, 2.0], [0.3, 1.6, 2.2], [-0.2, 0.7, 1.1]]))
    rng = np.random.default_rng(0)
    draws = [resampled(y, np.zeros(3), rng)[1] for _ in range(4000)]
    ly = np.log(y)
    for yb in draws[:50]:                     # a drawn row keeps its columns together: one offset per row
        dev = (np.log(yb) - ly.mean(0)) / np.sqrt(1.5)
        assert all(any(np.allclose(d, ly[i] - ly.mean(0)) for i in range(3)) for d in dev)
    means = np.array([np.log(yb).mean(0) for yb in draws])
    np.testing.assert_allclose(means.var(0), ly.var(0, ddof=1) / 3, rtol=0.1)       # plain: 2/3 of it


def test_an_unfinished_run_stays_nan_and_out_of_its_columns_mean():
    y = np.array([[1.0, 2.0], [1.5, np.nan], [2.0, 3.0]])
    order, yb = resampled(y, np.zeros(3), np.random.default_rng(1))
    assert np.isfinite(yb[:, 0]).all() and order.tolist() == [0, 1, 2]
    picked = ~np.isnan(yb[:, 1])
    assert picked.any() and np.log(yb[picked, 1]).min() > 0     # finite rows rescaled about log 2, 3's mean
