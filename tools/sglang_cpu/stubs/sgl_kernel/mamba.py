"""``sgl_kernel.mamba``: imported on SGLang's CPU path; every name raises when called."""

from sgl_kernel import module_getattr

__getattr__ = module_getattr(__name__)
