"""`rlhf report`'s healthy bands: drawn from health.RANGES at their true place and size."""

from __future__ import annotations

import pytest

from rlhf_cli.ppo.health import RANGES
from rlhf_cli.stages.report import PANELS, band_limits


def visible_share(values, band):
    """Share of the y-axis the shaded band covers."""
    bottom, top = band_limits(values, band)
    low, high = band
    low = bottom if low is None else max(low, bottom)
    high = top if high is None else min(high, top)
    return max(high - low, 0.0) / (top - bottom)


def test_every_panel_band_comes_from_the_one_table():
    shaded = [keys[0] for _, keys in PANELS if keys[0] in RANGES and RANGES[keys[0]].band]
    assert shaded == ["objective/kl", "objective/entropy", "objective/clipfrac"]


@pytest.mark.parametrize("values", [[6.0, 3.01, 3.03], [4.0, 1.8, 2.0], [6.0, 7.5, 8.2]])
def test_entropy_band_is_never_a_sliver(values):
    band = RANGES["objective/entropy"].limits(values[0])  # half the first value and up
    assert band == (values[0] / 2, None)
    bottom, top = band_limits(values, band)
    assert bottom < min(values) and top > max(values)  # the data are in view
    assert bottom < band[0] < top  # so is the band's edge
    assert visible_share(values, band) >= 0.15


def test_closed_band_and_data_are_both_in_view():
    bottom, top = band_limits([0.5, 0.6], RANGES["objective/clipfrac"].band)
    assert bottom < 0.10 and top > 0.6
    bottom, top = band_limits([0.2, 40.0], RANGES["objective/kl"].band)
    assert bottom < 0.0 and top > 40.0
    assert visible_share([0.2, 40.0], (0.0, 15.0)) == pytest.approx(15.0 / (top - bottom))


def test_missing_values_are_skipped():
    assert band_limits([None, 0.2, None], (0.10, 0.35)) == band_limits([0.2], (0.10, 0.35))
