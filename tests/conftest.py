"""Test configuration: float64 everywhere (exactness tests compare against closed forms)."""

import jax

jax.config.update("jax_enable_x64", True)
