"""The seccomp filter every sandboxed program (and test harness) runs under (stdlib only).

Installed through the system's libseccomp with ctypes; see :func:`_load_seccomp`.
"""

import ctypes
import os

# Seccomp (through the system's libseccomp): what a program may not ask of the kernel. Namespaces
# would let it become root of a user namespace and mount filesystems outside the disk limit;
# mounts, keyrings, BPF, perf, userfaultfd and ptrace are kernel surface it has no use for;
# io_uring would bypass the socket rule. Sockets other than AF_UNIX (needed by asyncio and
# multiprocessing) are refused; unix sockets reach nothing of the host (no host path is visible in
# the bwrap root, abstract ones live in the network namespace).
_SECCOMP_LIBRARY = "libseccomp.so.2"
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_NE, _SCMP_CMP_MASKED_EQ = 1, 7
_EPERM, _ENOSYS, _EAFNOSUPPORT = 1, 38, 97
_AF_UNIX = 1
_DENIED_SYSCALLS = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "keyctl", "add_key",
    "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "ptrace", "process_vm_readv", "process_vm_writev", "name_to_handle_at",
    "open_by_handle_at", "kexec_load", "init_module", "finit_module", "delete_module", "swapon",
    "swapoff", "reboot", "syslog", "acct", "quotactl", "lookup_dcookie", "vhangup")
# CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
_CLONE_NAMESPACE_FLAGS = (0x80, 0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000,
                          0x20000000, 0x40000000)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _errno_action(errno):
    return 0x00050000 | errno


def _load_seccomp():
    """Installs the filter on this process and its future children (after ``no_new_privs``).

    Raises:
      OSError: if libseccomp is missing or refuses the filter.
    """
    lib = ctypes.CDLL(_SECCOMP_LIBRARY, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")

    def rule(name, errno, *conditions):
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            return  # not a system call of this architecture
        args = (_ArgCmp * max(1, len(conditions)))(*conditions)
        result = lib.seccomp_rule_add_array(ctx, _errno_action(errno), number, len(conditions),
                                            args)
        if result != 0:
            raise OSError(-result, f"seccomp rule for {name}: {os.strerror(-result)}")

    for name in _DENIED_SYSCALLS:
        rule(name, _EPERM)
    for flag in _CLONE_NAMESPACE_FLAGS:
        rule("clone", _EPERM, _ArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag))
    # clone3's flags sit in memory a filter cannot read; libc falls back to clone on ENOSYS.
    rule("clone3", _ENOSYS)
    for name in ("socket", "socketpair"):
        rule(name, _EAFNOSUPPORT, _ArgCmp(0, _SCMP_CMP_NE, _AF_UNIX, 0))
    result = lib.seccomp_load(ctypes.c_void_p(ctx))
    if result != 0:
        raise OSError(-result, f"seccomp_load: {os.strerror(-result)}")
