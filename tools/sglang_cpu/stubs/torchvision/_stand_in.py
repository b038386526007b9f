"""Raising stand-ins for the torchvision names SGLang imports while loading."""


def _stand_in(qualname: str):
    def stand_in(*args, **kwargs):
        raise RuntimeError(
            f"{qualname} used: this CPU stand-in for torchvision has no image operations"
        )

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
