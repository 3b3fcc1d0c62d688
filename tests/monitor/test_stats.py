"""The significance tests of `actloop compare` against hand-computed and closed-form values."""

import math

import pytest

from actloop.monitor.stats import betainc, holm, sign_test_p, t_two_sided_p, welch_t_test


def test_betainc_closed_forms():
    assert betainc(1, 1, 0.3) == pytest.approx(0.3)  # uniform CDF
    assert betainc(2, 2, 0.5) == pytest.approx(0.5)  # symmetric
    assert betainc(1, 3, 0.2) == pytest.approx(1 - 0.8 ** 3)  # I_x(1, b) = 1 - (1 - x)^b
    assert betainc(3, 1, 0.7) == pytest.approx(0.7 ** 3)  # I_x(a, 1) = x^a
    assert betainc(0.5, 0.5, 0.3) == pytest.approx(2 / math.pi * math.asin(math.sqrt(0.3)))  # arcsine law
    assert betainc(2, 5, 0.0) == 0.0 and betainc(2, 5, 1.0) == 1.0
    with pytest.raises(ValueError):
        betainc(1, 1, 1.5)


def test_student_t_two_sided_p_values():
    assert t_two_sided_p(2.0, 5) == pytest.approx(0.1019, abs=5e-5)  # tables: t = 2.0, df = 5
    assert t_two_sided_p(2.228, 10) == pytest.approx(0.05, abs=1e-4)  # the 97.5% quantile of t(10)
    assert t_two_sided_p(1.0, 1) == pytest.approx(0.5)  # Cauchy: 1 - (2/pi) atan(1)
    assert t_two_sided_p(2.0, 2) == pytest.approx(1 - 2 / math.sqrt(6))  # df = 2: 1 - |t| / sqrt(t^2 + 2)
    assert t_two_sided_p(1.96, 1e6) == pytest.approx(0.05, abs=1e-4)  # the normal limit
    assert t_two_sided_p(0.0, 4) == pytest.approx(1.0) and t_two_sided_p(-2.0, 5) == t_two_sided_p(2.0, 5)
    assert t_two_sided_p(math.inf, 3) == 0.0


def test_welch_hand_computed():
    # means 3 and 1, variances 2 and 2, n = 2 each: t = 2 / sqrt(2/2 + 2/2) = sqrt 2,
    # df = (1 + 1)^2 / (1/1 + 1/1) = 2, p = 1 - sqrt2 / sqrt(2 + 2)
    w = welch_t_test([2, 4], [0, 2])
    assert w["t"] == pytest.approx(math.sqrt(2)) and w["df"] == pytest.approx(2)
    assert w["p"] == pytest.approx(1 - math.sqrt(2) / 2)
    # unequal variances: the constant sample adds nothing, df = n_x - 1 = 1 (Cauchy), t = 2 / sqrt(2/2)
    w = welch_t_test([1, 3], [0, 0, 0])
    assert (w["t"], w["df"]) == (pytest.approx(2.0), pytest.approx(1.0))
    assert w["p"] == pytest.approx(1 - 2 / math.pi * math.atan(2))
    assert welch_t_test([0.5], [0.1, 0.2]) is None  # one seed: no variance to test with
    assert welch_t_test([0.5, 0.5], [0.5, 0.5])["p"] == 1.0
    assert welch_t_test([0.6, 0.6], [0.5, 0.5])["p"] == 0.0


def test_exact_mcnemar_sign_test_hand_computed():
    assert sign_test_p(1, 6) == pytest.approx(2 * (1 + 7) / 2 ** 7)  # 0.125
    assert sign_test_p(6, 1) == sign_test_p(1, 6)
    assert sign_test_p(0, 10) == pytest.approx(2 / 1024)
    assert sign_test_p(2, 8) == pytest.approx(2 * (1 + 10 + 45) / 1024)  # 0.109375
    assert sign_test_p(3, 3) == 1.0 and sign_test_p(0, 0) == 1.0  # capped at 1; nothing discordant


def test_holm_step_down():
    # sorted 0.01, 0.03, 0.04 with m = 3: 3 * 0.01, 2 * 0.03, max(0.06, 1 * 0.04)
    assert holm([0.01, 0.04, 0.03, None]) == [pytest.approx(0.03), pytest.approx(0.06), pytest.approx(0.06), None]
    assert holm([0.2, 0.9]) == [pytest.approx(0.4), pytest.approx(0.9)] and holm([]) == []
    assert holm([0.6, 0.7]) == [1.0, pytest.approx(1.0)]  # capped at 1
