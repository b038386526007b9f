"""CPU stand-in for ``torchvision``.

PyPI's torchvision is built against a CUDA torch and fails to import beside the CPU build of torch
this venv uses. SGLang only imports it at load time (image and video processors of multimodal
models, which a text model never runs). Every name is a function that raises ``RuntimeError``
when called, except ``InterpolationMode``, a real enum (used in default arguments).
"""

from torchvision import io, transforms
from torchvision._stand_in import module_getattr

__version__ = "0.0.0+cpu.stand.in"

__getattr__ = module_getattr(__name__)
