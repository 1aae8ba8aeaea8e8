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


def test_posterior_intervals_of_a_conjugate_model_cover_the_true_parameter():
    """theta ~ N(0, 1), y_1..n | theta ~ N(theta, 2^2): the exact posterior is N(m, v) with
    v = 1 / (1 + n / 4), m = v sum(y) / 4. Over M datasets drawn from the prior predictive, central
    posterior intervals of level a contain the true theta with probability exactly a."""
    rng = np.random.default_rng(11)
    M, n, S = 4000, 5, 1000
    theta = rng.normal(size=M)
    y = theta[:, None] + 2.0 * rng.normal(size=(M, n))
    v = 1.0 / (1.0 + n / 4.0)
    m = v * y.sum(1) / 4.0
    draws = m + np.sqrt(v) * rng.normal(size=(S, M))
    for level, got in dg.interval_coverage(draws, theta, levels=(0.5, 0.8, 0.9, 0.95)).items():
        # binomial sd sqrt(a (1 - a) / M) <= 0.0079; the empirical quantiles of S = 1000 draws shift
        # the coverage by O(1 / S) (about 0.002), hence 4 sd + 0.005
        assert abs(got - level) < 4 * np.sqrt(level * (1 - level) / M) + 0.005
    assert scipy.stats.kstest(dg.pit(draws, theta), "uniform").pvalue > 1e-3
    # an over-confident posterior (sd halved) under-covers clearly
    narrow = m + 0.5 * np.sqrt(v) * rng.normal(size=(S, M))
    assert dg.interval_coverage(narrow, theta, levels=0.9)[0.9] < 0.7


def test_pav_matches_scikit_learn_isotonic_regression():
    from sklearn.isotonic import IsotonicRegression

    rng = np.random.default_rng(4)
    x = np.round(rng.uniform(size=500), 2)  # rounded: many ties
    y = (rng.uniform(size=500) < x**2).astype(float)
    w = rng.uniform(0.5, 2.0, size=500)
    fit = dg.pav(x, y, w)
    ref = IsotonicRegression().fit(x, y, sample_weight=w).predict(x)
    np.testing.assert_allclose(fit["calibrated"], ref[fit["order"]], atol=1e-12)
    assert np.all(np.diff(fit["calibrated"]) >= -1e-15)
    # CORP miscalibration: about 0 for a calibrated predictor, clearly positive for an over-confident one
    p, labels = random_classifier(rng, n=5000)
    sharp = p**4 / np.sum(p**4, 1, keepdims=True)
    assert dg.pav_reliability(p, labels)["miscalibration"] < 0.005
    assert dg.pav_reliability(sharp, labels)["miscalibration"] > 0.02


def test_novelty_score_matches_gaussian_closed_forms():
    rng = np.random.default_rng(5)
    m0, c0 = np.array([0.0, 1.0]), np.array([[1.0, 0.3], [0.3, 0.5]])
    m, c = np.array([1.0, 2.0]), 0.1 * np.eye(2)
    prior = rng.multivariate_normal(m0, c0, size=200000)
    post = rng.multivariate_normal(m, c, size=200000)
    diff = m - m0
    exact = np.sqrt(diff @ np.linalg.solve(c0, diff))
    # means and covariances from 2e5 draws: relative errors of order 1 / sqrt(2e5) = 0.002
    assert dg.novelty_score(post, prior) == pytest.approx(exact, rel=0.01)
    assert dg.novelty_score(post, prior, kind="kl") == pytest.approx(dg.gaussian_kl(m, c, m0, c0), rel=0.01)
    with pytest.raises(ConfigError):
        dg.novelty_score(post, prior, kind="euclid")


def _as_idata(posterior):
    import xarray as xr

    from fedbayes.result import to_arviz

    return to_arviz({"posterior": xr.Dataset(posterior)})


def test_compare_to_reference_reports_closed_form_distances():
    rng = np.random.default_rng(6)
    R = 4000
    ref = {"a": (["chain", "draw", "a_dim_0"], rng.normal(size=(2, R, 2))),
           "z": (["chain", "draw", "client", "z_dim_0"], rng.normal(size=(2, R, 3, 1)))}
    shifted = {"a": (["chain", "draw", "a_dim_0"], 0.5 + 2.0 * rng.normal(size=(2, R, 2))),
               "z": (["chain", "draw", "client", "z_dim_0"], rng.normal(size=(2, R, 3, 1)))}
    table = dg.compare_to_reference(_as_idata(shifted), _as_idata(ref))
    assert list(table.index) == ["a", "z"] and table.loc["z", "clients"] == 3
    a = table.loc["a"]
    # N(0.5, 4 I) against N(0, I) in 2-d: W2^2 = 2 * 0.25 + 2 * (2 - 1)^2, KL = (2*4 + 2*0.25 - 2 + 2*log(1/4)) / 2;
    # moment estimates from 8000 draws per side are within about 3 % here
    assert a["w2_gauss"] == pytest.approx(np.sqrt(2 * 0.25 + 2), rel=0.03)
    assert a["kl_gauss"] == pytest.approx((8 + 0.5 - 2 + 2 * np.log(0.25)) / 2, rel=0.05)
    assert a["mean_err"] == pytest.approx(0.5, abs=0.1) and a["sd_err"] == pytest.approx(1.0, abs=0.1)
    assert a["mmd"] > 0.1 and a["sliced_w2"] > 0.5
    z = table.loc["z"]  # the same law on both sides: every distance is sampling noise
    assert z["mean_err"] < 0.1 and z["w2_gauss"] < 0.1 and z["mmd"] < 0.05
    with pytest.raises(DataError, match="not in both"):
        dg.compare_to_reference(_as_idata(shifted), _as_idata(ref), var_names=["b"])


def test_loo_per_client_matches_exact_leave_one_out():
    """Bayesian linear regression with known noise: p(y_i | y_-i) = N(x_i m_-i, s^2 + x_i V_-i x_i') in
    closed form. PSIS-LOO from 4000 exact posterior draws reproduces each client's sum of them."""
    import xarray as xr

    from fedbayes.result import to_arviz

    rng = np.random.default_rng(7)
    n, s = 40, 0.5
    x = np.column_stack([np.ones(n), rng.normal(size=n)])
    y = x @ [0.5, -1.0] + s * rng.normal(size=n)
    client = np.repeat(np.arange(4), 10)

    def posterior(keep):  # prior w ~ N(0, I)
        prec = np.eye(2) + x[keep].T @ x[keep] / s**2
        cov = np.linalg.inv(prec)
        return cov @ x[keep].T @ y[keep] / s**2, cov

    m, cov = posterior(np.ones(n, bool))
    w = rng.multivariate_normal(m, cov, size=(2, 2000))  # (chain, draw, 2)
    mu = w @ x.T
    ll = scipy.stats.norm.logpdf(y, mu, s)
    exact = np.zeros(n)
    for i in range(n):
        mi, ci = posterior(np.arange(n) != i)
        exact[i] = scipy.stats.norm.logpdf(y[i], x[i] @ mi, np.sqrt(s**2 + x[i] @ ci @ x[i]))
    idata = to_arviz({"posterior": xr.Dataset({"w": (["chain", "draw", "w_dim_0"], w)}),
                      "log_likelihood": xr.Dataset({"y": (["chain", "draw", "obs"], ll)},
                                                   coords={"client": ("obs", client)})})
    table = dg.loo_per_client(idata)
    assert list(table["n"]) == [10] * 4
    # importance-sampling error per point is about 0.005 here (smooth, light-tailed weights)
    np.testing.assert_allclose(table["elpd_loo"], [exact[client == c].sum() for c in range(4)], atol=0.05)
    assert np.all(table["max_pareto_k"] < 0.7)


class _FakeFit:
    """predictive_probs(inputs, client) of a fit: client c predicts its classes with confidence 0.9."""

    def predictive_probs(self, inputs, client=None, *, num_samples=None, seed=0):
        x = np.asarray(inputs["x"])
        p = np.where(x[:, None] > 0, [0.9, 0.1], [0.5, 0.5])
        return np.broadcast_to(p, (3,) + p.shape)


def test_ood_report_scores_per_client_inputs():
    inside = [{"x": np.ones(4)}, {"x": np.ones(6)}]
    outside = [{"x": -np.ones(3)}, {"x": -np.ones(5)}]
    table = dg.ood_report(_FakeFit(), inside, outside, client=[0, 1])
    assert set(table.index) == {"predictive_entropy", "mutual_information", "expected_entropy", "neg_max_probability"}
    h = -(0.9 * np.log(0.9) + 0.1 * np.log(0.1))
    assert table.loc["predictive_entropy", "mean_in"] == pytest.approx(h)
    assert table.loc["predictive_entropy", "mean_out"] == pytest.approx(np.log(2))
    assert table.loc["predictive_entropy", "auroc"] == 1.0 and table.loc["neg_max_probability", "auroc"] == 1.0
    assert table.loc["mutual_information", "auroc"] == 0.5  # identical draws: no epistemic signal at all
    with pytest.raises(DataError, match="one input dict per client"):
        dg.ood_report(_FakeFit(), inside[0], outside, client=[0, 1])
