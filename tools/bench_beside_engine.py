#!/usr/bin/env python3
"""An engine-like thread's step beside a thread running Python, with the interpreter's default switch interval and
inside ``beside_engine()`` (``ckptstream/vllm_loader/inplace/beside_engine.py``), side by side in one run.

The engine-like step does a little Python then waits (the lock let go, as a CUDA wait does) ``--waits`` times;
the other thread runs a Python loop (as a staging maps thousands of tensors). Printed: the step's median alone
and beside it, and the other thread's time alone and beside the engine, medians over ``--repeat`` rounds.

    python tools/bench_beside_engine.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstream.vllm_loader.inplace.beside_engine import BESIDE_ENGINE_SWITCH_INTERVAL_S, beside_engine  # noqa: E402


def engine_steps(waits: int, stop: threading.Event, steps: list[float]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        for _ in range(waits):
            sum(range(200))  # the next launch
            time.sleep(0.0002)  # a wait on the device: the interpreter's lock let go
        steps.append(time.perf_counter() - started)


def python_work(rounds: int) -> float:
    started = time.perf_counter()
    total = 0
    for _ in range(rounds):
        for i in range(1000):
            total += i * i
    return time.perf_counter() - started


def measure(waits: int, rounds: int, inside: bool) -> tuple[float, float, float]:
    """(the step's median alone, its median beside the work, the work's seconds beside the engine)."""
    alone: list[float] = []
    stop = threading.Event()
    engine = threading.Thread(target=engine_steps, args=(waits, stop, alone))
    engine.start()
    time.sleep(0.3)
    stop.set()
    engine.join()
    beside: list[float] = []
    stop = threading.Event()
    engine = threading.Thread(target=engine_steps, args=(waits, stop, beside))
    engine.start()
    if inside:
        with beside_engine():
            work = python_work(rounds)
    else:
        work = python_work(rounds)
    stop.set()
    engine.join()
    return statistics.median(alone), statistics.median(beside), work


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waits", type=int, default=20, help="waits per engine step")
    parser.add_argument("--rounds", type=int, default=3000, help="the Python work's size")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work_alone = statistics.median(python_work(args.rounds) for _ in range(args.repeat))
    print(f"Python {sys.version.split()[0]}; the Python work alone: {work_alone:.3f} s\n\n"
          "| switch interval | engine step alone | beside the work | the work beside the engine |\n|---|---|---|---|")
    for inside in (False, True):
        rows = [measure(args.waits, args.rounds, inside) for _ in range(args.repeat)]
        step_alone, step_beside, work = (statistics.median(column) for column in zip(*rows))
        interval = BESIDE_ENGINE_SWITCH_INTERVAL_S if inside else sys.getswitchinterval()
        print(f"| {interval * 1e3:g} ms{' (beside_engine)' if inside else ''} | {step_alone * 1e3:.1f} ms "
              f"| {step_beside * 1e3:.1f} ms | {work:.3f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
