"""A pytest plugin that keeps one hung or crashed test from stalling a whole run.

jaxlib 0.10.2's CPU runtime has deadlocked (every thread waiting on a futex: docs/model_config.md
names a cause, now fixed), and a hang inside C++ code that holds the GIL is out of reach of anything
written in Python:
pytest-timeout's "thread" method never ran in such a case, and two CI runs printed nothing after
97-98% of the tests until their 90-minute limit. Three guards, each small:

- **A hard limit a test cannot hold off.** A process that runs tests arms
  `faulthandler.dump_traceback_later(exit=True)` for each test (setup, call and teardown) and for
  its start-up up to the end of collection. Its watchdog is a C thread that needs no GIL: past
  the limit it writes every thread's Python stack to the real stderr (the CI log, also from an
  xdist worker) and ends the process. Time a worker spends waiting for work is not limited.
- **A crashed test runs once more.** pytest-rerunfailures reruns a test whose xdist worker died
  only through the scheduler's `mark_test_pending`, which `--dist loadfile` does not implement:
  such a crash was reported as a failure. `LoadFileRerunScheduling` implements it; the rest of
  the run is unchanged (xdist already puts a crashed worker's file back in the queue).
- **A stalled run ends.** The xdist controller watches for test reports; after `STALL_LIMIT_S`
  with none, it names the tests in flight and sends SIGABRT to its workers (faulthandler, which
  pytest enables on stderr, prints their stacks; xdist replaces them and the rerun applies). If
  nothing is reported for as long again, it ends the run with status 3.

`INFERNIX_TEST_HANG_LIMIT` sets the per-test limit in seconds (0 turns the first guard off),
`INFERNIX_TEST_STALL_LIMIT` the controller's.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # pytest without xdist: nothing to schedule
    LoadFileScheduling = None

# The longest test of the suite takes ~45 s on 2 busy cores (a module's engines built in its
# first test's setup); start-up and collection take ~15 s.
DEFAULT_HANG_LIMIT_S = 300.0
# Longer than a hung test's limit plus a replacement worker's start-up and its rerun.
STALL_LIMIT_S = 900.0

_STREAM = pytest.StashKey[IO[str]]()


def hang_limit_s() -> float:
    return float(os.environ.get("INFERNIX_TEST_HANG_LIMIT", DEFAULT_HANG_LIMIT_S))


def runs_tests(config: pytest.Config) -> bool:
    """A process that runs tests: an xdist worker, or pytest without workers (not xdist's controller).

    Right from `pytest_configure` on (xdist registers its controller in a `pytest_configure` of
    its own, so which plugin is registered depends on the order of the hooks)."""
    return hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)


def _arm(config: pytest.Config) -> None:
    """Start the watchdog; past the limit it prints every thread's stack (the test's function
    among them) and ends the process, which xdist reports as a crash of the test it was running."""
    if _STREAM in config.stash:
        faulthandler.dump_traceback_later(hang_limit_s(), exit=True, file=config.stash[_STREAM])


def _disarm(config: pytest.Config) -> None:
    if _STREAM in config.stash:
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    if runs_tests(config):
        if hang_limit_s() > 0:
            # Output capture is suspended while plugins configure: fd 2 is the real stderr here.
            config.stash[_STREAM] = os.fdopen(os.dup(2), "w")
            _arm(config)  # start-up and collection
    else:  # xdist's controller
        config.pluginmanager.register(StallGuard(os.fdopen(os.dup(2), "w")), "infernix-stall-guard")


def pytest_collection_finish(session: pytest.Session) -> None:
    _disarm(session.config)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _arm(item.config)
    yield
    _disarm(item.config)


def pytest_unconfigure(config: pytest.Config) -> None:
    _disarm(config)
    stream = config.stash.get(_STREAM, None)
    if stream is not None:
        stream.close()


if LoadFileScheduling is not None:

    class LoadFileRerunScheduling(LoadFileScheduling):
        """`--dist loadfile` with a crashed test rerun (see the module's docstring)."""

        def mark_test_pending(self, item: str) -> None:
            """Nothing to do: when the worker died, `remove_node` put its unfinished file back
            in the queue with the crashed test first."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if LoadFileScheduling is not None and config.getvalue("dist") == "loadfile":
        return LoadFileRerunScheduling(config, log)
    return None


class StallGuard:
    """The xdist controller's watch over test reports (see the module's docstring)."""

    def __init__(self, stream: IO[str], limit_s: float | None = None) -> None:
        self.stream = stream
        self.limit_s = float(os.environ.get("INFERNIX_TEST_STALL_LIMIT", STALL_LIMIT_S)) if limit_s is None else limit_s
        self.last_report = time.monotonic()
        self.in_flight: set[str] = set()
        self.aborted_workers = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="infernix-stall-guard", daemon=True)
        self.thread.start()

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self.in_flight.add(nodeid)
        self.last_report = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.last_report = time.monotonic()
        self.aborted_workers = False
        if report.when == "teardown" or report.outcome == "rerun" or report.when == "???":
            self.in_flight.discard(report.nodeid)

    def pytest_unconfigure(self) -> None:
        self.stop.set()
        self.thread.join()
        self.stream.close()

    def _say(self, text: str) -> None:
        self.stream.write(f"\n[stall guard] {text}\n")
        self.stream.flush()

    def _watch(self) -> None:
        while not self.stop.wait(min(10.0, self.limit_s / 4)):
            idle = time.monotonic() - self.last_report
            if idle < self.limit_s:
                continue
            running = ", ".join(sorted(self.in_flight)) or "none"
            if not self.aborted_workers:
                self._say(f"no test reported for {idle:.0f} s; in flight: {running}. "
                          "Sending SIGABRT to the workers (their stacks follow).")
                for pid in _child_pids():
                    try:
                        os.kill(pid, signal.SIGABRT)
                    except ProcessLookupError:
                        pass
                self.aborted_workers = True
                self.last_report = time.monotonic()
            else:
                self._say(f"still no test reported {idle:.0f} s after the workers were aborted; "
                          f"in flight: {running}. Ending the run.")
                os._exit(3)


def _child_pids() -> list[int]:
    """This process's children (the xdist workers), from /proc."""
    pids: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(pids))
