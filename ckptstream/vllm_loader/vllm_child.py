"""vLLM as ``serve``'s child process: started (from a terminal, in a session of its own) with its output passed on
(to a log file or stderr) and its last lines kept (``last_error_line``: vLLM's own error line for a start that
fails), watched, and stopped: on a stop request (Ctrl-C, SIGTERM, SIGHUP), by SIGTERM, then every process it started
that is left, and the shared memory they left (``shm.EngineSegments``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from typing import IO, Any, Callable, Sequence

from ..process import die_with_parent, stop_process
from ..shm import SHM_DIR, EngineSegments

log = logging.getLogger("ckptstream.serve")

OUTPUT_LINES_KEPT = 400
"""vLLM output lines kept to report a failed start (the root cause comes well before the last line)."""

# An exception line of a Python traceback, after vLLM's "(Proc pid=N) LEVEL date time [file:line] " prefix.
_LOG_PREFIX = re.compile(r"^(\([^)]*\)\s+)?([A-Z]+\s+\d\d-\d\d \d\d:\d\d:\d\d\s+\[[^\]]*\]\s+)?")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception)):\s*\S")
# vLLM's wrappers that point back at the root cause instead of saying it.
_DEFERRING = ("root cause", "see stack trace")
_CONTINUATION_LINES = 2
_NOT_CONTINUATION = ("Traceback", "File ", "For further information", "The above exception")


def last_error_line(lines: Sequence[str]) -> str | None:
    """vLLM's own last error line in its output: the last exception line that states a cause (vLLM's
    "see root cause above" wrappers skipped), else the last exception line, else the last line. Lines
    that continue an exception's message (pydantic's field and reason) are appended after ``; ``."""
    texts = [_LOG_PREFIX.sub("", line.rstrip(), count=1) for line in lines]
    found = [i for i, text in enumerate(texts) if _EXCEPTION_LINE.match(text)]
    stating = [i for i in found if not any(d in texts[i].lower() for d in _DEFERRING)]
    if not found:
        rest = [text.strip() for text in texts if text.strip()]
        return rest[-1] if rest else None
    at = (stating or found)[-1]
    parts = [texts[at].strip()]
    for line in lines[at + 1:at + 1 + _CONTINUATION_LINES]:
        if not line.strip() or _LOG_PREFIX.match(line).group(0) or line.lstrip().startswith(_NOT_CONTINUATION):
            break
        parts.append(line.strip())
    return "; ".join(parts)


class OutputTail:
    """Passes a child's output on (``write`` per line) and keeps its last lines."""

    def __init__(self, source: IO[bytes], write: Callable[[str], object]):
        self.lines: collections.deque[str] = collections.deque(maxlen=OUTPUT_LINES_KEPT)
        self._source, self._write = source, write
        self.thread = threading.Thread(target=self._copy, daemon=True, name="ckptstream-vllm-output")
        self.thread.start()

    def _copy(self) -> None:
        for raw in iter(self._source.readline, b""):
            line = raw.decode("utf-8", "replace")
            self.lines.append(line)
            try:
                self._write(line)
            except (OSError, ValueError):  # the sink went away (closed log, broken pipe): keep the tail
                pass


def _writer(stream: IO[str]) -> Callable[[str], None]:
    def write(line: str) -> None:
        stream.write(line)
        stream.flush()

    return write


def start_child(command: list[str], env: dict[str, str], vllm_log: str | os.PathLike[str] | None
                ) -> tuple[subprocess.Popen[bytes], OutputTail, IO[str] | None]:
    """Start vLLM with its output passed on (to ``vllm_log`` or stderr) and its last lines kept. From the main thread
    (the CLI, where a terminal's signals come), in a session of its own: Ctrl-C reaches serve alone, which stops the
    follower, then vLLM (reaching vLLM too, it stopped vLLM's engine first, and serve exited 1). Elsewhere (a fleet's
    actor, a background serve) in the caller's process group, which Ray kills whole with a dead actor."""
    log_file = open(vllm_log, "a", encoding="utf-8") if vllm_log is not None else None
    try:
        child = subprocess.Popen(command, env=env, preexec_fn=die_with_parent, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=threading.current_thread() is threading.main_thread())
    except BaseException:
        if log_file is not None:
            log_file.close()
        raise
    assert child.stdout is not None
    return child, OutputTail(child.stdout, _writer(log_file or sys.stderr)), log_file


def watch_child(child: subprocess.Popen[bytes], stop: threading.Event, on_exit: Callable[[int], object] | None
                ) -> threading.Event:
    """Watch vLLM's process (not its output, which its children may keep open): the moment it exits, tell
    ``on_exit`` its exit code, set the returned event, then ``stop``."""
    died = threading.Event()

    def watch() -> None:
        code = child.wait()
        died.set()
        if on_exit is not None:
            try:
                on_exit(code)
            except Exception:  # noqa: BLE001 - the caller's hook: serve still stops
                log.exception("on_exit hook failed")
        stop.set()

    threading.Thread(target=watch, daemon=True, name="ckptstream-vllm").start()
    return died


def stop_on_signals(stop: threading.Event, child: subprocess.Popen[bytes]) -> tuple[dict[int, Any], threading.Event]:
    """Ctrl-C, SIGTERM and SIGHUP (the terminal closed) set ``stop`` (from the main thread only); another one while
    serve stops vLLM kills vLLM's processes at once (``kill_group``) rather than leave them. Returns the previous
    handlers and an event telling a stop request from vLLM exiting on its own."""
    signalled = threading.Event()

    def on_signal(*_: object) -> None:
        if signalled.is_set():
            kill_group(child)
        signalled.set()
        stop.set()

    if threading.current_thread() is not threading.main_thread():
        return {}, signalled
    handled = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # (ignored, as under nohup: serve outlives the terminal)
        handled.append(signal.SIGHUP)
    return {sig: signal.signal(sig, on_signal) for sig in handled}, signalled


def kill_group(child: subprocess.Popen[bytes]) -> None:
    """SIGKILL every process left in vLLM's process group, where vLLM leads one (``start_child``)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)


def stop_child(child: subprocess.Popen[bytes], output: OutputTail, log_file: IO[str] | None,
               segments: EngineSegments) -> bool:
    """Stop vLLM (if it still runs), remove the shared memory it left (``segments``, noted while it ran) and
    close its log; returns whether it had exited on its own."""
    exited_alone = child.poll() is not None
    if not exited_alone:
        segments.note(child.pid)
        stop_process(child, timeout=30)
    kill_group(child)  # (an engine process its parent lost track of)
    removed = segments.remove_orphans()
    if removed:
        log.info("removed the shared memory vLLM left: %s", ", ".join(f"{SHM_DIR}/{name}" for name in removed))
    output.thread.join(timeout=10)
    if log_file is not None:
        log_file.close()
    return exited_alone
