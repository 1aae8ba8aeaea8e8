"""fedbayes: Bayesian federated inference for NumPyro models."""

from . import checkpoint, compress, diagnostics, faults, flower, models, privacy, protocol, reference, wire
from .algorithms import (
    BELF,
    DELF,
    GD,
    LMC,
    PELF,
    QLSD,
    TAMUNA,
    FedAvg,
    FedEM,
    FedMM,
    FedRep,
    FedSOUL,
    FineTune,
    JointLMC,
    JointMALA,
    JointHMC,
    LocalOnly,
    ParamAveragingEM,
    Scaffnew,
)
from .algorithms import elf, tamuna
from .algorithms.expfam import CustomStatistics
from .api import clear_cache, fed_fit, resume
from .cache import compilation_cache
from .data import FederatedData
from .errors import (
    CallbackError,
    CheckpointError,
    CheckpointWarning,
    ClientIndexError,
    ConfigError,
    ConvergenceWarning,
    DataError,
    DivergenceError,
    FedbayesError,
    ModelError,
    PrecisionWarning,
    StalledError,
    TooFewClientsError,
)
from .faults import Aggregation, FaultPolicy, Faults
from .introspect import FedModel, local
from .kernels import ULA
from .models.formula import FormulaModel, from_formula
from .partition import partition_dirichlet, partition_iid, partition_shards
from .protocol import FederatedRun, FitParts
from .checkpoint import load_result as load
from .result import Result
from .symmetry import Symmetry
from .wire import WireError

__version__ = "0.1.0"

__all__ = [  # sorted: classes, then functions and modules
    "Aggregation",
    "BELF",
    "CallbackError",
    "CheckpointError",
    "CheckpointWarning",
    "ClientIndexError",
    "ConfigError",
    "ConvergenceWarning",
    "CustomStatistics",
    "DataError",
    "DELF",
    "DivergenceError",
    "FaultPolicy",
    "Faults",
    "FedAvg",
    "FedbayesError",
    "FedEM",
    "FederatedData",
    "FederatedRun",
    "FedMM",
    "FedModel",
    "FedRep",
    "FedSOUL",
    "FineTune",
    "FitParts",
    "FormulaModel",
    "GD",
    "JointHMC",
    "JointLMC",
    "JointMALA",
    "LMC",
    "LocalOnly",
    "ModelError",
    "ParamAveragingEM",
    "PELF",
    "PrecisionWarning",
    "QLSD",
    "Result",
    "Scaffnew",
    "StalledError",
    "Symmetry",
    "TAMUNA",
    "TooFewClientsError",
    "ULA",
    "WireError",
    "checkpoint",
    "clear_cache",
    "compilation_cache",
    "compress",
    "diagnostics",
    "elf",
    "faults",
    "fed_fit",
    "flower",
    "from_formula",
    "load",
    "local",
    "models",
    "partition_dirichlet",
    "partition_iid",
    "partition_shards",
    "privacy",
    "protocol",
    "reference",
    "resume",
    "tamuna",
    "wire",
]

from .cache import _from_environment

_from_environment()  # FEDBAYES_COMPILATION_CACHE: the persistent compilation cache from the environment
del _from_environment
