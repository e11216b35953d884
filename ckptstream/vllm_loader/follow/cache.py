"""The local cache of decoded versions that the followers of a stream on one host share: the only module
that creates or deletes names in it.

Layout::

    <root>/<stream id>/000000000007/               a complete version (it holds its marker file)
    <root>/<stream id>/.incoming-000000000008/     a version being written (renamed into place when complete)
    <root>/<stream id>/.locks/000000000007         its use lock: shared by every follower using the version
    <root>/<stream id>/.locks/000000000007.prepare its prepare lock: exclusive while it is being written
    <root>/<stream id>/.locks/000000000007.served  its served lock: shared by the vLLM workers serving it
    <root>/<stream id>/.locks/000000000007.staged  its staged lock: shared by the workers staging a change to it
    <root>/<stream id>/.changes/000000000006-000000000007.safetensors  a change applied in place (``change.py``)
    <root>/<stream id>/.requests/000000000007      a request: have version 7 complete here (``requested``)

Its users ask for intentions, not steps: ``acquire`` (a proven copy of version V, held for me: reused, or
decoded from the newest cached version of its chain), ``acquire_cached`` (the same, only if already here),
``prune`` (keep only these), ``change`` (the change file between two versions, built once), ``close``.

A version's path depends only on the root, the stream and the version, so every follower of the stream
on the host (and every node of a multi-node engine, for the same root) finds it at the same place, and it
is decoded once: the preparer holds the version's prepare lock exclusively while it writes; the others
wait on that lock, then find the version complete and reuse it.

A follower holds the use lock (shared) of every version it uses: the one it serves, the one it prepares
and the base it applies a delta to; it takes it *before* looking at the directory, so what it found
complete stays so. A pruner deletes a version only after taking that lock exclusively without waiting:
never one that another live follower uses. Every lock is a ``flock``, dropped by the kernel when its
process dies (SIGKILL included): a killed follower blocks nobody, and the ``.incoming-*`` directory a
killed preparer left is removed by the next preparer of that version (or by a pruner).

The vLLM workers of an engine spanning nodes hold the served lock (shared) of the version they serve, each on
its own node (``hold_served``, called through the worker extension: ``worker.WorkerExtension``), so that no
pruner of the node deletes it, and so that the node agent learns from its own cache what its engine serves
(``VersionCache.served``), with no replica record (a read-only stream has none): the version a failed reload
restores on every rank is still there. They hold it by version number (``hold_served_version``): after an
update applied in place, vLLM's model path still names the version it last reloaded.

With ``copies=False`` (``--cache-versions 0``) a node keeps no whole version once its engine loaded it: the
served version's directory is deleted (``drop_copies``), its served lock stays (what the engine serves stays
known), and a version the engine must reload (a fallback, a restart) is decoded on demand: the head asks every
rank for it (``worker.WorkerExtension``), which leaves a request file in its node's cache that the node's
agent reads (``requested``), until the workers hold the version they serve after the load (``hold_served_version``).

A version is written by the reader (``Stream.write_into``) into the ``.incoming-*`` directory this module
made, with a proof file (``.proof.json``: the manifest hash and each file's size, modification time and
inode), then renamed into place here. A complete directory is reused once proven against its manifest
(``proven``): its marker names the stream, version and manifest hash, and its files are those its preparer
wrote (a stat each), or, where the proof is missing or stale, every tensor's hash is checked (then the proof
is written again). A directory that fails is decoded again, never handed to vLLM.

The root is private to its user (created 0700; one owned by another user, or that others may write to, is
refused): no other user can plant a version that followers would reuse.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Callable, NamedTuple

from ...errors import CkptStreamError
from ...format import MARKER_FILE, parse_version_name, version_name
from ...locks import LOCK_FILE, lock_file, try_lock, unlock
from ...reader import Stream

log = logging.getLogger("ckptstream.follow")

INCOMING_PREFIX = ".incoming-"
"""A version being written; what a killed preparer leaves, removed by the next one (or a pruner)."""
LOCKS_DIR = ".locks"
"""The versions' lock files (kept apart so that a version's directory appears and goes in one rename)."""
PREPARE_SUFFIX = ".prepare"
"""A version's prepare lock file: its use lock file's name with this suffix."""
SERVED_SUFFIX = ".served"
"""A version's served lock file (held by the vLLM workers that serve it): its use lock file's name with this
suffix."""
STAGED_SUFFIX = ".staged"
"""A version's staged lock file (held by the vLLM workers staging the change to it: ``hold_staged``)."""
CHANGES_DIR = ".changes"
"""The changes between cached versions applied in place (``<base>-<version>.safetensors``, ``change.py``)."""
REQUESTS_DIR = ".requests"
"""Versions a node must have complete (``requested``): one empty file per version, named by it."""


class Prepared(NamedTuple):
    """A version ready in the cache: its directory, and whether this call decoded it (False: reused)."""

    path: Path
    decoded: bool


class Acquired(NamedTuple):
    """A version held in the cache for its caller (``VersionCache.acquire``): its directory, the version its delta
    was applied to (the version itself when the copy was reused, None for a decode from storage alone), the bytes
    read from the stream's storage meanwhile (``Stream.bytes_read``: measured, not the manifests' sizes), and
    whether this call decoded it."""

    path: Path
    base: int | None
    fetched: int
    decoded: bool


PROOF_FILE = ".proof.json"
"""In a cached version's directory: what its preparer wrote (see the module docstring)."""


def default_cache_dir(expected_bytes: int = 0) -> Path:
    """/dev/shm/ckptstream-<uid> when it has room for three copies of the model, else
    ~/.cache/ckptstream/follow (private to the user either way: see ``private_root``)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 3 * expected_bytes + (256 << 20):
        return shm / f"ckptstream-{os.getuid()}"
    return Path.home() / ".cache" / "ckptstream" / "follow"


def private_root(root: str | os.PathLike[str]) -> Path:
    """``root`` as an absolute path, created 0700 if missing; CkptStreamError if it is not a directory of
    this user's that nobody else may write to (another user could plant versions there)."""
    path = Path(root).expanduser().absolute()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    status = path.lstat()
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid() or status.st_mode & 0o022:
        raise CkptStreamError(f"the cache root {path} must be a directory of this user's that no other user may "
                              f"write to (it is {stat.filemode(status.st_mode)}, owner uid {status.st_uid})",
                              hint="Remove it, or pass --cache-dir a directory of your own (mode 0700)")
    return path


def safe_owner(name: str) -> str:
    """``name`` reduced to a plain directory name (letters, digits, ``.``, ``_``, ``-``)."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in name).lstrip(".-")
    return cleaned or "follower"


class VersionCache:
    """One follower's view of the decoded versions of one stream on this host, shared with the other
    followers of that stream; the versions it holds are its own until it releases them or ``close()``.

    Args:
        root: the cache root shared by followers (``--cache-dir``).
        stream_id: the stream's identity (versions of different streams never mix).
        owner: the follower's name (its replica id), for logs.
        ephemeral: on ``close()``, delete the versions it held that no other follower holds (replays:
            nobody reuses them later).
    """

    def __init__(self, root: str | os.PathLike[str], stream_id: str, owner: str = "follower", *,
                 ephemeral: bool = False):
        self.stream_dir = private_root(root) / stream_id
        self._locks = self.stream_dir / LOCKS_DIR
        self._locks.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.owner = safe_owner(owner)
        self.ephemeral = ephemeral
        self._holds: dict[int, int] = {}  # version -> descriptor of its use lock, held shared
        self._open = True
        self._remove_old_layout()

    def path(self, version: int) -> Path:
        """Where ``version`` is (or would be) materialized: the same for every follower of the root."""
        return self.stream_dir / version_name(version)

    def change(self, base: int, version: int, build: Callable[[Path], None]) -> Path | None:
        """The file of the change from ``base`` to ``version`` (``change.py``), built once per host by
        ``build(path)`` into a temporary name renamed into place (None where it wrote nothing); deleted with
        either version."""
        path = self.change_path(base, version)
        if not path.is_file():
            incoming = self.stream_dir / f"{INCOMING_PREFIX}{os.getpid()}-{threading.get_ident()}-{path.name}"
            try:
                build(incoming)
                if not incoming.is_file():
                    return None
                path.parent.mkdir(exist_ok=True)
                os.replace(incoming, path)
            finally:
                incoming.unlink(missing_ok=True)
        return path

    def proven(self, stream: Stream, version: int) -> bool:
        """Whether the complete directory of ``version`` is what its manifest describes (see the module
        docstring): cheaply where its proof holds, else by every tensor's hash (the proof then written).
        Hold it first."""
        directory = self.path(version)
        manifest_hash = stream.manifest(version).manifest_hash
        try:
            marker = json.loads((directory / MARKER_FILE).read_bytes())
            if (marker.get("stream_id"), marker.get("version"), marker.get("manifest_hash")) != (
                    stream.info().stream_id, version, manifest_hash):
                log.warning("%s is not version %d of this stream as committed (its marker differs)", directory,
                            version)
                return False
            proof = json.loads((directory / PROOF_FILE).read_bytes())
            if proof == {"manifest_hash": manifest_hash, "files": _file_stats(directory)}:
                return True
        except (OSError, ValueError, AttributeError):
            pass  # no proof, or an unreadable one: check the tensors
        try:
            stream.check_materialized(directory, version)
        except CkptStreamError as exc:
            log.warning("the cached copy of version %d is not the committed version (%s); decoding it again",
                        version, exc)
            return False
        _write_proof(directory, manifest_hash)
        return True

    def acquire(self, stream: Stream, version: int, *, keep: set[int], holder: str) -> Acquired:
        """A proven copy of ``version``, held for this caller until ``prune`` or ``close``: reused when complete
        and proven (another follower's decode, or an earlier one: ``proven``), else decoded here by applying its
        delta to the newest cached and proven version of its chain (waiting instead if another follower is
        decoding it). Every other version but those in ``keep`` (which the caller still uses) is released and
        pruned. ``holder`` names the stream lease held while decoding. Used by the follower, the node agent, the
        adapter follower and replay, and the weight-transfer engine.

        Raises:
            CkptStreamError: the version cannot be decoded (nothing of it is left held).
        """
        read_before = stream.bytes_read()
        if self.hold(version) and self.proven(stream, version):
            return Acquired(self.path(version), version, stream.bytes_read() - read_before, False)
        chain_versions = {m.version for m in stream.chain(version)}
        base = next((v for v in reversed(self.versions())
                     if v in chain_versions and v != version and self._hold_base(stream, v)), None)
        self.prune(keep | {v for v in (base, version) if v is not None})
        try:
            path, decoded = self.materialize(stream, version, base, holder=holder)
        except BaseException:
            self.release(version)  # refused: a pruner may delete what is left of it
            raise
        finally:
            if base is not None and base not in keep:
                self.release(base)
        if not decoded:  # another follower decoded it while this one waited
            base = version
        return Acquired(path, base, stream.bytes_read() - read_before, decoded)

    def acquire_cached(self, stream: Stream, version: int) -> Path | None:
        """``version``'s directory, held, if a complete and proven copy is cached; else None (nothing held)."""
        held = version in self._holds
        if self.hold(version) and self.proven(stream, version):
            return self.path(version)
        if not held:
            self.release(version)
        return None

    def versions(self) -> list[int]:
        """Complete cached versions (a materialized directory has its marker; partial ones have none).
        One that is not held may be deleted at any moment: ``hold`` it before using it."""
        return sorted(v for v in (parse_version_name(c.name) for c in self.stream_dir.iterdir())
                      if v is not None and self._complete(v))

    def held(self) -> set[int]:
        """The versions this follower holds."""
        return set(self._holds)

    def served(self) -> set[int]:
        """The versions that vLLM workers of this host serve (they hold their served lock: ``hold_served``,
        ``hold_served_version``), complete in the cache or not (``drop_copies``); no pruner deletes them."""
        return self._locked(SERVED_SUFFIX)

    def staged(self) -> set[int]:
        """The versions that vLLM workers of this host stage a change to (``hold_staged``): the head applies one
        of them next (no pruner is kept from deleting them: a node's agent keeps them)."""
        return self._locked(STAGED_SUFFIX)

    def _locked(self, suffix: str) -> set[int]:
        found = set()
        for path in self._locks.glob(f"*{suffix}"):
            version = parse_version_name(path.name.removesuffix(suffix))
            if version is None:
                continue
            fd = try_lock(path, create=False)
            if fd is None:
                if path.exists():  # held (not removed meanwhile, with the version)
                    found.add(version)
            else:
                unlock(fd)
        return found

    def hold(self, version: int) -> bool:
        """Hold ``version`` (shared: no pruner deletes it until it is released), whether or not it is
        complete yet; returns whether it is complete. Waits only while a pruner is deleting it."""
        if version not in self._holds:
            fd = lock_file(self._lock_path(version), shared=True)
            assert fd is not None  # a waiting lock is always granted
            self._holds[version] = fd
        return self._complete(version)

    def release(self, version: int) -> None:
        """Stop holding ``version`` (a pruner may delete it once nobody holds it)."""
        fd = self._holds.pop(version, None)
        if fd is not None:
            unlock(fd)

    def materialize(self, stream: Stream, version: int, base: int | None, *, holder: str = "follower") -> Prepared:
        """``version`` complete in the cache, held: decoded here (applying its delta to the cached ``base``
        if given, which is held meanwhile) unless it is complete already or another follower completes
        it meanwhile (waited for). The version's directory appears complete or not at all. ``holder``
        names the stream lease held while decoding.

        Raises:
            CkptStreamError: the version cannot be decoded (its hold is released; nothing is left).
        """
        newly_held = [v for v in (version, base) if v is not None and v not in self._holds]
        for v in newly_held:
            self.hold(v)
        try:
            prepare = lock_file(self._lock_path(version, PREPARE_SUFFIX))  # waits for another preparer
            assert prepare is not None  # a waiting lock is always granted
            try:
                return Prepared(self.path(version), self._write(stream, version, base, holder))
            finally:
                unlock(prepare)
        except BaseException:
            for v in newly_held:
                self.release(v)
            raise
        finally:
            if base is not None and base in newly_held:
                self.release(base)

    def change_path(self, base: int, version: int) -> Path:
        """Where the change from ``base`` to ``version`` is (or would be): the same path on every node."""
        return self.stream_dir / CHANGES_DIR / f"{version_name(base)}-{version_name(version)}.safetensors"

    def drop_copies(self, versions: set[int]) -> None:
        """Delete the directories of ``versions`` that no follower holds or prepares, served or not: their lock
        files stay, so what the engine serves stays known (``--cache-versions 0``: a node keeps no whole
        version once its engine loaded it)."""
        for version in sorted(versions - self.held()):
            use = lock_file(self._lock_path(version), wait=False)
            if use is None:
                continue
            try:
                prepare = lock_file(self._lock_path(version, PREPARE_SUFFIX), wait=False)
                if prepare is None:
                    continue
                try:
                    target = self.path(version)
                    with contextlib.suppress(FileNotFoundError):
                        (target / MARKER_FILE).unlink()  # first: a half-deleted directory never looks complete
                    shutil.rmtree(target, ignore_errors=True)
                finally:
                    unlock(prepare)
            finally:
                unlock(use)

    def requested(self) -> set[int]:
        """The versions the head asked this node for (a request file each, left by the worker extension's cache
        report: ``worker.WorkerExtension``) and not dropped since (``drop_request``)."""
        requests = self.stream_dir / REQUESTS_DIR
        names = [p.name for p in requests.iterdir()] if requests.is_dir() else []
        return {v for v in map(parse_version_name, names) if v is not None}

    def drop_request(self, version: int) -> None:
        """Forget the head's request for ``version`` (served since, or refused here)."""
        (self.stream_dir / REQUESTS_DIR / version_name(version)).unlink(missing_ok=True)

    def prune(self, keep: set[int]) -> None:
        """Release the versions held but not in ``keep``, then delete every version (complete or left
        half-written) not in ``keep`` that no follower holds."""
        for version in self.held() - keep:
            self.release(version)
        found = set()
        for child in self.stream_dir.iterdir():
            name = child.name.removeprefix(INCOMING_PREFIX)
            found.add(parse_version_name(name))
        for child in self._locks.iterdir():
            found.add(parse_version_name(child.name.removesuffix(PREPARE_SUFFIX).removesuffix(SERVED_SUFFIX)
                                         .removesuffix(STAGED_SUFFIX)))
        for version in sorted(v for v in found if v is not None and v not in keep):
            self._delete(version)

    def close(self) -> None:
        """Release every version held (an ephemeral cache also deletes those nobody else holds)."""
        if not self._open:
            return
        self._open = False
        mine = self.held()
        for version in mine:
            self.release(version)
        if self.ephemeral:
            for version in mine:
                self._delete(version)

    def __enter__(self) -> VersionCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------------------------------- private

    def _hold_base(self, stream: Stream, version: int) -> bool:
        """Hold ``version`` as the base of a delta if it is still complete (a pruner may have deleted it) and
        proven."""
        return self.acquire_cached(stream, version) is not None

    def _lock_path(self, version: int, suffix: str = "") -> Path:
        return self._locks / f"{version_name(version)}{suffix}"

    def _incoming(self, version: int) -> Path:
        return self.stream_dir / f"{INCOMING_PREFIX}{version_name(version)}"

    def _complete(self, version: int) -> bool:
        return (self.path(version) / MARKER_FILE).is_file()

    def _write(self, stream: Stream, version: int, base: int | None, holder: str) -> bool:
        """Under the version's prepare lock: write it unless complete and proven; whether it was written."""
        if self._complete(version) and self.proven(stream, version):
            return False
        incoming, target = self._incoming(version), self.path(version)
        shutil.rmtree(incoming, ignore_errors=True)  # a killed or failed earlier preparer's leftovers
        if target.exists():  # not complete or not proven: not what the manifest says (a copy interrupted...)
            shutil.rmtree(target)
        incoming.mkdir()
        try:
            stream.write_into(version, incoming, base_dir=self.path(base) if base is not None else None,
                              holder=holder)
            _write_proof(incoming, stream.manifest(version).manifest_hash)  # (renaming keeps the stats)
            os.rename(incoming, target)
        finally:
            shutil.rmtree(incoming, ignore_errors=True)
        log.info("decoded version %d into %s", version, target)
        return True

    def _delete(self, version: int) -> None:
        """Delete ``version`` (its directory, leftovers and lock files) if nobody holds, prepares or serves
        it."""
        use = lock_file(self._lock_path(version), wait=False)
        if use is None:
            return
        try:
            prepare = lock_file(self._lock_path(version, PREPARE_SUFFIX), wait=False)
            if prepare is None:
                return
            served = lock_file(self._lock_path(version, SERVED_SUFFIX), wait=False)
            if served is None:
                unlock(prepare)
                return
            try:
                target = self.path(version)
                with contextlib.suppress(FileNotFoundError):
                    (target / MARKER_FILE).unlink()  # first: a half-deleted directory never looks complete
                shutil.rmtree(target, ignore_errors=True)
                shutil.rmtree(self._incoming(version), ignore_errors=True)
                self._lock_path(version, PREPARE_SUFFIX).unlink(missing_ok=True)
                self._lock_path(version, SERVED_SUFFIX).unlink(missing_ok=True)
                self._lock_path(version, STAGED_SUFFIX).unlink(missing_ok=True)
                for change in [*(self.stream_dir / CHANGES_DIR).glob(f"*{version_name(version)}*"),
                               *self.stream_dir.glob(f"{INCOMING_PREFIX}*-*{version_name(version)}*.safetensors")]:
                    change.unlink(missing_ok=True)  # with what a killed builder left
            finally:
                unlock(served)
                unlock(prepare)
            self._lock_path(version).unlink(missing_ok=True)  # while locked: see locks.lock_file
        finally:
            unlock(use)

    def _remove_old_layout(self) -> None:
        """Migration from the previous layout (one directory per follower, ``<stream id>/<replica id>/``,
        flock'ed through its ``.lock`` while its follower ran), for one release: delete those directories
        once nobody holds their lock."""
        for child in self.stream_dir.iterdir():
            if child.name.startswith(".") or parse_version_name(child.name) is not None or not child.is_dir():
                continue
            fd = try_lock(child / LOCK_FILE, create=False)
            if fd is None:
                continue  # not an old follower's directory, or its follower still runs
            try:
                log.info("removing %s, a follower cache of the previous layout", child)
                shutil.rmtree(child, ignore_errors=True)
            finally:
                unlock(fd)


def hold_served(directory: str | os.PathLike[str]) -> tuple[int, int] | None:
    """For a vLLM worker that serves ``directory``: if it is a complete version of a follower's cache, hold its
    served lock (shared; waiting only while a pruner deletes it) and return (the version, the lock's descriptor
    for ``locks.unlock``); else None (a model directory of another kind, or a version deleted meanwhile)."""
    path = Path(directory).absolute()
    version = parse_version_name(path.name)
    locks = path.parent / LOCKS_DIR
    if version is None or not locks.is_dir():
        return None
    fd = lock_file(locks / f"{version_name(version)}{SERVED_SUFFIX}", shared=True)
    assert fd is not None  # a waiting lock is always granted
    if not (path / MARKER_FILE).is_file():
        unlock(fd)
        return None
    return version, fd


def hold_staged(change: str | os.PathLike[str]) -> int | None:
    """For a vLLM worker staging the change file ``change`` (``VersionCache.change_path``): hold the staged lock
    of the version it leads to (shared) and return its descriptor for ``locks.unlock``; None where ``change`` is
    no cache's. The worker holds it until the update is over (``hold_served_version``), the change discarded or
    another staged: meanwhile the node's agent keeps that version (``VersionCache.staged``: the base of the next
    change once served, which a version decoded during the apply would otherwise replace)."""
    path = Path(change).absolute()
    parts = path.name.removesuffix(".safetensors").split("-")
    version = parse_version_name(parts[-1]) if len(parts) == 2 else None
    locks = path.parent.parent / LOCKS_DIR
    if path.parent.name != CHANGES_DIR or version is None or not locks.is_dir():
        return None
    return lock_file(locks / f"{version_name(version)}{STAGED_SUFFIX}", shared=True)


def hold_served_version(versions_dir: str | os.PathLike[str], version: int) -> int | None:
    """For a vLLM worker that serves ``version`` of the cache at ``versions_dir`` (a stream's directory in a
    follower's cache), complete there or not: hold its served lock (shared) and return the lock's descriptor
    for ``locks.unlock``; None where ``versions_dir`` is no cache. After an update applied in place the model's
    path still names the version last reloaded: the version number is what the engine serves.

    The head has its workers do this once it is done with a load (the update's, or the served version's back
    after a failure), so the head's requests there (``VersionCache.requested``) are over, loaded or given up
    (it asks again for what it still needs): they are removed, and the node's agent keeps no copy for them."""
    directory = Path(versions_dir).absolute()
    if not (directory / LOCKS_DIR).is_dir():
        return None
    fd = lock_file(directory / LOCKS_DIR / f"{version_name(version)}{SERVED_SUFFIX}", shared=True)
    requests = directory / REQUESTS_DIR
    for request in requests.iterdir() if requests.is_dir() else ():
        request.unlink(missing_ok=True)
    return fd


def _file_stats(directory: Path) -> dict[str, list[int]]:
    """Per entry of ``directory`` but the proof: [size, modification time (ns), inode] of a regular file,
    [-1] for anything else (never equal to a proof's)."""
    stats: dict[str, list[int]] = {}
    for child in sorted(directory.iterdir()):
        if child.name != PROOF_FILE:
            status = child.lstat()
            stats[child.name] = ([status.st_size, status.st_mtime_ns, status.st_ino]
                                 if stat.S_ISREG(status.st_mode) else [-1])
    return stats


def _write_proof(directory: Path, manifest_hash: str | None) -> None:
    """Record what ``directory`` holds now as the proof of a version with ``manifest_hash``."""
    proof = json.dumps({"manifest_hash": manifest_hash, "files": _file_stats(directory)})
    temporary = directory / f"{PROOF_FILE}.{os.getpid()}-{threading.get_ident()}"
    temporary.write_text(proof)
    os.replace(temporary, directory / PROOF_FILE)
