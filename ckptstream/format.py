"""The ckptstream storage format: names, limits, hashes and the manifest schema (see FORMAT.md).

This module is the code form of FORMAT.md. It knows nothing about storage backends or torch: it turns
manifests and stream metadata into bytes and back, and refuses anything a writer following the spec could
not have produced (unknown format versions, file names escaping the version directory, inconsistent
sizes), so readers can safely parse untrusted manifests.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import xxhash

from .errors import IncompatibleStreamError, IntegrityError, TensorNotFoundError, UnsafeManifestError

FORMAT_NAME = "ckptstream"
FORMAT_VERSION = 3
"""The newest format version this library reads; readers refuse streams and manifests with a larger one.
Writers write the lowest version that holds what they write (``MANIFEST_FORMAT_VERSION``,
``stream_format_version``), so that older readers keep reading what they can read."""
MANIFEST_FORMAT_VERSION = 1
"""The format version of every manifest written without pieces (manifests are the same in versions 1 and 2)."""
PIECES_FORMAT_VERSION = 3
"""The format version that added tensors stored in pieces (FORMAT.md, "Tensors in pieces"): the lowest a
manifest holding one may carry, so that readers of version 2 refuse it instead of misreading it."""
ADAPTER_FORMAT_VERSION = 2
"""The format version that added stream kinds: the lowest a ``stream.json`` of a kind other than weights
may carry, so that readers of version 1 refuse an adapter stream instead of reading it as a model's weights."""

STREAM_FILE = "stream.json"
ASSETS_DIR = "assets"
MANIFESTS_DIR = "manifests"
VERSIONS_DIR = "versions"
REPLICAS_DIR = "replicas"
LEASES_DIR = "leases"
"""Where readers pulling a version keep their leases on it (FORMAT.md, "Leases")."""
TEMP_PREFIX = ".tmp-"
"""Prefix of every temporary name; anything carrying it older than the gc grace period is debris."""
LATEST_HINT_FILE = "latest.json"
"""Advisory file at the stream root naming the newest committed version, for readers that cannot list
(FORMAT.md, "Latest-version hint"); never trusted as more than a place to start probing."""
VERSION_PROBE_GAP = 16
"""Readers without listing probe this many consecutive missing version numbers before concluding that no
newer (or, going back, older) version exists."""
MAX_LATEST_HINT_BYTES = 4096
LATEST = "latest"
"""The version reference that stands for a stream's newest committed version (API and command line)."""
MARKER_FILE = "ckptstream.json"
"""Written last into a materialized directory: which stream and version it holds."""
INDEX_FILE = "model.safetensors.index.json"
"""The safetensors index of a sharded materialized directory."""
STREAM_KIND_WEIGHTS = "weights"
"""A stream of a model's full weights (the kind of a ``stream.json`` without ``kind``)."""
STREAM_KIND_ADAPTER = "adapter"
"""A stream of a PEFT LoRA adapter over a base model that ``stream.json`` names (FORMAT.md, "Adapter streams")."""
ADAPTER_CONFIG_FILE = "adapter_config.json"
"""PEFT's adapter configuration: an asset of every adapter stream."""
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
"""PEFT's adapter weights file: the one weights file of a materialized adapter directory."""
STREAM_KINDS = (STREAM_KIND_WEIGHTS, STREAM_KIND_ADAPTER)
MAX_ADAPTER_RANK = 1 << 16
"""Largest LoRA rank a ``stream.json`` may declare."""
MAX_LABEL_BYTES = 1024
"""Longest base-model name or target-module name of an adapter stream (UTF-8 bytes)."""
BASE_HASH_SAMPLE_BYTES = 64
"""Bytes of each tensor, from its middle, that a base model hash covers (``ckptstream.basehash``)."""
BUNDLE_INDEX_FILE = "ckptstream-bundle.json"
"""The first member of a bundle (FORMAT.md, "Bundles"): what the bundle carries, every member's size and hash."""
BUNDLE_FORMAT_NAME = "ckptstream-bundle"
BUNDLE_FORMAT_VERSION = 1
"""Bundle format version written by this library; importers refuse bundles with a larger one."""

VERSION_DIGITS = 12
MAX_VERSION = 10**VERSION_DIGITS - 1
MAX_MANIFEST_BYTES = 64 << 20
MAX_STREAM_FILE_BYTES = 16 << 20
MAX_ASSET_BYTES = 256 << 20
"""Upper bound on one asset file (config, tokenizer): readers and importers hold an asset whole."""
MAX_BUNDLE_INDEX_BYTES = 64 << 20
MAX_REPLICA_RECORD_BYTES = 1 << 20
"""Replica records larger than this are skipped unread (they are reports, not data)."""
MAX_LEASE_RECORD_BYTES = 64 << 10
"""Lease records larger than this are malformed: ignored by gc, skipped unread."""
LEASE_CLOCK_SKEW_SECONDS = 5.0
"""A lease counts as live until this long after its ``expires`` (or after its storage time plus its TTL):
clocks may differ by that much."""
MAX_LEASE_TTL = 86400.0
"""Seconds a lease may live at most past its last write (a day): a record whose TTL (``expires -
heartbeat``) is longer, or whose ``expires`` is further from its storage time, is malformed, so that no
record protects a version for ever."""
MAX_FILE_BYTES = 1 << 50
"""Upper bound on every size, offset, length, count and dimension a manifest declares."""
MAX_CHUNK_BYTES = 1 << 30
"""Upper bound on one decoded chunk: bounds the memory a reader needs per chunk."""
MAX_ZSTD_RATIO = 1 << 15
"""No zstd frame decodes to more than this many times its size (a block holds at most 128 KiB and takes
at least 4 bytes): bounds what a dense chunk may claim, so a reader never allocates for a tensor more than
its stored bytes can fill."""
MAX_PIECES = 1 << 16
"""The most pieces a tensor stored in pieces may have (FORMAT.md "Tensors in pieces": one per writing process)."""
MAX_SHAPE_DIMS = 16
"""Most dimensions a tensor may have."""
SAFETENSORS_LENGTH = struct.Struct("<Q")
"""The little-endian u64 that begins a safetensors file: the length of its JSON header."""
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
"""Upper bound on the JSON header of a keyframe data file (the safetensors library's own limit)."""
MAX_TENSOR_NAME_BYTES = 1024
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a manifest or stream.json may have (metadata included)."""
RESERVED_TENSOR_NAMES = frozenset({"__metadata__"})
"""Names safetensors gives a meaning of its own: a tensor so named makes the file unreadable."""
DEFAULT_SHARD_BYTES = 4 << 30
"""Default upper bound on one data file (writers) and one materialized shard (readers)."""

KEYFRAME = "keyframe"
DELTA = "delta"

ENCODING_RAW = "raw"            # stored bytes are the tensor's little-endian bytes (keyframes)
ENCODING_ZSTD = "zstd"          # chunks of the tensor's bytes, optionally byte-shuffled, zstd-compressed
ENCODING_XOR_ZSTD = "xor-zstd"  # like zstd, but of the XOR of the tensor's bytes with the base's
ENCODING_UNCHANGED = "unchanged"  # bit-identical to the base version's tensor; no stored bytes
ENCODING_PIECES = "pieces"  # stored as boxes of the whole tensor, each with an encoding of its own (format 3)
LAYOUT_DENSE = "dense"    # a chunk's bytes, byte-shuffled if the tensor says so
LAYOUT_SPARSE = "sparse"  # positions and values of the changed elements of an XOR chunk (xor-zstd only)
KEYFRAME_ENCODINGS = frozenset({ENCODING_RAW})
DELTA_ENCODINGS = frozenset({ENCODING_ZSTD, ENCODING_XOR_ZSTD, ENCODING_UNCHANGED})
CHUNKED_ENCODINGS = frozenset({ENCODING_ZSTD, ENCODING_XOR_ZSTD})
FULL_ENCODINGS = frozenset({ENCODING_RAW, ENCODING_ZSTD})
"""Encodings that need no base: where a delta chain starts."""

CHECK_VERSION = 1
"""The version of a delta entry's ``check`` field (FORMAT.md, "Change checks") that this ckptstream writes
and verifies; a reader keeps a check of another version unread (``ChangeCheck.known`` False)."""
CHECK_MASK = (1 << 64) - 1
CHECK_SEED, CHECK_MIX_A, CHECK_MIX_B = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
"""A change check's constants (FORMAT.md, "Change checks"): the seed added to a position, and the two
multipliers of splitmix64's finalizer (``check_mix``)."""
_CHECK_HEX_RE = re.compile(r"[0-9a-f]{16}")

# safetensors dtype name -> item size in bytes.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

HASH_PREFIX = "xxh3-128:"
# Both used with fullmatch: ``match`` with a ``$`` anchor would also take the string followed by "\n".
_HASH_RE = re.compile(r"xxh3-128:[0-9a-f]{32}")
_FILE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_MANIFEST_HASH_KEY = b'"manifest_hash": "' + HASH_PREFIX.encode()
_ZERO_HASH = HASH_PREFIX + "0" * 32
_CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f]")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".ckpt")
"""File name endings of model weights (any framework): never assets."""


# ----------------------------------------------------------------------------------------------- hashes

class Hasher:
    """Incremental content hash in the format's notation (``xxh3-128:<32 hex digits>``)."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._h.update(data)

    def digest(self) -> str:
        return HASH_PREFIX + self._h.hexdigest()


def is_hash(value: object) -> bool:
    """True for a hash in the format's notation (``xxh3-128:`` and 32 lowercase hex digits)."""
    return isinstance(value, str) and bool(_HASH_RE.fullmatch(value))


def content_hash(data: bytes | bytearray | memoryview) -> str:
    """Hash of ``data`` in the format's notation."""
    # Through the hash object: its update releases the GIL (the one-shot functions do not), so threads
    # hash tensors in parallel.
    hasher = xxhash.xxh3_128()
    hasher.update(data)
    return HASH_PREFIX + hasher.hexdigest()


# ------------------------------------------------------------------------------------------------- JSON

def dumps_json(value: Any, *, what: str, indent: int | None = 1) -> bytes:
    """Strict JSON (RFC 8259) of ``value``: NaN and Infinity are refused, as is nesting deeper than
    ``MAX_JSON_DEPTH`` (ValueError naming ``what``)."""
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.dumps(value, indent=indent, allow_nan=False).encode()
    except ValueError as exc:
        raise ValueError(f"{what} is not strict JSON ({exc}); NaN and Infinity cannot be stored") from None


def _manifest_json(body: dict[str, Any], *, what: str) -> bytes:
    """Strict JSON of a manifest's ``body`` (FORMAT.md, "Manifest seal"): a member per line, and each element of a
    member that is an array (a file, a tensor) on a line of its own, every line compact. Each line is serialized by
    the json module's C encoder (``indent`` takes its Python encoder: 0.1 s for the manifest of a MoE model's 3,000
    tensors, at every commit). Only the free-form members (``metadata``, ``writer``) are measured for
    ``MAX_JSON_DEPTH`` here: the rest is the manifest's own typed structure, a few levels deep where its fields hold
    what their types say (``writer.commit.commit_manifest`` parses the bytes as a reader does before committing them,
    which refuses any other depth)."""
    if max(json_depth(body.get(key)) for key in _FREE_FORM_MEMBERS) > MAX_JSON_DEPTH - 1:
        raise ValueError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels")
    encode = json.JSONEncoder(allow_nan=False).encode
    try:
        members = [encode(key) + ": " + ("[\n  " + ",\n  ".join(map(encode, item)) + "\n ]"
                                         if isinstance(item, list) and item else encode(item))
                   for key, item in body.items()]
    except RecursionError:
        raise ValueError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise ValueError(f"{what} is not strict JSON ({exc}); NaN and Infinity cannot be stored") from None
    return ("{\n " + ",\n ".join(members) + "\n}").encode()


def loads_json(raw: bytes, *, version: int | None, file: str) -> Any:
    """Parse untrusted strict JSON (FORMAT.md, "JSON"): IntegrityError for text that is not UTF-8,
    malformed text, NaN/Infinity, a key repeated within one object, or nesting deeper than
    ``MAX_JSON_DEPTH`` (never a RecursionError)."""
    def refuse_constant(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        body = dict(pairs)
        if len(body) != len(pairs):
            seen: set[str] = set()
            repeated = next(key for key, _ in pairs if key in seen or seen.add(key))  # (linear: the input is untrusted)
            raise ValueError(f"key {repeated[:80]!r} appears twice in one object")
        return body

    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=refuse_constant, object_pairs_hook=unique_keys)
    except RecursionError:
        body = None
    except ValueError as exc:
        raise IntegrityError(f"not valid JSON ({exc})", version=version, file=file,
                             hint="The file is corrupt or its writer did not follow the ckptstream format") from None
    if body is None or json_depth(body) > MAX_JSON_DEPTH:
        raise IntegrityError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels", version=version, file=file,
                             hint="The writer did not follow the ckptstream format; refusing it")
    return body


_CONTAINERS = (dict, list, tuple)  # what ``json_depth`` descends into
_FREE_FORM_MEMBERS = ("metadata", "writer")  # of a manifest: objects of any layout


def json_depth(value: Any) -> int:
    """Nesting depth of arrays and objects in a parsed JSON value (a scalar has depth 0), level by level (never a
    RecursionError; a manifest of thousands of tensors is checked at every commit and every read: one pass of list
    comprehensions per level, not a step per container). Past ``MAX_JSON_DEPTH`` it stops, at ``MAX_JSON_DEPTH + 1``."""
    level = [value] if isinstance(value, _CONTAINERS) else []
    depth = 0
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            return depth
        level = [child for item in level for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, _CONTAINERS)]
    return depth


# ------------------------------------------------------------------------------------------------ names

def version_name(version: int) -> str:
    """Zero-padded name of a version, so that lexical order is numeric order (``000000000007``)."""
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"version must be an integer in [0, {MAX_VERSION}], got {version!r}")
    return f"{version:0{VERSION_DIGITS}d}"


def parse_version_name(name: str) -> int | None:
    """The version a directory or manifest name stands for, or None for any other name."""
    stem = name[:-5] if name.endswith(".json") else name
    if len(stem) == VERSION_DIGITS and stem.isascii() and stem.isdigit():
        return int(stem)
    return None


def latest_hint_bytes(version: int) -> bytes:
    """The content of the latest-version hint file for ``version``: ``{"version": N}``."""
    version_name(version)  # the range check
    return dumps_json({"version": version}, what="latest-version hint", indent=None)


def parse_latest_hint(raw: bytes) -> int | None:
    """The version a latest-version hint names, or None if it is not a valid hint (readers then probe from
    version 0: a damaged hint costs probes, never correctness)."""
    if len(raw) > MAX_LATEST_HINT_BYTES:
        return None
    try:
        body = loads_json(raw, version=None, file=LATEST_HINT_FILE)
    except IntegrityError:
        return None
    version = body.get("version") if isinstance(body, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_VERSION:
        return None
    return version


def manifest_path(version: int) -> str:
    return f"{MANIFESTS_DIR}/{version_name(version)}.json"


def version_dir(version: int) -> str:
    return f"{VERSIONS_DIR}/{version_name(version)}"


def data_path(version: int, file_name: str) -> str:
    return f"{version_dir(version)}/{file_name}"


def asset_path(name: str) -> str:
    return f"{ASSETS_DIR}/{name}"


def lease_path(version: int, token: str) -> str:
    """The record of one lease on ``version``: ``leases/<version>-<token>.json``, ``token`` unique to the
    lease (ValueError if the name would not be a plain file name)."""
    name = f"{version_name(version)}-{token}.json"
    if not is_safe_file_name(name):
        raise ValueError(f"lease token {token!r} must be a plain name (letters, digits, '.', '_', '-')")
    return f"{LEASES_DIR}/{name}"


def tensor_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a tensor name, or None if it can (FORMAT.md, "Tensor names"): a string of
    1 to ``MAX_TENSOR_NAME_BYTES`` bytes of UTF-8 without control characters (U+0000-U+001F,
    U+007F-U+009F) that is not a reserved name."""
    if not isinstance(name, str):
        return f"tensor name {name!r} is not a string"
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return f"tensor name {name[:80]!r} is not valid UTF-8"
    if not 0 < len(encoded) <= MAX_TENSOR_NAME_BYTES:
        return f"tensor name {name[:80]!r} must have 1 to {MAX_TENSOR_NAME_BYTES} bytes of UTF-8"
    if _CONTROL_RE.search(name):
        return f"tensor name {name[:80]!r} has control characters"
    if name in RESERVED_TENSOR_NAMES:
        return f"tensor name {name!r} is reserved by safetensors"
    return None


def is_reserved_asset_name(name: str) -> bool:
    """True for names an asset may not take: they would replace or shadow the published weights, their
    index or the materialization marker in a materialized directory."""
    lowered = name.lower()
    return (lowered.endswith(WEIGHT_SUFFIXES) or lowered.endswith(".index.json")
            or lowered in (MARKER_FILE, INDEX_FILE))


def is_safe_file_name(name: object) -> bool:
    """True for a plain relative name inside one directory: no separators, no leading dot, bounded."""
    return isinstance(name, str) and bool(_FILE_NAME_RE.fullmatch(name)) and name not in (".", "..")


# ----------------------------------------------------------------------------------------- safetensors

def safetensors_header(tensors: Iterable[tuple[str, str, tuple[int, ...], int]],
                       metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[int]]:
    """Build a safetensors header for tensors laid out back to back in the given order.

    Args:
        tensors: (name, safetensors dtype, shape, nbytes) per tensor.
        metadata: the ``__metadata__`` string map.

    Returns:
        The header bytes (8-byte length + JSON, space-padded so data starts 8-byte aligned) and each
        tensor's offset from the start of the file.
    """
    entries: dict[str, Any] = {}
    if metadata:
        entries["__metadata__"] = dict(metadata)
    relative = []
    position = 0
    for name, dtype, shape, nbytes in tensors:
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, position + nbytes]}
        relative.append(position)
        position += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(SAFETENSORS_LENGTH.size + len(text)) % 8)  # tensor data starts 8-byte aligned
    header = SAFETENSORS_LENGTH.pack(len(text)) + text
    return header, [len(header) + r for r in relative]


def shard_groups(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive index groups whose sizes add up to at most ``limit`` (one index at least per group)."""
    groups: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not groups or (groups[-1] and total + size > limit):
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return groups


# -------------------------------------------------------------------------------------------- manifest

@dataclass(frozen=True)
class FileEntry:
    """A stored file: its name (relative to its directory), size in bytes and content hash."""

    name: str
    size: int
    hash: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "hash": self.hash}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a version: what it decodes to and where its stored bytes are.

    ``hash`` is the hash of the decoded tensor's raw little-endian bytes. ``file``/``offset``/``length``
    locate the stored bytes (absent for ``unchanged``), ``stored_hash`` is their hash, and ``chunks``
    lists ``(raw_bytes, stored_bytes, layout)`` of each independently compressed chunk for chunked
    encodings.
    ``changed`` counts elements whose bits differ from the base version (deltas only).

    A tensor stored in pieces (encoding ``pieces``, FORMAT.md "Tensors in pieces") lists them in ``pieces``:
    each an entry of its own (the tensor's name and dtype, the piece's shape, hash and stored bytes) whose
    ``offsets`` say where its box starts in the whole tensor; its ``hash`` is ``pieces_hash`` of theirs.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    hash: str
    encoding: str
    file: str | None = None
    offset: int = 0
    length: int = 0
    stored_hash: str | None = None
    shuffle: bool = False
    chunks: tuple[tuple[int, int, str], ...] = ()
    changed: int | None = None
    offsets: tuple[int, ...] | None = None
    """A piece's first element in the whole tensor, per dimension (None: a whole tensor)."""
    pieces: tuple[TensorEntry, ...] = ()
    """The pieces of a tensor stored in pieces, in ascending order of their ``offsets``."""
    check: ChangeCheck | None = None
    """An ``xor-zstd`` entry's check of the change it makes (FORMAT.md, "Change checks"), if written."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def stored_entries(self) -> tuple[TensorEntry, ...]:
        """What is encoded on its own: the pieces of a tensor stored in pieces, else the entry itself."""
        return self.pieces if self.encoding == ENCODING_PIECES else (self,)

    def piece_at(self, offsets: tuple[int, ...], shape: tuple[int, ...]) -> TensorEntry | None:
        """The piece of this tensor with that box (None if it is not stored in pieces or has no such piece)."""
        piece = self._pieces_by_box.get(tuple(offsets))
        return piece if piece is not None and piece.shape == tuple(shape) else None

    @functools.cached_property
    def _pieces_by_box(self) -> dict[tuple[int, ...], TensorEntry]:
        # (looked up per piece per step of a chain: a scan would cost the square of the pieces)
        return {piece.offsets or (): piece for piece in self.pieces}

    def to_json(self) -> dict[str, Any]:
        if self.offsets is not None:  # a piece: its tensor gives the name and dtype
            out: dict[str, Any] = {"offsets": list(self.offsets), "shape": list(self.shape), "hash": self.hash,
                                   "encoding": self.encoding}
        else:
            out = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "hash": self.hash,
                   "encoding": self.encoding}
        if self.encoding == ENCODING_PIECES:
            out["pieces"] = [p.to_json() for p in self.pieces]
        elif self.encoding != ENCODING_UNCHANGED:
            out.update(file=self.file, offset=self.offset, length=self.length, stored_hash=self.stored_hash)
        if self.encoding in CHUNKED_ENCODINGS:
            out.update(shuffle=self.shuffle, chunks=[list(c) for c in self.chunks])
        if self.changed is not None:
            out["changed"] = self.changed
        if self.check is not None:
            out["check"] = self.check.to_json()
        return out


def check_mix(x: int) -> int:
    """The 64-bit finalizer of splitmix64 (FORMAT.md, "Change checks"): ``x`` and the result in [0, 2^64)."""
    x ^= x >> 30
    x = (x * CHECK_MIX_A) & CHECK_MASK
    x ^= x >> 27
    x = (x * CHECK_MIX_B) & CHECK_MASK
    return x ^ (x >> 31)


def check_element(position: int, bits: int) -> int:
    """One element's term of a change check: ``mix(mix(position + seed) XOR bits)``, mod 2^64, for the flat
    ``position`` of the element in the whole tensor and its raw ``bits`` (its little-endian bytes read as an
    unsigned integer). The reference form of ``codec.check_sum``, which sums these over many elements."""
    return check_mix(check_mix((position + CHECK_SEED) & CHECK_MASK) ^ bits)


@dataclass(frozen=True)
class ChangeCheck:
    """A delta entry's ``check`` (FORMAT.md, "Change checks"): over the elements the delta changes (where
    the XOR is non-zero), their ``count`` and two additive multiset hashes, of (position, old bits) and of
    (position, new bits), each the sum mod 2^64 of ``check_element``. Additive: a tensor in pieces checks as
    the sum of its pieces' checks, and ranks holding parts of a tensor as the sum of their parts.

    Not cryptographic: the stored hashes prove the bytes; this proves that values served before an update
    were the delta's base, and those after it the version's, without the whole tensor's bytes.
    ``version`` other than ``CHECK_VERSION``: a check this ckptstream cannot read (``known`` False)."""

    count: int = 0
    old: int = 0
    new: int = 0
    version: int = CHECK_VERSION

    @property
    def known(self) -> bool:
        return self.version == CHECK_VERSION

    def __add__(self, other: ChangeCheck) -> ChangeCheck:
        if not (self.known and other.known):
            raise ValueError(f"change checks of version {self.version} and {other.version} do not add up")
        return ChangeCheck(self.count + other.count, (self.old + other.old) & CHECK_MASK,
                           (self.new + other.new) & CHECK_MASK)

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "count": self.count, "old": f"{self.old:016x}", "new": f"{self.new:016x}"}

    @classmethod
    def from_json(cls, value: Any) -> ChangeCheck:
        """A check as ``to_json`` writes it (ValueError otherwise); of an unknown version: kept unread."""
        if not isinstance(value, dict) or type(value.get("version")) is not int:
            raise ValueError("a change check is an object with an integer 'version'")
        if value["version"] != CHECK_VERSION:
            return cls(version=value["version"])
        count, old, new = value.get("count"), value.get("old"), value.get("new")
        if type(count) is not int or not 0 <= count <= MAX_FILE_BYTES:
            raise ValueError(f"a change check's count {count!r} is not an integer in [0, {MAX_FILE_BYTES}]")
        if not all(isinstance(h, str) and _CHECK_HEX_RE.fullmatch(h) for h in (old, new)):
            raise ValueError("a change check's 'old' and 'new' are each 16 lowercase hex digits")
        return cls(count, int(old, 16), int(new, 16))


def pieces_hash(hashes: Iterable[str]) -> str:
    """The hash of a tensor stored in pieces: XXH3-128 of its pieces' hashes (each as the ASCII of its
    notation, ``xxh3-128:`` and 32 hex digits), concatenated in the order of the pieces."""
    return content_hash("".join(hashes).encode("ascii"))


def pieces_problem(shape: tuple[int, ...], pieces: Iterable[TensorEntry]) -> str | None:
    """Why ``pieces`` do not store a tensor of ``shape`` (FORMAT.md, "Tensors in pieces"), or None: each
    piece a non-empty box inside the tensor, of its rank; the boxes exactly the non-empty cells of one grid
    (per dimension, consecutive intervals covering it), each once, in ascending order of their offsets; no
    two pieces in one data file."""
    pieces = list(pieces)
    if not pieces:
        return "a tensor stored in pieces needs at least one piece"
    if len(pieces) > MAX_PIECES:
        return f"{len(pieces)} pieces, more than the {MAX_PIECES} a tensor may have"
    cuts: list[set[tuple[int, int]]] = [set() for _ in shape]
    files = set()
    for piece in pieces:
        offsets = piece.offsets
        if offsets is None or len(offsets) != len(shape) or len(piece.shape) != len(shape):
            return f"piece at {offsets} does not have the tensor's {len(shape)} dimensions"
        if not piece.numel or any(o + n > d for o, n, d in zip(offsets, piece.shape, shape)):
            return f"piece at {list(offsets)} of shape {list(piece.shape)} is empty or lies outside the tensor"
        for dim, (o, n) in enumerate(zip(offsets, piece.shape)):
            cuts[dim].add((o, n))
        if piece.file is not None:
            if piece.file in files:
                return f"two pieces are stored in {piece.file}"
            files.add(piece.file)
    for dim, intervals in enumerate(cuts):
        end = 0
        for start, size in sorted(intervals):
            if start != end:
                return f"the pieces do not cut dimension {dim} into consecutive intervals"
            end = start + size
        if end != shape[dim]:
            return f"the pieces do not cover dimension {dim}"
    cells = 1
    for intervals in cuts:
        cells *= len(intervals)
    boxes = [p.offsets for p in pieces]
    if len(pieces) != cells or boxes != sorted(set(boxes)):  # type: ignore[type-var]
        return "the pieces are not each cell of one grid once, in ascending order of their offsets"
    return None


def join_pieces(entries: Iterable[TensorEntry]) -> list[TensorEntry]:
    """A version's entries with the parts of each tensor stored in pieces (one entry per writer, each
    holding that writer's pieces) joined into one, its pieces in order, its ``hash`` and ``changed`` theirs;
    ValueError where a name is given twice otherwise, or the pieces do not store their tensor."""
    joined: dict[str, TensorEntry] = {}
    for entry in entries:
        held = joined.get(entry.name)
        if held is None:
            joined[entry.name] = entry
            continue
        if ENCODING_PIECES not in (held.encoding, entry.encoding) or held.encoding != entry.encoding:
            raise ValueError(f"tensor {entry.name} is given twice")
        if (held.dtype, held.shape) != (entry.dtype, entry.shape):
            raise ValueError(f"the pieces of tensor {entry.name} disagree on its dtype or shape: "
                             f"{held.dtype}{list(held.shape)} and {entry.dtype}{list(entry.shape)}")
        joined[entry.name] = dataclasses.replace(held, pieces=held.pieces + entry.pieces)
    out = []
    for entry in joined.values():
        if entry.encoding == ENCODING_PIECES:
            pieces = tuple(sorted(entry.pieces, key=lambda p: p.offsets or ()))
            problem = pieces_problem(entry.shape, pieces)
            if problem is not None:
                raise ValueError(f"tensor {entry.name}: {problem}")
            counts = [p.changed for p in pieces]
            entry = dataclasses.replace(entry, pieces=pieces, hash=pieces_hash(p.hash for p in pieces),
                                        changed=None if None in counts else sum(c or 0 for c in counts))
        out.append(entry)
    return out


def manifest_format_version(tensors: Iterable[TensorEntry]) -> int:
    """The lowest format version of a manifest holding ``tensors``: ``PIECES_FORMAT_VERSION`` if one is
    stored in pieces, else ``MANIFEST_FORMAT_VERSION`` (readers of version 1 read it)."""
    pieced = any(t.encoding == ENCODING_PIECES for t in tensors)
    return PIECES_FORMAT_VERSION if pieced else MANIFEST_FORMAT_VERSION


@dataclass(frozen=True)
class Manifest:
    """The commit record of one version. A version exists iff its manifest exists."""

    version: int
    kind: str
    base_version: int | None
    keyframe_version: int
    chain_length: int
    stream_id: str
    created: str
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    step: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    writer: dict[str, Any] = field(default_factory=dict)
    format_version: int = MANIFEST_FORMAT_VERSION
    manifest_hash: str | None = field(default=None, compare=False)
    """The seal of the bytes this manifest was read from (None for one built in memory, not yet written)."""

    def tensor(self, name: str) -> TensorEntry:
        """The entry of tensor ``name``; TensorNotFoundError (a KeyError) if this version lacks it."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise TensorNotFoundError("this version has no such tensor", version=self.version, tensor=name,
                                  hint="`ckptstream show URL VERSION` lists its tensors")

    def tensor_map(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    @property
    def full_bytes(self) -> int:
        """Bytes of the decoded tensors (what a full safetensors copy stores, headers aside)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def stored_bytes(self) -> int:
        """Bytes of this version's own data files on storage."""
        return sum(f.size for f in self.files)

    @property
    def changed_elements(self) -> int | None:
        """Elements whose bits differ from the base version (None for keyframes)."""
        if self.kind != DELTA:
            return None
        return sum(t.changed or 0 for t in self.tensors)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "version": self.version,
            "kind": self.kind,
            "base_version": self.base_version,
            "keyframe_version": self.keyframe_version,
            "chain_length": self.chain_length,
            "stream_id": self.stream_id,
            "created": self.created,
            "step": self.step,
            "metadata": self.metadata,
            "writer": self.writer,
            "files": [f.to_json() for f in self.files],
            "tensors": [t.to_json() for t in self.tensors],
        }

    def to_bytes(self) -> bytes:
        """Strict JSON (a member per line, a tensor per line), sealed with ``manifest_hash`` (FORMAT.md, "Manifest
        seal")."""
        body = self.to_json()
        body["manifest_hash"] = _ZERO_HASH
        raw = _manifest_json(body, what=f"the manifest of version {self.version}")
        start = raw.rfind(_MANIFEST_HASH_KEY) + len(_MANIFEST_HASH_KEY)
        return raw[:start] + content_hash(raw)[len(HASH_PREFIX):].encode() + raw[start + 32:]

    @classmethod
    def from_bytes(cls, raw: bytes, *, version: int, stream_id: str | None = None) -> Manifest:
        """Parse and validate an untrusted manifest of ``version``.

        Raises:
            IntegrityError: the bytes are not a sealed manifest of this version (corrupted, truncated).
            UnsafeManifestError: names or sizes a conforming writer cannot produce.
            IncompatibleStreamError: a newer format version, or a manifest of another stream.
        """
        file = manifest_path(version)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise UnsafeManifestError(f"manifest is {len(raw)} bytes, over the {MAX_MANIFEST_BYTES} limit",
                                      version=version, file=file)
        seal = _check_sealed(raw, version=version, file=file)
        body = loads_json(raw, version=version, file=file)
        if not isinstance(body, dict) or body.get("manifest_hash") != seal:
            raise IntegrityError("manifest_hash is not the manifest's last top-level field",
                                 version=version, file=file)
        return dataclasses.replace(_parse_manifest(body, version=version, file=file, stream_id=stream_id),
                                   manifest_hash=seal)


def _check_sealed(raw: bytes, *, version: int, file: str) -> str:
    """Check the seal of a manifest's bytes; returns the sealed hash."""
    hint = "The manifest is corrupt or truncated; restore it from a copy or remove this version with gc"
    position = raw.rfind(_MANIFEST_HASH_KEY)
    start = position + len(_MANIFEST_HASH_KEY)
    if position < 0 or raw[start + 32:start + 33] != b'"':
        raise IntegrityError("manifest has no manifest_hash seal", version=version, file=file, hint=hint)
    claimed = raw[start:start + 32].decode("ascii", "replace")
    actual = content_hash(raw[:start] + b"0" * 32 + raw[start + 32:])
    if actual != HASH_PREFIX + claimed:
        raise IntegrityError(f"manifest hash mismatch (sealed {HASH_PREFIX}{claimed}, computed {actual})",
                             version=version, file=file, hint=hint)
    return actual


class _Checker:
    """Field accessors that turn any deviation from the schema into an UnsafeManifestError."""

    def __init__(self, version: int | None, file: str):
        self.version = version
        self.file = file

    def fail(self, message: str, tensor: str | None = None) -> UnsafeManifestError:
        return UnsafeManifestError(message, version=self.version, file=self.file, tensor=tensor,
                                   hint="The writer did not follow the ckptstream format; refusing it")

    def get(self, obj: Any, key: str, kind: type, tensor: str | None = None, optional: bool = False) -> Any:
        # (by exact type, as JSON parses them: a bool is no int; called a dozen times per tensor of a manifest)
        if type(obj) is not dict:
            raise self.fail(f"expected an object holding {key!r}", tensor)
        value = obj.get(key)
        if type(value) is kind:
            return value
        if value is None:
            if optional:
                return None
            raise self.fail(f"missing field {key!r}", tensor)
        raise self.fail(f"field {key!r} has the wrong type", tensor)

    def count(self, obj: Any, key: str, limit: int = MAX_FILE_BYTES, tensor: str | None = None,
              optional: bool = False) -> int | None:
        value = self.get(obj, key, int, tensor, optional)
        if value is not None and not 0 <= value <= limit:
            raise self.fail(f"field {key!r} = {value} is out of range [0, {limit}]", tensor)
        return value

    def hash(self, obj: Any, key: str, tensor: str | None = None, optional: bool = False) -> str | None:
        value = self.get(obj, key, str, tensor, optional)
        if value is not None and not _HASH_RE.fullmatch(value):
            raise self.fail(f"field {key!r} is not an {HASH_PREFIX} hash", tensor)
        return value

    def file_name(self, obj: Any, key: str, tensor: str | None = None) -> str:
        value = self.get(obj, key, str, tensor)
        if not is_safe_file_name(value):
            raise self.fail(f"file name {value!r} is not a plain name inside the version directory", tensor)
        return value

    def files(self, items: Any) -> tuple[FileEntry, ...]:
        if not isinstance(items, list):
            raise self.fail("'files' must be a list")
        files = tuple(FileEntry(self.file_name(f, "name"), self.count(f, "size"), self.hash(f, "hash"))
                      for f in items)
        if len({f.name for f in files}) != len(files):
            raise self.fail("duplicate file names")
        return files


def _parse_manifest(body: Any, *, version: int, file: str, stream_id: str | None) -> Manifest:
    c = _Checker(version, file)
    _check_format(c, body)
    if c.get(body, "version", int) != version:
        raise c.fail(f"manifest claims version {body['version']}")
    if stream_id is not None and c.get(body, "stream_id", str) != stream_id:
        raise IncompatibleStreamError(
            f"manifest belongs to stream {body['stream_id']}, not to this stream ({stream_id})",
            version=version, file=file, hint="A manifest was copied in from another stream; remove it")
    kind = c.get(body, "kind", str)
    if kind not in (KEYFRAME, DELTA):
        raise c.fail(f"unknown kind {kind!r}")
    base = c.count(body, "base_version", MAX_VERSION, optional=True)
    keyframe_version = c.count(body, "keyframe_version", MAX_VERSION)
    chain_length = c.count(body, "chain_length", MAX_VERSION)
    if kind == KEYFRAME and (base is not None or keyframe_version != version or chain_length != 0):
        raise c.fail("a keyframe has no base, chain length 0 and is its own keyframe")
    if kind == DELTA and (base is None or base >= version or keyframe_version > base or chain_length < 1):
        raise c.fail("a delta needs a base version older than itself and a chain length of at least 1")
    files = c.files(c.get(body, "files", list))
    file_sizes = {f.name: f.size for f in files}
    allowed = KEYFRAME_ENCODINGS if kind == KEYFRAME else DELTA_ENCODINGS
    pieced = body["format_version"] >= PIECES_FORMAT_VERSION
    tensors = []
    for item in c.get(body, "tensors", list):
        tensors.append(_parse_tensor(c, item, allowed | {ENCODING_PIECES} if pieced else allowed, file_sizes))
    if len({t.name for t in tensors}) != len(tensors):
        raise c.fail("duplicate tensor names")
    metadata = c.get(body, "metadata", dict, optional=True) or {}
    writer = c.get(body, "writer", dict, optional=True) or {}
    return Manifest(version=version, kind=kind, base_version=base, keyframe_version=keyframe_version,
                    chain_length=chain_length, stream_id=c.get(body, "stream_id", str),
                    created=c.get(body, "created", str), files=files, tensors=tuple(tensors),
                    step=c.get(body, "step", int, optional=True), metadata=metadata, writer=writer,
                    format_version=body["format_version"])


def _check_format(c: _Checker, body: Any) -> None:
    if c.get(body, "format", str) != FORMAT_NAME:
        raise c.fail(f"not a {FORMAT_NAME} document")
    fv = c.get(body, "format_version", int)
    if fv > FORMAT_VERSION or fv < 1:
        raise IncompatibleStreamError(
            f"format version {fv} is not supported (this ckptstream reads up to {FORMAT_VERSION})",
            version=c.version, file=c.file, hint="Upgrade ckptstream to read this stream")


def _parse_tensor(c: _Checker, item: Any, allowed: frozenset[str], file_sizes: dict[str, int],
                  whole: TensorEntry | None = None) -> TensorEntry:
    """One element of ``tensors`` or, with ``whole`` (the tensor it belongs to), one of its ``pieces``."""
    if whole is None:
        name = c.get(item, "name", str)
        problem = tensor_name_problem(name)
        if problem is not None:
            raise c.fail(problem)
        dtype = c.get(item, "dtype", str, name)
        if dtype not in DTYPE_SIZES:
            raise c.fail(f"unknown dtype {dtype!r}", name)
    else:
        name, dtype = whole.name, whole.dtype
        if not isinstance(item, dict) or "name" in item or "dtype" in item:
            raise c.fail("a piece is an object without 'name' or 'dtype' (its tensor's are its own)", name)
    shape_list = c.get(item, "shape", list, name)
    if len(shape_list) > MAX_SHAPE_DIMS or not all(type(d) is int and 0 <= d <= MAX_FILE_BYTES for d in shape_list):
        raise c.fail(f"invalid shape {shape_list[:MAX_SHAPE_DIMS + 1]!r}", name)
    encoding = c.get(item, "encoding", str, name)
    if encoding not in allowed:
        raise c.fail(f"encoding {encoding!r} is not allowed here", name)
    # (its fields gathered, the entry made once: three copies of a frozen dataclass per tensor were a third of
    # parsing the manifest of a MoE model's thousands of tensors, on every update's path)
    fields: dict[str, Any] = {"name": name, "dtype": dtype, "shape": tuple(shape_list),
                              "hash": c.hash(item, "hash", name), "encoding": encoding,
                              "changed": c.count(item, "changed", optional=True, tensor=name)}
    itemsize = DTYPE_SIZES[dtype]
    nbytes = math.prod(fields["shape"]) * itemsize
    if nbytes > MAX_FILE_BYTES:
        raise c.fail("tensor is larger than any file may be", name)
    if whole is not None:
        offsets = c.get(item, "offsets", list, name)
        if len(offsets) > MAX_SHAPE_DIMS or not all(type(o) is int and 0 <= o <= MAX_FILE_BYTES for o in offsets):
            raise c.fail(f"invalid piece offsets {offsets[:MAX_SHAPE_DIMS + 1]!r}", name)
        fields["offsets"] = tuple(offsets)
    if encoding == ENCODING_PIECES:
        items = c.get(item, "pieces", list, name)
        piece_encodings = allowed - {ENCODING_PIECES}
        entry = TensorEntry(**fields)
        pieces = tuple(_parse_tensor(c, p, piece_encodings, file_sizes, entry) for p in items)
        problem = pieces_problem(entry.shape, pieces)
        if problem is not None:
            raise c.fail(problem, name)
        if entry.hash != pieces_hash(p.hash for p in pieces):
            raise c.fail("the tensor's hash is not the hash of its pieces' hashes", name)
        return dataclasses.replace(entry, pieces=pieces)
    if encoding == ENCODING_UNCHANGED:
        return TensorEntry(**fields)
    file = c.file_name(item, "file", name)
    if file not in file_sizes:
        raise c.fail(f"tensor is stored in {file!r}, which the manifest does not list", name)
    offset, length = c.count(item, "offset", tensor=name), c.count(item, "length", tensor=name)
    if offset + length > file_sizes[file]:
        raise c.fail(f"stored range [{offset}, {offset + length}) lies beyond the end of {file}", name)
    fields.update(file=file, offset=offset, length=length, stored_hash=c.hash(item, "stored_hash", name))
    if encoding == ENCODING_XOR_ZSTD and "check" in item:  # (null included: malformed, not absent)
        try:
            check = fields["check"] = ChangeCheck.from_json(item["check"])
        except ValueError as exc:
            raise c.fail(str(exc), name) from None
        if check.known and check.count > nbytes // itemsize:
            raise c.fail(f"its change check counts {check.count} changed elements of its {nbytes // itemsize}", name)
        if check.known and fields["changed"] is not None and check.count != fields["changed"]:
            raise c.fail(f"its change check counts {check.count} changed elements, its 'changed' "
                         f"{fields['changed']}", name)
    if encoding == ENCODING_RAW:
        if length != nbytes:
            raise c.fail(f"raw tensor stores {length} bytes but its shape and dtype need {nbytes}", name)
        return TensorEntry(**fields)
    chunk_list = c.get(item, "chunks", list, name)
    chunks = []
    layouts = (LAYOUT_DENSE, LAYOUT_SPARSE) if encoding == ENCODING_XOR_ZSTD else (LAYOUT_DENSE,)
    for chunk in chunk_list:
        if (type(chunk) is not list or len(chunk) != 3 or type(chunk[0]) is not int or type(chunk[1]) is not int
                or not 0 < chunk[0] <= MAX_CHUNK_BYTES or not 0 <= chunk[1] <= MAX_FILE_BYTES
                or chunk[0] % itemsize or chunk[2] not in layouts):
            raise c.fail(f"invalid chunk {chunk!r}", name)
        if chunk[2] == LAYOUT_DENSE and chunk[0] > MAX_ZSTD_RATIO * chunk[1]:
            raise c.fail(f"a chunk of {chunk[0]} bytes cannot be stored in a zstd frame of {chunk[1]}", name)
        chunks.append((chunk[0], chunk[1], chunk[2]))
    if sum(c[0] for c in chunks) != nbytes or sum(c[1] for c in chunks) != length:
        raise c.fail("chunk sizes do not add up to the tensor's and the stored range's sizes", name)
    return TensorEntry(**fields, shuffle=bool(c.get(item, "shuffle", bool, name)), chunks=tuple(chunks))


# ---------------------------------------------------------------------------------------- stream.json

def stream_format_version(kind: str) -> int:
    """The format version a writer gives the ``stream.json`` of a stream of ``kind``: 1 for weights (readers
    of version 1 read it), ``ADAPTER_FORMAT_VERSION`` for any other kind (they refuse it)."""
    return MANIFEST_FORMAT_VERSION if kind == STREAM_KIND_WEIGHTS else ADAPTER_FORMAT_VERSION


@dataclass(frozen=True)
class AdapterInfo:
    """What an adapter stream adapts (``stream.json``'s ``adapter``, FORMAT.md "Adapter streams"): the base
    model's name and, where known, its hash (``ckptstream.basehash.base_model_hash``); the adapter's LoRA
    rank (the largest of its ranks, what a server's ``--max-lora-rank`` must reach) and target modules, as its
    adapter_config.json gives them. Fixed when the stream is created, so a follower checks them without reading
    the asset."""

    base_name: str
    base_hash: str | None
    rank: int
    target_modules: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        base: dict[str, Any] = {"name": self.base_name}
        if self.base_hash is not None:
            base["hash"] = self.base_hash
        return {"base": base, "rank": self.rank, "target_modules": list(self.target_modules)}

    def problem(self) -> str | None:
        """Why a reader would refuse this block, or None."""
        if _label_problem(self.base_name) is not None:
            return f"base model name: {_label_problem(self.base_name)}"
        if self.base_hash is not None and not is_hash(self.base_hash):
            return f"base hash {self.base_hash!r} is not an {HASH_PREFIX} hash"
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or not 1 <= self.rank <= MAX_ADAPTER_RANK:
            return f"rank {self.rank!r} is not an integer in [1, {MAX_ADAPTER_RANK}]"
        for module in self.target_modules:
            if _label_problem(module) is not None:
                return f"target module: {_label_problem(module)}"
        if len(set(self.target_modules)) != len(self.target_modules):
            return "a target module is listed twice"
        return None

    @classmethod
    def _parse(cls, c: _Checker, body: Any) -> AdapterInfo:
        base = c.get(body, "base", dict)
        targets = c.get(body, "target_modules", list)
        if not all(isinstance(t, str) for t in targets):
            raise c.fail("'adapter.target_modules' must be a list of strings")
        info = cls(base_name=c.get(base, "name", str), base_hash=c.hash(base, "hash", optional=True),
                   rank=c.count(body, "rank", MAX_ADAPTER_RANK), target_modules=tuple(targets))
        problem = info.problem()
        if problem is not None:
            raise c.fail(f"'adapter': {problem}")
        return info


def _label_problem(value: object) -> str | None:
    """Why ``value`` cannot be a base-model or module name: a string of 1 to ``MAX_LABEL_BYTES`` bytes of
    UTF-8 without control characters."""
    if not isinstance(value, str):
        return f"{value!r} is not a string"
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return f"{value[:80]!r} is not valid UTF-8"
    if not 0 < size <= MAX_LABEL_BYTES or _CONTROL_RE.search(value):
        return f"{value[:80]!r} must have 1 to {MAX_LABEL_BYTES} bytes of UTF-8 and no control characters"
    return None


@dataclass(frozen=True)
class StreamInfo:
    """Stream-wide metadata (``stream.json``): identity, format version, non-weight asset files, and the
    stream's kind: ``weights`` (a model's full weights) or ``adapter`` (a LoRA adapter, ``adapter`` saying of
    which base; its ``adapter_config.json`` is an asset)."""

    stream_id: str
    created: str
    assets: tuple[FileEntry, ...] = ()
    format_version: int = 0
    """0: the lowest that holds the stream's kind (``stream_format_version``)."""
    kind: str = STREAM_KIND_WEIGHTS
    adapter: AdapterInfo | None = None

    def __post_init__(self) -> None:
        if not self.format_version:
            object.__setattr__(self, "format_version", stream_format_version(self.kind))

    def problem(self) -> str | None:
        """Why a reader would refuse this ``stream.json`` (FORMAT.md, "`stream.json`"), or None."""
        reserved = [a.name for a in self.assets if is_reserved_asset_name(a.name)]
        if reserved:
            return (f"asset names {reserved} are reserved for weights, their index or the materialization marker: "
                    "they would replace the published weights")
        large = [a.name for a in self.assets if a.size > MAX_ASSET_BYTES]
        if large:
            return f"assets {large} are over the {MAX_ASSET_BYTES}-byte limit of an asset"
        if self.kind not in STREAM_KINDS:
            return f"unknown stream kind {self.kind!r} (this ckptstream knows {', '.join(STREAM_KINDS)})"
        if self.kind != STREAM_KIND_WEIGHTS and self.format_version < ADAPTER_FORMAT_VERSION:
            return f"a stream of kind {self.kind!r} needs format version {ADAPTER_FORMAT_VERSION} or later"
        if (self.adapter is not None) != (self.kind == STREAM_KIND_ADAPTER):
            return "an adapter stream, and only an adapter stream, has an 'adapter' block"
        if self.adapter is not None:
            if ADAPTER_CONFIG_FILE not in {a.name for a in self.assets}:
                return f"an adapter stream lacks the asset {ADAPTER_CONFIG_FILE}"
            problem = self.adapter.problem()
            if problem is not None:
                return f"'adapter': {problem}"
        return None

    def to_bytes(self) -> bytes:
        """Strict JSON of ``stream.json``; ValueError for a stream a reader would refuse. A weights stream's
        has no ``kind`` (as written before kinds existed)."""
        problem = self.problem()
        if problem is not None:
            raise ValueError(problem)
        body: dict[str, Any] = {"format": FORMAT_NAME, "format_version": self.format_version,
                                "stream_id": self.stream_id, "created": self.created}
        if self.kind != STREAM_KIND_WEIGHTS:
            body["kind"] = self.kind
        if self.adapter is not None:
            body["adapter"] = self.adapter.to_json()
        body["assets"] = [a.to_json() for a in self.assets]
        return dumps_json(body, what=STREAM_FILE)

    @classmethod
    def from_bytes(cls, raw: bytes) -> StreamInfo:
        """Parse and validate an untrusted ``stream.json`` (UnsafeManifestError / IntegrityError; an unknown
        kind is an UnsafeManifestError naming stream.json)."""
        c = _Checker(None, STREAM_FILE)
        if len(raw) > MAX_STREAM_FILE_BYTES:
            raise c.fail(f"{STREAM_FILE} is {len(raw)} bytes, over the {MAX_STREAM_FILE_BYTES} limit")
        body = loads_json(raw, version=None, file=STREAM_FILE)
        _check_format(c, body)
        adapter = c.get(body, "adapter", dict, optional=True)
        info = cls(stream_id=c.get(body, "stream_id", str), created=c.get(body, "created", str),
                   assets=c.files(c.get(body, "assets", list)), format_version=body["format_version"],
                   kind=c.get(body, "kind", str, optional=True) or STREAM_KIND_WEIGHTS,
                   adapter=None if adapter is None else AdapterInfo._parse(c, adapter))
        problem = info.problem()
        if problem is not None:
            raise c.fail(problem)
        return info


# --------------------------------------------------------------------------------------------- bundles

@dataclass(frozen=True)
class BundleIndex:
    """The index of a bundle (``ckptstream-bundle.json``, FORMAT.md "Bundle index"): the stream, the
    versions carried, the chain an incremental bundle's destination must hold, and every following member
    (name, size, hash) in archive order."""

    stream_id: str
    versions: tuple[int, ...]
    members: tuple[FileEntry, ...]
    since: int | None = None
    requires: tuple[tuple[int, str], ...] = ()  # (version, hash of its manifest's bytes), oldest first
    format_version: int = BUNDLE_FORMAT_VERSION

    def to_bytes(self) -> bytes:
        """Strict JSON of the index (ValueError for a layout an importer would refuse)."""
        raw = dumps_json({"format": BUNDLE_FORMAT_NAME, "bundle_format_version": self.format_version,
                          "stream_id": self.stream_id, "versions": list(self.versions), "since": self.since,
                          "requires": [{"version": v, "manifest_hash": h} for v, h in self.requires],
                          "members": [m.to_json() for m in self.members]}, what=BUNDLE_INDEX_FILE)
        try:
            BundleIndex.from_bytes(raw)
        except IntegrityError as exc:
            raise ValueError(f"not a valid bundle index: {exc}") from None
        return raw

    @classmethod
    def from_bytes(cls, raw: bytes) -> BundleIndex:
        """Parse and validate an untrusted index: strict JSON within its limit, a known format, and members
        in exactly the bundle layout (FORMAT.md, "Bundles").

        Raises:
            UnsafeManifestError / IntegrityError: anything else, naming the index.
            IncompatibleStreamError: a newer bundle format version.
        """
        c = _Checker(None, BUNDLE_INDEX_FILE)
        if len(raw) > MAX_BUNDLE_INDEX_BYTES:
            raise c.fail(f"the index is {len(raw)} bytes, over the {MAX_BUNDLE_INDEX_BYTES} limit")
        body = loads_json(raw, version=None, file=BUNDLE_INDEX_FILE)
        if c.get(body, "format", str) != BUNDLE_FORMAT_NAME:
            raise c.fail(f"not a {BUNDLE_FORMAT_NAME} index")
        fv = c.get(body, "bundle_format_version", int)
        if not 1 <= fv <= BUNDLE_FORMAT_VERSION:
            raise IncompatibleStreamError(
                f"bundle format version {fv} is not supported (this ckptstream reads up to {BUNDLE_FORMAT_VERSION})",
                file=BUNDLE_INDEX_FILE, hint="Upgrade ckptstream to import this bundle")
        versions = c.get(body, "versions", list)
        if not versions or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_VERSION
                                   for v in versions) or versions != sorted(set(versions)):
            raise c.fail("'versions' must be strictly ascending version numbers, at least one")
        since = c.count(body, "since", MAX_VERSION, optional=True)
        requires = []
        for item in c.get(body, "requires", list):
            requires.append((c.count(item, "version", MAX_VERSION), c.hash(item, "manifest_hash")))
        chain = [v for v, _ in requires]
        if chain != sorted(set(chain)) or (since is None) != (not chain) or (chain and chain[-1] != since):
            raise c.fail("'requires' must be the chain of 'since', oldest first, ending with it (empty without)")
        members = c.get(body, "members", list)
        entries = tuple(FileEntry(c.get(m, "name", str), c.count(m, "size"), c.hash(m, "hash")) for m in members)
        _check_bundle_layout(c, [e.name for e in entries], versions)
        return cls(stream_id=c.get(body, "stream_id", str), versions=tuple(versions), members=entries,
                   since=since, requires=tuple(requires), format_version=fv)


def bundle_layout(assets: Iterable[str], versions: Mapping[int, Iterable[str]]) -> list[str]:
    """The member names of a bundle after its index, in archive order: ``stream.json``, the assets sorted,
    then per version (ascending) its data files sorted and its manifest last."""
    names = [STREAM_FILE, *(asset_path(a) for a in sorted(assets))]
    for version in sorted(versions):
        names.extend(data_path(version, f) for f in sorted(versions[version]))
        names.append(manifest_path(version))
    return names


def _check_bundle_layout(c: _Checker, names: list[str], versions: list[int]) -> None:
    """Refuse member names that are not exactly ``bundle_layout`` of some assets and of ``versions``."""
    assets: list[str] = []
    files: dict[int, list[str]] = {v: [] for v in versions}
    for name in names:
        directory, _, leaf = name.partition("/")
        if directory == ASSETS_DIR and is_safe_file_name(leaf):
            assets.append(leaf)
        elif directory == VERSIONS_DIR and leaf.count("/") == 1:
            version, file = leaf.split("/")
            number = parse_version_name(version)
            if number not in files or not is_safe_file_name(file) or version != version_name(number):
                raise c.fail(f"member {name[:300]!r} is not a data file of a carried version")
            files[number].append(file)
        elif name != STREAM_FILE and not (directory == MANIFESTS_DIR and parse_version_name(leaf) in files
                                          and leaf == f"{version_name(parse_version_name(leaf))}.json"):
            raise c.fail(f"member {name[:300]!r} is not a file of the stream's layout")
    if len(set(names)) != len(names) or names != bundle_layout(assets, files):
        raise c.fail("the members are not in the bundle layout (stream.json, assets sorted, then per version its "
                     "data files sorted and its manifest last), or some are missing or repeated")
