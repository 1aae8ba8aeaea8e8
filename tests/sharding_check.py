"""Run by tests/test_sharding.py in a process with two CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=2``): each fit once on one device and once with its
clients over both, printing one JSON line per fit with the largest differences and where the clients lived."""

from __future__ import annotations

import json
import sys
import warnings

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

import fedbayes as fb  # noqa: E402
import fedbayes.engine as engine  # noqa: E402

assert len(jax.devices()) == 2, jax.devices()
warnings.simplefilter("ignore")  # short fits: their convergence warnings are not what is checked

placed: list[int] = []
_run_rounds = engine.run_rounds


def recording_run_rounds(*args, **kwargs):
    carry, history = _run_rounds(*args, **kwargs)
    # the devices of the clients' data and of their states (where they keep any) after the rounds
    states = jax.tree_util.tree_leaves(carry[1])
    placed.append([len(engine.stack_clients(args[1].data).mask.sharding.device_set),
                   len(states[0].sharding.device_set) if states else None])
    return carry, history


engine.run_rounds = recording_run_rounds
import fedbayes.api  # noqa: E402

fedbayes.api.run_rounds = recording_run_rounds


def largest_difference(a, b) -> float:
    leaves = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    return max((float(np.max(np.abs(np.asarray(x, float) - np.asarray(y, float)), initial=0.0)) for x, y in leaves),
               default=0.0)


def compare(name: str, model, data, algorithm, **kw) -> None:
    placed.clear()
    one = fb.fed_fit(model, data, algorithm, devices=1, progress=False, **kw)
    two = fb.fed_fit(model, data, algorithm, devices=2, progress=False, **kw)
    out = {"name": name, "devices": placed[:], "params": largest_difference(one.params, two.params),
           "bits": [int(one.history["bits_up"].sum() - two.history["bits_up"].sum()),
                    int(one.history["bits_down"].sum() - two.history["bits_down"].sum())],
           "scale": max(float(np.max(np.abs(np.asarray(v)))) for v in jax.tree_util.tree_leaves(one.params))}
    if one.global_samples:
        out["draws"] = largest_difference(one.global_samples, two.global_samples)
    if one.local_samples:
        out["locals"] = largest_difference(one.local_samples, two.local_samples)
    print(json.dumps(out), flush=True)


def refusals() -> None:
    """21 clients over 2 devices: refused when asked for, one device with a warning by default."""
    data, _ = fb.models.make_glm_clients(21, 2, 10, family="logistic", seed=0)
    out = {"name": "refusals"}
    try:
        fb.fed_fit(fb.models.logistic_regression(1.0), data, fb.LMC(), num_rounds=4, devices=2, progress=False)
    except fb.ConfigError as err:
        out["explicit"] = str(err)
    placed.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fb.fed_fit(fb.models.logistic_regression(1.0), data, fb.LMC(), num_rounds=4, progress=False)
    out["default_warning"] = [str(w.message) for w in caught if "cannot be split" in str(w.message)]
    out["default_devices"] = placed[:]
    print(json.dumps(out), flush=True)


def main() -> None:
    which = sys.argv[1:]
    if "refusals" in which:
        refusals()
    fedpop, _, _ = fb.models.make_fedpop_synthetic(40, test_size=1, seed=0)
    if "fedsoul" in which:
        compare("fedsoul", fb.models.fedpop_synthetic, fedpop, fb.FedSOUL(local_steps=5), num_rounds=60, seed=1)
    if "fedsoul-cohort" in which:
        compare("fedsoul-cohort", fb.models.fedpop_synthetic, fedpop, fb.FedSOUL(local_steps=5), num_rounds=60,
                clients_per_round=10, seed=2, faults=fb.Faults(drop=0.1))
    glm, _ = fb.models.make_glm_clients(20, 4, (20, 40), family="logistic", seed=3)
    if "lmc" in which:
        compare("lmc", fb.models.logistic_regression(1.0), glm, fb.LMC(num_chains=2), num_rounds=300, seed=4)
    if "belf" in which:
        top = fb.compress.top_k(2)
        compare("belf", fb.models.logistic_regression(1.0), glm, fb.BELF(uplink=top, downlink=top, num_chains=2),
                num_rounds=300, seed=5)
    if "fedmm" in which:
        mix, _ = fb.models.make_gaussian_mixture(20, num_components=2, dim=2, seed=6)
        compare("fedmm", fb.models.gaussian_mixture(2, 2), mix, fb.FedMM(), num_rounds=40, seed=7)


if __name__ == "__main__":
    main()
