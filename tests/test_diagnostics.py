"""fb.diagnostics against independent implementations (scikit-learn, scipy) and closed forms."""

import numpy as np
import pytest
import scipy.linalg
import scipy.stats
from sklearn.calibration import calibration_curve
from sklearn.metrics import brier_score_loss, log_loss, roc_auc_score

from fedbayes import diagnostics as dg
from fedbayes.errors import ConfigError, DataError


def random_classifier(rng, n=2000, k=4):
    logits = rng.normal(size=(n, k)) * 2
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y = np.array([rng.choice(k, p=row) for row in p])  # labels drawn from p: a calibrated predictor
    return p, y


def ece_from_sklearn(outcome, score, n_bins, strategy):
    """ECE from scikit-learn's calibration_curve, with bin counts for the same (e_{b-1}, e_b] bins."""
    prob_true, prob_pred = calibration_curve(outcome, score, n_bins=n_bins, strategy=strategy)
    edges = np.linspace(0, 1, n_bins + 1) if strategy == "uniform" else np.percentile(score, np.linspace(0, 100, n_bins + 1))
    counts = np.bincount(np.searchsorted(edges[1:-1], score), minlength=n_bins)
    counts = counts[counts > 0]
    return np.sum(counts * np.abs(prob_true - prob_pred)) / len(score)


@pytest.mark.parametrize("strategy", ["uniform", "quantile"])
def test_calibration_errors_match_scikit_learn(strategy):
    rng = np.random.default_rng(0)
    p, y = random_classifier(rng)
    conf, correct = p.max(1), (p.argmax(1) == y).astype(float)
    assert dg.expected_calibration_error(p, y, strategy=strategy) == pytest.approx(
        ece_from_sklearn(correct, conf, 15, strategy), abs=1e-12)
    classwise = np.mean([ece_from_sklearn((y == k).astype(float), p[:, k], 15, strategy) for k in range(4)])
    assert dg.classwise_ece(p, y, strategy=strategy) == pytest.approx(classwise, abs=1e-12)
    rel = dg.reliability_diagram(p, y, strategy=strategy)
    prob_true, prob_pred = calibration_curve(correct, conf, n_bins=15, strategy=strategy)
    nz = rel["count"] > 0
    np.testing.assert_allclose(rel["accuracy"][nz], prob_true, atol=1e-12)
    np.testing.assert_allclose(rel["confidence"][nz], prob_pred, atol=1e-12)
    assert dg.maximum_calibration_error(p, y, strategy=strategy) == pytest.approx(np.max(np.abs(prob_true - prob_pred)))


def test_scores_match_scikit_learn():
    rng = np.random.default_rng(1)
    p, y = random_classifier(rng)
    assert dg.negative_log_predictive_density(p, y) == pytest.approx(log_loss(y, p, labels=range(4)), rel=1e-12)
    onehot = np.eye(4)[y]
    assert dg.brier_score(p, y) == pytest.approx(np.mean(np.sum((p - onehot) ** 2, 1)), rel=1e-12)
    pb = rng.uniform(size=500)
    yb = (rng.uniform(size=500) < pb).astype(int)
    assert dg.brier_score(pb, yb) == pytest.approx(brier_score_loss(yb, pb), rel=1e-12)
    a, b = rng.normal(size=300), rng.normal(0.7, 1.0, size=200)
    b[:20] = a[:20]  # ties
    labels = np.r_[np.zeros(300), np.ones(200)]
    assert dg.ood_auroc(a, b) == pytest.approx(roc_auc_score(labels, np.r_[a, b]), rel=1e-12)


def test_a_calibrated_predictor_has_small_ece_and_an_overconfident_one_does_not():
    rng = np.random.default_rng(2)
    p, y = random_classifier(rng, n=20000)
    # sampling noise alone: each of 15 bins holds about 20000/15 points, so |acc - conf| is about
    # sqrt(0.25 / 1300) = 0.014 at most; the weighted ECE of a calibrated predictor stays below 0.02
    assert dg.expected_calibration_error(p, y) < 0.02
    sharp = p**4 / np.sum(p**4, 1, keepdims=True)  # same argmax, over-confident probabilities
    assert dg.expected_calibration_error(sharp, y) > 0.1
    curve = dg.accuracy_vs_confidence(p, y)
    assert curve["fraction"][0] == 1.0 and np.all(np.diff(curve["fraction"]) <= 0)
    assert curve["accuracy"][-1] > curve["accuracy"][0]
    with pytest.raises(ConfigError, match=">= 2"):
        dg.expected_calibration_error(p, y, n_bins=1)
    with pytest.raises(DataError):
        dg.expected_calibration_error(p[:, :3], y)  # rows do not sum to 1


def test_exact_posterior_intervals_cover_at_their_level():
    """Conjugate normal model: y_new | data ~ N(m, s^2 + 1) exactly; with draws from that predictive and
    outcomes from the same law, coverage equals the level within binomial error, and PIT is uniform."""
    rng = np.random.default_rng(3)
    n, S = 4000, 400
    m, s2 = rng.normal(size=n), 0.3
    draws = m + np.sqrt(s2 + 1) * rng.normal(size=(S, n))
    y = m + np.sqrt(s2 + 1) * rng.normal(size=n)
    cov = dg.interval_coverage(draws, y)
    for level, got in cov.items():
        # binomial sd sqrt(a (1 - a) / n) plus the quantile error of S = 400 draws (about 1 / sqrt(S) * pdf ratio)
        assert abs(got - level) < 4 * np.sqrt(level * (1 - level) / n) + 0.02
    u = dg.pit(draws, y)
    assert scipy.stats.kstest(u, "uniform").pvalue > 1e-3
    with pytest.raises(DataError):
        dg.interval_coverage(draws[:1], y)


def test_entropies_and_mutual_information():
    agree = np.tile([[0.7, 0.2, 0.1]], (5, 1, 1))  # 5 draws that agree: no epistemic part
    assert dg.mutual_information(agree)[0] == pytest.approx(0.0, abs=1e-12)
    h = -np.sum([0.7, 0.2, 0.1] * np.log([0.7, 0.2, 0.1]))
    assert dg.predictive_entropy(agree)[0] == pytest.approx(h) and dg.expected_entropy(agree)[0] == pytest.approx(h)
    disagree = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])  # confident draws that contradict each other
    assert dg.mutual_information(disagree)[0] == pytest.approx(np.log(2))
    assert dg.expected_entropy(disagree)[0] == pytest.approx(0.0)
    assert dg.max_probability(disagree)[0] == pytest.approx(0.5)


def test_gaussian_distances_match_closed_forms():
    rng = np.random.default_rng(4)
    # 1-d: W2^2 = (m1 - m2)^2 + (s1 - s2)^2
    assert dg.gaussian_w2(1.0, 4.0, -1.0, 1.0) == pytest.approx(np.sqrt(4 + 1))
    # diagonal: KL = sum (s1^2 / s2^2 + (m2 - m1)^2 / s2^2 - 1 + log(s2^2 / s1^2)) / 2
    v1, v2 = np.array([1.0, 2.0, 0.5]), np.array([2.0, 1.0, 1.5])
    m1, m2 = np.array([0.0, 1.0, -1.0]), np.array([0.5, 0.0, 0.0])
    kl = 0.5 * np.sum(v1 / v2 + (m2 - m1) ** 2 / v2 - 1 + np.log(v2 / v1))
    assert dg.gaussian_kl(m1, np.diag(v1), m2, np.diag(v2)) == pytest.approx(kl, rel=1e-12)
    # full covariances: W2 against scipy's matrix square root
    A, B = rng.normal(size=(3, 3)), rng.normal(size=(3, 3))
    c1, c2 = A @ A.T + np.eye(3), B @ B.T + np.eye(3)
    r = scipy.linalg.sqrtm(c2)
    ref = np.sum((m1 - m2) ** 2) + np.trace(c1 + c2 - 2 * np.real(scipy.linalg.sqrtm(r @ c1 @ r)))
    assert dg.gaussian_w2(m1, c1, m2, c2) == pytest.approx(np.sqrt(ref), rel=1e-9)
    assert dg.gaussian_kl(m1, c1, m1, c1) == pytest.approx(0.0, abs=1e-12)
    x = rng.normal(size=(4000, 3)) @ np.linalg.cholesky(c1).T + m1
    mean, cov = dg.gaussian_fit(x)
    assert dg.gaussian_w2(mean, cov, m1, c1) < 0.15  # sampling error of 4000 draws


def test_sample_distances():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(400, 2))
    assert dg.mmd(x, x) == pytest.approx(0.0, abs=1e-7)
    shifts = [dg.mmd(x, rng.normal(size=(400, 2)) + [delta, 0.0], bandwidth=1.0) for delta in (0.0, 0.5, 1.0, 2.0)]
    assert np.all(np.diff(shifts) > 0)
    # sliced W2 of a pure shift is |delta| times the RMS of u'e over random unit u: sqrt(1/2)|delta| in 2-d
    y = x + [2.0, 0.0]
    assert dg.sliced_wasserstein(x, y, num_projections=4000) == pytest.approx(2.0 * np.sqrt(0.5), rel=0.03)
    assert dg.sliced_wasserstein(x, x) == pytest.approx(0.0, abs=1e-12)
    err = dg.moment_errors(x + [0.1, 0.0], x)
    np.testing.assert_allclose(err["mean"], [0.1 / x[:, 0].std(ddof=1), 0.0], atol=1e-12)
    np.testing.assert_allclose(err["sd"], 0.0, atol=1e-12)
