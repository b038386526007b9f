from torchvision._stand_in import module_getattr

__getattr__ = module_getattr(__name__)
