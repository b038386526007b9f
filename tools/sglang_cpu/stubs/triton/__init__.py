"""CPU stand-in for ``triton``: SGLang's own mock, from ``sglang/_platform_stubs.py``.

SGLang imports triton at load time (``@triton.jit`` kernels at module level) but its CPU engine
never launches a triton kernel. The real package is 1 GB and only works with a GPU. SGLang ships
a mock of it for Apple machines: ``install_platform_stubs()`` registers mock modules for
``triton`` and ``triton.*`` (a meta-path finder makes every submodule, ``@triton.jit`` passes
the function through, ``triton.cdiv`` etc. are real). That function only runs on macOS with
MPS, so this package calls it with its platform checks answered for Apple and its MPS patches
(``torch.mps`` attributes, ``Tensor.to``/``copy_``) sent to a throwaway object: only the triton
mock is installed. The mock replaces this module in ``sys.modules``, so ``import triton``
returns it.
"""

import builtins
import importlib.util
import os
import sys
import types


def _load_platform_stubs():
    # find_spec on a top-level name does not run sglang/__init__.py (which imports triton).
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("triton stand-in: sglang is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "_platform_stubs.py")
    name = "_sglang_platform_stubs"  # a private name: sglang's own module stays untouched
    stubs_spec = importlib.util.spec_from_file_location(name, path)
    stubs = importlib.util.module_from_spec(stubs_spec)
    sys.modules[name] = stubs  # its dataclasses look their module up there
    stubs_spec.loader.exec_module(stubs)
    return stubs


def _install():
    stubs = _load_platform_stubs()
    ns = types.SimpleNamespace
    apple_torch = ns(backends=ns(mps=ns(is_available=lambda: True)), mps=ns())

    def _import(name, *args, **kwargs):
        if name == "torch":
            return apple_torch
        return builtins.__import__(name, *args, **kwargs)

    env = dict(vars(stubs))
    env.update(
        sys=ns(platform="darwin", modules={}, meta_path=sys.meta_path),
        platform=ns(machine=lambda: "arm64"),
        importlib=ns(util=ns(find_spec=lambda name: None)),
        _patch_non_blocking=lambda: None,
        __builtins__={**vars(builtins), "__import__": _import},
    )
    types.FunctionType(stubs.install_platform_stubs.__code__, env)()
    mock = sys.modules.get(__name__)
    if not isinstance(mock, stubs._MockModule):
        raise ImportError(
            "triton stand-in: sglang._platform_stubs.install_platform_stubs did not "
            "install its triton mock"
        )


_install()
