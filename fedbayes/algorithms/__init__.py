"""Federated algorithms, one module per family."""

from .elf import BELF, DELF, LMC, PELF, curvature_step_size, theory_step_size
from .fedsoul import FedSOUL
from .qlsd import QLSD

ALGORITHMS = {"fedsoul": FedSOUL, "lmc": LMC, "d-elf": DELF, "p-elf": PELF, "b-elf": BELF, "qlsd": QLSD}

__all__ = ["ALGORITHMS", "BELF", "DELF", "FedSOUL", "LMC", "PELF", "QLSD", "curvature_step_size", "theory_step_size"]
