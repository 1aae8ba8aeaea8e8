"""Checkpoints of a Flower run: the server's file, and each node's own snapshots of its client state.

A deployment's state is split: the server holds its round state, the broadcast that opens the next round,
the ledger and the history; each client's state (its chains, control variates, copy of the server's
vector) never leaves its node. So a Flower run is resumed from two kinds of file, each written atomically
and sealed by a digest (:func:`fedbayes.checkpoint.write_sealed`):

* the server's checkpoint (``FlowerSpec(checkpoint=path)``), written after the set-up exchange and after
  every round: the round reached, the server's state, the fingerprints of the fit;
* each node's snapshots (node config ``fedbayes-state = "<folder>"``), ``<folder>/<run tag>/client-<i>.r<round>.npz``,
  written after every message that changes the client's state, with the round of that message (-1: the set-up).
  The run tag is new for every run that writes a checkpoint (and kept by the checkpoint), so runs sharing a
  node never mix their snapshots; a finished run's subfolder can be removed.

A resumed run (``FlowerSpec(resume=True)``) repeats the set-up exchange (deterministic: it rebuilds the
states' structure), replaces the server's state with the checkpoint's of round K, and asks every node for
its newest snapshot of a round <= K. Rounds K + 1, ... then run as the uninterrupted run would have run
them, bit for bit. A node keeps its two newest snapshots: the server writes its checkpoint after every
round, so no node can be more than one round ahead of it.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .. import checkpoint as checkpoint_io
from ..errors import CheckpointError

STATE_KEY = "fedbayes-state"
"""The node-config key of a folder where a SuperNode keeps snapshots of its client state, so that a run
can be resumed (``flower-supernode --node-config 'client-id=3 fedbayes-state="/data/state"'``)."""

FORMAT = 1
KEEP = 2  # snapshots a node keeps: enough for a server checkpoint one round behind the node


TAG = re.compile(r"[0-9a-f]{32}")  # a run tag: uuid4().hex, the only name a node takes for a subfolder


def _server_meta(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A Flower checkpoint's verified metadata and entries; another sealed file of fedbayes' (a ``fed_fit``
    checkpoint, a saved result) is refused as what it is not."""
    meta, entries = checkpoint_io.read_sealed(path, FORMAT, "Flower checkpoint")
    if meta.get("kind") != "flower-server":
        raise CheckpointError(
            f"{os.fspath(path)!r} is not a Flower checkpoint (it is another fedbayes file: a fed_fit checkpoint, "
            "which fb.resume reads, or a saved result); give FlowerSpec(checkpoint=) the file its server wrote"
        )
    return meta, entries


def _check_fingerprints(path: str | os.PathLike, meta: dict[str, Any], fingerprints: dict[str, Any]) -> None:
    saved = meta.get("fingerprints", {})
    for name, value in fingerprints.items():
        if saved.get(name) != value:
            raise CheckpointError(
                f"the Flower checkpoint {os.fspath(path)!r} was written by another fit (its {name} differs): "
                "resume it with the same model, data layout, algorithm, num_rounds, clients_per_round and seed"
            )


def run_tag(path: str | os.PathLike, resume: bool, fingerprints: dict[str, Any]) -> str:
    """The tag of a run's snapshots on its nodes (a subfolder of each node's ``fedbayes-state`` folder): a new
    one for a run that writes the checkpoint ``path``; for a run that resumes it, the one ``path`` holds, once
    the checkpoint is known to be this fit's (before any message is sent)."""
    if not resume:
        return uuid.uuid4().hex
    meta, _ = _server_meta(path)
    _check_fingerprints(path, meta, fingerprints)
    return str(meta["extra"]["tag"])


def snapshot_folder(folder: str | os.PathLike, tag: str) -> Path:
    """``folder/tag``, for a tag of the form a server makes (refused otherwise: it names a path on the node)."""
    if not isinstance(tag, str) or TAG.fullmatch(tag) is None:
        raise CheckpointError(f"a run tag must be 32 hexadecimal digits, got {tag!r}: not a fedbayes server's")
    return Path(folder) / tag


def drop_after(folder: str | os.PathLike, index: int, round_: int) -> None:
    """Remove client ``index``'s snapshots of rounds after ``round_``: a resumed run replays those rounds, and
    the stopped run's versions of them must never be taken for its own."""
    for later in (r for r in _snapshot_rounds(folder, index) if r > round_):
        os.remove(_snapshot_path(folder, index, later))


def _snapshot_path(folder: str | os.PathLike, index: int, round_: int) -> Path:
    return Path(folder) / f"client-{index}.r{round_}.npz"


def _snapshot_rounds(folder: str | os.PathLike, index: int) -> list[int]:
    pattern = re.compile(rf"client-{index}\.r(-?\d+)\.npz$")
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(pattern.match, names) if m)


def write_snapshot(
    folder: str | os.PathLike,
    index: int,
    round_: int,
    records: dict[str, list[np.ndarray]],
    upload: bytes | None,
    pending: int,
) -> Path:
    """Write client ``index``'s state after a message of round ``round_`` and drop all but its ``KEEP`` newest
    snapshots. ``records``: the arrays of each state record; ``upload``: its last upload's bytes (kept until
    the server's reply); ``pending``: the round of its pending step, or -1."""
    os.makedirs(folder, exist_ok=True)
    meta = {
        "format": FORMAT,
        "kind": "flower-client",
        "client": index,
        "round": round_,
        "pending": pending,
        "records": {name: len(arrays) for name, arrays in records.items()},
        "upload": upload is not None,
    }
    entries = {"meta": checkpoint_io.meta_entry(meta)}
    for name, arrays in records.items():
        entries.update({f"record/{name}/{i:05d}": np.asarray(a) for i, a in enumerate(arrays)})
    if upload is not None:
        entries["upload"] = np.frombuffer(upload, np.uint8)
    path = _snapshot_path(folder, index, round_)
    checkpoint_io.write_sealed(path, entries, what="client snapshot")
    for old in _snapshot_rounds(folder, index)[:-KEEP]:
        try:
            os.remove(_snapshot_path(folder, index, old))
        except OSError:  # another process's clean-up, or read-only: a stale snapshot only costs disk space
            pass
    return path


def read_snapshot(
    folder: str | os.PathLike, index: int, at_most: int
) -> tuple[int, dict[str, list[np.ndarray]], bytes | None, int]:
    """Client ``index``'s newest snapshot of a round <= ``at_most``: ``(round, records, upload, pending)``.

    Raises
    ------
    CheckpointError
        If there is none (the node kept no snapshots, or only newer ones), or it fails its integrity check.
    """
    rounds = [r for r in _snapshot_rounds(folder, index) if r <= at_most]
    if not rounds:
        raise CheckpointError(
            f"client {index} has no state snapshot of round <= {at_most} in {os.fspath(folder)!r} (it has "
            f"{_snapshot_rounds(folder, index) or 'none'}): the run cannot resume from the server's checkpoint"
        )
    meta, entries = checkpoint_io.read_sealed(_snapshot_path(folder, index, rounds[-1]), FORMAT, "client snapshot")
    if meta.get("kind") != "flower-client" or meta.get("client") != index:
        raise CheckpointError(
            f"{os.fspath(_snapshot_path(folder, index, rounds[-1]))!r} is not client {index}'s snapshot"
        )
    records = {
        name: [entries[f"record/{name}/{i:05d}"] for i in range(count)] for name, count in meta["records"].items()
    }
    upload = entries["upload"].tobytes() if meta["upload"] else None
    return int(meta["round"]), records, upload, int(meta["pending"])


def save_server(
    path: str | os.PathLike,
    round_: int,
    fingerprints: dict[str, Any],
    trees: Any,
    history: dict[str, np.ndarray],
    extra: dict[str, Any],
) -> None:
    """Write the server's checkpoint after round ``round_`` (-1: after the set-up): ``trees`` (its state, the
    broadcast, ...), the ``history`` of the rounds done, and JSON-able ``extra`` fields."""
    leaves = jax.tree_util.tree_leaves(trees)
    meta = {
        "format": FORMAT,
        "kind": "flower-server",
        "round": round_,
        "fingerprints": fingerprints,
        "extra": extra,
        "weak": checkpoint_io.weak_flags(leaves),
    }
    entries = {"meta": checkpoint_io.meta_entry(meta)}
    entries.update({f"tree/{i:05d}": np.asarray(x) for i, x in enumerate(leaves)})
    entries.update({f"history/{k}": np.asarray(v) for k, v in history.items()})
    checkpoint_io.write_sealed(path, entries, what="Flower checkpoint")


def load_server(
    path: str | os.PathLike, fingerprints: dict[str, Any], template: Any
) -> tuple[int, Any, dict[str, np.ndarray], dict[str, Any]]:
    """The server's checkpoint at ``path``: ``(round, trees in template's structure, history, extra)``.

    Raises
    ------
    CheckpointError
        If it is missing, altered, or written by another fit (model, data layout, algorithm, rounds, cohort
        or seed differ: the fingerprint that differs is named; a state of other shapes).
    """
    meta, entries = _server_meta(path)
    _check_fingerprints(path, meta, fingerprints)
    stored = [entries[f"tree/{i:05d}"] for i in range(sum(k.startswith("tree/") for k in entries))]
    history = {k[len("history/") :]: v for k, v in entries.items() if k.startswith("history/")}
    # fed_fit's checkpoints restore a state the same way: its shapes, dtypes and weak types checked and kept
    try:
        trees = checkpoint_io.Checkpoint(meta, b"", stored, history).restore_carry(template)
    except CheckpointError as err:
        raise CheckpointError(
            f"the Flower checkpoint {os.fspath(path)!r} does not hold this run's server state: {err}"
        ) from err
    return int(meta["round"]), trees, history, meta["extra"]
