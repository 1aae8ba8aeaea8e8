"""Federated algorithms, one module per family."""

from .elf import BELF, DELF, LMC, PELF
from .fedmm import FedEM, FedMM, ParamAveragingEM
from .fedsoul import FedRep, FedSOUL, FineTune, LocalOnly
from .joint import JointLMC, JointMALA, JointHMC
from .qlsd import QLSD
from .tamuna import GD, TAMUNA, FedAvg, Scaffnew

ALGORITHMS = {
    "fedsoul": FedSOUL,
    "fedrep": FedRep,
    "finetune": FineTune,
    "local-only": LocalOnly,
    "fedmm": FedMM,
    "fedem": FedEM,
    "param-averaging-em": ParamAveragingEM,
    "lmc": LMC,
    "joint-lmc": JointLMC,
    "joint-mala": JointMALA,
    "joint-hmc": JointHMC,
    "d-elf": DELF,
    "p-elf": PELF,
    "b-elf": BELF,
    "qlsd": QLSD,
    "tamuna": TAMUNA,
    "scaffnew": Scaffnew,
    "gd": GD,
    "fedavg": FedAvg,
}

__all__ = [
    "ALGORITHMS",
    "BELF",
    "DELF",
    "FedEM",
    "FedMM",
    "ParamAveragingEM",
    "FedRep",
    "FedSOUL",
    "FineTune",
    "JointLMC",
    "JointMALA",
    "JointHMC",
    "LocalOnly",
    "LMC",
    "PELF",
    "QLSD",
    "TAMUNA",
    "Scaffnew",
    "GD",
    "FedAvg",
]
