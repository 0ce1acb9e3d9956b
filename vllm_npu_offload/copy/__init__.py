"""Copy paths behind one interface (``NPUDmaCopyBackend``)."""

from .backend import NPUDmaCopyBackend, available_paths, register_path
from .base import BackendChoice, CopyPath, Direction

__all__ = ["BackendChoice", "CopyPath", "Direction", "NPUDmaCopyBackend", "available_paths", "register_path"]
