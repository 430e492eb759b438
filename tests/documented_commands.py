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
changed); `fail CODE` runs it and wants that exit code (a command the page shows failing); `skip REASON`
does not run it and prints the reason. A block without its marks, or with more or fewer marks than
commands, is an error: a new documented command cannot go unchecked. The commands of one page run in
order in one fresh copy of the tracked files (`git ls-files`), with this checkout's `.venv` linked in
and its `bin` first on PATH, as in a clone after `make install`; an `export NAME=VALUE` line of the
page holds for the commands after it, as in the reader's shell.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
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
    action: str  # run | fail | skip
    extra: tuple[str, ...] = ()  # step-count options appended (run, fail)
    expected_code: int = 0
    reason: str = ""  # skip
    exports: tuple[str, ...] = ()  # the page's `export NAME=VALUE` lines before it

    def argv(self) -> list[str]:
        """The command's words (its trailing comment dropped), then the step counts."""
        return shlex.split(self.text, comments=True) + list(self.extra)

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
    words = shlex.split(rest)
    code = 0
    if action == "fail":
        if not words or not words[0].isdigit() or words[0] == "0":
            raise MarkError(f"{where}: `fail` needs the non-zero exit code the command must end with")
        code, words = int(words[0]), words[1:]
    elif action != "run":
        raise MarkError(
            f"{where}: unknown mark {mark.strip()!r}; use run [STEPS], fail CODE [STEPS] or skip REASON"
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


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.documented_commands", description=__doc__.split("\n")[0]
    )
    parser.add_argument("pages", nargs="*", type=Path, help="Markdown pages (default: README.md, docs/*.md)")
    parser.add_argument("--list", action="store_true", help="print the commands and their marks; run nothing")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per command (default 900)")
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
    counts, failures, started = {"passed": 0, "failed": 0, "skipped": 0}, [], time.monotonic()
    for commands in by_page.values():
        if not commands:
            continue
        with tempfile.TemporaryDirectory(prefix="docs-commands-") as scratch:
            workdir = fresh_copy(REPO, Path(scratch))
            for command in commands:
                shown = command.script()
                where = f"{command.doc}:{command.line}"
                if command.action == "skip":
                    print(f"[skipped: {command.reason}] {where}  $ {shown}", flush=True)
                    counts["skipped"] += 1
                    continue
                print(f"{where}  $ {shown}", flush=True)
                code, cost, output = run_command(command, workdir, env, options.timeout)
                passed = code == command.expected_code
                want = "" if passed else f" (want {command.expected_code})"
                print(f"    exit {code}{want}  {cost}  {'ok' if passed else 'FAILED'}", flush=True)
                counts["passed" if passed else "failed"] += 1
                if not passed:
                    failures.append((command, shown, code, output))
    for command, shown, code, output in failures:
        print(f"\n=== FAILED {command.doc}:{command.line}: exit {code}, want {command.expected_code}")
        print(f"$ {shown}\n--- last {FAILURE_TAIL_LINES} lines of its output:\n{_tail(output)}")
    print(
        f"\ndocumented commands: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['skipped']} skipped in {time.monotonic() - started:.0f} s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
