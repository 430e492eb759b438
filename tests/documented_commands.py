"""Run every command that README.md and docs/*.md show, as written, from a fresh copy of the repository.

    python -m tests.documented_commands [FILE.md ...] [--list]

A command is a line of a fenced shell block (bash, sh, shell) whose program is `lit-offpolicy`,
`python -m` or `make`, with its continuation lines (a trailing backslash). Each block holding commands
is followed by an HTML comment, invisible on the rendered page, with one mark per command, in order:

    <!-- ci: run --trainer.max_steps 2 -->

or, for a block of several commands, one mark a line:

    <!-- ci:
    run
    run --trainer.max_steps 20
    fail 2
    skip needs a GPU node: configs/strategy/ddp.yaml sets accelerator gpu
    -->

`run` runs the command with only step counts appended (`--trainer.max_steps N`: nothing else may be
changed); `fail CODE` runs it and wants that exit code (a command the page shows failing); `background`
starts a command the page ends with `&` (a server the next commands use) and ends its process group
when the page's commands are done, failing if it exited before; `skip REASON` does not run it and
prints the reason. A block without its marks, or with more or fewer marks than
commands, is an error: a new documented command cannot go unchecked. The commands of one page run in
order in one fresh copy of the tracked files (`git ls-files`), with this checkout's `.venv` linked in
and its `bin` first on PATH, as in a clone after `make install`; an `export NAME=VALUE` line of the
page holds for the commands after it, as in the reader's shell.

Pages repeat their first steps (the tiny model, its SFT warm-up, `make demo`): where a page's first
commands are, word for word and in order, another page's, they run once and the later page starts from
a copy of the files they left (printed as `[ran for PAGE:LINE]`), up to its first background command.
`--jobs 2` runs two pages at a time (CI: their commands are mostly one core's start-ups), each page's
lines printed when it ends; a command's CPU seconds then count the other page's finished commands too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
SHELL_FENCES = ("bash", "sh", "shell")
PROGRAMS = ("lit-offpolicy", "python", "make")
STEP_OPTIONS = ("--trainer.max_steps",)
FAILURE_TAIL_LINES = 30
MARK_OPEN = "<!-- ci:"


class MarkError(ValueError):
    """A documented command's CI mark is missing, malformed or asks for more than step counts."""


@dataclass(frozen=True)
class Command:
    """One documented command and how CI runs it."""

    doc: str
    line: int  # 1-based, the command's first line
    text: str  # as written, continuation lines joined
    action: str  # run | fail | background | skip
    extra: tuple[str, ...] = ()  # step-count options appended (run, fail)
    expected_code: int = 0
    reason: str = ""  # skip
    exports: tuple[str, ...] = ()  # the page's `export NAME=VALUE` lines before it

    def argv(self) -> list[str]:
        """The command's words (its trailing comment and a background `&` dropped), then the step counts."""
        words = shlex.split(self.text, comments=True)
        return (words[:-1] if words[-1:] == ["&"] else words) + list(self.extra)

    def script(self) -> str:
        """What bash runs: the exports before it, then the command."""
        return "; ".join([*self.exports, shlex.join(self.argv())])


def _is_command(words: list[str]) -> bool:
    """Whether the words start `lit-offpolicy ...`, `python -m ...` or `make ...`."""
    if not words or words[0] not in PROGRAMS:
        return False
    return words[0] != "python" or (len(words) > 1 and words[1] == "-m")


def _block_commands(lines: list[str], start: int, exports: list[str]) -> list[tuple[int, str, tuple]]:
    """(line number, text, exports so far) of the commands in a block; `start` is the first line's number.

    The block's `export` lines are added to `exports`, the page's.
    """
    commands, i = [], 0
    while i < len(lines):
        first, text = start + i, lines[i].strip()
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1].rstrip() + " " + lines[i].strip()
        i += 1
        words = _words(text)
        if words[:1] == ["export"]:
            exports.append(shlex.join(words))
        elif _is_command(words):
            commands.append((first, text, tuple(exports)))
    return commands


def _words(text: str) -> list[str]:
    """The shell words of a line, without its comment (whitespace-split where the quoting is open)."""
    try:
        return shlex.split(text, comments=True)
    except ValueError:
        return text.split()


def _parse_mark(mark: str, doc: str, line: int, text: str, exports: tuple[str, ...]) -> Command:
    """A Command from its mark `run [STEPS]`, `fail CODE [STEPS]` or `skip REASON`."""
    action, _, rest = mark.strip().partition(" ")
    where = f"{doc}:{line}"
    if action == "skip":
        if not rest.strip():
            raise MarkError(f"{where}: `skip` needs a reason (skip REASON)")
        return Command(doc, line, text, "skip", reason=rest.strip(), exports=exports)
    in_background = _words(text)[-1:] == ["&"]
    if (action == "background") != in_background:
        wanted = "`background`" if in_background else "`background` only for a command ending with `&`"
        raise MarkError(f"{where}: a command the page ends with `&` is marked {wanted}, got {action!r}")
    words = shlex.split(rest)
    code = 0
    if action == "fail":
        if not words or not words[0].isdigit() or words[0] == "0":
            raise MarkError(f"{where}: `fail` needs the non-zero exit code the command must end with")
        code, words = int(words[0]), words[1:]
    elif action not in ("run", "background"):
        raise MarkError(
            f"{where}: unknown mark {mark.strip()!r}; use run [STEPS], fail CODE [STEPS], background or "
            "skip REASON"
        )
    pairs = zip(words[::2], words[1::2], strict=False)
    if len(words) % 2 or any(option not in STEP_OPTIONS or not count.isdigit() for option, count in pairs):
        raise MarkError(
            f"{where}: a mark may only append step counts ({', '.join(STEP_OPTIONS)} N), got {rest.strip()!r}"
        )
    return Command(doc, line, text, action, extra=tuple(words), expected_code=code, exports=exports)


def _read_marks(lines: list[str], index: int) -> tuple[list[str], int] | None:
    """The marks of the `<!-- ci: ... -->` comment at lines[index] (after blank lines), and its end."""
    while index < len(lines) and not lines[index].strip():
        index += 1
    if index >= len(lines) or not lines[index].strip().startswith(MARK_OPEN):
        return None
    body, end = [], index
    while True:
        body.append(lines[end])
        if "-->" in lines[end]:
            break
        end += 1
        if end >= len(lines):
            raise MarkError(f"line {index + 1}: a `{MARK_OPEN}` comment without its closing `-->`")
    text = "\n".join(body).strip()[len(MARK_OPEN) :]
    text = text[: text.index("-->")]
    return [mark.strip() for mark in text.splitlines() if mark.strip()], end + 1


def extract(markdown: str, doc: str) -> list[Command]:
    """The marked commands of a Markdown page, in order; MarkError for a block whose marks do not fit."""
    lines = markdown.splitlines()
    found, exports, i = [], [], 0
    while i < len(lines):
        fence = re.match(r"^\s*(```+|~~~+)\s*(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        end = next(
            (j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(fence.group(1))), len(lines)
        )
        shell = fence.group(2) in SHELL_FENCES
        commands = _block_commands(lines[i + 1 : end], i + 2, exports) if shell else []
        i = end + 1
        if not commands:
            continue
        marks = _read_marks(lines, i)
        if marks is None:
            first = commands[0][0]
            raise MarkError(
                f"{doc}:{first}: a block of {len(commands)} command(s) without a `{MARK_OPEN} ... -->` "
                "comment after it (one mark per command: run [STEPS], fail CODE [STEPS] or skip REASON)"
            )
        marks, i = marks
        if len(marks) != len(commands):
            raise MarkError(
                f"{doc}:{commands[0][0]}: {len(commands)} command(s) in the block but {len(marks)} mark(s)"
            )
        found += [_parse_mark(mark, doc, *command) for command, mark in zip(commands, marks, strict=True)]
    return found


def documented_pages(repo: Path = REPO) -> list[Path]:
    """README.md and docs/*.md."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def fresh_copy(repo: Path, into: Path) -> Path:
    """The repository's tracked files copied into `into`, with repo's .venv linked in as installed."""
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.split("\0")
    for name in filter(None, tracked):
        source, target = repo / name, into / name
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
            # older than .venv's install stamp, so that `make demo` finds the install done (it is)
            os.utime(target, (0, 0))
    (into / ".venv").symlink_to(repo / ".venv")
    return into


def _children_cpu_seconds() -> float:
    """User + system CPU seconds of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_command(command: Command, cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """(exit code, its wall and CPU seconds as text, output) of the command run by bash in `cwd`.

    On a time-out the command and every process under it are killed, and the exit code is 124. The CPU
    seconds (of the processes the command waited for) tell a busy machine's slowness from its own cost.
    """
    started, cpu_started = time.monotonic(), _children_cpu_seconds()
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        process = subprocess.Popen(
            ["bash", "-c", command.script()],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            for child in [*psutil.Process(process.pid).children(recursive=True), process]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            process.wait()
            code = 124
            log.write(f"\n(killed after {timeout:.0f} s)")
        log.seek(0)
        output = log.read()
    cost = f"{time.monotonic() - started:.1f} s (CPU {_children_cpu_seconds() - cpu_started:.0f} s)"
    return code, cost, output


def _tail(output: str, lines: int = FAILURE_TAIL_LINES) -> str:
    """The last lines of the output, progress bars' carriage returns resolved to their last state."""
    shown = [line.rsplit("\r", 1)[-1] for line in output.splitlines()]
    return "\n".join(shown[-lines:])


def _shown_path(page: Path) -> str:
    """The page's path relative to the repository where it is inside it."""
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else str(page)


def start_in_background(command: Command, cwd: Path, env: dict[str, str], log) -> subprocess.Popen:
    """The command started by bash in a session of its own (its process group ends with the page)."""
    return subprocess.Popen(
        ["bash", "-c", command.script()],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )


def stop_background(process: subprocess.Popen) -> int | None:
    """End the process group of a background command as a launched server's watchdog ends its server's
    (``supervise.end_group``: SIGTERM, a grace, SIGKILL to what is left of the group); its exit code if it
    had exited by itself."""
    from lit_offpolicy.rollout.server.supervise import end_group  # imports torch: only where a page needs it

    code = process.poll()
    end_group(process)
    process.wait()
    return code


def shared_prefixes(pages: list[list[Command]]) -> set[tuple[str, ...]]:
    """The first commands (their scripts) that a page has in common with a later page, up to the first
    background command: what runs once and is copied."""
    scripts = []
    for commands in pages:
        ran = [command for command in commands if command.action != "skip"]
        stop = next((i for i, command in enumerate(ran) if command.action == "background"), len(ran))
        scripts.append(tuple(command.script() for command in ran[:stop]))
    shared = set()
    for i, mine in enumerate(scripts):
        for theirs in scripts[i + 1 :]:
            common = _common_length(mine, theirs)
            if common:
                shared.add(mine[:common])
    return shared


def _copy_tree(source: Path, target: Path) -> None:
    """A page's working copy; links stay links (HFExport's ``outputs/actor`` names a place beside it,
    relative; copytree takes a relative link it would follow for dangling) and .venv links to the
    repository's."""
    shutil.copytree(source, target, symlinks=True, ignore=shutil.ignore_patterns(".venv"), dirs_exist_ok=True)
    if not os.path.lexists(target / ".venv"):
        (target / ".venv").symlink_to(REPO / ".venv")


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.documented_commands", description=__doc__.split("\n")[0]
    )
    parser.add_argument("pages", nargs="*", type=Path, help="Markdown pages (default: README.md, docs/*.md)")
    parser.add_argument("--list", action="store_true", help="print the commands and their marks; run nothing")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per command (default 900)")
    parser.add_argument(
        "--jobs", type=int, default=1, help="pages run at a time (default 1; CI: 2, each printed when done)"
    )
    options = parser.parse_args(args)
    pages = [page.resolve() for page in options.pages] or documented_pages()
    try:
        by_page = {page: extract(page.read_text(), _shown_path(page)) for page in pages}
    except MarkError as error:
        print(f"documented commands: {error}")
        return 2
    if options.list:
        for command in (command for commands in by_page.values() for command in commands):
            mark = f"skip: {command.reason}" if command.action == "skip" else command.action
            print(f"[{mark}] {command.doc}:{command.line}  $ {command.script()}")
        return 0
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = PageRuns(env, options.timeout, shared_prefixes(list(by_page.values())))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="docs-commands-shared-") as snapshots:
        run.snapshot_root = Path(snapshots)
        run.pages([commands for commands in by_page.values() if commands], max(1, options.jobs))
    for command, shown, code, output in run.failures:
        print(f"\n=== FAILED {command.doc}:{command.line}: exit {code}, want {command.expected_code}")
        print(f"$ {shown}\n--- last {FAILURE_TAIL_LINES} lines of its output:\n{_tail(output)}")
    counts = run.counts
    print(
        f"\ndocumented commands: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['skipped']} skipped, {counts['shared']} ran once for an earlier page, "
        f"in {time.monotonic() - started:.0f} s"
    )
    return 1 if run.failures else 0


class PageRuns:
    """Runs pages, each in a fresh copy, sharing the runs of their common first commands."""

    def __init__(self, env: dict[str, str], timeout: float, shared: set[tuple[str, ...]]) -> None:
        self.env, self.timeout, self.shared = env, timeout, shared
        self.snapshots: dict[tuple[str, ...], tuple[Path, list[str]]] = {}
        """A shared prefix's scripts -> a copy of the files it left, and where each of its commands ran."""
        self.snapshot_root = Path(tempfile.gettempdir())
        self.counts = {"passed": 0, "failed": 0, "skipped": 0, "shared": 0}
        self.failures: list[tuple[Command, str, int, str]] = []
        self.lock = threading.Lock()

    def pages(self, pages: list[list[Command]], jobs: int) -> None:
        """``jobs`` pages at a time, each printed whole when it ends (as it runs, one at a time); a page
        that begins with an earlier page's commands starts once that page is done."""
        done = [threading.Event() for _ in pages]
        scripts = [_scripts(commands) for commands in pages]

        def one(index: int) -> None:
            for earlier in range(index):
                if _common_length(scripts[earlier], scripts[index]):
                    done[earlier].wait()
            out = sys.stdout if jobs == 1 else io.StringIO()
            try:
                self.page(pages[index], out)
            finally:
                done[index].set()
                if out is not sys.stdout:
                    with self.lock:
                        print(out.getvalue(), end="", flush=True)

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, range(len(pages))))

    def page(self, commands: list[Command], out) -> None:
        """The page's commands in order in a fresh copy: the first ones from an earlier page's files where
        they ran there already; the background ones ended when the others are done."""
        with tempfile.TemporaryDirectory(prefix="docs-commands-") as scratch, contextlib.ExitStack() as stack:
            workdir = fresh_copy(REPO, Path(scratch))
            with self.lock:
                starting = [prefix for prefix in self.snapshots if _starts(commands, prefix)]
                reused = max(starting, key=len, default=())
            ran: list[str] = []  # where each command run so far ran: on this page, or an earlier one's
            if reused:
                files, ran_at = self.snapshots[reused]
                _copy_tree(files, workdir)
            for command in commands:
                shown, where = command.script(), f"{command.doc}:{command.line}"
                if command.action == "skip":
                    print(f"[skipped: {command.reason}] {where}  $ {shown}", file=out, flush=True)
                    self._count("skipped")
                    continue
                if len(ran) < len(reused):
                    print(f"[ran for {ran_at[len(ran)]}] {where}  $ {shown}", file=out, flush=True)
                    self._count("shared")
                    ran.append(ran_at[len(ran)])
                    continue
                ran.append(where)
                if command.action == "background":
                    log = stack.enter_context(tempfile.TemporaryFile("w+", errors="replace"))
                    process = start_in_background(command, workdir, self.env, log)
                    stack.callback(self._end_background, command, process, log, out)
                    print(f"{where}  $ {shown} &\n    started in the background", file=out, flush=True)
                    continue
                print(f"{where}  $ {shown}", file=out, flush=True)
                self._report(command, shown, *run_command(command, workdir, self.env, self.timeout), out)
                self._keep(_scripts(commands)[: len(ran)], workdir, ran)

    def _keep(self, prefix: tuple[str, ...], workdir: Path, ran: list[str]) -> None:
        """A copy of the page's files after ``prefix``, where a later page begins with it."""
        with self.lock:
            if prefix not in self.shared or prefix in self.snapshots:
                return
            files = self.snapshot_root / str(len(self.snapshots))
            self.snapshots[prefix] = (files, list(ran))
            _copy_tree(workdir, files)

    def _count(self, outcome: str) -> None:
        with self.lock:
            self.counts[outcome] += 1

    def _report(self, command: Command, shown: str, code: int, cost: str, output: str, out) -> None:
        passed = code == command.expected_code
        want = "" if passed else f" (want {command.expected_code})"
        print(f"    exit {code}{want}  {cost}  {'ok' if passed else 'FAILED'}", file=out, flush=True)
        self._count("passed" if passed else "failed")
        if not passed:
            with self.lock:
                self.failures.append((command, shown, code, output))

    def _end_background(self, command: Command, process: subprocess.Popen, log, out) -> None:
        """A background command passes if it still ran when the page's other commands were done."""
        code = stop_background(process)
        log.seek(0)
        print(f"{command.doc}:{command.line}  (the background command, ended with the page)", file=out)
        self._report(command, command.script(), 0 if code is None else code, "", log.read(), out)


def _scripts(commands: list[Command]) -> tuple[str, ...]:
    """What the page runs, in order (its skipped commands left out)."""
    return tuple(command.script() for command in commands if command.action != "skip")


def _common_length(mine: tuple[str, ...], theirs: tuple[str, ...]) -> int:
    """How many first commands two pages have in common."""
    return next(
        (n for n, pair in enumerate(zip(mine, theirs, strict=False)) if pair[0] != pair[1]),
        min(len(mine), len(theirs)),
    )


def _starts(commands: list[Command], prefix: tuple[str, ...]) -> bool:
    return _scripts(commands)[: len(prefix)] == prefix


if __name__ == "__main__":
    sys.exit(main())
