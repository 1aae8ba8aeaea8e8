"""What both ends agree on: the model, the algorithm and how a node finds its client's data.

Edit this file for your problem. The ServerApp builds its side on ``data.blank()`` (the layout: keys,
client sizes, shapes; every value zero) and learns the rest from the set-up exchange; a ClientApp reads
only the partition of its own client. In a deployment, ``load_data`` runs on each SuperNode and reads
that site's own data (its rows never leave the node; the other partitions may be blank), and the
server's ``load_data`` needs only the layout. Here every node generates the same synthetic data set, so
the template runs anywhere.
"""

import fedbayes as fb
from fedbayes.flower import FlowerSpec

MODEL = fb.models.logistic_regression(prior_scale=2.0)


def algorithm(num_rounds: int):
    # init="prior": the chains start at the prior's centre. On Flower that is what the default means (the
    # federated Newton search for the mode runs in simulation only); naming it gives fed_fit the same start.
    return fb.DELF(uplink=fb.compress.top_k(2), num_chains=4, warmup=num_rounds // 4, init="prior")


def load_data(num_clients: int) -> fb.FederatedData:
    data, _ = fb.models.make_glm_clients(num_clients, 4, 40, seed=0)
    return data


def spec(run_config, role: str = "client") -> FlowerSpec:
    """Both ends' spec; the server's holds only the data's layout (``data.blank()``: every value zero).

    ``min-clients``: the fault policy's (a round with fewer answers stops the run with TooFewClientsError).
    ``checkpoint``: the server's checkpoint file ("" for none); ``resume = true`` continues the run that wrote
    it, each client from the snapshots its node keeps (node config ``fedbayes-state``)."""
    num_clients, num_rounds = int(run_config.get("num-clients", 10)), int(run_config.get("num-rounds", 200))
    data = load_data(num_clients)
    server = {"checkpoint": str(run_config.get("checkpoint", "")) or None, "resume": bool(run_config.get("resume", False))}
    return FlowerSpec(model=MODEL, data=data.blank() if role == "server" else data, algorithm=algorithm(num_rounds),
                      num_rounds=num_rounds, seed=int(run_config.get("seed", 0)),
                      fault_policy=fb.FaultPolicy(min_clients=int(run_config.get("min-clients", 1))),
                      token=f"fedbayes-app-{role}", **(server if role == "server" else {}))
