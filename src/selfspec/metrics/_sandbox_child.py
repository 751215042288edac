"""Child side of :mod:`selfspec.metrics.sandbox`: run one HumanEval program, report on a pipe.

Not imported by selfspec: the parent runs this file's text as
``python -I -c <text> VERDICT_FD PASS_LINE TIMEOUT AS_BYTES CPU_S FSIZE_BYTES NPROC``
in the program's working directory (``program.py`` there), with a random nonce line on
standard input. Standard library only. The threat model is in the parent's docstring.

Order matters: everything up to ``_arm`` runs before any program code and is trusted; the
two audit hooks installed there stay for the life of the process (CPython cannot remove them).
"""

import gc
import os
import resource
import sys
import threading

PASS = "selfspec_sandbox_pass"  # audit event names (hooks get a fresh exact str of the name)
ARM = "selfspec_sandbox_arm"

# Audit events a HumanEval program has no use for and that reach past the sandbox's rules:
# heap and frame walks, tracing, new code objects from arguments or bytes (marshal: also
# importlib's .pyc loading and _imp.get_frozen_object with data), native code (SQLite
# extensions), other processes, signals to other processes, sockets, raising its own limits,
# links (a symbolic or hard link in the working directory would give a path into /proc a
# harmless name).
DENIED = frozenset({
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
    "sys._current_exceptions", "sys.settrace", "sys.setprofile", "sys.addaudithook",
    "sys.monitoring.register_callback", "code.__new__", "marshal.load", "marshal.loads",
    "sqlite3.enable_load_extension", "sqlite3.load_extension",
    "os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
    "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
    "socket.__new__", "resource.setrlimit", "resource.prlimit", "os.symlink", "os.link",
})
# modules that reach past the audit events: native modules that read or write arbitrary memory
# (ctypes, cffi, CPython's test modules), subinterpreters (3.11's _xxsubinterpreters, 3.13's
# _interpreters: they start without these hooks), _posixsubprocess, whose fork_exec starts a
# process without raising any (subprocess, multiprocessing and asyncio import it, so they fail
# too), and Tcl (tkinter), whose exec, open and socket commands run processes, open files and
# connect without any either
MODULES_DENIED = ("_ctypes", "ctypes", "_cffi", "cffi", "_test", "_xx", "_interp", "_posixsubprocess",
                  "_tkinter", "tkinter")
# functions removed before the program runs, for want of an audit event: a pidfd signals any
# process of its user (signal.pidfd_send_signal), past os.kill's (a fresh copy of posix from
# _imp.create_builtin has it again: the parent's docstring says so)
REMOVED = ("pidfd_open",)
# path components that lead to the process's own memory or file descriptors (/proc, /dev/fd),
# also from a directory descriptor or another working directory
PATH_DENIED = frozenset({"proc", "fd"})
# where imports look for bytecode: nowhere (/dev/null is no directory), so they compile from
# source instead of unmarshalling .pyc files, which the guard refuses
NO_BYTECODE = os.devnull + "/selfspec-sandbox"


def _limits(as_bytes: int, cpu_s: int, fsize: int, nproc: int) -> None:
    """Hard resource limits; the program can lower but never raise them."""
    nproc += _own_tasks()
    for name, value in (("RLIMIT_AS", as_bytes), ("RLIMIT_CPU", cpu_s), ("RLIMIT_FSIZE", fsize),
                        ("RLIMIT_NPROC", nproc), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))


def _own_tasks() -> int:
    """Processes and threads of this user that RLIMIT_NPROC will count (0 without a /proc: in
    the bubblewrap sandbox the count starts afresh in its own user namespace)."""
    uid, n = os.getuid(), 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0
    for pid in pids:
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return n


def _install_verdict(fd: int, pass_line: int) -> None:
    """The audit hook that alone knows the nonce (read from stdin here, in no frame of the
    harness, never in a global). It writes the nonce to ``fd`` for the first PASS event only, and
    only when that event comes from the ``_run`` frame that armed it, on its verdict line: the
    ``else`` branch after ``exec`` returned. Everything it uses is bound now (no global or
    builtin lookups the program could patch); it never raises (no traceback can hold its frame);
    the collector is off while it runs (no collector callback or finaliser sees its frame)."""
    nonce = os.read(0, 64)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    armed = None
    spent = False

    def verdict(event, args, _pass=PASS, _arm=ARM, _getframe=sys._getframe, _write=os.write,
                _gc_is_on=gc.isenabled, _gc_off=gc.disable, _gc_on=gc.enable, _base=BaseException):
        nonlocal armed, spent
        if event != _pass and event != _arm:
            return
        was_on = _gc_is_on()
        _gc_off()
        try:
            caller = _getframe(1)
            if event == _arm and armed is None and not spent:
                armed = caller
            elif not spent:
                spent = True
                if event == _pass and caller is armed and caller.f_lineno == pass_line:
                    _write(fd, nonce)
        except _base:
            spent = True
        finally:
            if was_on:
                _gc_on()

    sys.addaudithook(verdict)


def _install_guard(prefixes: tuple) -> None:
    """The audit hook that refuses :data:`DENIED`, native modules outside the Python
    installation (and :data:`MODULES_DENIED` anywhere), and paths into /proc or /dev/fd.
    It holds no secret; like the verdict hook it binds everything it uses now."""

    def guard(event, args, _denied=DENIED, _modules=MODULES_DENIED, _paths=PATH_DENIED,
              _prefixes=prefixes, _type=type, _str=str, _bytes=bytes, _int=int,
              _error=PermissionError):
        if event in _denied or event.startswith("ctypes."):
            raise _error(f"sandbox: {event} is not allowed")
        if event == "import":
            name, filename = args[0], args[1]
            if name.partition(".")[0].startswith(_modules):
                raise _error(f"sandbox: import {name} is not allowed")
            if filename is not None and (
                    filename.rpartition("/")[2].startswith(_modules)
                    or "/.." in filename or not filename.startswith(_prefixes)):
                raise _error(f"sandbox: native module {filename} is not allowed")
        elif event == "open" or event == "os.chdir":
            path = args[0]
            if _type(path) is _int:
                return
            if _type(path) is _bytes:
                path = path.decode("utf-8", "surrogateescape")
            elif _type(path) is not _str:
                raise _error("sandbox: paths must be str or bytes")
            if path.startswith(_prefixes) and "/.." not in path:
                return  # the Python installation (imports)
            for part in path.split("/"):
                if part in _paths:
                    raise _error(f"sandbox: {path} is not allowed")

    sys.addaudithook(guard)


def _prefixes() -> tuple:
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots |= {os.path.realpath(r) for r in roots}
    return tuple(r.rstrip("/") + "/" for r in roots if r.strip("/"))  # never the whole tree


def _run(code, fd, _exec=exec, _audit=sys.audit, _write=os.write, _base=BaseException):
    """The program's thread: arm the verdict hook, run the program, and raise PASS only in the
    ``else`` branch (a normal return). Signal handlers run in the main thread, never here."""
    _audit(ARM)
    try:
        _exec(code, {})
    except _base as err:
        try:
            _write(fd, f"failed: {type(err).__name__}: {err}"[:1000].encode(errors="replace"))
        except _base:
            pass
    else:
        _audit(PASS)  # VERDICT LINE


def _remove_unaudited() -> str | None:
    """Remove :data:`REMOVED` from ``os`` and ``posix``; None, or why the program cannot run
    safely: a module of :data:`MODULES_DENIED` was imported before it (by a ``.pth`` file of the
    installation, say), where a later import would find it without an audit event."""
    import posix

    for module in (os, posix):
        for name in REMOVED:
            module.__dict__.pop(name, None)
    loaded = sorted(m for m in sys.modules if m.partition(".")[0].startswith(MODULES_DENIED))
    return f"failed: sandbox: {', '.join(loaded)} imported before the program" if loaded else None


def main(argv: list) -> None:
    fd, pass_line, timeout, as_bytes, cpu_s, fsize, nproc = argv
    fd, pass_line = int(fd), int(pass_line)
    sys.dont_write_bytecode = True
    _limits(int(as_bytes), int(cpu_s), int(fsize), int(nproc))
    with open("program.py", encoding="utf-8") as f:
        source = f.read()
    prefixes = _prefixes()
    unsafe = _remove_unaudited()
    if unsafe:
        os.write(fd, unsafe.encode())
        os._exit(1)
    sys.pycache_prefix = NO_BYTECODE
    _install_verdict(fd, pass_line)
    _install_guard(prefixes)
    if hasattr(sys, "monitoring"):  # 3.12+: its callbacks would see the hooks' frames
        del sys.monitoring
    try:
        code = compile(source, "program.py", "exec")
    except BaseException as err:  # noqa: BLE001 — a program that does not compile fails
        os.write(fd, f"failed: {type(err).__name__}: {err}"[:1000].encode(errors="replace"))
        os._exit(1)
    worker = threading.Thread(target=_run, args=(code, fd), daemon=True)
    worker.start()
    worker.join(float(timeout))
    if worker.is_alive():
        os.write(fd, b"timed out")
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
