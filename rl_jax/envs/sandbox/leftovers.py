"""What a program of a weaker isolation mode left on the host, found after its run and removed.

In the ``namespaces`` and ``rlimits`` modes the program's uid may write wherever the host lets
any user write: with ``rlimits`` the host's shared temporary directories (``/tmp``, ``/var/tmp``,
``/dev/shm``, ``/run/lock``) and System V IPC objects; with ``namespaces``, which replaces those
by its own tmpfs and IPC namespace, only world-writable places elsewhere on the host (none on a
usual system), so there the watch below is a check that finds nothing.
:class:`LeftoverWatch` looks, after the run, at the entries of :data:`SHARED_DIRS` and of the
world-writable directories below them (down to :data:`MAX_DEPTH` levels, at most
:data:`MAX_DIRS` directories) and at the System V shared memory segments, message queues and
semaphore sets:

* as root every program runs under a uid of its own, so an entry owned by that uid (or by its
  test harness's uid) is the program's: it is counted, removed (never following a symbolic link)
  and the run fails with reason ``host_files``;
* without root the program shares the runner's uid, so what it made cannot be told from what
  other processes of that user made at the same time: an entry of that uid that was not there
  before the run fails the run likewise, but is left in place and named (a deployment that needs
  more runs the ``bwrap`` mode).

In ``bwrap`` mode nothing of the host is writable, and no watch is kept.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import stat

from rl_jax.envs.sandbox.limits import SandboxResult

SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")
MAX_DEPTH = 4
MAX_DIRS = 4096
_SYSV_IPC = (  # the /proc/sysvipc file, its id column, its creator-uid column
    ("shm", "shmid", "cuid"), ("msg", "msqid", "cuid"), ("sem", "semid", "cuid"))
_IPC_RMID = 0
_NAMED_IN_DETAIL = 5


def watched_dirs(roots: tuple[str, ...] = SHARED_DIRS, skip_uids: frozenset[int] = frozenset()
                 ) -> list[str]:
    """``roots`` that exist and the world-writable directories below them (a bounded walk of the
    host's directories: one owned by a uid of ``skip_uids`` is neither counted nor entered, as
    it is a leftover itself)."""
    found, stack, seen = [], [(os.path.realpath(r), 0) for r in roots], set()
    while stack and len(seen) < MAX_DIRS:
        path, depth = stack.pop()
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        if depth == 0 or st.st_mode & 0o002:
            found.append(path)
        if depth >= MAX_DEPTH:
            continue
        try:
            with os.scandir(path) as it:
                for e in it:
                    try:
                        if (e.is_dir(follow_symlinks=False)
                                and e.stat(follow_symlinks=False).st_uid not in skip_uids):
                            stack.append((e.path, depth + 1))
                    except OSError:
                        continue
        except OSError:
            continue
    return found


def _entries(dirs: list[str]) -> dict[str, tuple[int, int]]:
    """``path -> (inode, owner uid)`` of every entry directly inside ``dirs``."""
    entries = {}
    for d in dirs:
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    entries[e.path] = (st.st_ino, st.st_uid)
        except OSError:
            continue
    return entries


def _sysv_objects() -> list[tuple[str, int, int]]:
    """``(kind, id, creator uid)`` of every System V IPC object visible here."""
    objects = []
    for kind, id_column, uid_column in _SYSV_IPC:
        try:
            with open(f"/proc/sysvipc/{kind}", encoding="ascii") as f:
                header = f.readline().split()
                for line in f:
                    fields = line.split()
                    objects.append((kind, int(fields[header.index(id_column)]),
                                    int(fields[header.index(uid_column)])))
        except (OSError, ValueError, IndexError):
            continue
    return objects


def _remove_sysv(kind: str, ident: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if kind == "shm":
        libc.shmctl(ident, _IPC_RMID, None)
    elif kind == "msg":
        libc.msgctl(ident, _IPC_RMID, None)
    else:
        libc.semctl(ident, 0, _IPC_RMID)


def _size_of(path: str) -> tuple[int, int]:
    """(entries, bytes) of ``path`` and everything below it, without following links."""
    count, size, stack = 0, 0, [path]
    while stack:
        p = stack.pop()
        try:
            st = os.stat(p, follow_symlinks=False)
        except OSError:
            continue
        count += 1
        size += st.st_blocks * 512
        if stat.S_ISDIR(st.st_mode):
            try:
                with os.scandir(p) as it:
                    stack.extend(e.path for e in it)
            except OSError:
                pass
    return count, size


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: never follows links
        else:
            os.unlink(path)
    except OSError:
        pass


def _outermost(paths: list[str]) -> list[str]:
    """``paths`` without those inside another of them (without root the walk enters a leftover
    directory and lists its entries too), sorted."""
    kept = set(paths)
    def inside_another(path):
        parent = os.path.dirname(path)
        while parent != os.path.dirname(parent):
            if parent in kept:
                return True
            parent = os.path.dirname(parent)
        return False
    return sorted(p for p in paths if not inside_another(p))


@dataclasses.dataclass
class LeftoverWatch:
    """Taken before one run (:meth:`start`), checked after it (:meth:`check`).

    Args:
      uids: the program's and its harness's uids when the sandbox runs them under uids of their
        own (as root); empty otherwise, and then entries of this process's uid that appear
        during the run count as the program's but are not removed.
    """

    uids: frozenset[int]
    _before: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    _sysv_before: set[tuple[str, int]] = dataclasses.field(default_factory=set)

    def start(self) -> LeftoverWatch:
        if not self.uids:
            self._before = _entries(watched_dirs())
            self._sysv_before = {(k, i) for k, i, _ in _sysv_objects()}
        return self

    def check(self, result: SandboxResult) -> SandboxResult:
        """``result``, or a ``host_files`` failure naming what the program left (removed as
        root)."""
        owners = self.uids or frozenset({os.getuid()})
        left = [path for path, (ino, uid) in _entries(watched_dirs(skip_uids=self.uids)).items()
                if uid in owners and (self.uids or self._before.get(path, (None,))[0] != ino)]
        ipc = [(k, i) for k, i, uid in _sysv_objects()
               if uid in owners and (self.uids or (k, i) not in self._sysv_before)]
        if not left and not ipc:
            return result
        left = _outermost(left)
        entries = size = 0
        for path in left:
            n, b = _size_of(path)
            entries, size = entries + n, size + b
            if self.uids:
                _remove(path)
        if self.uids:
            for kind, ident in ipc:
                _remove_sysv(kind, ident)
        named = left[:_NAMED_IN_DETAIL] + [f"System V {k} {i}" for k, i in ipc][
            :_NAMED_IN_DETAIL]
        more = len(left) + len(ipc) - len(named)
        what = ", ".join(named) + (f" and {more} more" if more > 0 else "")
        fate = ("removed" if self.uids else
                "left in place: without root the sandbox cannot tell them from other processes' "
                "files")
        detail = (f"the program left {entries} files and directories ({size} bytes) and "
                  f"{len(ipc)} System V IPC objects outside its sandbox: {what}; {fate}. "
                  f"The run fails whatever it printed (it ended as {result.reason!r})")[:2000]
        return dataclasses.replace(result, reason="host_files", detail=detail)
