"""Federated algorithms, one module per family."""

from .elf import BELF, DELF, LMC, PELF, curvature_step_size, theory_step_size
from .fedsoul import FedSOUL

ALGORITHMS = {"fedsoul": FedSOUL, "lmc": LMC, "d-elf": DELF, "p-elf": PELF, "b-elf": BELF}

__all__ = ["ALGORITHMS", "BELF", "DELF", "FedSOUL", "LMC", "PELF", "curvature_step_size", "theory_step_size"]
