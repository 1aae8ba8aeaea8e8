"""Run any fedbayes algorithm on Flower (``pip install "fedbayes[flower]"``).

* :func:`server_app` / :func:`client_app`: a Flower ``ServerApp`` and ``ClientApp`` that run an algorithm's
  ``client_step`` / ``server_step`` protocol: the server samples each round's cohort with its own PRNG key,
  sends the broadcast, receives the uploads, screens them and steps; each client keeps its state
  (chains, control variates, error-feedback memories) in Flower's ``context.state`` and its data
  partition to itself. Messages carry the compressed encodings (:mod:`fedbayes.wire`), so the bytes
  Flower moves are the ledger's bits, rounded up to whole bytes per message. A run starts with the
  algorithm's set-up exchange and ends with its final exchange (:class:`fedbayes.protocol.FederatedRun`), so the
  server never reads client data; personal posteriors stay on their nodes.
* Checkpoints: ``FlowerSpec(checkpoint=path)`` writes the server's state after the set-up and every round,
  and a node whose config names a folder under :data:`STATE_KEY` keeps snapshots of its client state there;
  ``FlowerSpec(resume=True)`` continues a stopped run from them, bit for bit (:mod:`fedbayes.flower._resume`).
* :func:`simulate`: the same apps under Flower's simulation engine in this process, returning the
  :class:`fedbayes.Result` that :func:`fedbayes.fed_fit` returns for the same arguments.

See docs/guides/flower.md ("Run on Flower") for the way from a notebook to ``flwr run`` on real nodes.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "FlowerSpec",
    "LocalGrid",
    "OUTPUT_KEY",
    "STATE_KEY",
    "SecAggPlus",
    "client_app",
    "flwr_available",
    "payload_bytes",
    "run_server",
    "server_app",
    "simulate",
    "write_personal_posterior",
]


def flwr_available() -> bool:
    """Whether the ``flwr`` package (the ``fedbayes[flower]`` extra) is installed."""
    try:
        import flwr  # noqa: F401
    except ImportError:
        return False
    return True


def __getattr__(name: str) -> Any:
    if name in __all__ and name != "flwr_available":
        if not flwr_available():
            raise ImportError('fedbayes.flower needs Flower: pip install "fedbayes[flower]"')
        from . import _apps

        return getattr(_apps, name)
    raise AttributeError(name)
