"""The trusted test harness: all of a sample's tests in one sandbox run, each in a child of its own.

This file is the program the sandbox runs (stdlib only: ``CodeExecutionReward`` sends its source). It
forks a :class:`Zygote`, reads one JSON payload on stdin (``{"nonce", "timeout_s", "output_bytes",
"tests": [...]}``), runs the tests one after another, each in a child the zygote forks, with its own
deadline, CPU limit and output cap, and writes one line per test as it ends: ``<nonce> <JSON outcome>``
(a line that is not there failed). Two kinds of test:

- ``{"program", "stdin"}`` (stdin/stdout and call layouts): the child runs the program on that input as
  a script; its exit status and stdout (base64) come back, and the reward compares them.
- ``{"code", "check"}`` (MBPP's asserts, HumanEval's ``check``): the child runs ``code`` and serves its
  names; the harness runs ``check`` in its own process, where a name of the program's is a proxy
  (:class:`Remote`). Values cross as data (:func:`encode`), so the test compares real builtins built by
  the harness, never an object of the program's. It passes when ``check`` ran to its end.

The program cannot pass a test by exiting early (``exited_early``), by a value whose class lies about
equality, order, truth or length (``lying_equality``), by printing a verdict (its stdout is a pipe to
the harness; lines carry a nonce it never sees: the zygote was forked before it was read), by patching
builtins or ``math`` (the test's are the harness's own), or by reading the harness's memory (harness
and zygote are not dumpable), or by redefining a function its prompt gives (the test's is the prompt's:
``code.prompt_functions``). Not covered: a test calling another function of the program's runs its
version; honest results of the program's own classes (dataclasses) fail, as do tests of in-place
mutation (arguments cross as copies); a program that signals the harness (same user id) fails all of
the sample's tests; a test that ``eval``s a returned string runs it here. docs/rewards.md has the list.
"""

from __future__ import annotations

import ast
import atexit
import base64
import builtins
import collections
import contextlib
import importlib
import json
import math
import os
import resource
import selectors
import signal
import socket
import sys
import time
import types

MESSAGE_BYTES = 16 * 2**20
"""The largest message a child may send the harness (a value, or its names)."""
TAIL_BYTES = 2000
"""The end of a child's stderr that comes back with a failed test (to say what went wrong)."""
ITERATOR_ITEMS = 100_000
"""An iterator returned to a test is read to its end up to this many items (more: the call raises)."""
LYING_METHODS = (
    "__eq__",
    "__ne__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__bool__",
    "__len__",
    "__hash__",
)
"""A class of the program's that defines one of these (itself or a base of its own) lies to a test."""
OUTCOMES = ("passed", "failed", "exited_early", "lying_equality", "timed_out", "output_exceeded", "ran")
"""How a test ends; ``ran``: a stdin test that ended by itself (the reward judges its stdout)."""
KILL_WAIT_S = 5.0
"""Seconds the harness waits for a killed child's exit status before it replaces the zygote."""
PR_SET_DUMPABLE = 4


# ------------------------------------------------------------------ values as data, both ways


def encode(value, other):
    """``value`` as JSON data: None, bool, int, float and str as themselves, a list as an array, other
    builtin values as ``{"tag": data}``; ``other(value)`` gives the data of anything else."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode(item, other) for item in value]
    if kind in (tuple, set, frozenset, collections.deque):
        return {kind.__name__: [encode(item, other) for item in value]}
    if kind in (dict, collections.OrderedDict, collections.Counter, collections.defaultdict):
        tag = {collections.OrderedDict: "OrderedDict", collections.Counter: "Counter"}.get(kind, "dict")
        return {tag: [[encode(k, other), encode(v, other)] for k, v in value.items()]}
    if kind in (bytes, bytearray):
        return {kind.__name__: value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    if kind is range:
        return {"range": [value.start, value.stop, value.step]}
    return other(value)


def decode(data, other):
    """The value ``encode`` gave ``data`` for; ``other(tag, payload)`` for the tags it does not know."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(item, other) for item in data]
    if type(data) is not dict or len(data) != 1:
        raise ValueError(f"not an encoded value: {str(data)[:100]}")
    ((tag, payload),) = data.items()
    if tag in ("tuple", "set", "frozenset", "deque"):
        maker = collections.deque if tag == "deque" else getattr(builtins, tag)
        return maker(decode(item, other) for item in payload)
    if tag in ("dict", "OrderedDict", "Counter"):
        pairs = {decode(k, other): decode(v, other) for k, v in payload}
        return pairs if tag == "dict" else getattr(collections, tag)(pairs)
    if tag in ("bytes", "bytearray"):
        return getattr(builtins, tag).fromhex(payload)
    if tag == "complex":
        return complex(*payload)
    if tag == "range":
        return range(*payload)
    if tag in ("keys", "values", "items", "iterator"):
        items = [decode(item, other) for item in payload]
        views = {
            "keys": lambda: dict.fromkeys(items).keys(),
            "values": lambda: dict(enumerate(items)).values(),
            "items": lambda: dict(items).items(),
            "iterator": lambda: iter(items),
        }
        return views[tag]()
    return other(tag, payload)


def lies(kind: type) -> bool:
    """Whether a class of the program's own (not the standard library's) among ``kind``'s defines a
    comparison, truth or length method: its values could pass any test."""
    own = [
        c for c in kind.__mro__ if c.__module__ not in sys.stdlib_module_names and c.__module__ != "builtins"
    ]
    return any(name in vars(c) for c in own for name in LYING_METHODS)


# ------------------------------------------------------------------ the child (the program's side)


def child(mode: str, cpu_seconds: int, request_fd: int, response_fd: int) -> None:
    """Run the code of the first request; ``stdin``: as a script, on this process's stdin; ``rpc``: then
    send its names and answer calls (``{"op": "call"|"getattr", "ref", ...}``) until the harness is done."""
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    requests, responses = os.fdopen(request_fd, "rb"), os.fdopen(response_fd, "wb")
    code = json.loads(requests.readline())["code"]
    module = types.ModuleType("__main__")
    module.__file__, sys.argv, sys.modules["__main__"] = "solution.py", ["solution.py"], module
    if mode == "stdin":
        requests.close()
        responses.close()
        run_as_script(code, module.__dict__)
    sys.set_int_max_str_digits(0)
    objects: dict[int, object] = {}

    def send(message: dict) -> None:
        responses.write(json.dumps(message).encode() + b"\n")
        responses.flush()

    def reference(value) -> dict:
        if isinstance(value, types.ModuleType):
            return {"module": value.__name__}
        objects[id(value)] = value
        return {"ref": id(value)}

    def as_data(value) -> dict:
        """What ``encode`` does not know: a liar, an honest subclass of a builtin (as the builtin), a
        dict view or a builtin iterator (its items), else a reference."""
        kind = type(value)
        if lies(kind):
            return {"lying": kind.__qualname__}
        for base in (int, float, str, bytes, tuple, list, set, frozenset, dict):
            if isinstance(value, base):
                return encode(base(value), as_data)
        view = {type({}.keys()): "keys", type({}.values()): "values", type({}.items()): "items"}.get(kind)
        if view or (kind.__module__ in ("builtins", "itertools") and hasattr(value, "__next__")):
            items = [encode(item, as_data) for item, _ in zip(value, range(ITERATOR_ITEMS + 1), strict=False)]
            if len(items) > ITERATOR_ITEMS:
                raise ValueError(f"an iterator of more than {ITERATOR_ITEMS} items")
            return {view or "iterator": items}
        return reference(value)

    def program_value(tag: str, payload):
        if tag != "ref":
            raise ValueError(f"not a value: {tag}")
        return objects[payload]

    def answer(request: dict):
        target = objects[request["ref"]]
        if request["op"] == "getattr":
            return getattr(target, request["name"])
        args = decode(request["args"], program_value)
        return target(*args, **{k: decode(v, program_value) for k, v in request["kwargs"].items()})

    try:
        exec(compile(code, "solution.py", "exec"), module.__dict__)
    except Exception as error:  # a SystemExit is no answer: the harness sees the child go
        send({"raised": type(error).__name__, "message": _said(error)})
        return
    send(
        {
            "names": {
                name: reference(v) for name, v in list(module.__dict__.items()) if not name.startswith("__")
            }
        }
    )
    for line in requests:
        try:
            reply = {"value": encode(answer(json.loads(line)), as_data)}
        except Exception as error:
            reply = {"raised": type(error).__name__, "message": _said(error)}
        send(reply)


def run_as_script(code: str, namespace: dict) -> None:
    """Run ``code`` and end as ``python solution.py`` would (exit status, traceback, threads joined,
    ``atexit`` run, output flushed), without the interpreter's teardown: ~100 ms in a fork of the harness."""
    try:
        exec(compile(code, "solution.py", "exec"), namespace)
        status = 0
    except SystemExit as exit:
        status = exit.code if isinstance(exit.code, int) else exit.code is not None
        if not isinstance(exit.code, int | None):
            print(exit.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()  # what the interpreter does first at its end
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            status = 120  # the interpreter's status where its output could not be flushed
    os._exit(status & 0xFF)


def _said(error: BaseException) -> str:
    try:
        return str(error)[:500]
    except Exception:
        return "?"


# ------------------------------------------------------------------ the harness (the trusted side)


class TestEnded(BaseException):
    """The test ended before its end for a reason of the child's (not caught by ``except Exception``)."""

    outcome = "failed"


class ExitedEarly(TestEnded):
    outcome = "exited_early"


class LyingEquality(TestEnded):
    outcome = "lying_equality"


class TimedOut(TestEnded):
    outcome = "timed_out"


class OutputExceeded(TestEnded):
    outcome = "output_exceeded"


class ProgramError(Exception):
    """The program raised an exception that is not a builtin one (its name and message)."""


class Zygote:
    """A clean interpreter that forks each test's child (a fork costs a millisecond, a new interpreter
    20-250): it never runs the program's code and never holds the payload or the nonce, being a fork
    of the harness from before it read them (:meth:`fork_now`) or a fresh one (:meth:`exec_new`)."""

    def __init__(self, control: socket.socket, pid: int) -> None:
        self.control, self.pid, self.healthy = control, pid, True

    @classmethod
    def fork_now(cls) -> Zygote:
        """Fork this process as the zygote; only the harness returns (call it before reading stdin)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            ours.close()
            child(*zygote(theirs.fileno()))  # returns in a test's child only, which then ends as a script
            sys.exit(0)
        theirs.close()
        return cls(ours, pid)

    @classmethod
    def exec_new(cls, source: str) -> Zygote:
        """A fresh interpreter as the zygote (the harness holds the nonce now, so no plain fork)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [sys.executable, "-I", "-B", "-c", source, "zygote", str(theirs.fileno())]
        pid = os.fork()
        if pid == 0:
            os.closerange(3, theirs.fileno())
            os.closerange(theirs.fileno() + 1, os.sysconf("SC_OPEN_MAX"))
            os.set_inheritable(theirs.fileno(), True)
            os.execv(sys.executable, command)
        theirs.close()
        return cls(ours, pid)

    def alive(self) -> bool:
        if not self.healthy:
            return False
        try:
            return os.waitpid(self.pid, os.WNOHANG)[0] == 0
        except ChildProcessError:  # reaped by the sweep
            return False

    def fork(self, mode: str, cpu_seconds: int, fds: list[int], deadline: float) -> int:
        """A new child running ``child(mode, ...)`` on ``fds`` (stdin, stdout, stderr, requests,
        responses); its pid."""
        try:
            socket.send_fds(self.control, [json.dumps([mode, cpu_seconds]).encode()], fds)
        except OSError:
            self.healthy = False
            raise
        return self.read(deadline)

    def read(self, deadline: float) -> int:
        """The zygote's next number (a pid, then that child's exit status); ``TimeoutError`` at
        ``deadline``, ``ConnectionError`` where the zygote is gone."""
        try:
            self.control.settimeout(max(deadline - time.monotonic(), 0.001))
            message = self.control.recv(64)
            if not message:
                raise ConnectionError("the zygote ended")
            return int(message)
        except (OSError, ValueError):
            self.healthy = False
            raise

    def close(self) -> None:
        self.control.close()
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)


def zygote(control_fd: int) -> tuple[str, int, int, int]:
    """The zygote's loop: for each request, fork; report the child's pid, then its exit status. In the
    child (the only way out), the arguments of ``child``."""
    _not_dumpable()  # again: an exec made it dumpable
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # not the harness's stdin (the payload) nor its stdout
    os.dup2(devnull, 1)
    os.close(devnull)
    control = socket.socket(fileno=control_fd)
    while True:
        message, fds, _, _ = socket.recv_fds(control, 4096, 5)
        if not message:
            os._exit(0)
        mode, cpu_seconds = json.loads(message)
        pid = os.fork()
        if pid == 0:
            control.close()
            os.setsid()
            for target, fd in enumerate(fds[:3]):
                os.dup2(fd, target)
                os.close(fd)
            return mode, cpu_seconds, fds[3], fds[4]
        for fd in fds:
            os.close(fd)
        control.send(str(pid).encode())
        control.send(str(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])).encode())


def _not_dumpable() -> None:
    """No process of the run's user may ptrace this one or open its ``/proc/<pid>/mem`` or ``fd/``."""
    import ctypes

    if ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        sys.exit("harness: cannot make itself non-dumpable")


class Child:
    """One test's child process: its pipes, its deadline, and what it said; :meth:`request` talks to
    it, :meth:`finish` waits for it to end. Raises a ``TestEnded`` once that happened."""

    def __init__(self, zygote: Zygote, mode: str, code: str, stdin: str, timeout_s: float, output_bytes: int):
        self.deadline = time.monotonic() + timeout_s
        self.zygote, self.output_bytes, self.status = zygote, output_bytes, None
        pipes = [os.pipe() for _ in range(5)]  # stdin, stdout, stderr, requests, responses
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][0], pipes[4][1]]
        self.stdin_fd, self.stdout_fd, self.stderr_fd = pipes[0][1], pipes[1][0], pipes[2][0]
        self.request_fd, self.response_fd = pipes[3][1], pipes[4][0]
        self.fds = [self.stdin_fd, self.stdout_fd, self.stderr_fd, self.request_fd, self.response_fd]
        try:
            self.pid = zygote.fork(mode, math.ceil(timeout_s), theirs, self.deadline)
        except BaseException:
            for fd in self.fds:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        self.ended: TestEnded | None = None
        self.stdout, self.stderr, self.response = bytearray(), bytearray(), bytearray()
        self.pending = {self.stdin_fd: stdin.encode(), self.request_fd: b""}
        self.selector = selectors.DefaultSelector()
        for fd in self.fds:
            os.set_blocking(fd, False)
        for fd in (self.stdout_fd, self.stderr_fd, self.response_fd):
            self.selector.register(fd, selectors.EVENT_READ)
        self.remotes: dict[int, Remote] = {}
        self._send({"code": code})
        if stdin:
            self.selector.register(self.stdin_fd, selectors.EVENT_WRITE)
        else:
            self._close_input()

    def request(self, message: dict) -> dict:
        """Send ``message``; the child's answer (a ``TestEnded`` where it ended or lied first)."""
        if self.ended:
            raise self.ended
        self._send(message)
        return self._receive()

    def names(self, test: str) -> dict:
        """The test's namespace: the program's names that the test uses, but a builtin is the builtin
        and a stdlib module the test uses as ``mod.attr`` is that module."""
        answer = self._receive()
        tree = ast.parse(test)
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} - set(vars(builtins))
        namespace = {name: self.decode(data) for name, data in answer["names"].items() if name in used}
        modules = {
            node.value.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        }
        for name in modules & sys.stdlib_module_names:
            namespace[name] = importlib.import_module(name)
        return {**namespace, "__name__": "__main__", "__builtins__": builtins}

    def decode(self, data):
        return decode(data, self._program_value)

    def _program_value(self, tag: str, payload):
        if tag == "ref" and type(payload) is int:
            return self.remotes.setdefault(payload, Remote(self, payload))
        if tag == "module" and type(payload) is str and payload.partition(".")[0] in sys.stdlib_module_names:
            return importlib.import_module(payload)
        if tag == "lying":
            self._end(LyingEquality(f"a value of the program's class {str(payload)[:100]}, which lies"))
        self._end(TestEnded(f"the program sent an unknown value {tag!r}"))

    def finish(self) -> int:
        """Wait for the child to close its output and end; its exit status."""
        while self.selector.get_map():
            self._wait()
        try:
            self.status = self.zygote.read(self.deadline)
        except TimeoutError:  # closed its output, then went on running
            self._end(TimedOut("timed out"))
        return self.status

    def close(self) -> None:
        """Kill the child and everything in its process group; release the pipes."""
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(self.pid, signal.SIGKILL)
        if self.status is None:
            with contextlib.suppress(OSError, ValueError):
                self.zygote.read(time.monotonic() + KILL_WAIT_S)
        self.selector.close()
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def tail(self) -> str:
        return bytes(self.stderr[-TAIL_BYTES:]).decode(errors="replace")

    def _send(self, message: dict) -> None:
        self.pending[self.request_fd] += json.dumps(message).encode() + b"\n"
        if self.request_fd not in self.selector.get_map():
            self.selector.register(self.request_fd, selectors.EVENT_WRITE)

    def _receive(self) -> dict:
        while b"\n" not in self.response:
            if self.response_fd not in self.selector.get_map():
                self._end(ExitedEarly("the program ended before the test did"))
            self._wait()
        line, _, rest = bytes(self.response).partition(b"\n")
        self.response[:] = rest
        try:
            answer = json.loads(line)
        except ValueError:
            answer = {}
        if "raised" in answer:
            name = str(answer["raised"])
            kind = getattr(builtins, name, None)
            exception = kind if isinstance(kind, type) and issubclass(kind, Exception) else None
            raise (
                exception(answer.get("message"))
                if exception
                else ProgramError(f"{name}: {answer.get('message')}")
            )
        if "value" not in answer and "names" not in answer:
            self._end(TestEnded(f"the program answered {line[:100]!r}"))
        return answer

    def _wait(self) -> None:
        """Move data until something happens or the deadline passes."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            self._end(TimedOut("timed out"))
        for key, events in self.selector.select(timeout=remaining):
            fd = key.fd
            if events & selectors.EVENT_WRITE:
                try:
                    written = os.write(fd, self.pending[fd][:65536])
                    self.pending[fd] = self.pending[fd][written:]
                except BrokenPipeError:
                    self.pending[fd] = b""
                if not self.pending[fd]:
                    if fd == self.request_fd:
                        self.selector.unregister(fd)
                    else:
                        self._close_input()
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                self.selector.unregister(fd)
                continue
            if fd == self.response_fd:
                self.response += chunk
                if len(self.response) > MESSAGE_BYTES:
                    self._end(OutputExceeded("a message over the harness's limit"))
                continue
            stream = self.stdout if fd == self.stdout_fd else self.stderr
            stream += chunk
            if len(stream) > self.output_bytes:
                self._end(OutputExceeded("output exceeded"))
            if stream is self.stderr and len(stream) > 2 * TAIL_BYTES:
                del stream[:-TAIL_BYTES]

    def _close_input(self) -> None:
        if self.stdin_fd in self.selector.get_map():
            self.selector.unregister(self.stdin_fd)
        os.close(self.stdin_fd)
        self.fds.remove(self.stdin_fd)

    def _end(self, ended: TestEnded):
        self.ended = self.ended or ended
        raise self.ended


class Remote:
    """An object of the program's, held by the child: calls and attributes go to it; it has no truth
    value and is equal only to itself (the test never holds the program's own objects)."""

    def __init__(self, owner: Child, ref: int) -> None:
        self._owner, self._ref = owner, ref

    def __call__(self, *args, **kwargs):
        message = {
            "op": "call",
            "ref": self._ref,
            "args": self._data(list(args)),
            "kwargs": self._data(kwargs),
        }
        return self._owner.decode(self._owner.request(message)["value"])

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return self._owner.decode(
            self._owner.request({"op": "getattr", "ref": self._ref, "name": name})["value"]
        )

    def __bool__(self) -> bool:
        raise TypeError("an object of the program's own class has no truth value in a test")

    def __repr__(self) -> str:
        return f"<the program's object {self._ref}>"

    @staticmethod
    def _data(value):
        def other(item):
            if isinstance(item, Remote):
                return {"ref": item._ref}
            raise TypeError(f"a test cannot pass a {type(item).__name__} to the program")

        if type(value) is dict:
            return {str(k): encode(v, other) for k, v in value.items()}
        return encode(value, other)


def run_test(zygote: Zygote, test: dict, timeout_s: float, output_bytes: int) -> dict:
    """One test in a child of its own: its outcome (``OUTCOMES``), with the stdout of a stdin test."""
    mode = "rpc" if "check" in test else "stdin"
    program = test["code"] if mode == "rpc" else test["program"]
    try:
        child_process = Child(zygote, mode, program, test.get("stdin", ""), timeout_s, output_bytes)
    except (OSError, ValueError) as error:
        return {"outcome": "failed", "detail": f"the harness could not start the test: {error!r}"}
    detail = ""
    try:
        if mode == "stdin":
            status = child_process.finish()
            stdout = base64.b64encode(child_process.stdout).decode()
            return {"outcome": "ran", "status": status, "stdout": stdout, "detail": child_process.tail()}
        namespace = child_process.names(test["check"])
        try:
            exec(compile(test["check"], "test.py", "exec"), namespace)
        except SystemExit as exit:  # the test's own exit: a pass where it says so, as a script's would
            if exit.code not in (0, None):
                raise AssertionError(f"the test exited with {exit.code!r}") from None
        outcome = child_process.ended.outcome if child_process.ended else "passed"
    except TestEnded as ended:
        outcome, detail = (child_process.ended or ended).outcome, str(child_process.ended or ended)
    except Exception as error:
        outcome, detail = "failed", f"{type(error).__name__}: {_said(error)}"
    finally:
        child_process.close()
    if outcome != "passed":
        detail += "\n" + child_process.tail()
    return {"outcome": outcome, "detail": detail.strip()}


def sweep(spawner: Zygote) -> None:
    """As the PID namespace's init (the sandbox's program is): reap the orphans a test left, and where
    a process of its still runs, kill every process but this one (the zygote too) and reap them."""
    if os.getpid() != 1:
        return
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    if {int(name) for name in os.listdir("/proc") if name.isdigit()} <= {1, spawner.pid}:
        return
    with contextlib.suppress(OSError):
        os.kill(-1, signal.SIGKILL)  # every process of the namespace but this one
    with contextlib.suppress(ChildProcessError):
        while True:
            os.waitpid(-1, 0)


def harness() -> None:
    """Fork the zygote, read the payload, run the tests, write each outcome with the nonce."""
    _not_dumpable()
    spawner = Zygote.fork_now()
    payload = json.loads(sys.stdin.buffer.read())
    nonce = payload["nonce"]
    with open(__file__) as file:
        source = file.read()
    results = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a test's prints go nowhere
    sys.set_int_max_str_digits(0)
    for index, test in enumerate(payload["tests"]):
        if not spawner.alive():  # a test killed it, or the sweep did
            spawner.close()
            spawner = Zygote.exec_new(source)
        outcome = run_test(spawner, test, payload["timeout_s"], payload["output_bytes"])
        line = memoryview(f"{nonce} {json.dumps({'test': index, **outcome})}\n".encode())
        while line:
            line = line[os.write(results, line) :]
        sweep(spawner)
    spawner.close()
    os._exit(0)  # the outcomes are written (unbuffered); the interpreter's teardown would cost ~100 ms


if __name__ == "__main__":
    if sys.argv[1:2] == ["zygote"]:
        child(*zygote(int(sys.argv[2])))
    else:
        harness()
