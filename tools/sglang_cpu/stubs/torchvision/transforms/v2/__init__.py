from torchvision.transforms.v2 import functional
from torchvision._stand_in import module_getattr

__getattr__ = module_getattr(__name__)
