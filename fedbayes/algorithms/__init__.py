"""Federated algorithms, one module per family."""

from .fedsoul import FedSOUL

ALGORITHMS = {"fedsoul": FedSOUL}

__all__ = ["ALGORITHMS", "FedSOUL"]
