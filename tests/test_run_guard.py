"""The test run's guards (tests/run_guard.py): a hung or crashed test costs one rerun, not the run."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest_plugins = ("pytester",)

# A test that misbehaves on its first attempt only (a marker file remembers it), and a quick one.
FIRST_ATTEMPT_ONLY = """
import os, signal, time, ctypes
from pathlib import Path

def test_quick():
    pass

def test_misbehaves_once():
    marker = Path(__file__).with_suffix(".attempted")
    if not marker.exists():
        marker.touch()
        {action}

def test_after_it():
    pass
"""


def run_inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, action: str,
              **env: str) -> pytest.RunResult:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    pytester.makepyfile(test_inner=FIRST_ATTEMPT_ONLY.format(action=action))
    return pytester.runpytest_subprocess(
        "-p", "tests.run_guard", "-n", "2", "--dist", "loadfile", "-rR", "--reruns", "1",
        "--only-rerun", "crashed while running", timeout=120)


def outcomes(result: pytest.RunResult) -> dict[str, int]:
    """The inner run's test outcomes, without its warning count (a loaded machine can add a
    warning that says nothing about the guards)."""
    return {k: v for k, v in result.parseoutcomes().items() if k not in ("warning", "warnings")}


def test_a_hang_that_holds_the_gil_ends_its_worker_and_the_test_runs_again(pytester, monkeypatch):
    # libc's sleep through PyDLL keeps the GIL: no Python-level timeout can run meanwhile.
    result = run_inner(pytester, monkeypatch, "ctypes.PyDLL(None).sleep(600)", INFERNIX_TEST_HANG_LIMIT="3")
    output = result.stdout.str() + result.stderr.str()
    assert result.ret == 0, output
    assert "Timeout (0:00:03)!" in output and "test_misbehaves_once" in output  # the stacks
    assert outcomes(result) == {"passed": 3, "rerun": 1}


def test_a_crashed_worker_s_test_runs_again_under_loadfile(pytester, monkeypatch):
    result = run_inner(pytester, monkeypatch, "os.kill(os.getpid(), signal.SIGSEGV)")
    assert result.ret == 0, result.stdout.str()
    assert outcomes(result) == {"passed": 3, "rerun": 1}
    result.stdout.fnmatch_lines(["*RERUN*test_misbehaves_once*", "*PASSED*test_misbehaves_once*"])


def test_a_test_that_crashes_twice_fails(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makepyfile(test_inner="import os, signal\ndef test_crashes():\n    os.kill(os.getpid(), signal.SIGSEGV)\n")
    result = pytester.runpytest_subprocess(
        "-p", "tests.run_guard", "-n", "2", "--dist", "loadfile", "--reruns", "1",
        "--only-rerun", "crashed while running", timeout=120)
    assert result.ret == 1
    assert outcomes(result) == {"failed": 1, "rerun": 1}


def test_a_stalled_run_aborts_its_workers_and_goes_on(pytester, monkeypatch):
    result = run_inner(pytester, monkeypatch, "time.sleep(600)", INFERNIX_TEST_HANG_LIMIT="0",
                       INFERNIX_TEST_STALL_LIMIT="4")
    output = result.stdout.str() + result.stderr.str()
    assert result.ret == 0, output
    assert "[stall guard] no test reported" in output and "test_inner.py::test_misbehaves_once" in output
    assert outcomes(result) == {"passed": 3, "rerun": 1}
