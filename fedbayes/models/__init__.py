"""Ready-made NumPyro models of one client's data, for use with ``fb.fed_fit``."""

from .fedpop import (
    aligned_head_error,
    fedpop_synthetic,
    latent_rotation_and_scale,
    make_fedpop_synthetic,
    principal_angle_distance,
)
from .images import classification_scores, fedpop_classifier, load_images, make_fedpop_images, read_idx
from .formula import FormulaModel, RandomBlock, from_formula
from .tables import CovarianceBlock, MixedLayout
from .glm import linear_regression, logistic_map, logistic_regression, make_glm_clients, prior_scale_for_kappa
from .latent import gaussian_mixture, make_gaussian_mixture, mixture_of_regressions, ppca
from .mixed import (
    EIGHT_SCHOOLS_SIGMA,
    EIGHT_SCHOOLS_Y,
    eight_schools,
    eight_schools_data,
    eight_schools_pooled,
    linear_mixed_effects,
    make_linear_mixed_effects,
    personalized_logistic,
    random_intercepts,
)

__all__ = [
    "FormulaModel",
    "RandomBlock",
    "MixedLayout",
    "CovarianceBlock",
    "from_formula",
    "aligned_head_error",
    "fedpop_synthetic",
    "latent_rotation_and_scale",
    "linear_regression",
    "logistic_map",
    "logistic_regression",
    "make_glm_clients",
    "prior_scale_for_kappa",
    "gaussian_mixture",
    "make_gaussian_mixture",
    "mixture_of_regressions",
    "ppca",
    "linear_mixed_effects",
    "make_fedpop_synthetic",
    "make_linear_mixed_effects",
    "personalized_logistic",
    "principal_angle_distance",
    "classification_scores",
    "fedpop_classifier",
    "load_images",
    "make_fedpop_images",
    "read_idx",
    "EIGHT_SCHOOLS_SIGMA",
    "EIGHT_SCHOOLS_Y",
    "eight_schools",
    "eight_schools_data",
    "eight_schools_pooled",
    "random_intercepts",
]
