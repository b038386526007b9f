"""Confinement of a forked child and the sandbox's filesystem (stdlib only).

:func:`_confine` applies the rlimits, drops the capability bounding set, takes the child's own
uid and gid, sets ``no_new_privs`` and installs the seccomp filter; :func:`_setup_namespace_fs`
mounts the limited tmpfs in the ``bwrap`` and ``namespaces`` modes.
"""

import ctypes
import os
import resource

from seccomp_filter import _load_seccomp

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
_PR_CAPBSET_DROP = 24
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18
_WRITABLE_DIRS = ("/var/tmp", "/dev/shm", "/run/lock")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _drop_bounding_capabilities():
    """Empties the capability bounding set (as root, before giving up the uid)."""
    for cap in range(64):
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() == 22:  # EINVAL: past the last capability of this kernel
                return
            _check(-1, f"prctl(PR_CAPBSET_DROP, {cap})")


def _mount(source, target, fstype, flags, data):
    _check(_libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                       ctypes.c_ulong(flags), data.encode() if data else None), f"mount {target}")


def _setup_namespace_fs(limits, num_files):
    """The limited tmpfs on /tmp (bound over the other writable dirs); returns the work dir."""
    _mount("none", "/", None, _MS_REC | _MS_PRIVATE, None)
    inodes = int(limits["max_files"]) + 2 + num_files  # + the root and work dirs, our files
    _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={int(limits['max_disk_bytes'])},nr_inodes={inodes},mode=1777")
    for path in _WRITABLE_DIRS:
        if os.path.isdir(path):
            _mount("/tmp", path, None, _MS_BIND, None)
    return "/tmp/work"


def _confine(job, uid, nproc_limit, file_bytes):
    """In a forked child: rlimits, then the uid, ``no_new_privs`` and the seccomp filter."""
    limits = job["limits"]
    cpu = max(1, int(-(-float(limits["cpu_time"]) // 1)))
    for res, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                       (resource.RLIMIT_AS, int(limits["memory_bytes"])),
                       (resource.RLIMIT_FSIZE, file_bytes),
                       (resource.RLIMIT_NOFILE, int(limits["max_open_files"])),
                       (resource.RLIMIT_NPROC, nproc_limit),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, value if isinstance(value, tuple) else (value, value))
    if os.geteuid() == 0:
        _drop_bounding_capabilities()
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    if job.get("seccomp"):
        _load_seccomp()
