from torchvision.transforms._interpolation import InterpolationMode
from torchvision._stand_in import module_getattr

__getattr__ = module_getattr(__name__)
