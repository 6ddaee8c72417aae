"""Sequence lengths: distribution specs, sampling and lengths files, for the mock training data
(``--varlen-distribution``, ``--varlen-lengths-file``) and the simulator (``megatron-dcp simulate
--distribution / --lengths``). Pure Python (``random.Random``), no numpy or torch. Errors start with
the parameter's name (``distribution=...``, ``lengths_file=...``); callers put their flag in its
place with :func:`renamed`.

Distribution spec syntax::

    lognormal:median=M,sigma=S[,min=A][,max=B]   log-normal with median M (or mean=M) and shape S
    uniform:min=A,max=B                          integers uniformly in [A, B]
    constant:value=V                             every sequence has V tokens
    mixture:W1*SPEC1|W2*SPEC2|...                pick component i with probability Wi / ΣW

``mean`` is the mean of the *unclipped* log-normal (``μ = ln(mean) − σ²/2``); ``min``/``max``
clip each drawn length. Integers accept a ``k``/``K`` (×1024) or ``m``/``M`` (×1024²) suffix, so
``uniform:min=32K,max=256K`` works. Every length is clipped to at least 1 token.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

DISTRIBUTION_FLAG = "distribution"
LENGTHS_FLAG = "lengths_file"
SYNTAX_HELP = (
    "use e.g. 'lognormal:median=1024,sigma=1.0,max=8192', 'uniform:min=1,max=32768', "
    "'constant:value=4096' or 'mixture:0.99*lognormal:median=1024,sigma=1.0|"
    "0.01*uniform:min=32K,max=256K'"
)
_SUFFIXES = {"k": 1024, "m": 1024 * 1024}


class Distribution:
    """A distribution of sequence lengths; :meth:`draw` returns one length ≥ 1."""

    spec: str = ""

    def draw(self, rng: random.Random) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class LogNormal(Distribution):
    """Log-normal lengths ``exp(N(mu, sigma))``, rounded and clipped to ``[low, high]``."""

    mu: float
    sigma: float
    low: int = 1
    high: Optional[int] = None
    spec: str = ""

    def draw(self, rng: random.Random) -> int:
        return _clip(round(rng.lognormvariate(self.mu, self.sigma)), self.low, self.high)


@dataclass(frozen=True)
class Uniform(Distribution):
    """Integer lengths uniformly distributed in ``[low, high]``."""

    low: int
    high: int
    spec: str = ""

    def draw(self, rng: random.Random) -> int:
        return max(1, rng.randint(self.low, self.high))


@dataclass(frozen=True)
class Constant(Distribution):
    """Every sequence has the same length."""

    value: int
    spec: str = ""

    def draw(self, rng: random.Random) -> int:
        return max(1, self.value)


@dataclass(frozen=True)
class Mixture(Distribution):
    """Component ``i`` is drawn with probability ``weights[i] / sum(weights)``."""

    weights: Tuple[float, ...]
    components: Tuple[Distribution, ...]
    spec: str = ""

    def draw(self, rng: random.Random) -> int:
        pick = rng.random() * sum(self.weights)
        for weight, component in zip(self.weights, self.components):
            pick -= weight
            if pick < 0:
                return component.draw(rng)
        return self.components[-1].draw(rng)


def _clip(value: int, low: int, high: Optional[int]) -> int:
    value = max(value, low, 1)
    return value if high is None else min(value, high)


def _error(spec: str, problem: str) -> ValueError:
    return ValueError(f"{DISTRIBUTION_FLAG}={spec!r}: {problem}; {SYNTAX_HELP}.")


def _number(spec: str, key: str, text: str, integer: bool) -> float:
    """Parse one parameter value; integers may carry a k/M suffix."""
    scale = _SUFFIXES.get(text[-1:].lower(), 1) if integer else 1
    digits = text[:-1] if scale > 1 else text
    try:
        value = int(digits) * scale if integer else float(digits)
    except ValueError:
        kind = "an integer (optionally with a k/M suffix)" if integer else "a number"
        raise _error(spec, f"{key}={text!r} is not {kind}") from None
    if not math.isfinite(value) or value < 0:
        raise _error(spec, f"{key}={text!r} must be a finite number ≥ 0")
    return value


def _params(spec: str, body: str, allowed: Dict[str, bool]) -> Dict[str, float]:
    """Parse ``key=value,key=value``; ``allowed`` maps each key to 'is an integer'."""
    params: Dict[str, float] = {}
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or key not in allowed:
            raise _error(spec, f"unknown parameter {item!r} (allowed: {', '.join(allowed)})")
        if key in params:
            raise _error(spec, f"parameter {key!r} is given twice")
        params[key] = _number(spec, key, text.strip(), allowed[key])
    return params


def _lognormal(spec: str, body: str) -> LogNormal:
    keys = {"mean": False, "median": False, "sigma": False, "min": True, "max": True}
    p = _params(spec, body, keys)
    if ("mean" in p) == ("median" in p):
        raise _error(spec, "lognormal needs exactly one of mean=... or median=...")
    sigma = p.get("sigma", 1.0)
    center = p.get("mean", p.get("median"))
    if center <= 0:
        raise _error(spec, "lognormal mean/median must be > 0")
    mu = math.log(center) - (sigma * sigma / 2 if "mean" in p else 0.0)
    low, high = int(p.get("min", 1)), p.get("max")
    if high is not None and high < max(low, 1):
        raise _error(spec, f"max={int(high)} is below min={low}")
    return LogNormal(mu, sigma, low, None if high is None else int(high), spec)


def _uniform(spec: str, body: str) -> Uniform:
    p = _params(spec, body, {"min": True, "max": True})
    if "min" not in p or "max" not in p or p["min"] > p["max"]:
        raise _error(spec, "uniform needs min=A,max=B with A ≤ B")
    return Uniform(int(p["min"]), int(p["max"]), spec)


def _constant(spec: str, body: str) -> Constant:
    p = _params(spec, body, {"value": True})
    if "value" not in p:
        raise _error(spec, "constant needs value=V")
    return Constant(int(p["value"]), spec)


def _mixture(spec: str, body: str) -> Mixture:
    weights, components = [], []
    for part in body.split("|"):
        weight, star, component = part.partition("*")
        if not star:
            raise _error(spec, f"mixture component {part!r} must read WEIGHT*SPEC")
        weights.append(_number(spec, "weight", weight.strip(), integer=False))
        components.append(_simple(spec, component.strip()))
    if sum(weights) <= 0:
        raise _error(spec, "mixture weights must sum to > 0")
    return Mixture(tuple(weights), tuple(components), spec)


_KINDS = {"lognormal": _lognormal, "uniform": _uniform, "constant": _constant}


def _simple(spec: str, text: str) -> Distribution:
    kind, _, body = text.partition(":")
    if kind.strip() not in _KINDS:
        raise _error(spec, f"unknown distribution {kind.strip()!r} (choose {', '.join(_KINDS)})")
    return _KINDS[kind.strip()](spec, body)


def parse_distribution(spec: str) -> Distribution:
    """Parse a ``--distribution`` spec (see the module docstring); ValueError when malformed."""
    kind, _, body = spec.strip().partition(":")
    if kind.strip() == "mixture":
        return _mixture(spec, body)
    return _simple(spec, spec.strip())


def sample_lengths(
    distribution: Distribution,
    seed: int = 0,
    num_sequences: Optional[int] = None,
    total_tokens: Optional[int] = None,
) -> List[int]:
    """Draw ``num_sequences`` lengths, or draw until they sum to at least ``total_tokens``."""
    if (num_sequences is None) == (total_tokens is None):
        raise ValueError("give exactly one of num_sequences or total_tokens")
    rng = random.Random(seed)
    if num_sequences is not None:
        return [distribution.draw(rng) for _ in range(num_sequences)]
    lengths, total = [], 0
    while total < total_tokens:
        lengths.append(distribution.draw(rng))
        total += lengths[-1]
    return lengths


def read_lengths(path: str, minimum: int = 0) -> List[int]:
    """One integer ≥ ``minimum`` (0: non-negative, 1: positive) per line; blank lines and ``#``
    comments are ignored."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ValueError(f"{LENGTHS_FLAG}={path!r}: cannot read the file ({error}).") from None
    rule = "non-negative" if minimum == 0 else "positive" if minimum == 1 else f"≥ {minimum}"
    lengths = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if not line.isdigit() or int(line) < minimum:
            raise ValueError(
                f"{LENGTHS_FLAG}={path!r}: line {number} reads {line!r}; write one {rule} "
                f"integer (a sequence length in tokens) per line."
            )
        lengths.append(int(line))
    if not lengths:
        raise ValueError(f"{LENGTHS_FLAG}={path!r}: the file holds no lengths; one int per line.")
    return lengths


def renamed(error: ValueError, flag: str) -> ValueError:
    """``error`` with its leading parameter name (``distribution`` or ``lengths_file``) replaced
    by the flag the user typed."""
    message = str(error)
    for name in (DISTRIBUTION_FLAG, LENGTHS_FLAG):
        if message.startswith(name + "="):
            return ValueError(flag + message[len(name) :])
    return ValueError(message)
