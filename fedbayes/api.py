"""``fed_fit``: a NumPyro model of one client + federated data + an algorithm -> :class:`Result`."""

from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import re
import sys
import warnings
from typing import Any, NamedTuple, cast
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from . import checkpoint as checkpoint_io
from . import convergence, prng
from .seeds import require_seed, seed_key
from .algorithms import ALGORITHMS
from .data import FederatedData
from .engine import (
    STALL_TIMEOUT,
    Problem,
    Progress,
    Stopped,
    concat_records,
    fault_events,
    resolve_cohort_size,
    resolve_devices,
    bucketed_clients,
    check_size_buckets,
    run_rounds,
    sharded_clients,
    split_key,
    matmul_precision,
    check_matmul_precision,
    compile_ahead,
    staged_init,
    wait_ready,
    with_init_bits,
)
from .errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DivergenceError,
    ModelError,
    TooFewClientsError,
    require_int,
)
from .errors import COUNT_MAX, CallbackError, CheckpointWarning, is_real
from .faults import FaultPolicy, Faults
from .introspect import FedModel, serialized
from .protocol import FederatedRun, FitParts
from .result import Result


MAX_ROUNDS = COUNT_MAX
"""The most rounds a fit may plan (``num_rounds``): the device counts rounds in 32-bit integers."""


def check_progress(progress: object) -> None:
    """ConfigError unless ``progress`` is None, True or False (a string such as "no" is not read as a flag)."""
    if progress is not None and not isinstance(progress, (bool, np.bool_)):
        raise ConfigError(f"progress must be None, True or False, got {progress!r}")


def _resolve_algorithm(algorithm: Any) -> Any:
    if isinstance(algorithm, str):
        key = algorithm.lower().replace("_", "-")
        if key not in ALGORITHMS:
            raise ConfigError(
                f"unknown algorithm '{algorithm}'; choose one of {sorted(ALGORITHMS)} or pass an instance"
            )
        return ALGORITHMS[key]()
    if isinstance(algorithm, type) and hasattr(algorithm, "build"):
        raise ConfigError(
            f"algorithm must be an instance, not the class: pass fb.{algorithm.__name__}() (with its options), "
            f"not fb.{algorithm.__name__}"
        )
    if not hasattr(algorithm, "build"):
        raise ConfigError(f"algorithm must be a name or an algorithm instance such as fb.FedSOUL(), got {algorithm!r}")
    return algorithm


_DEFAULT_HINT = (
    "The likely cause is a step size: lower the Langevin step_size (or leave it None for the per-client "
    "automatic step) or the server_lr."
)


def public_history(history: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The history without the private records (keys starting with "_", e.g. the samplers' raw draws)."""
    return {k: v for k, v in history.items() if not k.startswith("_")}


def finalize_parts(
    run: FederatedRun,
    key: jax.Array,
    carry: Any,
    problem: Problem,
    history: dict[str, np.ndarray] | None,
    setup_bits: tuple[int, int],
) -> FitParts:
    """``run.finalize``'s parts of the Result, with ``init_bits``: the set-up exchange's bits and any the run
    spent before it (``start_bits``)."""
    return with_init_bits(run.finalize(key, carry, problem, history=history), setup_bits)


def _stopped(
    err: Stopped,
    run: Any,
    problem: Problem,
    fm: FedModel,
    data: FederatedData,
    seed: int,
    key: jax.Array,
    history: dict[str, np.ndarray],
    setup_bits: tuple[int, int],
) -> DivergenceError | TooFewClientsError:
    """The user-facing error of a fit stopped early, with the fit finalised at the last good round."""
    hint = f"Likely fixes: {run.divergence_hint}." if run.divergence_hint else _DEFAULT_HINT
    kind: type[DivergenceError | TooFewClientsError]
    if err.reason == "diverged":
        message = f"{run.name} diverged: the global parameters became non-finite at round {err.round}. {hint}"
        kind = DivergenceError
    elif err.reason == "nonfinite_uploads":
        c = err.counts
        message = (
            f"{run.name} diverged on the clients at round {err.round}: the global parameters were still "
            f"finite, but no client answered usefully and {c['nonfinite']} of the "
            f"{c['nonfinite'] + c['dropped'] + c['too_large']} taking part sent non-finite uploads, so their "
            f"local computation overflowed or produced NaN at these parameters. {hint} If that is not it, "
            "look for what else overflows on a client: a compressor whose wire format cannot hold the "
            "values, or a model term that is NaN/inf there (err.history['nonfinite'] counts such clients "
            "per round)."
        )
        kind = DivergenceError
    else:
        message = (
            f"{run.name} stopped: at round {err.round} client faults left fewer answering clients than "
            f"fb.FaultPolicy(min_clients=...) allows; err.history['active'] and the fault counts "
            "('dropped', 'nonfinite', 'too_large') show the rounds before it. Lower min_clients, or "
            "find why clients fail (res.faults / err.result.faults list every event)."
        )
        kind = TooFewClientsError
    if err.round:
        message += f" err.result holds the fit at round {err.round - 1}, the last good one."
    result: Result | None = None
    if err.round > 0:
        try:
            parts = finalize_parts(run, key, err.carry, problem._replace(num_rounds=err.round), history, setup_bits)
            result = Result(
                model=fm,
                data=data,
                run=run,
                algorithm=run.name,
                seed=seed,
                parts=parts,
                history=public_history(history),
            )
            if not all(np.all(np.isfinite(v)) for v in result.params.values()):
                result = None
        except Exception:
            result = None
    return kind(message, round=err.round, history=public_history(history), result=result)


class _Fit(NamedTuple):
    """Everything that determines a fit's result (what a checkpoint must reproduce)."""

    model: Callable
    data: FederatedData
    algorithm: Any
    num_rounds: int
    clients_per_round: int | float | None
    seed: int
    model_kwargs: Mapping[str, Any] | None
    chunk_size: int | None
    faults: Faults | None
    fault_policy: FaultPolicy | None


def validate_fit(
    model, data, algorithm, num_rounds, clients_per_round, seed, model_kwargs, chunk_size, faults, fault_policy
) -> _Fit:
    """The arguments of a fit checked and normalised (``fb.fed_fit``'s and ``fb.flower``'s): a clear
    ``ModelError`` / ``DataError`` / ``ConfigError`` for bad input, before any computation."""
    if not callable(model):
        raise ModelError(f"model must be a NumPyro model function (callable), got {type(model).__name__}")
    if not isinstance(data, FederatedData):
        if isinstance(data, Mapping):
            data = FederatedData(data)
        else:
            raise DataError(f"data must be fb.FederatedData or a dict of per-client lists, got {type(data).__name__}")
    require_int(num_rounds, "num_rounds", 1, MAX_ROUNDS)
    if chunk_size is not None:
        require_int(chunk_size, "chunk_size", 1)
    seed = require_seed(seed)
    if model_kwargs is not None and not isinstance(model_kwargs, Mapping):
        raise ConfigError(
            f"model_kwargs must be a dict of keyword arguments or None, got {type(model_kwargs).__name__}"
        )
    if faults is not None and not isinstance(faults, Faults):
        raise ConfigError(f"faults must be fb.Faults(...) or None, got {faults!r}")
    if fault_policy is not None and not isinstance(fault_policy, FaultPolicy):
        raise ConfigError(f"fault_policy must be fb.FaultPolicy(...) or None, got {fault_policy!r}")
    resolve_cohort_size(clients_per_round, data.num_clients)
    return _Fit(
        model,
        data,
        _resolve_algorithm(algorithm),
        int(num_rounds),
        clients_per_round,
        int(seed),
        model_kwargs,
        None if chunk_size is None else int(chunk_size),
        faults,
        fault_policy,
    )


@serialized
def fed_fit(
    model: Callable,
    data: FederatedData | Mapping[str, Any],
    algorithm: Any = "fedsoul",
    *,
    num_rounds: int = 500,
    clients_per_round: int | float | None = None,
    seed: int = 0,
    model_kwargs: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    chunk_size: int | None = None,
    faults: Faults | None = None,
    fault_policy: FaultPolicy | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    callback: Callable[[int, dict[str, np.ndarray]], Any] | None = None,
    stall_timeout: float | None = STALL_TIMEOUT,
    devices: int | Sequence[jax.Device] | None = None,
    matmul_precision: str | None = "highest",
    size_buckets: str | int = "auto",
) -> Result:
    """Fit ``model`` (a NumPyro model of one client's data) across the clients of ``data``.

    Parameters
    ----------
    model:
        Called as ``model(**client_data, **model_kwargs)``. Sites under ``fb.local()`` are per-client
        latents; other sample sites are global parameters with priors; ``param`` sites are global
        parameters without prior.
    data:
        ``fb.FederatedData`` (or a dict of per-client lists, converted).
    algorithm:
        An instance such as ``fb.FedSOUL(local_steps=10)`` or ``fb.DELF(uplink=fb.compress.top_k(5))``,
        or a name (``"fedsoul"``, ``"lmc"``, ``"d-elf"``, ``"p-elf"``, ``"b-elf"``) for the defaults.
    num_rounds:
        Communication rounds, at most ``MAX_ROUNDS`` (2^31 - 1), and few enough that the history of every
        round (``res.history``, on the host) takes at most half the machine's memory: a fit with more stops
        after its first round with a ConfigError that says how many fit (:func:`fedbayes.engine.check_history_memory`).
    clients_per_round:
        Cohort size per round: an int, a fraction in (0, 1], or None for all clients.
    seed:
        An integer in ``[0, 2**64)``, or a JAX key (``jax.random.PRNGKey(s)``, ``jax.random.key(s)``: the fit of
        that s); the fit is a deterministic function of ``seed`` on a given machine.
    progress:
        Progress after each chunk (:class:`fedbayes.engine.Progress`). None (default): a live line on a
        terminal or in a Jupyter notebook, nothing elsewhere; True: also in a log, one line per chunk;
        False: none.
    chunk_size:
        Rounds per chunk: the rounds run on the device in chunks, and progress, callbacks, checkpoints and the
        stop checks happen between chunks. None (default): chunks timed to last about half a second each
        (1, 2, 4, ... rounds until a chunk's time is measured, then as many as that holds; see
        :class:`fedbayes.engine.ChunkSchedule`), so that the host's work between chunks costs nothing
        measurable however short a round is; an int: chunks of that many rounds. Every chunk runs the same
        compiled program, so the chunks change no round of the fit, only how often progress, callbacks and
        checkpoints come.
    faults:
        ``fb.Faults(drop=..., nan=..., large=...)``: simulated client faults (to test a set-up's
        resilience). Real faults are screened for whether or not this is given.
    fault_policy:
        ``fb.FaultPolicy(min_clients=..., max_abs=..., relative=...)``: how uploads are screened and
        when too few answers stop the fit (default: reject non-finite and absurdly large uploads,
        stop when a round's faults leave no answer).
    checkpoint, checkpoint_every:
        A file to which the full state (server, clients, ledger, history) is written atomically every
        ``checkpoint_every`` rounds (default: every chunk), at the end of a chunk; ``fb.resume(path)``
        continues from it and gives exactly the result of an uninterrupted fit. A write that fails (disk
        full, read-only) gives a ``fb.errors.CheckpointWarning`` saying where and why: the previous
        checkpoint is kept, the fit goes on in memory and the next chunk tries to write again.
    callback:
        Called after each chunk as ``callback(rounds_done, chunk_history)`` (the chunk's public records).
        An exception in it stops the fit with ``fb.errors.CallbackError`` (``round``; the exception
        chained), after the checkpoint due at that round is written.
    stall_timeout:
        Seconds (default 300; None: off) that a compiled computation (the set-up exchange, a chunk of
        rounds) may stay unfinished while the process uses no CPU before ``fb.errors.StalledError``
        (``rounds``, ``history``) is raised instead of waiting for ever. The clock starts once the
        computation is dispatched (compilation does not count) and restarts whenever the process
        computes, so a slow fit is never stopped, only a deadlocked one (see the error's message for
        causes and remedies). It watches CPU runs only: on a GPU the host is idle while a long kernel runs,
        so idleness says nothing there. A deadlocked computation cannot be cancelled: its threads stay blocked
        and the process cannot exit normally afterwards (end it with ``os._exit``).
    devices:
        The devices over which the clients are laid (``jax.sharding.Mesh`` with one axis, ``"clients"``):
        a number (the first that many of ``jax.devices()``) or a sequence of devices. Default: every
        device of the default backend (the largest count that divides the number of clients). Each
        device holds and runs its share of the clients; the server's sums over clients become sums
        across devices, so the result equals the one-device fit up to the order of those float sums.
    matmul_precision:
        The precision of the fit's matrix products (``jax.default_matmul_precision``): ``"highest"``
        (default) computes float32 products in full float32 on every device; None leaves JAX's own
        setting, which on recent NVIDIA GPUs is TensorFloat-32 (about 3 significant digits: FedMM's
        sufficient statistics then lose positive-definiteness), and ``"default"`` asks for it explicitly,
        for the speed of a large network's products on a GPU. A CPU always computes in full precision
        (see :func:`fedbayes.engine.matmul_precision`).
    size_buckets:
        Clients of unequal sizes are padded to the largest; an algorithm whose client step ignores its padding
        (FedMM and FedEM with an exact E-step, the samplers LMC, D-, P- and B-ELF and QLSD, each without
        minibatches), with every client in every round, can instead
        run its clients in groups of similar size, each padded to its own largest
        (:func:`fedbayes.engine.size_buckets`): fewer rows a round, one more compilation a group.
        ``"auto"`` (default): as many groups (at most 4) as the fit's rounds repay; an int k: at most k
        (1: none). The result is the same up to the order of float sums.

    Notes
    -----
    A second call with the same model function, data, algorithm, number of rounds and cohort size reuses
    the first call's analysis, set-up and compiled computations (only the seed, chunk size, faults and
    the rest may differ): see :func:`fedbayes.clear_cache`, and :func:`fedbayes.compilation_cache` to keep
    compilations across processes.
    """
    fit = validate_fit(
        model, data, algorithm, num_rounds, clients_per_round, seed, model_kwargs, chunk_size, faults, fault_policy
    )
    _check_run_options(checkpoint, checkpoint_every, callback)
    _check_stall_timeout(stall_timeout)
    check_progress(progress)
    check_matmul_precision(matmul_precision)
    check_size_buckets(size_buckets)
    chosen = resolve_devices(devices, fit.data.num_clients)
    return _execute(
        fit,
        progress=progress,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        callback=callback,
        stall_timeout=stall_timeout,
        devices=chosen,
        precision=matmul_precision,
        buckets=size_buckets,
    )


def _check_stall_timeout(stall_timeout: Any) -> None:
    if stall_timeout is not None and not (is_real(stall_timeout) and stall_timeout > 0):
        raise ConfigError(f"stall_timeout must be a number of seconds > 0 or None (no watchdog), got {stall_timeout!r}")


def _check_run_options(checkpoint: Any, checkpoint_every: Any, callback: Any) -> None:
    """Refuse bad checkpoint / callback arguments before any computation."""
    if checkpoint is not None:
        try:
            path = os.fspath(checkpoint)
        except TypeError:
            raise ConfigError(f"checkpoint must be a file path or None, got {checkpoint!r}") from None
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
            raise ConfigError(f"checkpoint {path!r}: the directory {directory!r} does not exist or is not writable")
    if checkpoint is None and checkpoint_every is not None:
        raise ConfigError("checkpoint_every needs checkpoint='path' (the file to write)")
    if checkpoint_every is not None:
        require_int(checkpoint_every, "checkpoint_every")
    if callback is not None and not callable(callback):
        raise ConfigError(f"callback must be callable, got {type(callback).__name__}")


def _data_digest(data: FederatedData) -> str:
    return checkpoint_io.tree_digest((data.padded, data.mask, np.asarray(data.sizes)))


def _fingerprints(fit: _Fit, fm: FedModel, cohort: int, data_digest: str) -> dict[str, Any]:
    """What a checkpoint must agree on with the fit that resumes it."""
    model = ";".join(f"{n}:{s.role}:{list(s.shape)}" for n, s in sorted(fm.sites.items()))
    with np.printoptions(threshold=sys.maxsize):  # whole arrays, not "..." summaries
        options = repr(
            (
                fit.algorithm,
                fit.num_rounds,
                cohort,
                fit.seed,
                fit.chunk_size,
                fit.faults,
                fit.fault_policy,
                sorted((fit.model_kwargs or {}).items()),
            )
        )
    options = re.sub(r" at 0x[0-9a-fA-F]+", "", options)  # a function's address changes from process to process
    return {"model": model, "data": data_digest, "options": options}


BUILD_CACHE_SIZE = 4
"""How many built runs ``fed_fit`` keeps for later calls with the same model, data and algorithm."""

_BUILDS: collections.OrderedDict[tuple, tuple[FedModel, Any, list]] = collections.OrderedDict()


def clear_cache() -> None:
    """Forget the built runs (and with them their compiled computations) that ``fed_fit`` keeps for reuse."""
    _BUILDS.clear()


def _build(fit: _Fit, data: FederatedData, cohort: int, data_digest: str) -> tuple[FedModel, Any]:
    """The analysed model and the built run of a fit, reused from an earlier call where they are the same.

    A run is a deterministic function of the model function, its keyword arguments, the data, the
    algorithm's options, the number of rounds and the cohort size (not of the seed, the chunk size, the
    faults or the screening policy, which enter only at run time), and it is immutable after ``build``;
    the computations compiled for it stay with it (:func:`fedbayes.engine.run_jit`). So a second call
    with the same arguments, say in a notebook with only the seed or the number of chunks changed,
    compiles nothing again. The model function is matched by identity, as ``jax.jit`` matches
    functions: redefine it (or call :func:`clear_cache`) after changing what it reads from outside.
    Warnings of the analysis and the build are recorded and given again on each reuse. The last
    ``BUILD_CACHE_SIZE`` builds are kept."""
    with np.printoptions(threshold=sys.maxsize):  # whole arrays, not "..." summaries
        try:
            key = (
                fit.model,
                repr(sorted((fit.model_kwargs or {}).items())),
                data_digest,
                repr(fit.algorithm),
                fit.num_rounds,
                cohort,
                bool(cast(Any, jax.config).jax_enable_x64),  # config options are dynamic attributes
                jax.default_backend(),
            )
            hash(key)
        except Exception:
            key = None
    if key is not None and key in _BUILDS:
        _BUILDS.move_to_end(key)
        fm, run, caught = _BUILDS[key]
    else:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fm = FedModel(fit.model, data, fit.model_kwargs)
            run = fit.algorithm.build(Problem(fm, data, fit.num_rounds, cohort))
        if key is not None:
            _BUILDS[key] = (fm, run, caught)
            while len(_BUILDS) > BUILD_CACHE_SIZE:
                _BUILDS.popitem(last=False)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return fm, run


def _spec_bytes(fit: _Fit) -> bytes:
    """The fit specification pickled (model by reference), or b"" when something in it does not pickle."""
    try:
        return pickle.dumps(fit._asdict(), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return b""


def _execute(
    fit: _Fit,
    *,
    devices: Sequence[Any] | None = None,
    precision: str | None = "highest",
    buckets: str | int = "auto",
    **options: Any,
) -> Result:
    """A validated fit, its clients laid over ``devices`` (:func:`fedbayes.engine.sharded_clients`), its
    matrix products traced at ``precision`` (:func:`fedbayes.engine.matmul_precision`), its rounds' clients in
    size ``buckets`` (:func:`fedbayes.engine.bucketed_clients`), and every computation it compiles, the eager
    ones included, lowered with the unrolled hash (:func:`fedbayes.prng.unrolled_hash`)."""
    with sharded_clients(devices), matmul_precision(precision), bucketed_clients(buckets), prng.unrolled_hash():
        return _execute_here(fit, **options)


def _execute_here(
    fit: _Fit, *, progress, checkpoint, checkpoint_every, callback, stall_timeout=STALL_TIMEOUT, resumed: Any = None
) -> Result:
    bar = Progress(fit.num_rounds, getattr(fit.algorithm, "name", type(fit.algorithm).__name__), progress)
    try:
        return _execute_phases(fit, bar, checkpoint, checkpoint_every, callback, stall_timeout, resumed)
    finally:
        bar.close()


def _execute_phases(
    fit: _Fit, bar: Progress, checkpoint, checkpoint_every, callback, stall_timeout, resumed: Any
) -> Result:
    """:func:`_execute_here`'s work, each phase reported on ``bar``."""
    data = fit.data
    cohort = resolve_cohort_size(fit.clients_per_round, data.num_clients)
    bar.phase("analysing the model")
    data_digest = _data_digest(data)
    fm, run = _build(fit, data, cohort, data_digest)
    problem = Problem(fm, data, fit.num_rounds, cohort)
    k_init, k_rounds, k_final = split_key(seed_key(fit.seed), 3)
    bar.phase("compiling and running the set-up exchange")
    carry, setup_bits = wait_ready(staged_init(run, k_init, problem), stall_timeout, f"{run.name}: the set-up exchange")
    plain = {
        "clients_per_round": fit.clients_per_round,
        "chunk_size": fit.chunk_size,
        "faults": None if fit.faults is None else dataclasses.asdict(fit.faults),
        "fault_policy": None if fit.fault_policy is None else dataclasses.asdict(fit.fault_policy),
    }
    meta = {
        "algorithm": run.name,
        "num_rounds": fit.num_rounds,
        "seed": fit.seed,
        "versions": checkpoint_io.versions(),
        "plain": plain,
        "fingerprints": _fingerprints(fit, fm, cohort, data_digest),
        "init_digest": checkpoint_io.tree_digest(carry),
    }
    start, past = 0, []
    if resumed is not None:
        _check_match(resumed, meta)
        carry, start = resumed.restore_carry(carry), resumed.round
        past = [resumed.history] if start else []
    spec = _spec_bytes(fit) if checkpoint is not None else b""
    every = 1 if checkpoint_every is None else checkpoint_every  # default: after every chunk
    last_saved = [start]

    def on_chunk(done: int, state: Any, records: list[dict[str, np.ndarray]]) -> None:
        if checkpoint is not None and done < fit.num_rounds and done - last_saved[0] >= every:
            try:
                checkpoint_io.save(checkpoint, dict(meta, round=done), spec, state, concat_records(past + records))
                last_saved[0] = done
            except CheckpointError as err:  # the fit goes on in memory; the next chunk tries again
                warnings.warn(
                    f"{err}. The fit goes on in memory (round {done} of {fit.num_rounds}) and tries to "
                    "write the checkpoint again after the next chunk",
                    CheckpointWarning,
                    stacklevel=2,
                )
        if callback is not None:
            try:
                callback(done, public_history(records[-1]))
            except Exception as err:
                kept = (
                    f" The checkpoint {os.fspath(checkpoint)!r} holds round {last_saved[0]}; fb.resume continues "
                    "from it."
                    if checkpoint is not None and last_saved[0] > start
                    else ""
                )
                raise CallbackError(
                    f"the callback failed after round {done} of {fit.num_rounds} "
                    f"({type(err).__name__}: {err}); the fit is stopped.{kept} Fix the callback "
                    "(its traceback is above).",
                    round=done,
                ) from err

    try:
        if start < fit.num_rounds:
            carry, history = run_rounds(
                run,
                problem,
                carry,
                base_key=k_rounds,
                cohort_size=cohort,
                start=start,
                chunk_size=fit.chunk_size,
                progress=bar,
                stop_on_divergence=True,
                faults=fit.faults,
                policy=fit.fault_policy,
                on_chunk=on_chunk,
                stall_timeout=stall_timeout,
                prepare=(lambda c: run.finalize_ahead(k_final, c, problem)) if compile_ahead() else None,
            )
            history = concat_records(past + [history])
        else:
            history = past[0]
    except Stopped as err:
        full = concat_records(past + [err.history]) if err.history else concat_records(past)
        stopped = _stopped(err, run, problem, fm, data, fit.seed, k_final, full, setup_bits)
        if isinstance(stopped.result, Result):  # the fit at the last good round, or None
            stopped.result.faults = fault_table(full, k_rounds, data.num_clients, cohort)
        raise stopped from None
    bar.phase("the final exchange")
    parts = finalize_parts(run, k_final, carry, problem, history, setup_bits)
    result = Result(
        model=fm, data=data, run=run, algorithm=run.name, seed=fit.seed, parts=parts, history=public_history(history)
    )
    result.faults = fault_table(history, k_rounds, data.num_clients, cohort)
    bar.phase("the convergence checks")
    result.diagnostics  # noqa: B018 - computed (and kept) before the line ends, warned about after
    bar.finish()
    convergence.report(result)  # res.diagnostics; one fb.ConvergenceWarning per failed check
    return result


def fault_table(history: dict[str, np.ndarray], base_key: jax.Array, num_clients: int, cohort: int):
    """``res.faults``: a DataFrame (round, client, kind) of every client fault in ``history``."""
    import pandas as pd

    events = fault_events(history, base_key, num_clients, cohort)
    return pd.DataFrame(events, columns=["round", "client", "kind"])


def _check_match(ck: checkpoint_io.Checkpoint, meta: dict[str, Any]) -> None:
    """Refuse a checkpoint written by a different fit, version or machine set-up."""
    saved = ck.meta
    if saved.get("versions") != meta["versions"]:
        raise CheckpointError(
            f"checkpoint was written with {saved.get('versions')}, this run has {meta['versions']}; "
            "an exact continuation needs the same library versions, float width and backend"
        )
    for field, what in (("model", "model structure"), ("data", "data"), ("options", "algorithm or fit options")):
        if saved["fingerprints"][field] != meta["fingerprints"][field]:
            raise CheckpointError(
                f"checkpoint does not match this fit: its {what} differ "
                f"(saved {saved['fingerprints'][field][:200]!r}, now {meta['fingerprints'][field][:200]!r})"
            )
    if saved["init_digest"] != meta["init_digest"]:
        raise CheckpointError(
            "checkpoint does not match this fit: the initial state differs (a different model "
            "function body, data or initialisation)"
        )
    if not 0 <= ck.round <= meta["num_rounds"]:
        raise CheckpointError(f"checkpoint round {ck.round} is outside the fit's 0..{meta['num_rounds']}")


@serialized
def resume(
    path: str | os.PathLike,
    *,
    model: Callable | None = None,
    data: FederatedData | Mapping[str, Any] | None = None,
    algorithm: Any = None,
    model_kwargs: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    checkpoint: str | os.PathLike | None | bool = True,
    checkpoint_every: int | None = None,
    callback: Callable[[int, dict[str, np.ndarray]], Any] | None = None,
    stall_timeout: float | None = STALL_TIMEOUT,
    devices: int | Sequence[jax.Device] | None = None,
    matmul_precision: str | None = "highest",
    size_buckets: str | int = "auto",
) -> Result:
    """Continue the fit saved in the checkpoint ``path``; the result equals the uninterrupted fit's, bit
    for bit (same machine, same library versions).

    The checkpoint carries the fit's specification when it pickles (a model function importable by
    name, the data, the algorithm); otherwise pass ``model=`` (and ``data=``, ``algorithm=``,
    ``model_kwargs=``) again. Whatever is passed is checked against the checkpoint's fingerprints, and
    the re-initialised state against the saved digest: a checkpoint of a different fit, or a corrupted
    one, raises :class:`fb.CheckpointError` and is never used. ``checkpoint=True`` keeps writing to
    ``path`` (``False``/None: no more checkpoints, or another path). ``stall_timeout``, ``devices``,
    ``matmul_precision`` and ``size_buckets`` as in ``fed_fit`` (the continuation is exact with the devices,
    precision and size buckets of the interrupted fit).
    """
    ck = checkpoint_io.load(path)
    try:
        spec = ck.unpickle_spec() or {}
    except Exception as err:
        if model is None:
            raise CheckpointError(
                f"the checkpoint's fit specification cannot be loaded here ({type(err).__name__}: "
                f"{err}); pass model=, data=, algorithm= and model_kwargs= to fb.resume"
            ) from None
        spec = {}
    plain = ck.meta["plain"]
    fields = {
        "num_rounds": ck.meta["num_rounds"],
        "seed": ck.meta["seed"],
        "model_kwargs": None,
        "clients_per_round": plain["clients_per_round"],
        "chunk_size": plain["chunk_size"],
        "faults": None if plain["faults"] is None else Faults(**plain["faults"]),
        "fault_policy": None if plain["fault_policy"] is None else FaultPolicy(**plain["fault_policy"]),
    }
    fields.update(spec)
    given = {"model": model, "data": data, "algorithm": algorithm, "model_kwargs": model_kwargs}
    fields.update({name: value for name, value in given.items() if value is not None})
    missing = [n for n in ("model", "data", "algorithm") if n not in fields]
    if missing:
        raise CheckpointError(
            f"the checkpoint does not carry {missing} (they did not pickle when it was written); "
            f"pass them to fb.resume({', '.join(m + '=...' for m in missing)})"
        )
    fit = validate_fit(**fields)
    target = path if checkpoint is True else (None if checkpoint is False else checkpoint)
    _check_run_options(target, checkpoint_every, callback)
    _check_stall_timeout(stall_timeout)
    check_progress(progress)
    check_matmul_precision(matmul_precision)
    check_size_buckets(size_buckets)
    chosen = resolve_devices(devices, fit.data.num_clients)
    return _execute(
        fit,
        precision=matmul_precision,
        buckets=size_buckets,
        progress=progress,
        checkpoint=target,
        checkpoint_every=checkpoint_every,
        callback=callback,
        stall_timeout=stall_timeout,
        resumed=ck,
        devices=chosen,
    )
