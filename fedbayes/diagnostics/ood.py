"""Out-of-distribution scores for inputs and for whole clients.

Inputs. From S posterior draws of the class probabilities, ``draws`` (S, N, K): predictive entropy
H[mean_s p_s] (total uncertainty), expected entropy mean_s H[p_s] (aleatoric part) and their
difference, the mutual information I(y; theta | x) between the label and the parameters (epistemic
part: how much the draws disagree), and the max-probability of the posterior-mean prediction.
``ood_auroc`` measures how well a score separates OOD from in-distribution inputs.

Clients. A new client is novel when its local posterior p(z | D_new, theta*) sits far from the
population prior p(z | theta*) that the federation learned; ``novelty_score`` measures that distance
and ``client_novelty`` calibrates it against the training clients' own scores.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError, DataError


# ------------------------------------------------------------------------------------------ OOD


def _entropy(p: np.ndarray) -> np.ndarray:
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


def _check_draws(draws: Any) -> np.ndarray:
    d = np.asarray(draws, dtype=np.float64)
    if d.ndim == 2:
        d = d[None]
    if d.ndim != 3 or d.shape[-1] < 2:
        raise DataError(f"draws must be (S, N, K) posterior draws of class probabilities, got {np.shape(draws)}")
    return d


def predictive_entropy(draws: Any) -> np.ndarray:
    """H[mean_s p_s] per input (total uncertainty), from (S, N, K) draws or (N, K) probabilities."""
    return _entropy(_check_draws(draws).mean(0))


def expected_entropy(draws: Any) -> np.ndarray:
    """mean_s H[p_s] per input (aleatoric part)."""
    return _entropy(_check_draws(draws)).mean(0)


def mutual_information(draws: Any) -> np.ndarray:
    """I(y; theta | x) = H[mean p] - mean H[p] >= 0 per input (epistemic part: disagreement of draws).
    Differences below 1e-12 nats are rounding (identical draws) and reported as exactly 0."""
    d = _check_draws(draws)
    mi = _entropy(d.mean(0)) - _entropy(d).mean(0)
    return np.where(mi > 1e-12, mi, 0.0)


def max_probability(draws: Any) -> np.ndarray:
    """max_k of the posterior-mean class probabilities per input (low = uncertain)."""
    return _check_draws(draws).mean(0).max(-1)


def ood_auroc(scores_in: Any, scores_out: Any) -> float:
    """Area under the ROC curve of telling OOD from in-distribution inputs by a score that is larger
    for OOD inputs (entropy, mutual information; use -max_probability): P(s_out > s_in) + P(tie) / 2."""
    a = np.asarray(scores_in, dtype=np.float64).ravel()
    b = np.asarray(scores_out, dtype=np.float64).ravel()
    if a.size == 0 or b.size == 0 or not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise DataError("scores_in and scores_out must be non-empty and finite")
    both = np.concatenate([a, b])
    ranks = _average_ranks(both)
    return float((ranks[a.size :].sum() - b.size * (b.size + 1) / 2) / (a.size * b.size))  # Mann-Whitney U


def _average_ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(x.size)
    ranks[order] = np.arange(1, x.size + 1)
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    return sums[inv] / counts[inv]


# ------------------------------------------------------------------------------- reports


_SCORES = {
    "predictive_entropy": predictive_entropy,
    "mutual_information": mutual_information,
    "expected_entropy": expected_entropy,
    "neg_max_probability": lambda d: -max_probability(d),
}


def ood_scores(draws_in: Any, draws_out: Any) -> Any:
    """Table (pandas DataFrame) of every OOD score on in- and out-of-distribution probability draws
    (S, N, K): mean score on each side and the AUROC of telling them apart (0.5 = blind, 1 = perfect)."""
    import pandas as pd

    rows = []
    for name, fn in _SCORES.items():
        a, b = fn(draws_in), fn(draws_out)
        rows.append({"score": name, "mean_in": float(a.mean()), "mean_out": float(b.mean()), "auroc": ood_auroc(a, b)})
    return pd.DataFrame(rows).set_index("score")


def _probs_of(fit: Any, inputs: Any, client: Any, num_samples: int | None, seed: int) -> np.ndarray:
    """Probability draws (S, N, K) of a fit at ``inputs``; per-client lists are concatenated along N."""
    if isinstance(client, (list, tuple, np.ndarray)):
        if not isinstance(inputs, (list, tuple)) or len(inputs) != len(client):
            raise DataError("with a list of clients, inputs must be a list of one input dict per client")
        parts = [fit.predictive_probs(x, int(c), num_samples=num_samples, seed=seed) for x, c in zip(inputs, client)]
        return np.concatenate(parts, axis=1)
    return fit.predictive_probs(inputs, client, num_samples=num_samples, seed=seed)


def ood_report(
    fit: Any, inputs_in: Any, inputs_out: Any, *, client: Any = None, num_samples: int | None = None, seed: int = 0
) -> Any:
    """OOD report of a classification fit: :func:`ood_scores` on the fit's class-probability draws
    (``fit.predictive_probs``) at in-distribution inputs ``inputs_in`` and OOD inputs ``inputs_out``.

    ``client`` is a client index (its personalised posterior), None (a new client: locals from the
    population prior), or a list of indices with ``inputs_in`` / ``inputs_out`` lists of one input
    dict per client (e.g. every client's own test and OOD inputs, scored by its own posterior).
    """
    d_in = _probs_of(fit, inputs_in, client, num_samples, seed)
    d_out = _probs_of(fit, inputs_out, client, num_samples, seed)
    return ood_scores(d_in, d_out)


def novelty_score(local_draws: Any, prior_draws: Any, kind: str = "mahalanobis") -> float:
    """Distance of a client's local posterior from the population prior, from draws (S, d) of each.

    ``"mahalanobis"``: sqrt((m - m0)' C0^-1 (m - m0)) for the local posterior mean m and the prior's
    mean m0 and covariance C0 (draws in unconstrained coordinates): how many prior standard deviations
    the client's latent sits from the population. ``"kl"``: KL(N(m, C) || N(m0, C0)) between Gaussian
    fits, which also grows with how much the client's data sharpen the posterior.
    """
    from .posterior import gaussian_fit, gaussian_kl

    m, c = gaussian_fit(local_draws)
    m0, c0 = gaussian_fit(prior_draws)
    if kind == "mahalanobis":
        diff = np.linalg.solve(np.linalg.cholesky(c0), m - m0)
        return float(np.sqrt(diff @ diff))
    if kind == "kl":
        return gaussian_kl(m, c, m0, c0)
    raise ConfigError(f"kind must be 'mahalanobis' or 'kl', got {kind!r}")


def client_novelty(
    fit: Any,
    new_client_data: Any,
    *,
    kind: str = "mahalanobis",
    num_samples: int = 500,
    warmup: int = 500,
    prior_samples: int = 4000,
    seed: int = 0,
) -> dict[str, Any]:
    """Novelty of a new client for a personalised fit (FedSOUL): its :func:`novelty_score` and the
    fraction of training clients scoring at least as high (an empirical p-value: small = novel).

    The new client's local posterior p(z | D_new, theta*) is sampled on the client by the fit's own
    Langevin kernel (``fit.sample_client``); the population prior p(z | theta*) by ancestral sampling.
    Training clients are scored from their own local posterior samples, so the reference reflects
    the training clients' sizes: a new client much smaller or larger than them shifts the score.
    Returns ``score``, ``p_value``, and ``training_scores`` (one per training client).
    """
    import jax

    from ..seeds import seed_key
    from ..data import FederatedData

    fm = fit._fm
    if not fm.local_names or not fit.local_samples:
        raise DataError("client novelty needs a personalised fit with local posterior samples (e.g. FedSOUL)")
    new = fit.sample_client(new_client_data, num_samples=num_samples, warmup=warmup, seed=seed)
    one = FederatedData({k: [np.asarray(v)] for k, v in new_client_data.items()})
    data = {k: v[0] for k, v in one.padded.items()}
    keys = jax.random.split(seed_key(seed + 1, "seed + 1"), prior_samples)
    prior_u = jax.vmap(fm.sample_local_prior, in_axes=(0, None, None, None))(keys, fit._theta_u, data, one.mask[0])

    def flat(u: dict[str, Any]) -> np.ndarray:  # {site: (S, ...)} -> (S, d)
        return np.concatenate([np.asarray(u[k]).reshape(len(u[k]), -1) for k in fm.local_names], axis=1)

    def flat_u(constrained: dict[str, Any]) -> np.ndarray:  # constrained draws -> unconstrained (S, d)
        return flat(jax.vmap(fm.unconstrain)({k: constrained[k] for k in fm.local_names}))

    prior = flat(prior_u)
    score = novelty_score(flat_u(new), prior, kind)
    train = np.array(
        [
            novelty_score(flat_u({k: v[i] for k, v in fit.local_samples.items()}), prior, kind)
            for i in range(fit._data.num_clients)
        ]
    )
    return {"score": score, "p_value": float(np.mean(train >= score)), "training_scores": train}
