"""Federated algorithms, one module per family."""

from .elf import BELF, DELF, LMC, PELF, curvature_step_size, theory_step_size
from .fedmm import FedEM, FedMM, ParamAveragingEM
from .fedsoul import FedSOUL
from .qlsd import QLSD

ALGORITHMS = {"fedsoul": FedSOUL, "fedmm": FedMM, "fedem": FedEM, "param-averaging-em": ParamAveragingEM, "lmc": LMC, "d-elf": DELF, "p-elf": PELF, "b-elf": BELF, "qlsd": QLSD}

__all__ = ["ALGORITHMS", "BELF", "DELF", "FedEM", "FedMM", "ParamAveragingEM", "FedSOUL", "LMC", "PELF", "QLSD", "curvature_step_size", "theory_step_size"]
