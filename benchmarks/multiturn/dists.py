"""Seeded length distributions (constant, uniform, lognormal, zipf, poisson) with optional
``min``/``max`` clamps, described by small dicts as in vLLM's generate_multi_turn.json."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import BenchError

KINDS = ("constant", "uniform", "lognormal", "zipf", "poisson")


@dataclass(frozen=True)
class Dist:
    kind: str
    params: dict[str, float]
    lo: int = 0
    hi: int | None = None

    def sample(self, rng: np.random.Generator, n: int = 1) -> list[int]:
        p = self.params
        if self.kind == "constant":
            x = np.full(n, p["value"], dtype=float)
        elif self.kind == "uniform":
            x = rng.integers(int(p["min"]), int(p["max"]) + 1, size=n).astype(float)
        elif self.kind == "lognormal":
            x = rng.lognormal(p["mean"], p["sigma"], size=n)
        elif self.kind == "zipf":
            x = rng.zipf(p["alpha"], size=n).astype(float)
        else:
            x = rng.poisson(p["alpha"], size=n).astype(float)
        x = np.maximum(np.rint(x), self.lo)
        if self.hi is not None:
            x = np.minimum(x, self.hi)
        return [int(v) for v in x]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"distribution": self.kind, **self.params}
        if self.hi is not None and self.kind != "uniform":
            d["max"] = self.hi
        if self.lo and self.kind != "uniform":
            d["min"] = self.lo
        return d


def _num(d: dict, key: str, where: str, positive: bool = False) -> float:
    if key not in d:
        raise BenchError(f"{where}: distribution {d.get('distribution')!r} needs {key!r} (got keys {sorted(d)})")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (positive and v <= 0) or v < 0:
        need = "a number > 0" if positive else "a number >= 0"
        raise BenchError(f"{where}.{key} = {v!r}: must be {need}")
    return float(v)


def parse_dist(d: Any, where: str) -> Dist:
    """Validate ``{"distribution": kind, ...}`` (a bare int means constant). Lognormal takes
    ``average`` (+ optional ``median_ratio``, default 0.85) or ``mean``/``sigma`` of the log."""
    if isinstance(d, int) and not isinstance(d, bool):
        d = {"distribution": "constant", "value": d}
    if not isinstance(d, dict) or "distribution" not in d:
        raise BenchError(f"{where} = {d!r}: expected an int or {{'distribution': one of {KINDS}, ...}}")
    kind = d["distribution"]
    if kind not in KINDS:
        raise BenchError(f"{where}.distribution = {kind!r}: allowed are {', '.join(KINDS)}")
    hi = int(_num(d, "max", where)) if "max" in d else None
    lo = int(_num(d, "min", where)) if "min" in d else 0
    if kind == "constant":
        params = {"value": _num(d, "value", where)}
    elif kind == "uniform":
        lo, hi = int(_num(d, "min", where)), int(_num(d, "max", where))
        params = {"min": lo, "max": hi}
    elif kind == "lognormal":
        if "average" in d:
            avg = _num(d, "average", where, positive=True)
            ratio = d.get("median_ratio", 0.85)
            if not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
                raise BenchError(f"{where}.median_ratio = {ratio!r}: must be in (0, 1)")
            # median = exp(mu), mean = exp(mu + sigma^2/2)  =>  sigma^2 = 2 ln(1/ratio)
            mu = math.log(avg * ratio)
            params = {"mean": mu, "sigma": math.sqrt(2 * math.log(1 / ratio))}
        else:
            params = {"mean": float(d.get("mean", math.nan)), "sigma": _num(d, "sigma", where, positive=True)}
            if math.isnan(params["mean"]):
                raise BenchError(f"{where}: lognormal needs 'average' or 'mean' and 'sigma'")
    elif kind == "zipf":
        params = {"alpha": _num(d, "alpha", where)}
        if params["alpha"] <= 1:
            raise BenchError(f"{where}.alpha = {params['alpha']}: zipf needs alpha > 1")
    else:
        params = {"alpha": _num(d, "alpha", where, positive=True)}
    if hi is not None and hi < lo:
        raise BenchError(f"{where}: max {hi} < min {lo}")
    return Dist(kind, params, lo, hi)


def dist_from_spec(spec: str, where: str) -> Dist:
    """CLI form: ``120`` | ``uniform:80,120`` | ``lognormal:1000[,max]`` | ``zipf:1.5[,max]`` |
    ``poisson:10[,max]``."""
    kind, _, rest = spec.partition(":")
    try:
        if not rest:
            return parse_dist(int(kind), where)
        vals = [float(v) for v in rest.split(",") if v]
    except ValueError:
        raise BenchError(f"{where} = {spec!r}: expected e.g. 120, uniform:80,120, lognormal:1000,5000, "
                         f"zipf:1.5,400 or poisson:10") from None
    d: dict[str, Any] = {"distribution": kind}
    keys = {"constant": ("value",), "uniform": ("min", "max"), "lognormal": ("average", "max"),
            "zipf": ("alpha", "max"), "poisson": ("alpha", "max")}.get(kind)
    if keys is None:
        raise BenchError(f"{where} = {spec!r}: distribution {kind!r} unknown; allowed are {', '.join(KINDS)}")
    if len(vals) > len(keys) or len(vals) < (2 if kind == "uniform" else 1):
        raise BenchError(f"{where} = {spec!r}: {kind} takes {','.join(keys)}")
    for k, v in zip(keys, vals):
        d[k] = int(v) if k in ("max", "min", "value") or (kind == "uniform") else v
    return parse_dist(d, where)
