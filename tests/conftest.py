"""Test configuration: float64 everywhere (exactness tests compare against closed forms), and a
compilation cache shared by the fits of one test process.

Every ``fed_fit`` builds and compiles its own round program; fits of the same model, data shapes and
options compile to the same program, so XLA's persistent cache (in a temporary directory removed at
exit) lets later fits load it instead of compiling again. Results are unchanged: the cache keys on
the whole compiled program.
"""

import atexit
import shutil
import tempfile

import jax

jax.config.update("jax_enable_x64", True)

_cache = tempfile.mkdtemp(prefix="fedbayes-xla-cache-")
atexit.register(shutil.rmtree, _cache, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
