"""The sandbox's launcher: confines a child, which becomes the program (``execve``), and waits for it.
Run by path (``python -I -S sandbox_launch.py CONFIG``), so it imports nothing of the package:
start-up is the interpreter's alone, and nothing of the trainer's is loaded where untrusted code runs.

CONFIG (JSON) holds the program's source file, its limits, the interpreter and, as root, the user id
it runs as. As root (``isolation: "full"``), in order:

1. the launcher dies with its parent (``PR_SET_PDEATHSIG``);
2. new mount, network and PID namespaces: no network (a loopback that is down); fresh tmpfs mounts on
   /tmp, /var/tmp and /dev/shm, private to the run; the run's directory /tmp/run with the source;
3. a child, the new PID namespace's init, mounts its own /proc (the host's processes are not there),
   sets the resource limits, takes the run's user and group id (no supplementary groups),
   ``PR_SET_PDEATHSIG`` again (changing ids cleared it) and ``PR_SET_NO_NEW_PRIVS``, then becomes
   ``python -I -B program.py`` with the environment the parent allowed: the base interpreter (a virtual
   environment's ``bin/python`` links to it), the one exposed in step 2, without the environment's packages;
4. the launcher waits and exits as the program did. When the program ends, or the launcher dies (its
   parent died, or was killed at the deadline), the kernel kills every process of the namespace:
   nothing the program started outlives it.

With ``isolation: "limits_only"`` only the limits, in the parent's directory, and ``execve`` at once.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
MS_REC, MS_PRIVATE = 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SETUP_FAILED = 125  # the exit status of a launcher that could not confine itself (nothing ran)


def fail(what: str) -> None:
    os.write(2, f"sandbox: {what}: {os.strerror(ctypes.get_errno())}\n".encode())
    os._exit(SETUP_FAILED)


def private_scratch(libc, size: str, uid: int) -> str:
    """New mount, network and PID namespaces (the PID one for the next child), tmpfs on the shared
    scratch places; the run's directory."""
    if libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID) != 0:
        fail("unshare")
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:  # nothing propagates to the host
        fail("mount --make-rprivate /")
    for place in (b"/tmp", b"/var/tmp", b"/dev/shm"):
        if (
            os.path.isdir(place)
            and libc.mount(b"tmpfs", place, b"tmpfs", MS_NOSUID | MS_NODEV, size.encode()) != 0
        ):
            fail(f"mount tmpfs on {place.decode()}")
    expose_interpreter(libc, sys.base_prefix)
    os.mkdir("/tmp/run", 0o700)
    os.chown("/tmp/run", uid, uid)
    return "/tmp/run"


def expose_interpreter(libc, prefix: str) -> None:
    """Make the interpreter's installation (``prefix``) readable by the run's user at its own path
    (its shared library is found by that absolute path): where a directory above it is closed to
    others (pyenv under /root, mode 0700), a tmpfs covers that directory (hiding what else it holds)
    and the installation is bind-mounted back in, read-only."""
    closed = next((p for p in ancestors(prefix) if not os.stat(p).st_mode & 0o001), None)
    if closed is None:
        return
    staging = "/tmp/.interpreter"
    os.mkdir(staging, 0o755)
    if libc.mount(prefix.encode(), staging.encode(), None, MS_BIND | MS_REC, None) != 0:
        fail(f"bind-mount {prefix}")
    if libc.mount(b"tmpfs", closed.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=1m") != 0:
        fail(f"mount tmpfs on {closed}")
    os.makedirs(prefix, 0o755, exist_ok=True)
    if libc.mount(staging.encode(), prefix.encode(), None, MS_BIND | MS_REC, None) != 0:
        fail(f"bind-mount the interpreter at {prefix}")
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    if libc.mount(None, prefix.encode(), None, flags, None) != 0:
        fail(f"remount {prefix} read-only")


def ancestors(path: str) -> list[str]:
    """``path`` and the directories above it, from the root down ("/a/b" -> ["/a", "/a/b"])."""
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def main() -> None:
    config = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # ending as the program did (SIGXCPU) dumps no core
    if os.getppid() != config["parent"]:  # it died before the line above took effect
        os._exit(SETUP_FAILED)
    uid = config["uid"]
    if uid is None:  # limits_only
        become_program(libc, config, config["directory"])
    with open(config["source"], "rb") as file:
        source = file.read()
    directory = private_scratch(libc, f"size={config['scratch_bytes']},mode=1777", uid)
    with open(os.path.join(directory, "program.py"), "wb") as file:
        file.write(source)
    os.chown(os.path.join(directory, "program.py"), uid, uid)
    child = os.fork()
    if child == 0:  # PID 1 of the new namespace
        if libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) != 0:
            fail("mount proc")
        become_program(libc, config, directory, uid)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):  # end as the program did: the parent reads the same signal
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def become_program(libc, config: dict, directory: str, uid: int | None = None) -> None:
    """Limits, the run's ids, then ``execve`` of the program (this function does not return)."""
    os.chdir(directory)
    for name, (soft, hard) in config["limits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # changing ids cleared it
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    env = dict(config["env"], HOME=directory, TMPDIR=directory)
    interpreter = config["interpreter"]
    os.execve(interpreter, [interpreter, "-I", "-B", "program.py"], env)


if __name__ == "__main__":
    main()
