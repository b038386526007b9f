"""CPU stand-in for ``sgl_kernel`` (the real package is CUDA-only: it loads libcuda.so.1).

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) on a CPU without Intel AMX computes every
layer with its own torch code; it only imports names from ``sgl_kernel`` while loading. Every
name here is a function that raises ``RuntimeError`` when called. When the environment variable
``RL_JAX_SGL_KERNEL_CALLS`` names a file, each call first appends its name to that file, so a
test can assert that no kernel was called.

Submodules: ``sgl_kernel.mamba`` and ``sgl_kernel.speculative``, which SGLang imports
unconditionally on the CPU path (linear-attention models, speculative decoding). The others it
imports are CUDA/XPU-only, or sit in ``try: ... except ImportError`` (``allreduce``,
``kvcacheio``, ``scalar_type``), where their absence selects SGLang's own fallback, so they are
left out on purpose.
"""

import os

CALLS_ENV = "RL_JAX_SGL_KERNEL_CALLS"


def _stand_in(qualname: str):
    def stand_in(*args, **kwargs):
        log = os.environ.get(CALLS_ENV)
        if log:
            with open(log, "a", encoding="utf-8") as f:
                f.write(qualname + "\n")
        raise RuntimeError(f"{qualname} called: this CPU stand-in has no kernels")

    stand_in.__name__ = qualname.rsplit(".", 1)[-1]
    stand_in.__qualname__ = qualname
    return stand_in


def module_getattr(module_name: str):
    """A module-level ``__getattr__`` for ``module_name`` that hands out raising stand-ins."""

    def __getattr__(name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return _stand_in(f"{module_name}.{name}")

    return __getattr__


__getattr__ = module_getattr(__name__)
