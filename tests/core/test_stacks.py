"""``kill -USR2`` prints a process's thread stacks and it goes on (lit_offpolicy.core.stacks)."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """\
import io, os, signal, sys, threading, time
from lit_offpolicy.core.stacks import stacks_on_sigusr2
sys.stderr = io.StringIO()  # as under pytest's capture or a logging redirect: not the process's stderr
stacks_on_sigusr2()
def waits_for_ever(): threading.Event().wait()
threading.Thread(target=waits_for_ever, daemon=True).start()
os.kill(os.getpid(), signal.SIGUSR2)
time.sleep(0.2)
print('went on')
"""


def test_sigusr2_prints_every_thread_s_stack_to_the_process_s_stderr_and_it_goes_on():
    """The main thread's stack and that of a second one blocked in a wait reach the real stderr (the
    program replaced ``sys.stderr``), and the program then finishes normally."""
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == "went on\n", result.stderr[-2000:]
    assert result.stderr.count("hread 0x") == 2, result.stderr  # "Thread 0x…" and "Current thread 0x…"
    assert "in waits_for_ever" in result.stderr and "<module>" in result.stderr


CRASH = """\
import ctypes, threading
from lit_offpolicy.core.stacks import stacks_on_crash
stacks_on_crash()
def waits_for_ever(): threading.Event().wait()
threading.Thread(target=waits_for_ever, daemon=True).start()
def crashes(): ctypes.string_at(0)  # a read of address 0: SIGSEGV
crashes()
"""


def test_a_crash_in_native_code_prints_every_thread_s_stack():
    """A rank that died of SIGSEGV said only "terminated with code -11" (Lightning's launcher): the
    stacks name where it was."""
    result = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True, timeout=60)
    assert result.returncode == -11, (result.returncode, result.stderr[-2000:])
    assert "Segmentation fault" in result.stderr and "in crashes" in result.stderr, result.stderr
    assert "in waits_for_ever" in result.stderr
