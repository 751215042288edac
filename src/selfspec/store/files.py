"""Files on disk written so that nothing is lost: atomic writes (a temporary file in the same
directory, then a rename), a full disk's error naming the file, strict JSON values, and the checks
that a directory can be made and written before a run writes into it (issue 39). Files that runs or
other programs left are read only as regular files of bounded size, their JSON strict (issue 52).
A file that ships with selfspec and is damaged or missing is refused with how to get it back, as
selfspec is installed here (:func:`restore_hint`, issue 68).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator


def to_jsonable(obj: Any) -> Any:
    """Plain JSON values for configs, tensors, numpy scalars; NaN/inf become ``None``."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(obj):
            return to_jsonable(OmegaConf.to_container(obj, resolve=True))
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # torch / numpy
        return to_jsonable(obj.tolist())
    if hasattr(obj, "item"):
        return to_jsonable(obj.item())
    return str(obj)


def not_plain(info: os.stat_result) -> str | None:
    """Why a file with this ``lstat`` / ``fstat`` is not one selfspec reads or appends ("is a FIFO",
    "has 2 hard links (...)"), or None for a regular file with one link."""
    mode = info.st_mode
    if stat.S_ISREG(mode):
        return None if info.st_nlink == 1 else \
            f"has {info.st_nlink} hard links (it shares its lines with another file)"
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return f"is {name}"
    return "is not a regular file"


#: the most bytes selfspec reads from a file a run or another program left (a summary, a run's
#: ``.hydra/`` record, an artefact's ``meta.json``, a profile): far above what it writes itself
READ_LIMIT = 256 << 20


def read_text(path: str | Path, limit: int | None = None) -> str:
    """The UTF-8 text of ``path``, which must be a regular file (a symlink to one is followed) of at
    most ``limit`` bytes (default :data:`READ_LIMIT`); else a :class:`ValueError` naming it and what
    it is (issue 52: reading a FIFO waited forever, and /dev/zero grew memory until the host ran
    out). Opened without blocking, so a FIFO is named, not waited on; :class:`OSError` when it cannot
    be opened."""
    limit = READ_LIMIT if limit is None else limit
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} {not_plain(info)}, not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{path} holds {info.st_size} bytes, more than the {limit} selfspec reads")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:  # it grew while read
        raise ValueError(f"{path} holds more than the {limit} bytes selfspec reads")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from None


def _not_finite(text: str) -> float:
    raise ValueError(f"{text} is not a finite number")


def _finite(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else _not_finite(text)


def strict_json(text: str) -> Any:
    """``text`` parsed as JSON as selfspec writes it: ``NaN``, ``Infinity`` and numbers beyond a
    float's range (``1e999``) are refused with a :class:`ValueError` naming the value (selfspec
    writes null for a figure that is not finite, so no file it wrote holds one; issue 52: a summary's
    Infinity was reported as "inf× faster")."""
    return json.loads(text, parse_constant=_not_finite, parse_float=_finite)


def restore_hint(path: str | Path) -> str:
    """How to get back ``path``, a file that ships with selfspec, as selfspec is installed here:
    from git in a source checkout (``make install`` and ``pip install -e .`` install the checkout's
    own files, so installing again would not replace it), else by reinstalling the package (from
    where it was installed, as pip recorded it)."""
    import selfspec

    root = Path(selfspec.__file__).resolve().parents[2]
    path = Path(path).resolve()
    if (root / "pyproject.toml").is_file() and path.is_relative_to(root):
        rel = path.relative_to(root).as_posix()
        if (root / ".git").exists():
            return f"restore selfspec's copy from git (`git -C {root} checkout -- {rel}`)"
        return f"restore {rel} from a fresh copy of selfspec's source ({root} has no git history)"
    return f"reinstall selfspec (`pip install --force-reinstall --no-deps {_installed_from()}`)"


def _installed_from() -> str:
    """Where pip installed selfspec from (its ``direct_url.json``), else the package name."""
    from importlib import metadata

    try:
        recorded = json.loads(metadata.distribution("selfspec").read_text("direct_url.json") or "{}")
    except (metadata.PackageNotFoundError, ValueError):
        recorded = {}
    url = recorded.get("url") if isinstance(recorded, dict) else None
    return url.removeprefix("file://") if isinstance(url, str) and url.startswith("file://") else "selfspec"


def read_json(path: str | Path, limit: int | None = None) -> Any:
    """:func:`strict_json` of :func:`read_text` of ``path``."""
    return strict_json(read_text(path, limit))


def cache_dir() -> Path:
    """The cache: ``$SELFSPEC_CACHE`` or ``~/.cache/selfspec`` (offline assets, derived values, built kernels)."""
    return Path(os.environ.get("SELFSPEC_CACHE") or Path.home() / ".cache" / "selfspec")


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def per_file_version(kind: str, path: str | Path, derive: Callable[[Path], Any],
                     valid: Callable[[Any], bool] = lambda value: True) -> Any:
    """What ``derive`` makes of the file at ``path`` (a JSON value), derived once per version of the
    file: kept in ``<cache>/<kind>/`` with the file's resolved path, size, mtime_ns, ctime_ns and
    inode, and derived again when any of them changes (a write moves the ctime even when the mtime
    is restored) or when the kept value is not ``valid``. A record that cannot be read or written
    is no obstacle: the value is derived. ``kind`` names what is derived, and its version: a new
    ``kind`` when what ``derive`` makes of a file changes, so no record of the old one is taken."""
    import hashlib

    path = Path(path).resolve()
    st = path.stat()
    stamp = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
             "inode": st.st_ino}
    record = cache_dir() / kind / f"{hashlib.sha256(str(path).encode()).hexdigest()[:16]}.json"
    try:
        kept = read_json(record, limit=1 << 20)
        if kept.get("stamp") == stamp and valid(kept["value"]):
            return kept["value"]
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        pass  # none kept, another version's, or not one selfspec wrote
    value = derive(path)
    try:
        write_json(record, {"stamp": stamp, "value": value})
    except OSError:
        pass  # a cache that cannot be written: derived again next time
    return value


def content_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes, read once per version of the file (:func:`per_file_version`,
    ``<cache>/sha256/``), so an unchanged multi-GB file is not read again at every run."""
    import re

    return per_file_version("sha256", path, sha256_of,
                            valid=lambda digest: re.fullmatch(r"[0-9a-f]{64}", str(digest)) is not None)


def check_writable(directory: str | Path, what: str) -> None:
    """Raise :class:`PermissionError` naming ``what`` unless a file can be created in ``directory``
    (an unnamed temporary file: nothing is left behind)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise PermissionError(f"cannot write to {directory} ({err.strerror or err}): choose a writable "
                              f"directory for {what}") from None


def check_directory(path: str | Path, key: str) -> None:
    """Refuse, naming ``key``, a directory that cannot be made or written (issue 39: an existing file
    there, or a read-only parent, gave a raw FileExistsError or OSError naming no key, after a lock
    file had been created): ``path`` must be a directory or not exist yet, and the nearest existing
    directory on its way must take a new file. Nothing is created."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{key}={path} is an existing file, not a directory: choose a directory")
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise NotADirectoryError(f"{key}={path} lies under the file {ancestor}: choose a directory")
    check_writable(ancestor, key)


@contextlib.contextmanager
def disk_space(path: str | Path) -> Iterator[None]:
    """Name ``path`` in a full disk's error (issue 39: a raw ``OSError [Errno 28]`` named no file),
    and in the error of a write past the process's file-size limit (issue 68: ``ulimit -f`` gave a
    raw ``OSError [Errno 27]``; Python ignores SIGXFSZ, so the write fails with EFBIG). What was
    written before stays: a run resumes where it stopped once there is space, or a higher limit."""
    try:
        yield
    except OSError as err:
        if err.errno == errno.EFBIG:
            what, remedy = "the file-size limit stopped writing", "raise the limit (ulimit -f)"
        elif err.errno in (errno.ENOSPC, errno.EDQUOT):
            what, remedy = "no space left on the device writing", "free some space"
        else:
            raise
        raise OSError(err.errno, f"{what} {path} ({os.strerror(err.errno)}): {remedy} and run the same command "
                                 "again (a run resumes where it stopped)", str(path)) from None


def _new(folder: str | Path, name: str, create: Callable[[Path], Any]) -> tuple[Any, Path]:
    """``create(path)`` at the first free ``folder/.<name>.<random>.tmp``: what it returns, and the path."""
    for _ in range(100):
        tmp = Path(folder) / f".{name}.{os.urandom(6).hex()}.tmp"
        try:
            return create(tmp), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name for {name} in {folder}")


def new_temporary(folder: str | Path, name: str) -> tuple[int, Path]:
    """A new file ``.<name>.<random>.tmp`` in ``folder``, to be renamed into place: its descriptor (open
    for writing) and path. Its permissions are a plain write's, 0o666 less the umask: ``tempfile``'s
    0o600 left every summary and checkpoint unreadable to the rest of a team sharing ``outputs/``."""
    return _new(folder, name, lambda tmp: os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))


def new_temporary_folder(folder: str | Path, name: str) -> Path:
    """A new folder ``.<name>.<random>.tmp`` in ``folder``, to be renamed into place, with ``mkdir``'s
    permissions (0o777 less the umask, where ``tempfile.mkdtemp``'s are 0o700)."""
    return _new(folder, name, lambda tmp: os.mkdir(tmp, 0o777))[1]


def plain_permissions(path: str | Path) -> None:
    """Give ``path``, a file a library made 0o600 (safetensors' ``save_file`` does), the permissions a plain
    write gives: 0o666 less the umask (read from ``/proc/self/status``, else set and put back)."""
    try:
        mask = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                        if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` atomically (temporary file in the same directory + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with disk_space(path):
        fd, tmp = new_temporary(path.parent, path.name)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON atomically (:func:`write_text`)."""
    return write_text(path, json.dumps(to_jsonable(obj), indent=2, ensure_ascii=False) + "\n")


def check_run_dir_argument(argv: list[str]) -> None:
    """Before Hydra makes the run directory a command line names (``hydra.run.dir=...``), refuse one
    that cannot be made or written with :func:`check_directory`'s message, and exit (Hydra would
    fail with a raw FileExistsError). A sweep's directories and interpolated paths are left to Hydra."""
    import sys

    for arg in argv:
        if arg.startswith("hydra.run.dir=") and "${" not in arg:
            try:
                check_directory(arg.split("=", 1)[1], "hydra.run.dir")
            except OSError as err:
                sys.exit(f"{type(err).__name__}: {err}")
