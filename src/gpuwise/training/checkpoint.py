"""Checkpoints that survive a crash and refuse to run code.

A checkpoint is a folder ``step-000123/`` holding ``model.safetensors`` (weights: tensors only, no code),
``state.pt`` (optimizer, scheduler, scaler, RNG states, data position: read back with
``torch.load(weights_only=True)``, so a pickle that carries code is refused) and ``manifest.json``
(step, the run's fingerprint, each file's size and SHA-256). It is written as a hidden temporary folder,
every file fsync'ed, then renamed into place and the parent fsync'ed: a crash leaves either the old set
or the new one, never half a checkpoint. Loading checks the manifest; a corrupted or truncated
checkpoint is skipped for the one before it, and the reason is reported.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import random
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from gpuwise.errors import DamagedCheckpoint, GpuwiseError, first_line
from gpuwise.files import DISK_FULL, load_json
from gpuwise.training.config import not_a_folder

PREFIX = "step-"
MANIFEST = "manifest.json"


MANIFEST_LIMIT = 64 << 20  # bytes: ours are a few KiB (a name, size and checksum per file, the run's settings)
STEP_LIMIT = 1 << 31  # TrainConfig's --steps bound: a manifest step above it (or not a whole number) is garbage


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed ``manifest.json`` of the checkpoint folder ``path``, or ``DamagedCheckpoint`` saying why not.

    Only a regular file is read: a FIFO planted under the name blocked the read forever, and a device
    (``/dev/zero`` by a symlink) never ends. It is checked before opening, then again on the open descriptor
    (opened non-blocking, so a FIFO swapped in between is not waited on either)."""
    file = path / MANIFEST
    try:
        mode = os.stat(file).st_mode
        if stat.S_ISREG(mode):
            with os.fdopen(os.open(file, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                info = os.fstat(f.fileno())
                mode = info.st_mode
                if stat.S_ISREG(mode) and info.st_size > MANIFEST_LIMIT:
                    raise DamagedCheckpoint(f"{path.name}: {MANIFEST} holds {info.st_size} bytes, not a manifest")
                manifest = load_json(f.read()) if stat.S_ISREG(mode) else None
        if not stat.S_ISREG(mode):
            raise DamagedCheckpoint(f"{path.name}: {MANIFEST} is {_file_kind(mode)}, not a file")
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and load_json's TooDeep are ValueErrors
        raise DamagedCheckpoint(f"{path.name}: no readable manifest ({type(exc).__name__})") from None
    if not isinstance(manifest, dict):
        raise DamagedCheckpoint(f"{path.name}: no readable manifest (a JSON {type(manifest).__name__})")
    return manifest


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def step_of(path: Path, manifest: dict[str, Any]) -> int:
    """The manifest's step, a whole number in 0..STEP_LIMIT; else ``DamagedCheckpoint`` naming the value
    (``"step": Infinity`` is valid JSON to Python, and ``int(inf)`` raised OverflowError: exit 3)."""
    step = manifest.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= STEP_LIMIT:
        shown = json.dumps(step) if isinstance(step, (int, float, str, type(None))) else type(step).__name__
        raise DamagedCheckpoint(f"{path.name}: the manifest's step is {shown[:40]}, not a step number")
    return step


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    fingerprint: str


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _split_shared(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors stores each storage once: tied weights (GPT-2's embedding and head) become aliases."""
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple, tuple], str] = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if key in seen and t.numel():
            aliases[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = t.detach().contiguous().cpu()
    return unique, aliases


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and CUDA generators, in types ``weights_only`` loading accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.copy()), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(tuple(v if not isinstance(v, list) else tuple(v) for v in state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rank_seed(seed: int, rank: int) -> int:
    """The seed of process ``rank``'s randomness (dropout) after the weights are made: one stream per process,
    so the ranks do not draw the same masks (rank 0 keeps ``seed``)."""
    return seed + 1_000_003 * rank if rank else seed


def gather_rng(device: torch.device, world_size: int) -> dict[str, list[torch.Tensor]]:
    """Every process's torch generator states (CPU, and this GPU's), gathered as uint8 tensors: under torchrun
    each process draws its own dropout masks, and an exact resume needs each one's stream."""
    mine = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        mine["cuda"] = torch.cuda.get_rng_state(device)
    out = {}
    for key, state in mine.items():
        state = state.to(device)  # NCCL gathers GPU tensors
        parts = [torch.empty_like(state) for _ in range(world_size)]
        torch.distributed.all_gather(parts, state)
        out[key] = [t.cpu() for t in parts]
    return out


def set_rank_rng(streams: dict[str, list[torch.Tensor]], *, rank: int, world_size: int, device: torch.device,
                 seed: int) -> None:
    """This process's stream from ``gather_rng``'s ``streams``; saved by another number of processes (or not at
    all), a fresh stream per process from ``seed``."""
    if len(streams.get("torch", ())) == world_size:
        torch.set_rng_state(streams["torch"][rank])
        if "cuda" in streams and device.type == "cuda":
            torch.cuda.set_rng_state(streams["cuda"][rank], device)
    else:
        torch.manual_seed(rank_seed(seed, rank))


def save(folder: str | os.PathLike, step: int, *, model_state: dict[str, torch.Tensor], state: dict[str, Any],
         fingerprint: str, keep: int = 3, identity: dict[str, Any] | None = None,
         run: dict[str, Any] | None = None) -> Checkpoint:
    """Write checkpoint ``step`` into ``folder`` atomically, then keep only the newest ``keep``. ``identity``
    (what the fingerprint hashes) is kept in the manifest so a mismatch can be named; ``run`` (the settings the
    run was started with) so a resume need not repeat them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{PREFIX}{step:09d}.", dir=folder))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; give the folder the permissions mkdir would
    try:
        tensors, aliases = _split_shared(model_state)
        save_file(tensors, str(tmp / "model.safetensors"))
        torch.save(state, tmp / "state.pt")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit(folder, step, tmp, fingerprint=fingerprint, keep=keep,
                  extra={"aliases": aliases, "identity": identity, "run": run})


def commit(folder: Path, step: int, tmp: Path, *, fingerprint: str, keep: int, extra: dict[str, Any]) -> Checkpoint:
    """Seal the files written into the hidden folder ``tmp``: a manifest of every file (size, SHA-256), fsync,
    rename into place, fsync the parent; then prune to the newest ``keep`` and clear what killed runs left."""
    final = folder / f"{PREFIX}{step:09d}"
    try:
        names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in names}
        manifest = {"step": step, "fingerprint": fingerprint, **extra, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        for name in (*files, MANIFEST):
            _fsync(tmp / name)
        for sub in {(tmp / name).parent for name in files}:
            _fsync(sub)
        if final.exists():  # a checkpoint of this step from an earlier run: replace it
            trash = folder / f".trash-{final.name}"
            os.replace(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, final)
        _fsync(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # the newest ``keep`` by the step their manifests hold, not by name: a renamed folder or junk named step-*
    # neither counts toward those kept nor pushes a real checkpoint out; what has no readable manifest stays
    ordered = [path for _, path in sorted(((s, p) for p in steps_in(folder) if p != final
                                           for s in [manifest_step(p)] if s is not None), reverse=True)]
    for old in ordered[max(keep - 1, 0):] if keep > 0 else []:
        trash = folder / f".trash-{old.name}"
        os.replace(old, trash)  # out of sight first: a kill during the delete leaves no half checkpoint
        shutil.rmtree(trash, ignore_errors=True)
    for leftover in (*folder.glob(f".{PREFIX}*"), *folder.glob(".trash-*")):  # left by processes killed earlier
        shutil.rmtree(leftover, ignore_errors=True)
    return Checkpoint(path=final, step=step, fingerprint=fingerprint)


def _verify(path: Path) -> Checkpoint:
    """The checkpoint in ``path`` if its manifest lists every file with the right size and checksum."""
    manifest = read_manifest(path)
    step = step_of(path, manifest)
    try:
        files = {str(name): (int(meta["bytes"]), str(meta["sha256"])) for name, meta in manifest["files"].items()}
        fingerprint = str(manifest["fingerprint"])
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as exc:  # "bytes": Infinity overflows
        raise DamagedCheckpoint(f"{path.name}: no readable manifest ({type(exc).__name__})") from None
    needed = ("state.pt", "dcp/.metadata") if manifest.get("format") == "dcp" else ("state.pt", "model.safetensors")
    for name in needed:
        if name not in files:
            raise DamagedCheckpoint(f"{path.name}: the manifest does not list {name}")
    for name, (size, digest) in files.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            raise DamagedCheckpoint(f"{path.name}/{name} is missing or truncated")
        if _sha256(f) != digest:
            raise DamagedCheckpoint(f"{path.name}/{name} does not match its checksum")
    return Checkpoint(path=path, step=step, fingerprint=fingerprint)


def check_writable(folder: Path) -> None:
    """Fail before training, not after it, when checkpoints could not be written."""
    not_a_folder(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=".probe-", dir=folder))
        probe.rmdir()
    except OSError as exc:
        raise GpuwiseError(f"cannot write checkpoints to {folder}: {exc.strerror or exc}",
                           "pick a folder you can write to") from None


def steps_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob(f"{PREFIX}*") if p.is_dir()) if folder.is_dir() else []


def manifest_step(path: Path) -> int | None:
    """The step ``path``'s manifest holds (no checksums read), None without a readable manifest or step."""
    try:
        return step_of(path, read_manifest(path))
    except DamagedCheckpoint:
        return None


def candidates(folder: str | os.PathLike) -> tuple[list[Checkpoint], list[str]]:
    """Every checkpoint in ``folder`` that verifies, newest first by the step in its manifest (a folder renamed
    ``step-000000999`` stays the step it is), and why the others were skipped."""
    good: list[Checkpoint] = []
    skipped: list[str] = []
    for path in reversed(steps_in(Path(folder))):
        try:
            good.append(_verify(path))
        except DamagedCheckpoint as exc:
            skipped.append(str(exc))
    # a name that matches the manifest's step first among equal steps: that is the one this run wrote
    good.sort(key=lambda c: (c.step, c.path.name == f"{PREFIX}{c.step:09d}", c.path.name), reverse=True)
    return good, skipped


def latest(folder: str | os.PathLike) -> tuple[Checkpoint | None, list[str]]:
    """The newest checkpoint that verifies, and why the others that were passed over were skipped."""
    good, skipped = candidates(folder)
    return (good[0] if good else None), skipped


def saved_run(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The settings the newest readable checkpoint's run was started with (``run`` in its manifest), or None."""
    readable = []  # (step, manifest), each manifest read once
    for path in steps_in(Path(folder)):
        try:
            manifest = read_manifest(path)
            # one with no step is passed over by the resume too: its settings are not used
            readable.append((step_of(path, manifest), manifest))
        except DamagedCheckpoint:
            continue
    for _, manifest in sorted(readable, key=lambda r: r[0], reverse=True):
        run = manifest.get("run")
        if isinstance(run, dict):
            return run
    return None


def dead_end(folder: Path) -> str:
    """The way out when every checkpoint in ``folder`` is damaged: keep them aside, start afresh."""
    return (f"move them aside and start afresh: mv {folder} {folder}.damaged, then run without --resume; "
            "or keep them and pass another --checkpoint-dir")


def fingerprint_of(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def check_identity(ckpt: Checkpoint, identity: dict[str, Any]) -> None:
    """Refuse a checkpoint of another model or run, naming the first difference."""
    if ckpt.fingerprint == fingerprint_of(identity):
        return
    saved = _manifest(ckpt).get("identity") or {}
    hint = "point --checkpoint-dir at this run's folder, or start afresh without --resume"
    mine, theirs = identity.get("model", {}), saved.get("model", {})
    for name in mine:
        if name not in theirs:
            raise GpuwiseError(f"{ckpt.path.name} is from another model: it has no parameter {name!r}", hint)
        if theirs[name] != mine[name]:
            raise GpuwiseError(f"{ckpt.path.name} is from another model: {name} is {theirs[name]} there, "
                               f"{mine[name]} here", hint)
    extra = [n for n in theirs if n not in mine]
    if extra:
        raise GpuwiseError(f"{ckpt.path.name} is from another model: it has parameter {extra[0]!r} that this "
                           "model lacks", hint)
    for key in sorted(set(identity) | set(saved)):
        if key != "model" and identity.get(key) != saved.get(key):
            raise GpuwiseError(f"{ckpt.path.name} was written with {key} {saved.get(key)}, this run has "
                               f"{identity.get(key)}", f"resume with the same --{key.replace('_', '-')}, or {hint}")
    raise GpuwiseError(f"{ckpt.path.name} was written by another model or config", hint)


def load(ckpt: Checkpoint, *, fingerprint: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Weights and state of a verified checkpoint; refuses another run's checkpoint and pickled code."""
    if fingerprint is not None and ckpt.fingerprint != fingerprint:
        raise GpuwiseError(f"{ckpt.path} was written by another model or config ({ckpt.fingerprint[:12]} here "
                           f"{fingerprint[:12]})", "point --checkpoint-dir at this run's folder, or start afresh")
    manifest = _manifest(ckpt)
    if manifest.get("format") == "dcp":
        raise GpuwiseError(f"{ckpt.path} holds sharded weights (written under --sharding fsdp)",
                           "resume it with torchrun and --sharding fsdp")
    try:
        weights = load_file(str(ckpt.path / "model.safetensors"))
    except Exception as exc:  # safetensors parses a header and raw tensors only: anything else is refused
        raise GpuwiseError(f"{ckpt.path}/model.safetensors is refused: not a safetensors file ({exc})",
                           "gpuwise loads only checkpoints it wrote; start afresh") from None
    for alias, name in manifest.get("aliases", {}).items():
        weights[alias] = weights[name]
    return weights, load_state(ckpt)


def load_state(ckpt: Checkpoint) -> dict[str, Any]:
    """``state.pt`` with ``weights_only``: plain data only, a pickle with code in it is refused."""
    try:
        return torch.load(ckpt.path / "state.pt", weights_only=True, map_location="cpu")
    except Exception as exc:  # the restricted unpickler met something that is not plain data
        raise GpuwiseError(f"{ckpt.path}/state.pt is refused: it is not plain data ({type(exc).__name__})",
                           "gpuwise loads only checkpoints without pickled code; write a new one") from None


def is_sharded(ckpt: Checkpoint) -> bool:
    return _manifest(ckpt).get("format") == "dcp"


def _manifest(ckpt: Checkpoint) -> dict[str, Any]:
    """The manifest of a checkpoint that verified; replaced since (another process), a one-line error."""
    try:
        return read_manifest(ckpt.path)
    except DamagedCheckpoint as exc:
        raise GpuwiseError(f"{exc} (it changed after it was verified)", "run again; if it persists, "
                           "start afresh with another --checkpoint-dir") from None


def identity(model: torch.nn.Module, config: Any, world_size: int = 1) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: parameter names, shapes and dtypes, and the run's batch,
    precision, learning rate, seed and layout (sharded or whole). The micro-batch and the number of
    processes may change (the steps are the same); so may ``steps``, which stretches the schedule."""
    return {"model": {name: [list(p.shape), str(p.dtype).removeprefix("torch.")]
                      for name, p in model.state_dict().items()},
            "batch": config.batch, "precision": config.precision, "lr": config.lr, "seed": config.seed,
            "sharding": "fsdp" if config.sharding == "fsdp" and world_size > 1 else "none"}


class CheckpointNotWritten(GpuwiseError):
    """A checkpoint that could not be written (a full disk, a folder gone): the ones before it are intact."""


# How each writer reports a failed write, measured with a 1 MiB `ulimit -f` (EFBIG) and full filesystems (ENOSPC):
# an OSError from our own files; safetensors' SafetensorError "Error while serializing: I/O error: File too large
# (os error 27)"; torch.save's RuntimeError "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
# with the context RuntimeError "basic_ios::clear: iostream error".
_WRITE_FAILED = ("i/o error", "os error", "inline_container", "iostream error", "file write failed", "unexpected pos",
                 "no space left", "file too large", "disk quota")


def write_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a write that the disk refused, whatever library wrote."""
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, OSError):
            return True
        if type(exc).__name__ in ("SafetensorError", "RuntimeError") and any(
                k in str(exc).lower() for k in _WRITE_FAILED):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in DISK_FULL:
        return True
    text = f"{exc} {exc.__context__ or ''}".lower()
    return any(k in text for k in ("no space left", "file too large", "os error 28", "os error 27", "disk quota",
                                   "inline_container", "iostream error"))


class Checkpointer:
    """A run's checkpoints, whole or sharded behind one interface: ``save(step, ...)`` and ``resume(...)``.

    Whole (one process, or DDP, where every process holds the same state): rank 0 writes the module's weights
    as safetensors and the rest in ``state.pt``. Sharded (FSDP2): every process writes its shards with
    ``torch.distributed.checkpoint`` into one hidden folder, then rank 0 adds ``state.pt`` and seals it.

    >>> # ck = Checkpointer("runs/a", identity=identity(model, config)); ck.save(10, model, optimizer, state)
    """

    def __init__(self, folder: str | os.PathLike, *, identity: dict[str, Any], ranks: Any = None,
                 sharded: bool = False, keep: int = 3, run: dict[str, Any] | None = None) -> None:
        from gpuwise.training.distributed import Ranks

        self.folder = Path(folder)
        check_writable(self.folder)
        self.identity, self.fingerprint = identity, fingerprint_of(identity)
        self.ranks, self.sharded, self.keep, self.run = ranks or Ranks(), sharded, keep, run
        self._lock: int | None = None

    def lock(self) -> None:
        """Hold ``.lock`` in the folder for the run (rank 0): a second trainer on the same folder is refused
        instead of pruning the first one's checkpoints. The kernel drops the lock when the process dies."""
        if not self.ranks.main or self._lock is not None:
            return
        path = self.folder / ".lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise GpuwiseError(f"cannot lock {path}: {exc.strerror or exc}", "pick a folder you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise GpuwiseError(f"cannot lock {path}: {exc.strerror or exc}",
                                   "pick a folder on a file system with locks") from None
            raise GpuwiseError(f"another gpuwise train is using {self.folder} ({path} is locked)",
                               "wait for it to finish, or pass another --checkpoint-dir") from None
        self._lock = fd

    def unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor releases the flock
            self._lock = None

    def _barrier(self) -> None:
        if self.ranks.world_size > 1:
            torch.distributed.barrier()

    def check_fresh(self) -> None:
        """Refuse to start a new run over another run's checkpoints (naming the way out when all are damaged)."""
        existing = steps_in(self.folder)
        if not existing:
            return
        good, skipped = candidates(self.folder)
        if not good:
            raise GpuwiseError(f"{self.folder} holds {len(existing)} damaged checkpoint(s) and no usable one "
                               f"({skipped[0]})", dead_end(self.folder))
        raise GpuwiseError(f"{self.folder} holds checkpoints of a run already (newest {good[0].path.name})",
                           "pass --resume to continue it, or another --checkpoint-dir")

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
             ) -> None:
        """Checkpoint ``step``: the (unwrapped) model, the optimizer and ``state`` (plain data and tensors).
        A write that fails (a full disk) leaves the checkpoints before it as they were."""
        try:
            if self.sharded:
                self._save_sharded(step, model, optimizer, state)
            elif self.ranks.main:  # one writer: under DDP every process holds the same weights and optimizer state
                save(self.folder, step, model_state=model.state_dict(),
                     state={**state, "optimizer": optimizer.state_dict()}, fingerprint=self.fingerprint,
                     keep=self.keep, identity=self.identity, run=self.run)
        except Exception as exc:
            if not write_failed(exc):
                raise
            shutil.rmtree(self.folder / f".{PREFIX}{step:09d}.sharded", ignore_errors=True)
            good, _ = candidates(self.folder)
            kept = (f"; the last good checkpoint is step {good[0].step} ({good[0].path.name}), intact" if good else
                    "; no earlier checkpoint")
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc)
            full = "disk full" if _disk_full(exc) else "write failed"
            raise CheckpointNotWritten(f"{full} at checkpoint {PREFIX}{step:09d} in {self.folder} ({why}){kept}",
                                       "free space there (df -h), or pass another --checkpoint-dir and --resume "
                                       "from a copy") from None
        self._barrier()

    def _save_sharded(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        tmp = self.folder / f".{PREFIX}{step:09d}.sharded"
        if self.ranks.main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp / "dcp"))
        self._barrier()
        if self.ranks.main:
            torch.save(state, tmp / "state.pt")
            commit(self.folder, step, tmp, fingerprint=self.fingerprint, keep=self.keep,
                   extra={"format": "dcp", "identity": self.identity, "run": self.run})

    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, steps: int,
               needs: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[str]]:
        """Load the newest good checkpoint into ``model`` and ``optimizer``, checked to be this run's and short of
        ``steps``; returns the rest of its state and the newer, damaged checkpoints that were passed over."""
        good, skipped = candidates(self.folder)
        if not good:
            if not skipped:
                raise GpuwiseError(f"no checkpoint in {self.folder} to resume from",
                                   "start without --resume, or point --checkpoint-dir at the run's folder")
            raise GpuwiseError(f"no usable checkpoint in {self.folder} ({'; '.join(skipped)})", dead_end(self.folder))
        found = good[0]
        check_identity(found, self.identity)
        if found.step >= steps:
            raise GpuwiseError(f"{found.path.name} is at step {found.step} already, --steps is {steps}",
                               f"pass --steps above {found.step} to train on")
        if is_sharded(found) != self.sharded:
            raise GpuwiseError(f"{found.path.name} is {'sharded' if is_sharded(found) else 'whole'}, this run "
                               f"is {'sharded' if self.sharded else 'not'}",
                               "resume with the same --sharding and torchrun")
        if self.sharded:
            return self._load_sharded(found, model, optimizer), skipped
        for i, found in enumerate(good):  # one that passes its checksums but does not load: the one before it
            try:
                check_identity(found, self.identity)
                weights, state = load(found)
                model.load_state_dict(weights)
                optimizer.load_state_dict(state.pop("optimizer"))
                for key in needs:
                    if key not in state:
                        raise GpuwiseError(f"{found.path.name}/state.pt has no {key}")
                return state, skipped
            except (GpuwiseError, RuntimeError, ValueError, KeyError, TypeError) as exc:
                if i == len(good) - 1:
                    why = exc.message if isinstance(exc, GpuwiseError) else first_line(exc)
                    raise GpuwiseError(f"no checkpoint in {self.folder} loads (the oldest: {why})",
                                       dead_end(self.folder)) from None
                skipped.append(f"{found.path.name} does not load "
                               f"({exc.message if isinstance(exc, GpuwiseError) else first_line(exc)})")
        raise AssertionError("unreachable")

    def _load_sharded(self, found: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer
                      ) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        shards = {"model": model_state, "optimizer": optim_state}
        try:
            dcp.load(shards, checkpoint_id=str(found.path / "dcp"))
        except BaseException as exc:  # CheckpointException derives from BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise GpuwiseError(f"{found.path.name}: the sharded weights do not load ({type(exc).__name__})",
                               "resume with the processes that wrote it") from None
        set_state_dict(model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"])
        return load_state(found)
