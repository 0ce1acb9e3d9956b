"""``NPUDmaCopyBackend``: the one Python interface over every copy path.

It chooses a ``CopyPath`` per direction once, at construction (not per call), from
the platform and what is installed; ``NPU_OFFLOAD_COPY_PATH`` forces one.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .. import env
from ..platform import Platform
from .base import BackendChoice, CopyPath, Direction, PathFactory, PlatformPaths
from .host import HostCopyPath

logger = logging.getLogger(__name__)

# Paths every platform has, plus any a test or an extension registers by name.
_EXTRA_PATHS: dict[str, PathFactory] = {"host": lambda platform, pages: HostCopyPath()}


def register_path(name: str, factory: PathFactory) -> None:
    """Make one more path selectable by name (tests, out-of-tree paths)."""
    _EXTRA_PATHS[name] = factory


def platform_paths(kind: str) -> PlatformPaths | None:
    """The copy paths of a device kind, imported on first use so that a machine without a
    toolkit never loads them; None for CPU, or when the kind's module cannot load."""
    try:
        if kind == "cuda":
            from .cuda_paths import PATHS
        elif kind == "npu":
            from .npu_paths import PATHS
        else:
            return None
    except ImportError as e:
        logger.warning("copy paths for %s unavailable: %s", kind, e)
        return None
    return PATHS


def path_factories(kind: str) -> dict[str, PathFactory]:
    """Every path selectable on ``kind``, by name."""
    found = platform_paths(kind)
    return {**_EXTRA_PATHS, **(found.paths if found is not None else {})}


def available_paths(kind: str = "cpu") -> tuple[str, ...]:
    return tuple(path_factories(kind))


def default_choice(platform: Platform, page_sizes: "list[int] | None" = None,
                   measure: "tuple[Direction, ...]" = tuple(Direction)) -> BackendChoice:
    """The platform's pick per direction; only ``measure``'s directions are calibrated (a core
    whose stores go staged never uses a measured direct store path)."""
    if platform.kind == "cpu":
        return BackendChoice("host", "host")
    found = platform_paths(platform.kind)
    if found is None:
        raise RuntimeError(f"no copy path is available for device kind {platform.kind!r}; build the native library")
    return found.choose(platform, list(page_sizes or []), tuple(measure))


def staged_paths(platform: Platform, page_sizes: "list[int]") -> "tuple[CopyPath, CopyPath] | None":
    """(local, link) copy paths for staged transfers on ``platform``; None when unavailable.
    The local path copies device <-> device staging (gather/scatter), the link path moves the
    few large staging <-> host runs."""
    if platform.kind == "cpu":
        return HostCopyPath(), HostCopyPath()
    found = platform_paths(platform.kind)
    if found is None:
        return None
    try:
        return found.staged(platform, list(page_sizes))
    except (ImportError, RuntimeError, OSError) as e:
        logger.warning("staged copies unavailable on %s (%s); transfers stay direct", platform.kind, e)
        return None


class NPUDmaCopyBackend:
    """Copies descriptor batches in either direction with the path chosen for it."""

    ENV_FORCE = "NPU_OFFLOAD_COPY_PATH"

    def __init__(self, platform: Platform, page_sizes: list[int] | None = None, choice: BackendChoice | None = None,
                 measure: tuple[Direction, ...] = tuple(Direction)):
        self.platform = platform
        factories = path_factories(platform.kind)
        forced = env.get(self.ENV_FORCE)
        if forced:
            if forced not in factories:
                raise ValueError(f"{self.ENV_FORCE}={forced!r} is not one of {tuple(factories)}")
            choice = BackendChoice(forced, forced)
        pages = list(page_sizes or [])
        self.choice = choice or default_choice(platform, pages, measure)
        self._paths: dict[Direction, CopyPath] = {}
        for d, name in ((Direction.H2D, self.choice.load), (Direction.D2H, self.choice.store)):
            if name not in factories:
                raise ValueError(f"copy path {name!r} is not one of {tuple(factories)}")
            self._paths[d] = factories[name](platform, pages)
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
