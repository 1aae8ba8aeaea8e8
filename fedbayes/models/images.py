"""FedPop's image experiment (Kotelevskii et al. 2022, Table 2 and Figure 3) on data available offline.

FedPop's protocol: 100 clients, each holding S classes of a 10-class image set (S = 2 or 5), 500 training
and 100 test images per client, balanced over its classes; a neural feature extractor shared by all
clients and a personal last layer per client with a learned population prior. FedPop uses CIFAR-10 and
CIFAR-100; here the images are Fashion-MNIST when Debian's ``dataset-fashion-mnist`` is installed (the
original 60 000 + 10 000 images; or a folder of its four IDX files named by ``FEDBAYES_FASHION_MNIST``)
and scikit-learn's 8 x 8 digits otherwise (1 797 images, bundled with scikit-learn).

What differs with digits: 1 797 images cannot give 100 clients 600 distinct images each. The digits are
split once into a training pool (80%) and a test pool (20%), stratified; a client's training images
come from the training pool only and its test images from the test pool only (no image is ever both
trained on and tested on), but clients holding the same class share images, and a client whose share of
a class exceeds the pool draws it with replacement (``info["with_replacement"]``). With Fashion-MNIST
(and FedPop's CIFAR) each class's images are split among its holders and no image repeats.
"""

from __future__ import annotations

import glob
import gzip
import os
from typing import Any
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints

from ..data import FederatedData
from ..errors import ConfigError, DataError
from ..introspect import local
from ..partition import shard_classes

FASHION_DIRS = (
    "/usr/share/dataset-fashion-mnist",
    "/usr/share/datasets/fashion-mnist",
    "/usr/share/fashion-mnist",
    "/usr/share/dataset-fashion-mnist/data/fashion",
)
"""Where the Debian package's files are looked for (after ``$FEDBAYES_FASHION_MNIST``), recursively."""


def read_idx(path: str) -> np.ndarray:
    """An IDX file (MNIST's format, gzip-compressed or not) as a NumPy array: a big-endian magic number
    whose third byte is the element type (0x08: unsigned byte) and fourth the number of dimensions, the
    dimensions as big-endian int32, then the data."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    shape = tuple(int(np.frombuffer(raw, ">i4", 1, 4 + 4 * i)[0]) for i in range(ndim))
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise DataError(f"{path}: {data.size} values for the shape {shape} in its header")
    return data.reshape(shape)


def _find_fashion() -> str | None:
    roots = [os.environ["FEDBAYES_FASHION_MNIST"]] if os.environ.get("FEDBAYES_FASHION_MNIST") else []
    for root in [*roots, *FASHION_DIRS]:
        hits = sorted(glob.glob(os.path.join(root, "**", "train-images-idx3-ubyte*"), recursive=True))
        if hits:
            return os.path.dirname(hits[0])
    return None


def load_images(source: str = "auto", seed: int = 0) -> dict[str, Any]:
    """A 10-class image set as ``{"x_train", "y_train", "x_test", "y_test", "name"}``: images flattened to
    float32 rows in [0, 1], integer labels.

    ``source``: ``"fashion-mnist"`` (the Debian package, or ``$FEDBAYES_FASHION_MNIST``; its own
    train / test split), ``"digits"`` (scikit-learn's; split 80 / 20 stratified by ``seed``), or ``"auto"``
    (Fashion-MNIST when found, else digits)."""
    if source not in ("auto", "fashion-mnist", "digits"):
        raise ConfigError(f"source must be 'auto', 'fashion-mnist' or 'digits', got {source!r}")
    folder = _find_fashion() if source != "digits" else None
    if folder is not None:

        def part(kind: str) -> tuple[np.ndarray, np.ndarray]:
            x = read_idx(glob.glob(os.path.join(folder, f"{kind}-images-idx3-ubyte*"))[0])
            y = read_idx(glob.glob(os.path.join(folder, f"{kind}-labels-idx1-ubyte*"))[0])
            return (x.reshape(len(x), -1) / np.float32(255)).astype(np.float32), y.astype(np.int64)

        (xa, ya), (xb, yb) = part("train"), part("t10k")
        return {"x_train": xa, "y_train": ya, "x_test": xb, "y_test": yb, "name": "fashion-mnist"}
    if source == "fashion-mnist":
        raise DataError(
            "Fashion-MNIST not found: install Debian's dataset-fashion-mnist or set FEDBAYES_FASHION_MNIST "
            f"to a folder holding its IDX files (looked in {', '.join(FASHION_DIRS)})"
        )
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.data / np.float32(16)).astype(np.float32), digits.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), bool)
    for k in np.unique(y):
        items = rng.permutation(np.flatnonzero(y == k))
        test[items[: int(round(0.2 * len(items)))]] = True
    return {"x_train": x[~test], "y_train": y[~test], "x_test": x[test], "y_test": y[test], "name": "digits"}


def _client_items(
    pool_labels: np.ndarray,
    classes: np.ndarray,
    counts: Sequence[int],
    holders: dict[int, list[int]],
    rng: np.random.Generator,
) -> tuple[list[np.ndarray], bool]:
    """Each client's items: ``counts[i]`` split evenly over its classes; a class's items are dealt to its holders
    without repetition when the pool holds enough, else each holder draws its share independently."""
    num_clients = len(counts)
    per_class = {
        i: np.diff(np.linspace(0, counts[i], len(classes[i]) + 1).round().astype(int)) for i in range(num_clients)
    }
    chosen: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    repeated = False
    for k, owners in holders.items():
        items = rng.permutation(np.flatnonzero(pool_labels == k))
        need = [int(per_class[i][list(classes[i]).index(k)]) for i in owners]
        if sum(need) <= len(items):
            ends = np.cumsum(need)
            for i, a, b in zip(owners, ends - need, ends):
                chosen[i].append(items[a:b])
        else:
            for i, n in zip(owners, need):
                again = n > len(items)
                repeated |= again
                chosen[i].append(rng.choice(items, n, replace=again))
    return [rng.permutation(np.concatenate(c)) for c in chosen], repeated


def make_fedpop_images(
    num_clients: int = 100,
    classes_per_client: int = 2,
    *,
    train_size: int = 500,
    test_size: int = 100,
    small_fraction: float = 0.0,
    small_size: int = 5,
    source: str = "auto",
    seed: int = 0,
) -> tuple[FederatedData, FederatedData, dict[str, Any]]:
    """Train / test data of FedPop's image protocol: client i holds ``classes_per_client`` = S classes,
    ``perm[(i S + j) mod 10]`` for j < S (``fb.partition_shards``'s rule: each class held by about 10 S
    clients), with ``train_size`` training and ``test_size`` test images balanced over them; the first
    ``round(small_fraction * num_clients)`` clients hold only ``small_size`` training images (Figure 3's
    small-data variant). Returns ``(train, test, info)``, both ``FederatedData({"x", "y"})``;
    ``info``: ``classes`` (num_clients, S), ``source``, ``with_replacement``."""
    images = load_images(source, seed)
    num_classes = int(images["y_train"].max()) + 1
    if not 1 <= classes_per_client <= num_classes:
        raise ConfigError(f"classes_per_client must lie in 1..{num_classes}, got {classes_per_client}")
    if not 0.0 <= small_fraction <= 1.0:
        raise ConfigError(f"small_fraction must lie in [0, 1], got {small_fraction}")
    rng = np.random.default_rng(seed)
    classes = shard_classes(num_classes, num_clients, classes_per_client, rng)
    holders: dict[int, list[int]] = {}
    for i in range(num_clients):
        for k in classes[i]:
            holders.setdefault(int(k), []).append(i)
    n_small = int(round(small_fraction * num_clients))
    sizes = [small_size if i < n_small else train_size for i in range(num_clients)]
    train_items, rep_a = _client_items(images["y_train"], classes, sizes, holders, rng)
    test_items, rep_b = _client_items(images["y_test"], classes, [test_size] * num_clients, holders, rng)

    def as_data(x, y, items):
        return FederatedData({"x": [x[i] for i in items], "y": [y[i] for i in items]})

    train = as_data(images["x_train"], images["y_train"], train_items)
    test = as_data(images["x_test"], images["y_test"], test_items)
    return train, test, {"classes": classes, "source": images["name"], "with_replacement": rep_a or rep_b}


def fedpop_classifier(
    x, y=None, *, hidden: Sequence[int] = (32, 16), num_classes: int = 10, prior_scale: float | None = None
):
    """FedPop's personalised classifier: a flax MLP feature extractor phi (tanh layers of sizes ``hidden``)
    shared by all clients, and a personal last layer z_i in R^{h x K} with the population prior
    z_i ~ N(mu, sigma^2 I), mu learned, sigma learned (``prior_scale=None``) or fixed at ``prior_scale``
    (FedPop's released image configurations fix it at 1):

        p(y_j = k | x_j, phi, z_i) = softmax(phi(x_j)^T z_i)_k.

    Needs flax (the ``nn`` extra). A fit of the non-personalised model (``fb.FedAvg(local_latents=
    "population-mean")``) is FedAvg's one shared classifier, every head at mu."""
    try:
        import flax.linen as nn
        from numpyro.contrib.module import flax_module
    except ImportError as err:  # pragma: no cover - the nn extra is installed by make
        raise ImportError("fedpop_classifier needs flax: pip install 'fedbayes[nn]'") from err

    class Features(nn.Module):
        sizes: tuple[int, ...]

        @nn.compact
        def __call__(self, h):
            for width in self.sizes:
                h = nn.tanh(nn.Dense(width)(h))
            return h

    net = flax_module("phi", Features(tuple(hidden)), input_shape=(1, x.shape[-1]))
    width = hidden[-1]
    mu = numpyro.param("mu", jnp.zeros((width, num_classes)))
    sigma = (
        numpyro.param("sigma", jnp.ones(()), constraint=constraints.positive)
        if prior_scale is None
        else jnp.asarray(prior_scale, jnp.result_type(float))
    )
    with local():
        head = numpyro.sample("head", dist.Normal(mu, sigma).expand([width, num_classes]).to_event(2))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=net(x) @ head), obs=y)


def classification_scores(
    res: Any, test: FederatedData, *, num_samples: int | None = 100, seed: int = 0, n_bins: int = 10
) -> Any:
    """Per-client test scores of a classifier fit: a pandas DataFrame indexed by client with ``accuracy``,
    ``ece`` (top-label, ``n_bins`` equal-width bins), ``brier`` (multi-class, summed over classes) and
    ``nll`` (mean negative log predictive probability) of the posterior predictive
    p(y | x, D_i) = mean_s p(y | x, theta*, z_s), from ``num_samples`` of the client's draws."""
    import pandas as pd

    from ..diagnostics.calibration import brier_score, expected_calibration_error, negative_log_predictive_density

    probs = res.predictive_probs(test, client="all", num_samples=num_samples, seed=seed)  # (K, S, N, classes)
    rows = []
    for i in range(test.num_clients):
        n = int(test.sizes[i])
        p = np.asarray(probs[i].mean(0))[:n].astype(np.float64)
        p /= p.sum(-1, keepdims=True)
        labels = np.asarray(test.client(i)["y"])
        rows.append(
            {
                "accuracy": float(np.mean(p.argmax(-1) == labels)),
                "ece": expected_calibration_error(p, labels, n_bins=n_bins),
                "brier": brier_score(p, labels),
                "nll": negative_log_predictive_density(p, labels),
            }
        )
    return pd.DataFrame(rows, index=pd.Index(test.client_coordinate(), name="client"))
