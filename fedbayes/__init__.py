"""fedbayes: Bayesian federated inference for NumPyro models."""

from . import checkpoint, compress, diagnostics, faults, flower, models, protocol, reference, wire
from .algorithms import (BELF, DELF, GD, LMC, PELF, QLSD, TAMUNA, FedAvg, FedEM, FedMM, FedSOUL, ParamAveragingEM, Scaffnew,
                         curvature_step_size, theory_step_size)
from .algorithms import tamuna
from .expfam import CustomStatistics
from .api import fed_fit, resume
from .data import FederatedData, partition_dirichlet, partition_iid, partition_shards
from .errors import (CallbackError, CheckpointError, CheckpointWarning, ClientIndexError, ConfigError, ConvergenceWarning,
                     DataError, DivergenceError, FedbayesError, ModelError, PrecisionWarning, StalledError, TooFewClientsError)
from .faults import Aggregation, FaultPolicy, Faults
from .kernels import ULA
from .model import FedModel, local
from .protocol import FederatedRun
from .result import Result, load
from .wire import WireError

__version__ = "0.1.0"

__all__ = [
    "BELF", "TAMUNA", "Scaffnew", "GD", "FedAvg", "tamuna", "CustomStatistics", "DELF", "FedEM", "FedMM", "ParamAveragingEM", "LMC", "PELF", "QLSD", "ConfigError", "DataError", "DivergenceError", "FedModel", "FedSOUL", "FederatedData", "FedbayesError", "ModelError",
    "Result", "ULA", "compress", "diagnostics", "reference", "fed_fit", "local", "models", "partition_dirichlet", "partition_iid",
    "partition_shards", "curvature_step_size", "theory_step_size", "resume", "checkpoint", "faults", "Faults",
    "FaultPolicy", "Aggregation", "TooFewClientsError", "CheckpointError", "CallbackError", "CheckpointWarning",
    "ClientIndexError", "ConvergenceWarning", "PrecisionWarning", "StalledError", "WireError", "load", "protocol",
    "FederatedRun",
]
