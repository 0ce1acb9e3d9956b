"""Copy paths behind one interface (``NPUDmaCopyBackend``)."""

from .backend import BackendChoice, NPUDmaCopyBackend, available_paths, register_chooser, register_path
from .base import CopyPath, Direction

__all__ = [
    "BackendChoice",
    "CopyPath",
    "Direction",
    "NPUDmaCopyBackend",
    "available_paths",
    "register_chooser",
    "register_path",
]
