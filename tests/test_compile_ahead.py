"""Compilation ahead (fedbayes.engine.FitJitted.ahead): a fit's final exchange is traced while its round chunk
compiles on a worker thread, and compiled there while the rounds run; the executable compiled ahead is the one
that runs, and it is the plain compilation's program (the same bits)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedbayes import engine


def _f(x, y):
    return jnp.sin(x) @ y, jnp.sum(y)


def test_a_call_runs_what_was_compiled_ahead() -> None:
    x, y = jnp.linspace(0.0, 1.0, 12).reshape(3, 4), jnp.arange(8.0).reshape(4, 2)
    fj = engine.fit_jit(lambda a, b: _f(a, b))  # a function of its own (jit's caches go by function)
    shapes = fj.ahead(jax.ShapeDtypeStruct(x.shape, x.dtype), y)  # shapes alone stand for arrays
    assert shapes == jax.eval_shape(_f, x, y)
    got = fj(x, y)
    assert fj._jitted._cache_size() == 0  # the plain jit compiled nothing: the call ran the executable from ahead
    want = engine.fit_jit(lambda a, b: _f(a, b))(x, y)  # a function of its own (jit's caches go by function)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # arguments of another shape are not what was compiled: the plain jit compiles them
    other = fj(x[:2], y)
    assert fj._jitted._cache_size() == 1
    np.testing.assert_array_equal(np.asarray(other[0]), np.asarray(want[0][:2]))
    # the same signature again is not compiled twice
    fj.ahead(x, y)
    assert len(fj._compiled) == 1


def test_arguments_the_ahead_executable_refuses_are_compiled_as_usual() -> None:
    # e.g. arrays laid out over several devices where the shapes ahead foresaw one: the executable refuses them
    # (a ValueError) and the plain jit compiles for them
    x, y = jnp.ones((3, 4)), jnp.ones((4, 2))
    fj = engine.fit_jit(lambda a, b: _f(a, b))  # a function of its own (jit's caches go by function)
    fj.ahead(x, y)
    [signature] = fj._compiled

    def refuses(*args):
        raise ValueError("compiled for another layout")

    fj._compiled[signature] = refuses
    got = fj(x, y)
    assert fj._jitted._cache_size() == 1 and fj._compiled[signature] is None
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(_f(x, y)[0]))


def test_what_fails_ahead_fails_at_the_call() -> None:
    def bad(x):
        raise ValueError("not traceable")

    fj = engine.fit_jit(bad)
    assert fj.ahead(jnp.ones(3)) is None  # nothing raised ahead: the call is where the user's error belongs
    with pytest.raises(ValueError, match="not traceable"):
        fj(jnp.ones(3))


@pytest.mark.filterwarnings("ignore::fedbayes.errors.ConvergenceWarning")  # 12 rounds: not what is tested
@pytest.mark.slow  # two FedSOUL fits with their final exchange (Louis terms) compiled: about 20 s
def test_a_fit_runs_its_final_exchange_compiled_ahead_with_the_same_result(monkeypatch) -> None:
    from fedbayes.algorithms.fedsoul import FedSOULRun
    from fit_pairs import fedsoul_twice, paired_outputs

    monkeypatch.setenv(engine.COMPILE_AHEAD_ENV, "1")  # on whatever the JAX (engine.compile_ahead)

    def check_and_switch_off(ahead):
        jitted = engine._JITTED[ahead._run]
        for name in ("chunk", "final_clients", "final_message", "uncertainty"):
            [fj] = [v for k, v in jitted.items() if (k[0] if isinstance(k, tuple) else k) == name]
            assert fj._compiled and fj._jitted._cache_size() == 0, name  # compiled ahead, and only ahead
        monkeypatch.setattr(FedSOULRun, "finalize_ahead", lambda *args: None)

    ahead, plain = fedsoul_twice(12, 12, check_and_switch_off)
    assert not engine._JITTED[plain._run]["final_clients"]._compiled
    for got, want in paired_outputs(ahead, plain):  # the same programs, compiled on another thread: the same bits
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_compiling_ahead_is_on_by_default_from_jax_0_10_and_the_environment_decides(monkeypatch) -> None:
    monkeypatch.delenv(engine.COMPILE_AHEAD_ENV, raising=False)
    for version, expected in (("0.10.2", True), ("0.11.0", True), ("1.0.0", True), ("0.9.9", False),
                              ("0.4.30.dev20240101", False)):
        monkeypatch.setattr(jax, "__version__", version)
        assert engine.compile_ahead() is expected, version
        monkeypatch.setenv(engine.COMPILE_AHEAD_ENV, "0")
        assert engine.compile_ahead() is False
        monkeypatch.setenv(engine.COMPILE_AHEAD_ENV, "1")
        assert engine.compile_ahead() is True
        monkeypatch.delenv(engine.COMPILE_AHEAD_ENV)
    monkeypatch.setenv(engine.COMPILE_AHEAD_ENV, "yes")  # neither 0 nor 1: the default
    monkeypatch.setattr(jax, "__version__", "0.10.2")
    assert engine.compile_ahead() is True


def test_cpu_compiler_options_leave_out_what_this_xla_does_not_know(monkeypatch) -> None:
    monkeypatch.setattr(engine, "CPU_COMPILER_OPTIONS", {"xla_cpu_use_fusion_emitters": False,
                                                          "xla_no_such_option_anywhere": True})
    engine.cpu_compiler_options.cache_clear()
    try:
        kept = engine.cpu_compiler_options()
        assert "xla_no_such_option_anywhere" not in kept
        if jax.default_backend() == "cpu":  # the option fits compile with (jaxlib 0.10)
            assert kept == {"xla_cpu_use_fusion_emitters": False}
            fj = engine.fit_jit(lambda a: a * 2.0, once=3)
            assert fj._jitted(jnp.ones(2)).tolist() == [2.0, 2.0]
    finally:
        engine.cpu_compiler_options.cache_clear()  # the module's own options again for the tests after
