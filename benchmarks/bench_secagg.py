"""What secure aggregation costs on Flower: messages, bytes and seconds per round of LMC with distributed
DP, plain against Flower's SecAgg+ (``fb.flower.SecAggPlus()``), on the in-process grid
(``backend="local"``: every message is serialised by Flower's protobuf codec, as on a network, but
delivered without a transport, so the seconds are computation, not latency).

Per round and client, the plain protocol sends one broadcast and receives one upload. SecAgg+ runs four
exchanges: key advertisement, key sharing (each client's Shamir shares, encrypted for its neighbours,
forwarded by the server), the masked upload (int64 per coordinate, with the broadcast riding in the
same message) and unmasking. Seconds are those of a whole ``simulate`` call (compiled beforehand) of one
round and of ROUNDS rounds, set-up included. Bytes are Flower's: the payload's bytes for the plain messages, the
serialised content for SecAgg+'s. ``num_shares=1.0`` (every client a neighbour of every other) is
Flower's default and the costliest; ``num_shares=3`` shows SecAgg+'s own saving.

    python benchmarks/bench_secagg.py
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

import fedbayes as fb  # noqa: E402
from _common import machine_line  # noqa: E402

ROUNDS = 20


def per_round(res, rounds: int) -> tuple[float, float]:
    """Messages and bytes per round (the rounds' messages: the set-up's are left out)."""
    secure = any(kind.startswith("secagg:") for kind, *_ in res.flower_messages)
    # under SecAgg+ the broadcast rides in the masked-upload stage's message, whose bytes count it already
    msgs = [(k, b) for kind, k, _, b, _ in res.flower_messages
            if k >= 0 and kind != "setup" and not (secure and kind == "broadcast")]
    return len(msgs) / rounds, sum(b for _, b in msgs) / rounds


def main() -> None:
    from fedbayes import flower

    print(machine_line())
    print(f"# LMC with distributed DP on Flower's local grid, {ROUNDS} rounds, 2 chains; per round (set-up excluded)")
    print(f"| clients | dimension | protocol | messages / round | KB / round | KB / round / client | seconds, 1 round | "
          f"seconds, {ROUNDS} rounds |")
    print("|---|---|---|---|---|---|---|---|")
    for n, d in ((5, 3), (5, 50), (20, 50)):
        data, _ = fb.models.make_glm_clients(n, d, 20, seed=0)
        algo = fb.LMC(step_size=0.005, num_chains=2, init="prior",
                      privacy=fb.privacy.DP(clip=1.0, noise_multiplier=10.0, mode="distributed", noise_seed=0))
        for label, secure in (("plain", None), ("SecAgg+ (num_shares=1.0)", flower.SecAggPlus()),
                              ("SecAgg+ (num_shares=3)", flower.SecAggPlus(num_shares=3, reconstruction_threshold=2))):
            if label.endswith("=3)") and n < 10:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                times = []
                for rounds in (1, 1, ROUNDS):  # compile; then a fit of one round and one of ROUNDS
                    t0 = time.perf_counter()
                    res = flower.simulate(fb.models.logistic_regression(), data, algo, num_rounds=rounds, seed=0,
                                          backend="local", secure_aggregation=secure)
                    times.append(time.perf_counter() - t0)

            m, b = per_round(res, ROUNDS)
            print(f"| {n} | {d} | {label} | {m:.0f} | {b / 1e3:.1f} | {b / 1e3 / n:.2f} | {times[1]:.2f} | "
                  f"{times[2]:.2f} |")


if __name__ == "__main__":
    main()
