"""Centralised reference posteriors: NumPyro NUTS on the pooled data, for checking federated fits.

The federated target of a model of one client's data is

    p(theta, z_1..z_C | D) ∝ p(theta) prod_i p(z_i | theta) p(D_i | theta, z_i),

one global theta and one set of local latents per client. ``nuts`` samples it jointly with NumPyro's
NUTS from the same per-client log-densities the federated algorithms use (``FedModel``), so the
reference and the fit cannot disagree about the model. It is meant for small problems: every
gradient touches every client's data.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import xarray as xr

from .seeds import require_seed, seed_key
from .data import FederatedData
from .errors import ModelError, require_int
from .introspect import FedModel, serialized
from .arviz_adapter import site_dims, to_arviz


@serialized
def nuts(
    model: Callable,
    data: FederatedData | Mapping[str, Any],
    *,
    num_warmup: int = 500,
    num_samples: int = 1000,
    num_chains: int = 2,
    seed: int = 0,
    model_kwargs: Mapping[str, Any] | None = None,
    chain_method: str = "sequential",
    progress: bool = False,
    **nuts_kwargs: Any,
) -> Any:
    """NUTS on the pooled federated target; returns ArviZ data with a ``posterior`` group.

    Globals have dims (chain, draw, ...), locals (chain, draw, client, ...), named as in
    ``res.idata`` so :func:`fb.diagnostics.compare_to_reference` can line them up. Every global must be
    a ``sample`` site with a prior (a ``numpyro.param`` has none: its reference is the centralised
    maximiser, not a posterior) and every latent continuous. ``nuts_kwargs`` go to
    ``numpyro.infer.NUTS`` (e.g. ``target_accept_prob``).
    """
    from numpyro.infer import MCMC, NUTS

    if not isinstance(data, FederatedData):
        data = FederatedData(data)
    for what, value, low in (
        ("num_warmup", num_warmup, 0),
        ("num_samples", num_samples, 1),
        ("num_chains", num_chains, 1),
    ):
        require_int(value, what, low)
    require_seed(seed)
    fm = FedModel(model, data, model_kwargs)
    params = [n for n in fm.global_names if fm.sites[n].role == "param"]
    if params:
        raise ModelError(
            f"sites {params} are numpyro.param (no prior), so there is no posterior to sample; give "
            "them priors for a NUTS reference, or compare with a centralised maximiser"
        )
    fm.require("the NUTS reference", minibatch=True)  # full data: a subsampled plate runs over all rows
    C = data.num_clients
    padded, mask = data.padded, data.mask

    def potential(u: dict[str, jax.Array]) -> jax.Array:
        theta = {n: u[n] for n in fm.global_names}
        z = {n: u[n] for n in fm.local_names}
        per_client = jax.vmap(fm.client_log_joint, in_axes=(None, 0, 0, 0))(theta, z, padded, mask)
        return -(fm.log_prior(theta, jacobian=True) + jnp.sum(per_client))

    key_init, key_run = jax.random.split(seed_key(seed))
    theta0 = fm.init_globals(key_init)
    z0 = jax.vmap(fm.sample_local_prior, in_axes=(0, None, 0, 0))(jax.random.split(key_init, C), theta0, padded, mask)
    init = {**theta0, **z0}
    init = (
        jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (num_chains,) + a.shape), init) if num_chains > 1 else init
    )
    mcmc = MCMC(
        NUTS(potential_fn=potential, **nuts_kwargs),
        num_warmup=num_warmup,
        num_samples=num_samples,
        num_chains=num_chains,
        chain_method=chain_method,
        progress_bar=progress,
    )
    mcmc.run(key_run, init_params=init)
    u = mcmc.get_samples(group_by_chain=True)  # (chain, draw, ...), locals (chain, draw, client, ...)
    flat = jax.tree_util.tree_map(lambda a: a.reshape((-1,) + a.shape[2:]), u)
    theta_c = jax.vmap(fm.constrain)({n: flat[n] for n in fm.global_names})
    z_c = jax.vmap(jax.vmap(fm.constrain))({n: flat[n] for n in fm.local_names}) if fm.local_names else {}
    post, coords = (
        {},
        {"chain": np.arange(num_chains), "draw": np.arange(num_samples), "client": data.client_coordinate()},
    )
    for n, a in theta_c.items():
        v = np.asarray(a).reshape((num_chains, num_samples) + a.shape[1:])
        post[n] = (["chain", "draw", *site_dims(n, v.shape[2:])], v)
    for n, a in z_c.items():
        v = np.asarray(a).reshape((num_chains, num_samples) + a.shape[1:])
        post[n] = (["chain", "draw", "client", *site_dims(n, v.shape[3:])], v)
    diverging = np.asarray(mcmc.get_extra_fields(group_by_chain=True)["diverging"])
    stats = xr.Dataset({"diverging": (["chain", "draw"], diverging)}, coords={k: coords[k] for k in ("chain", "draw")})
    posterior = xr.Dataset(post, coords=coords, attrs={"inference_library": "numpyro NUTS (pooled reference)"})
    return to_arviz({"posterior": posterior, "sample_stats": stats})
