"""Exceptions raised by ckptstream.

Every error derives from :class:`CkptStreamError` and also from the builtin that matches its meaning
(``FileNotFoundError``, ``FileExistsError``, ``ValueError``, ...), so callers can catch either. Each carries
the ``version``, ``file`` and ``tensor`` it concerns (``None`` where not applicable), and its message says
what failed and what to do next, with any URL's userinfo redacted (``ckptstream.credentials``).
"""

from __future__ import annotations

from typing import Any

from .credentials import redact

# CLI exit codes: one definition, used by the error classes below and by the command line.
EXIT_OK = 0  # success
EXIT_ERROR = 1  # unexpected error
EXIT_USAGE = 2  # usage error
EXIT_INTEGRITY = 3  # corrupt, truncated or unsafe data
EXIT_NOT_FOUND = 4  # no such stream or version, or a delta's base is gone
EXIT_CONFLICT = 5  # the version exists or is not newer than the latest
EXIT_INCOMPATIBLE = 6  # unsupported format version, other model, storage lacks a primitive
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, the shell's convention)


class CkptStreamError(Exception):
    """Base class of every ckptstream error.

    Attributes:
        version: the stream version concerned, if any.
        file: the stored file concerned (relative to the stream root), if any.
        tensor: the tensor name concerned, if any.
        exit_code: the CLI exit code for this kind of error.
    """

    exit_code = EXIT_ERROR

    def __init__(self, message: str, *, version: int | None = None, file: str | None = None,
                 tensor: str | None = None, hint: str | None = None):
        self.version = version
        self.file = file
        self.tensor = tensor
        self.hint = hint
        where = []
        if version is not None:
            where.append(f"version {version}")
        if file is not None:
            where.append(f"file {file}")
        if tensor is not None:
            where.append(f"tensor {tensor}")
        text = f"{', '.join(where)}: {message}" if where else message
        if hint:
            text = f"{text}. {hint}"
        super().__init__(redact(text))  # a URL's userinfo never reaches a message, a log line or an answer


class IntegrityError(CkptStreamError, ValueError):
    """Stored bytes do not match what the manifest promises (hash, size, truncation, malformed data).

    Never retried silently: the version is refused as a whole.
    """

    exit_code = EXIT_INTEGRITY


class UnsafeManifestError(IntegrityError):
    """A manifest names a file outside its version directory, or declares absurd sizes."""


class ModelMismatchError(IntegrityError):
    """A version's tensors differ in name, dtype or shape from the model its servers run: refused before
    vLLM's reload, which would fail and leave the engine dead."""


class VersionNotFoundError(CkptStreamError, FileNotFoundError):
    """The requested version has no committed manifest (never published, or garbage-collected)."""

    exit_code = EXIT_NOT_FOUND


class MissingBaseError(VersionNotFoundError):
    """A delta's base version (or a data file of it) is no longer on storage."""


class TensorNotFoundError(CkptStreamError, KeyError):
    """The version has no tensor of the requested name (a KeyError too, for dict-like callers)."""

    exit_code = EXIT_NOT_FOUND

    def __str__(self) -> str:  # KeyError would show the message quoted, as a repr
        return str(self.args[0]) if self.args else ""


class InvalidVersionError(CkptStreamError, ValueError):
    """A version reference is neither ``latest`` nor a version number in the format's range."""

    exit_code = EXIT_USAGE


class NotADirectoryOutputError(CkptStreamError, NotADirectoryError):
    """An output path given for a directory (``materialize``) exists and is not a directory."""

    exit_code = EXIT_USAGE


class SourceNotFoundError(CkptStreamError, FileNotFoundError):
    """What was to be published is not there (a model directory without weights, a missing checkpoint)."""

    exit_code = EXIT_NOT_FOUND


class StreamNotFoundError(CkptStreamError, FileNotFoundError):
    """No stream exists at the given URL."""

    exit_code = EXIT_NOT_FOUND


class VersionConflictError(CkptStreamError, FileExistsError):
    """Another writer committed this version first; the losing writer's data is left as debris for gc."""

    exit_code = EXIT_CONFLICT


class ForeignStreamError(CkptStreamError, ValueError):
    """A destination holds another stream (another ``stream_id``) than the one being copied into it."""

    exit_code = EXIT_CONFLICT


class VersionOrderError(CkptStreamError, ValueError):
    """A version number is not greater than the latest version of the stream."""

    exit_code = EXIT_CONFLICT


class IncompatibleStreamError(CkptStreamError, ValueError):
    """The stream uses an unsupported format version, or differs from what the caller publishes."""

    exit_code = EXIT_INCOMPATIBLE


class StreamKindError(IncompatibleStreamError):
    """A stream is of another kind (``stream.json``'s ``kind``: ``weights``, ``adapter``) than the reader or
    writer handles: a weights follower given an adapter stream, an adapter publisher given a weights stream
    (``reader.adapter.kind_error`` words it).

    Attributes:
        url: the stream.
        kind: the kind it is.
        expected: the kind that was expected.
    """

    def __init__(self, message: str, *, url: str, kind: str, expected: str, **where: Any):
        super().__init__(message, **where)
        self.url = url
        self.kind = kind
        self.expected = expected


class AdapterMismatchError(ModelMismatchError):
    """A version of an adapter stream does not fit where it is to be served: another base model than the
    server's, a rank above the server's ``--max-lora-rank``, target modules the server cannot adapt, or
    tensors whose ranks contradict the stream's."""


class StorageCapabilityError(CkptStreamError, OSError):
    """The storage backend lacks a primitive the format requires (e.g. atomic put-if-absent)."""

    exit_code = EXIT_INCOMPATIBLE


class StorageAccessError(CkptStreamError, OSError):
    """The storage cannot be reached, keeps failing after retries, or refuses access (HTTP 401/403)."""


class PublishError(CkptStreamError, RuntimeError):
    """A background publish failed; raised by the next call on the publisher and by its future."""


class CommitOutcomeUnknownError(PublishError):
    """The manifest's put failed and could not be read back: the version may or may not be committed, so
    its data files must be kept (``gc`` removes them if no manifest names them)."""


class ConversionError(CkptStreamError, ValueError):
    """A Megatron model or checkpoint holds a tensor that cannot be mapped to the Hugging Face layout."""

    exit_code = EXIT_INCOMPATIBLE


class VllmError(CkptStreamError, RuntimeError):
    """A vLLM server refused a control call, did not do what it answered, or cannot generate."""


class VllmUnreachable(VllmError, ConnectionError):
    """The vLLM server does not answer (not started yet, restarting, or dead)."""


class AdapterRefused(VllmError):
    """A vLLM server refused a LoRA adapter call: loading a corrupt adapter, one whose rank is above the
    server's ``--max-lora-rank`` or whose modules the model lacks, or a name it does not hold. The server
    keeps serving every adapter it held.

    Attributes:
        adapter: the adapter name of the call (``<name>@<version>``, or the stable ``<name>``).
        path: the PEFT directory it was to be loaded from (None for an unload).
        status: vLLM's HTTP status (400: a bad request, 404: no such adapter or directory, 500: the engine
            could not load it).
    """

    def __init__(self, message: str, *, adapter: str, path: str | None = None, status: int | None = None,
                 **where: Any):
        super().__init__(message, **where)
        self.adapter = adapter
        self.path = path
        self.status = status


class VllmArgumentError(CkptStreamError, ValueError):
    """vLLM arguments given to ``serve`` contradict what serving the stream needs (for an adapter stream: fewer
    adapter slots than resident versions, a maximum rank below the adapters', no request statistics)."""

    exit_code = EXIT_USAGE


class NodesNotReady(VllmError):
    """Some node of a multi-node engine does not hold the version, complete and verified, at the path every
    rank would reload it from: the engine keeps serving the previous version (retried later, never loaded
    into a partial set of ranks).

    Attributes:
        lagging: the nodes that lack it, as ``node <rank> (<host>)``.
    """

    def __init__(self, message: str, *, lagging: list[str], **where: Any):
        super().__init__(message, **where)
        self.lagging = lagging


class ReplicaRefused(CkptStreamError, TimeoutError):
    """A trainer waits for a version that too few replicas can ever serve: the others are pinned to an
    older version or refused this one (each named with its reason).

    Attributes:
        reasons: replica id -> why it will not serve the version.
    """

    def __init__(self, message: str, *, reasons: dict[str, str], **where: Any):
        super().__init__(message, **where)
        self.reasons = reasons


class WeightTransferError(CkptStreamError, RuntimeError):
    """An update through vLLM's weight-transfer API failed; every rank serves its last good version."""


class RouterError(CkptStreamError, RuntimeError):
    """A vLLM router does not answer, refused a change of its worker list, or answered without doing it
    (its worker list is the proof, not its status code).

    Attributes:
        router: the router's base URL.
        worker: the worker (vLLM server) URL concerned, if any.
    """

    def __init__(self, message: str, *, router: str, worker: str | None = None, **where: Any):
        subject = f"router {router}" + (f", worker {worker}" if worker else "")
        super().__init__(f"{subject}: {message}", **where)
        self.router = router
        self.worker = worker

class FleetError(CkptStreamError, RuntimeError):
    """A fleet of servers on Ray could not do what was asked (start, scale, replay, wait)."""


class FleetNotFoundError(FleetError, LookupError):
    """No fleet of this stream (or name) runs on the Ray cluster."""

    exit_code = EXIT_NOT_FOUND


class FleetTimeout(FleetError, TimeoutError):
    """Too few of a fleet's servers reached a version in time."""
