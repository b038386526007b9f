"""The sandbox's limits, results and error (see :mod:`rl_jax.envs.sandbox`)."""

from __future__ import annotations

import dataclasses

from rl_jax.errors import UserError

REASONS = ("ok", "runtime_error", "test_failed", "timeout", "memory", "output_limit",
           "file_limit", "process_limit", "host_files", "sandbox_error")


class SandboxError(UserError, RuntimeError):
    """The sandbox itself cannot run (bad limits, an isolation mode that is unavailable or below
    the minimum, missing interpreter): a launcher prints it as one line."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run.

    Attributes:
      wall_time: seconds from start until the whole process tree is killed.
      cpu_time: CPU seconds of the program (``RLIMIT_CPU``, rounded up to whole seconds).
      memory_bytes: address space per process (``RLIMIT_AS``).
      max_total_memory_bytes: resident memory of all the program's processes together, sampled
        every 20 ms (overshoot is what the program can fault in between two samples).
      max_processes: processes and threads of the program's uid (``RLIMIT_NPROC``).
      max_file_bytes: size of any one file (``RLIMIT_FSIZE``).
      max_open_files: open file descriptors per process (``RLIMIT_NOFILE``).
      max_files: files and directories the program may create.
      max_disk_bytes: bytes the program may store in files.
      max_output_bytes: bytes kept from stdout and from stderr; more kills the program.
    """

    wall_time: float = 10.0
    cpu_time: float = 10.0
    memory_bytes: int = 512 * 2**20
    max_total_memory_bytes: int = 2**30
    max_processes: int = 32
    max_file_bytes: int = 16 * 2**20
    max_open_files: int = 64
    max_files: int = 256
    max_disk_bytes: int = 64 * 2**20
    max_output_bytes: int = 2**20

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not value > 0:
                raise SandboxError(f"SandboxLimits.{field.name} must be positive, got {value!r}")
        if self.memory_bytes < 32 * 2**20:
            raise SandboxError(f"SandboxLimits.memory_bytes={self.memory_bytes} is below 32 MiB, "
                               "too little to start a Python interpreter")
        if self.max_open_files < 8:
            raise SandboxError(f"SandboxLimits.max_open_files={self.max_open_files} is below 8, "
                               "too few to start a Python interpreter")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What happened to one program.

    Attributes:
      reason: one of :data:`REASONS`; ``"ok"`` means the program exited with status 0;
        ``"host_files"`` that it left files or IPC objects on the host (weaker modes only; see
        :mod:`rl_jax.envs.sandbox.leftovers`), whatever else it did.
      detail: a human-readable explanation of ``reason``.
      exit_code: the main process's exit status, or None if it was killed by a signal.
      signal: the signal that killed the main process, or None.
      stdout, stderr: decoded output (UTF-8, invalid bytes replaced), at most
        ``max_output_bytes`` each.
      stdout_truncated, stderr_truncated: whether more was written than kept.
      wall_time: seconds from the runner's start to the end of the program.
      cpu_time: CPU seconds of all the program's processes.
      peak_processes: most processes seen at once (sampled every 20 ms).
      peak_memory_bytes: most resident memory of all its processes together (sampled).
      files_created: files and directories the program created.
      tests_run, tests_passed: for a run with ``tests``, how many the harness ran (the program
        did not stop first) and how many passed.
    """

    reason: str
    detail: str = ""
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_time: float = 0.0
    cpu_time: float = 0.0
    peak_processes: int = 0
    peak_memory_bytes: int = 0
    files_created: int = 0
    tests_run: int = 0
    tests_passed: int = 0

    @property
    def ok(self) -> bool:
        return self.reason == "ok"
