"""Crash-safe checkpoints: tensors in safetensors, everything else in a JSON manifest that commits them.

A checkpoint of round r is two files: ``ckpt-<r>-<sha12>.safetensors`` and ``ckpt-<r>.json``. Both are
written to temporary names in the same directory, fsynced and renamed with ``os.replace``; the JSON
comes last and names the tensor file with its sha256, so it is the commit point. Nothing is pickled:
optimizer states go in as flat tensors plus a JSON skeleton (``flatten_state`` / ``unflatten_state``).

Failure behaviour: if saving fails (unwritable directory, disk full, …) the temporary files are
removed, ``CheckpointError`` names the path, and the previous checkpoints are untouched. A crash
mid-save leaves at most stray temporary or unreferenced files (removed by the next save), never a
manifest that points at a half-written tensor file. ``load_latest_checkpoint`` skips, with a warning,
any checkpoint whose manifest is unreadable or whose tensor file is missing or fails its sha256, and
falls back to the next older one. The last save defines the latest checkpoint: it removes any of a
later round (left by an abandoned history). One writer per directory is assumed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_MANIFEST = re.compile(r"^ckpt-(\d+)\.json$")
_TMP_PREFIX = ".ckpt-tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; ``path`` is where."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(f"checkpoint at {path}: {message}")
        self.path = path


@dataclass(frozen=True)
class Checkpoint:
    round: int
    tensors: dict[str, torch.Tensor]  # on CPU
    metadata: dict[str, Any]
    path: Path  # the manifest


# ------------------------------------------------------------------------------------- nested state ↔ flat


def flatten_state(prefix: str, state: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Splits a nested state (dicts, lists, tuples, scalars, tensors) into flat tensors and a JSON skeleton.

    Tensors become ``{"__tensor__": name}`` in the skeleton and ``name`` (``prefix.path.to.it``) in the
    flat dict. Dicts whose keys are not all strings (torch optimizers key their state by int) are kept
    as ``{"__dict__": [[key, value], ...]}`` so that int keys survive JSON.
    """
    tensors: dict[str, torch.Tensor] = {}

    def encode(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[path] = value.detach()
            return {"__tensor__": path}
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: encode(v, f"{path}.{k}") for k, v in value.items()}
            for k in value:
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"{path}: dict key {k!r} is neither str nor int")
            return {"__dict__": [[k, encode(v, f"{path}.{k}")] for k, v in value.items()]}
        if isinstance(value, tuple):
            return {"__tuple__": [encode(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [encode(v, f"{path}.{i}") for i, v in enumerate(value)]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"{path}: cannot store {type(value).__name__} without pickle")

    return tensors, encode(state, prefix)


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of ``flatten_state``."""
    if isinstance(skeleton, list):
        return [unflatten_state(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if set(skeleton) == {"__tensor__"}:
            return tensors[skeleton["__tensor__"]]
        if set(skeleton) == {"__tuple__"}:
            return tuple(unflatten_state(v, tensors) for v in skeleton["__tuple__"])
        if set(skeleton) == {"__dict__"}:
            return {k: unflatten_state(v, tensors) for k, v in skeleton["__dict__"]}
        return {k: unflatten_state(v, tensors) for k, v in skeleton.items()}
    return skeleton


# --------------------------------------------------------------------------------------------------- saving


def peer_snapshot(outer: dict[str, torch.Tensor], inner: Any, residual: torch.Tensor,
                  metadata: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A DiLoCo peer's checkpoint as (tensors, metadata): its outer optimizer's state (θ and momentum: copies
    already), its inner optimizer's state and its error feedback (none when the codec keeps none), both copied to
    the CPU as they change with training; ``metadata`` gains the inner state's skeleton."""
    inner_tensors, inner_skeleton = flatten_state("inner", inner)
    feedback = {"feedback.residual": residual} if residual.numel() else {}
    changing = {name: t.detach().to("cpu", copy=True) for name, t in {**inner_tensors, **feedback}.items()}
    return {**{f"outer.{k}": v for k, v in outer.items()}, **changing}, dict(metadata, inner=inner_skeleton)


@dataclass(frozen=True)
class PeerState:
    """What :func:`peer_snapshot` wrote, read back."""

    outer: dict[str, torch.Tensor]
    inner: Any
    round: int
    residual: torch.Tensor | None  # float32; None when the checkpoint holds no error feedback


def peer_state(tensors: dict[str, torch.Tensor], metadata: dict) -> PeerState:
    residual = tensors.get("feedback.residual")
    return PeerState({k[len("outer."):]: v for k, v in tensors.items() if k.startswith("outer.")},
                     unflatten_state(metadata["inner"], tensors), int(metadata["round"]),
                     None if residual is None else residual.to(torch.float32).clone())


def save_checkpoint(
    directory: str | Path, round: int, tensors: dict[str, torch.Tensor], metadata: dict[str, Any], *, keep: int = 3
) -> Path:
    """Writes round ``round`` atomically and makes it the latest; keeps ``keep`` checkpoints. Returns the manifest."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    directory = Path(directory)
    manifest_path = directory / f"ckpt-{round:08d}.json"
    tmp_paths: list[Path] = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp_tensors = _temp_path(directory, ".safetensors", tmp_paths)
        save_file(_cpu_unshared(tensors), str(tmp_tensors))
        _fsync_file(tmp_tensors)
        digest = _sha256(tmp_tensors)
        tensors_name = f"ckpt-{round:08d}-{digest[:12]}.safetensors"
        manifest = {
            "format": FORMAT_VERSION,
            "round": round,
            "tensors_file": tensors_name,
            "sha256": digest,
            "bytes": tmp_tensors.stat().st_size,
            "metadata": metadata,
        }
        tmp_manifest = _temp_path(directory, ".json", tmp_paths)
        tmp_manifest.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _fsync_file(tmp_manifest)
        os.replace(tmp_tensors, directory / tensors_name)
        _fsync_directory(directory)
        os.replace(tmp_manifest, manifest_path)  # the commit point
        _fsync_directory(directory)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(manifest_path, f"{type(e).__name__}: {e}") from e
    finally:
        for tmp in tmp_paths:  # already renamed away on success
            tmp.unlink(missing_ok=True)
    _prune(directory, keep, round)
    return manifest_path


class BackgroundCheckpoints:
    """Writes checkpoints of one directory on a background thread, one at a time, while training goes on (the write
    was most of a round's bookkeeping: ~80 ms for the tiny preset, seconds for larger ones). A failed write raises its
    CheckpointError from the next :meth:`write` or :meth:`flush`; the checkpoint before it stays the latest."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._pool = ThreadPoolExecutor(1, "checkpoint")
        self._writing: Future[Path] | None = None

    def write(self, round: int, snapshot: Callable[[], tuple[dict[str, torch.Tensor], dict[str, Any]]]) -> None:
        """:func:`save_checkpoint` of ``snapshot()`` — (tensors, metadata), copies the caller no longer changes — in
        the background. The snapshot is taken once the checkpoint before is written: one checkpoint's copies in memory
        at a time (GBs for the 1b preset)."""
        self.flush()
        tensors, metadata = snapshot()
        self._writing = self._pool.submit(save_checkpoint, self.directory, round, tensors, metadata)

    def flush(self) -> None:
        """Wait for the checkpoint being written (if any); raise its CheckpointError if the write failed."""
        if (writing := self._writing) is not None:
            self._writing = None
            writing.result()

    def close(self) -> None:
        self._pool.shutdown()


def _temp_path(directory: Path, suffix: str, registry: list[Path]) -> Path:
    fd, name = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=suffix, dir=directory)
    os.close(fd)
    registry.append(Path(name))
    return Path(name)


def _cpu_unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two entries sharing storage (safetensors refuses tied weights)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        pointer = t.untyped_storage().data_ptr()
        if pointer in seen and t.numel() > 0:
            t = t.clone()
        seen.add(pointer)
        out[name] = t
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_directory(directory: Path) -> None:
    """Makes the renames durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _manifests(directory: Path) -> list[tuple[int, Path]]:
    """Manifests present, newest round first."""
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _MANIFEST.match(p.name))]
    return sorted(found, reverse=True)


def _prune(directory: Path, keep: int, current_round: int) -> None:
    """Leaves the just-saved checkpoint and the ``keep - 1`` before it; removes everything else of ours.

    Removed: older checkpoints, manifests of rounds after ``current_round`` (relics of an abandoned
    history that would otherwise shadow the one just saved), unreadable manifests, tensor files no kept
    manifest names, and stray temporaries. Failures are logged, not raised: the checkpoint is committed.
    """
    try:
        kept: list[str] = []  # tensor files named by the kept manifests
        for round, manifest in _manifests(directory):
            tensors_file = _tensors_file_named_by(manifest)
            if round > current_round or tensors_file is None or len(kept) >= keep:
                manifest.unlink(missing_ok=True)
            else:
                kept.append(tensors_file)
        for path in directory.iterdir():
            stray = path.name.startswith(_TMP_PREFIX)
            tensor_file = path.name.startswith("ckpt-") and path.suffix == ".safetensors"
            if stray or (tensor_file and path.name not in kept):
                path.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("could not prune old checkpoints in %s: %s", directory, e)


def _tensors_file_named_by(manifest: Path) -> str | None:
    try:
        name = json.loads(manifest.read_text())["tensors_file"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) else None


# -------------------------------------------------------------------------------------------------- loading


def load_latest_checkpoint(directory: str | Path) -> Checkpoint | None:
    """The newest checkpoint that verifies, or ``None`` when there is none (or no directory)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    for round, manifest_path in _manifests(directory):
        try:
            return _load(round, manifest_path)
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
            logger.warning("skipping checkpoint %s: %s", manifest_path, e)
    return None


def _load(round: int, manifest_path: Path) -> Checkpoint:
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT_VERSION or manifest.get("round") != round:
        raise ValueError(f"unexpected format/round in manifest: {manifest.get('format')}, {manifest.get('round')}")
    if Path(manifest["tensors_file"]).name != manifest["tensors_file"]:
        raise ValueError(f"tensor file {manifest['tensors_file']!r} is outside the checkpoint directory")
    tensors_path = manifest_path.parent / manifest["tensors_file"]
    digest = _sha256(tensors_path)
    if digest != manifest["sha256"]:
        raise ValueError(f"{tensors_path.name}: sha256 {digest[:12]}… does not match the manifest")
    tensors = load_file(str(tensors_path))
    return Checkpoint(round=round, tensors=tensors, metadata=manifest["metadata"], path=manifest_path)
