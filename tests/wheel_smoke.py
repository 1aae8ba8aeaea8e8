"""Run by ``make dist-check`` with the interpreter of a fresh virtual environment into which only the built
wheel was installed: fedbayes must import from that environment (not from the source tree) and fit."""

import os
import sys

import fedbayes as fb

where = os.path.dirname(fb.__file__)
assert os.path.realpath(where).startswith(os.path.realpath(sys.prefix)), f"fedbayes imported from {where}"
data = fb.models.make_glm_clients(4, 2, 30, family="linear", seed=0)[0]
res = fb.fed_fit(fb.models.linear_regression(), data, fb.GD(), num_rounds=200, seed=0, progress=False)
assert res.converged, res.diagnostics
print(f"fedbayes {fb.__version__} from {where}: GD fit converged")
print(res)
