"""Co-location slowdown: the measured Lucid pairs, the utilisation fit, and its error on held-out pairs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from enforcer.interference import BUILTIN_WEIGHTS, InterferenceModel, holdout_error, load_pairs, slowdown
from store.errors import InvalidInput
from tests.conftest import FLEET


@pytest.fixture(scope="module")
def model() -> InterferenceModel:
    return InterferenceModel.from_csv(FLEET)


def test_pairs_join_every_measurement_to_both_solo_utilisations() -> None:
    pairs = load_pairs(FLEET)
    assert len(pairs) == 2 * 1388  # every pair seen from both sides
    assert pairs.ua.between(0, 1).all() and pairs.ub.between(0, 1).all()
    first = pairs[(pairs.model_a == "MobileNetV3") & (pairs.model_b == "ResNet18")].iloc[0]
    assert first.speed == pytest.approx(0.983) and first.speed_b == pytest.approx(1.034)


def test_fit_reproduces_the_builtin_weights(model: InterferenceModel) -> None:
    assert np.allclose(model.weights, BUILTIN_WEIGHTS, atol=1e-6)


def test_measured_lookup_and_estimate(model: InterferenceModel) -> None:
    # the row nearest to these solo utilisations: MobileNetV3 bs32 fp32 (45.4%) with ResNet18 bs128 fp32 (96.3%)
    sa, sb = model.slowdown(0.454, 0.9625, models=("MobileNetV3", "ResNet18"))
    assert sa == pytest.approx(1 / 0.729) and sb == pytest.approx(1 / 0.890)
    # the same pair asked the other way round gives the same measurement mirrored
    sb2, sa2 = model.slowdown(0.9625, 0.454, models=("ResNet18", "MobileNetV3"))
    assert (sa2, sb2) == pytest.approx((sa, sb))
    # a pair never measured falls back to the utilisation estimate
    assert model.measured("BERT", "NeuMF") is None
    assert model.slowdown(0.5, 0.5, models=("BERT", "NeuMF")) == model.slowdown(0.5, 0.5)


def test_estimate_is_sane(model: InterferenceModel) -> None:
    assert model.slowdown(0.05, 0.05) == pytest.approx((1.0, 1.0), abs=0.01)
    # busier neighbours hurt more, and two saturating jobs hurt each other most
    assert model.slowdown(0.5, 0.2)[0] < model.slowdown(0.5, 0.6)[0] < model.slowdown(0.5, 1.0)[0]
    assert min(model.slowdown(1.0, 1.0)) > 1.4
    assert all(s >= 1.0 for s in model.slowdowns([0.3, 0.4, 0.9]))
    grid = np.linspace(0, 1, 11)
    assert (1.0 / model.speed_array(grid[:, None], grid[None, :]) >= 1.0).all()
    assert slowdown(0.7, 0.7) == InterferenceModel().slowdown(0.7, 0.7)


def test_holdout_error_beats_a_constant() -> None:
    err = holdout_error(FLEET)
    assert err["n_measurements"] == 2776 and err["n_model_pairs"] > 20
    assert 0 < err["mae"] < err["baseline_mae"]


def test_missing_file_and_missing_columns(tmp_path) -> None:
    with pytest.raises(InvalidInput, match="does not exist"):
        InterferenceModel.from_csv(tmp_path)
    (tmp_path / "lucid_colocate_info.csv").write_text("model1,speed1\nA,1\n")
    (tmp_path / "lucid_single_data.csv").write_text((FLEET / "lucid_single_data.csv").read_text())
    with pytest.raises(InvalidInput, match="lacks columns.*model2"):
        InterferenceModel.from_csv(tmp_path)


def _model_measuring(speed: float) -> InterferenceModel:
    pairs = pd.DataFrame({"pair": [0, 0], "model_a": ["x", "y"], "model_b": ["y", "x"], "ua": [0.5, 0.5],
                          "ub": [0.5, 0.5], "speed": [speed, speed], "speed_b": [speed, speed]})
    return InterferenceModel(pairs=pairs)


def test_each_model_reads_its_own_measured_pairs(monkeypatch) -> None:
    """The measured-pair index was cached by the table's id, and CPython gives a freed table's id to the next: a
    model built after another was freed read the other's speeds. Every table here gets one id, as if reused."""
    import enforcer.interference as interference

    monkeypatch.setattr(interference, "id", lambda _obj: 1, raising=False)
    assert _model_measuring(0.9).measured("x", "y") == (0.9, 0.9)
    assert _model_measuring(0.3).measured("x", "y") == (0.3, 0.3)
    for k in range(50):  # and as it happens: models made and freed one after the other
        speed = 0.2 + k / 100
        assert _model_measuring(speed).measured("x", "y") == pytest.approx((speed, speed))
