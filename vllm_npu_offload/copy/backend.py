"""``NPUDmaCopyBackend``: the one Python interface over every copy path.

It chooses a ``CopyPath`` per direction once, at construction (not per call), from
the platform and what is installed; ``NPU_OFFLOAD_COPY_PATH`` forces one.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..platform import Platform
from .base import CopyPath, Direction
from .host import HostCopyPath

logger = logging.getLogger(__name__)

# name -> factory(platform, page_sizes) ; accelerator paths register themselves here
_PATH_FACTORIES: dict[str, Callable[[Platform, "list[int]"], CopyPath]] = {
    "host": lambda platform, pages: HostCopyPath(),
}


def register_path(name: str, factory: Callable[[Platform, "list[int]"], CopyPath]) -> None:
    _PATH_FACTORIES[name] = factory


def available_paths() -> tuple[str, ...]:
    return tuple(_PATH_FACTORIES)


@dataclass(frozen=True)
class BackendChoice:
    load: str
    store: str


# Accelerator paths live in their own modules, imported on first use so that a
# machine without a toolkit never loads them. Each calls register_path/register_chooser.
_ACCELERATOR_MODULES = {"cuda": "vllm_npu_offload.copy.cuda_paths", "npu": "vllm_npu_offload.copy.npu_paths"}


def load_accelerator_paths(kind: str) -> None:
    mod = _ACCELERATOR_MODULES.get(kind)
    if mod is None:
        return
    try:
        importlib.import_module(mod)
    except ImportError as e:
        logger.warning("copy paths for %s unavailable: %s", kind, e)


def default_choice(platform: Platform, page_sizes: "list[int] | None" = None) -> BackendChoice:
    if platform.kind == "cpu":
        return BackendChoice("host", "host")
    load_accelerator_paths(platform.kind)
    chooser = _CHOOSERS.get(platform.kind)
    if chooser is None:
        raise RuntimeError(f"no copy path is available for device kind {platform.kind!r}; build the native library")
    return chooser(platform, list(page_sizes or []))


# kind -> chooser(platform, page_sizes) -> BackendChoice (may measure, e.g. CUDA calibration)
_CHOOSERS: dict[str, Callable[[Platform, "list[int]"], BackendChoice]] = {}


def register_chooser(kind: str, chooser: Callable[[Platform, "list[int]"], BackendChoice]) -> None:
    _CHOOSERS[kind] = chooser


# kind -> factory(platform) -> (local path, link path) for staged transfers: the local
# path copies device <-> device staging (gather/scatter), the link path moves the few
# large staging <-> host runs. A factory raises ImportError/RuntimeError when the
# platform lacks what staging needs (then transfers stay direct).
_STAGED_FACTORIES: dict[str, Callable[[Platform, "list[int]"], "tuple[CopyPath, CopyPath]"]] = {
    "cpu": lambda platform, pages: (HostCopyPath(), HostCopyPath()),
}


def register_staged(kind: str, factory: Callable[[Platform, "list[int]"], "tuple[CopyPath, CopyPath]"]) -> None:
    _STAGED_FACTORIES[kind] = factory


def staged_paths(platform: Platform, page_sizes: "list[int]") -> "tuple[CopyPath, CopyPath] | None":
    """(local, link) copy paths for staged transfers on ``platform``; None when unavailable."""
    load_accelerator_paths(platform.kind)
    factory = _STAGED_FACTORIES.get(platform.kind)
    if factory is None:
        return None
    try:
        return factory(platform, list(page_sizes))
    except (ImportError, RuntimeError, OSError) as e:
        logger.warning("staged copies unavailable on %s (%s); transfers stay direct", platform.kind, e)
        return None


class NPUDmaCopyBackend:
    """Copies descriptor batches in either direction with the path chosen for it."""

    ENV_FORCE = "NPU_OFFLOAD_COPY_PATH"

    def __init__(self, platform: Platform, page_sizes: list[int] | None = None, choice: BackendChoice | None = None):
        self.platform = platform
        load_accelerator_paths(platform.kind)
        forced = os.environ.get(self.ENV_FORCE)
        if forced:
            if forced not in _PATH_FACTORIES:
                raise ValueError(f"{self.ENV_FORCE}={forced!r} is not one of {available_paths()}")
            choice = BackendChoice(forced, forced)
        pages = list(page_sizes or [])
        self.choice = choice or default_choice(platform, pages)
        self._paths: dict[Direction, CopyPath] = {}
        for d, name in ((Direction.H2D, self.choice.load), (Direction.D2H, self.choice.store)):
            if name not in _PATH_FACTORIES:
                raise ValueError(f"copy path {name!r} is not one of {available_paths()}")
            self._paths[d] = _PATH_FACTORIES[name](platform, pages)
        logger.info("NPUDmaCopyBackend on %s: load=%s store=%s", platform.kind, self.choice.load, self.choice.store)

    def use_path(self, direction: Direction, path: CopyPath) -> None:
        """Replace one direction's path (set-up only, before any copy is submitted)."""
        direction = Direction(direction)
        self._paths[direction] = path
        load, store = self.choice.load, self.choice.store
        self.choice = BackendChoice(path.name if direction.is_load else load, store if direction.is_load else path.name)
        logger.info("NPUDmaCopyBackend on %s: %s now uses %s", self.platform.kind, direction.name, path.name)

    def path(self, direction: Direction) -> CopyPath:
        return self._paths[Direction(direction)]

    def copy(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, direction: Direction, stream: Any, buffers=None) -> None:
        """Enqueue the batch on ``stream`` (asynchronous; raises ``CopyError`` on a failed submit)."""
        if len(sizes) == 0:
            return
        self._paths[Direction(direction)].copy(src, dst, sizes, Direction(direction), stream, buffers)
