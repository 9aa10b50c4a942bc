"""Scaling-law fits with numpy alone: loss against compute, ``L(C) = E + A * C^(-alpha)``, and the Chinchilla form
in parameters and tokens, ``L(N, D) = E + A * N^(-alpha) + B * D^(-beta)``.

Both are ``y = E + sum_j A_j * x_j^(-a_j)``, which is linear in ``E`` and the ``A_j`` once the exponents are fixed:
the exponents are searched (a grid, then golden-section refinement one exponent at a time) and, for each, ``E``
and the ``A_j`` come from weighted least squares, with ``E >= 0`` and ``A_j > 0`` enforced. The parameters'
1-sigma uncertainties come from the linearized fit (the inverse of ``J^T W J``): with each point's standard error
given, that is the uncertainty the measurement noise leaves (scaled up by the reduced chi-squared when there are
more points than parameters and they scatter more than their errors say); without errors, the residuals' own
scatter, which needs more points than parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

__all__ = ["PowerLawFit", "fit_power_law", "fit_loss_vs_compute", "fit_chinchilla"]

_EXPONENT_RANGE = (1e-3, 3.0)


@dataclass
class PowerLawFit:
    """A fitted ``y = E + sum_j A_j * x_j^(-a_j)``.

    :param names: the parameters in order: ``E``, then ``A_j`` and ``a_j`` for each input (e.g. ``A``, ``alpha``).
    :param values: their fitted values.
    :param stderr: their 1-sigma uncertainties (None where unknown, or for ``E`` pinned at its bound 0).
    """

    form: str
    names: list[str]
    values: list[float]
    stderr: list[Optional[float]]
    n_points: int
    rss: float
    """Weighted residual sum of squares (chi-squared when errors were given)."""
    scales: list[float]
    """Each input's geometric mean, by which it is divided inside the fit (keeps the problem well conditioned)."""
    covariance: Optional[np.ndarray]
    """Covariance of the internal parameters ``E, a_1, alpha_1, ...`` (``a_j`` the amplitude at the scale)."""

    @property
    def params(self) -> dict[str, float]:
        return dict(zip(self.names, self.values))

    def _internal(self) -> np.ndarray:
        theta = [self.values[0]]
        for j, scale in enumerate(self.scales):
            amplitude, exponent = self.values[1 + 2 * j], self.values[2 + 2 * j]
            theta += [amplitude * scale ** (-exponent), exponent]
        return np.asarray(theta)

    def predict(self, *x: float) -> tuple[float, Optional[float]]:
        """The fitted value at ``x`` (one value per input) and its 1-sigma uncertainty from the parameters'."""
        theta = self._internal()
        u = np.asarray([[xi / s for xi, s in zip(x, self.scales)]])
        value = float(_model(theta, u)[0])
        if self.covariance is None:
            return value, None
        grad = _jacobian(theta, u)[0]
        return value, float(math.sqrt(max(0.0, grad @ self.covariance @ grad)))

    def as_dict(self) -> dict[str, Any]:
        return {
            "form": self.form,
            "params": self.params,
            "stderr": dict(zip(self.names, self.stderr)),
            "n_points": self.n_points,
            "rss": self.rss,
        }


def _model(theta: np.ndarray, u: np.ndarray) -> np.ndarray:
    out = np.full(u.shape[0], theta[0])
    for j in range(u.shape[1]):
        out = out + theta[1 + 2 * j] * u[:, j] ** (-theta[2 + 2 * j])
    return out


def _jacobian(theta: np.ndarray, u: np.ndarray) -> np.ndarray:
    cols = [np.ones(u.shape[0])]
    for j in range(u.shape[1]):
        a, k = theta[1 + 2 * j], theta[2 + 2 * j]
        power = u[:, j] ** (-k)
        cols += [power, -a * power * np.log(u[:, j])]
    return np.stack(cols, axis=1)


def _linear_part(
    exponents: np.ndarray, u: np.ndarray, y: np.ndarray, w: np.ndarray
) -> tuple[float, np.ndarray, float]:
    """For fixed exponents: (E, amplitudes, weighted RSS), or an infinite RSS when no amplitudes are positive."""
    powers = u ** (-exponents[None, :])  # (n, k)
    sw = np.sqrt(w)
    for with_e in (True, False):  # E below 0 is not a loss: pin it at 0
        design = np.concatenate([np.ones((len(y), 1)), powers], axis=1) if with_e else powers
        coef, *_ = np.linalg.lstsq(design * sw[:, None], y * sw, rcond=None)
        e, amps = (coef[0], coef[1:]) if with_e else (0.0, coef)
        if with_e and e < 0:
            continue
        if np.any(amps <= 0):
            return 0.0, amps, math.inf
        resid = y - design @ coef
        return float(e), amps, float(np.sum(w * resid**2))
    raise AssertionError("unreachable")


def _golden(f: Any, lo: float, hi: float, iters: int = 60) -> float:
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


def _polish(
    theta: np.ndarray, u: np.ndarray, y: np.ndarray, w: np.ndarray, pinned: bool
) -> tuple[np.ndarray, float]:
    """Levenberg-Marquardt steps on every parameter at once from the searched start (the exponent search alone
    converges slowly along the valley where exponents and amplitudes trade off)."""

    def rss(t: np.ndarray) -> float:
        return float(np.sum(w * (y - _model(t, u)) ** 2))

    best, damping = rss(theta), 1e-3
    for _ in range(200):
        jac = _jacobian(theta, u)
        if pinned:
            jac[:, 0] = 0.0
        info = jac.T @ (w[:, None] * jac)
        grad = jac.T @ (w * (y - _model(theta, u)))
        try:
            step = np.linalg.solve(info + damping * np.diag(np.diag(info) + 1e-12), grad)
        except np.linalg.LinAlgError:
            break
        trial = theta + step
        valid = trial[0] >= 0 and np.all(trial[1:] > 0)
        value = rss(trial) if valid else math.inf
        if value < best:
            converged = best - value <= 1e-15 * max(1.0, best)
            theta, best, damping = trial, value, damping / 3
            if converged:
                break
        else:
            damping *= 10
            if damping > 1e12:
                break
    return theta, best


def fit_power_law(
    x: np.ndarray,
    y: np.ndarray,
    sigma: Optional[np.ndarray] = None,
    names: Optional[list[str]] = None,
    form: str = "",
) -> PowerLawFit:
    """Fit ``y = E + sum_j A_j * x[:, j]^(-a_j)`` (``x`` positive, shape (n, k) or (n,)).

    :param sigma: each point's standard error; None weighs the points equally.
    :param names: the parameters' names (default ``E, A1, a1, A2, a2, ...``).
    :raises ValueError: with fewer than two points per input, or inputs that are not positive.
    """
    x = np.asarray(x, dtype=float).reshape(len(y), -1)
    y = np.asarray(y, dtype=float)
    n, k = x.shape
    if n < 1 + k or np.any(x <= 0) or not np.all(np.isfinite(y)):
        raise ValueError(f"need at least {1 + k} points with positive inputs and finite values, got {n}")
    scales = np.exp(np.log(x).mean(axis=0))
    u = x / scales
    w = np.ones(n) if sigma is None else 1.0 / np.maximum(np.asarray(sigma, dtype=float), 1e-12) ** 2

    def cost(exponents: np.ndarray) -> float:
        return _linear_part(exponents, u, y, w)[2]

    grid = np.geomspace(*_EXPONENT_RANGE, 160 if k == 1 else 40)
    candidates = np.array(np.meshgrid(*[grid] * k)).reshape(k, -1).T  # every combination of grid exponents
    exponents = candidates[int(np.argmin([cost(c) for c in candidates]))].astype(float)
    for _ in range(3 if k > 1 else 1):
        for j in range(k):
            i = int(np.argmin(np.abs(grid - exponents[j])))
            lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]

            def along(v: float, j: int = j) -> float:
                trial = exponents.copy()
                trial[j] = v
                return cost(trial)

            exponents[j] = _golden(along, lo, hi)
    e, amps, rss = _linear_part(exponents, u, y, w)
    theta = np.array([e, *[v for pair in zip(amps, exponents) for v in pair]])
    theta, rss = _polish(theta, u, y, w, pinned=e == 0.0)
    e = float(theta[0])
    amps, exponents = theta[1::2], theta[2::2]
    covariance = _covariance(theta, u, w, rss, sigma is not None, pinned=e == 0.0)
    values = [e]
    for j in range(k):
        values += [float(amps[j] * scales[j] ** exponents[j]), float(exponents[j])]
    stderr = _stderr(theta, covariance, scales, pinned=e == 0.0)
    names = names or ["E", *[f"{p}{j + 1}" for j in range(k) for p in ("A", "a")]]
    return PowerLawFit(form, names, values, stderr, n, rss, scales.tolist(), covariance)


def _covariance(
    theta: np.ndarray, u: np.ndarray, w: np.ndarray, rss: float, weighted: bool, pinned: bool
) -> Optional[np.ndarray]:
    jac = _jacobian(theta, u)
    if pinned:
        jac[:, 0] = 0.0  # E sits at its bound: it does not vary
    free = jac.shape[1] - int(pinned)
    dof = len(u) - free
    if dof <= 0 and not weighted:
        return None
    info = jac.T @ (w[:, None] * jac)
    if pinned:
        info[0, 0] = 1.0
    try:
        cov = np.linalg.inv(info)
    except np.linalg.LinAlgError:
        return None
    if not np.all(np.isfinite(cov)):
        return None
    scale = rss / dof if dof > 0 else 1.0
    if weighted:
        scale = max(1.0, scale) if dof > 0 else 1.0
    cov = cov * scale
    if pinned:
        cov[0, :] = cov[:, 0] = 0.0
    return cov


def _stderr(
    theta: np.ndarray, cov: Optional[np.ndarray], scales: np.ndarray, pinned: bool
) -> list[Optional[float]]:
    """1-sigma errors of ``E, A_j, a_j`` (``A_j = a_j * scale_j^alpha_j`` by the delta method)."""
    if cov is None:
        return [None] * len(theta)
    out: list[Optional[float]] = [None if pinned else float(math.sqrt(max(0.0, cov[0, 0])))]
    for j, scale in enumerate(scales):
        ia, ik = 1 + 2 * j, 2 + 2 * j
        amp = theta[ia] * scale ** theta[ik]
        grad = np.zeros(len(theta))
        grad[ia], grad[ik] = scale ** theta[ik], amp * math.log(scale)
        out += [float(math.sqrt(max(0.0, grad @ cov @ grad))), float(math.sqrt(max(0.0, cov[ik, ik])))]
    return out


def fit_loss_vs_compute(flops: Any, loss: Any, sigma: Any = None) -> PowerLawFit:
    """``L(C) = E + A * C^(-alpha)`` over runs' training FLOPs ``C`` and final losses."""
    return fit_power_law(
        np.asarray(flops), np.asarray(loss), sigma, ["E", "A", "alpha"], "L(C) = E + A * C^(-alpha)"
    )


def fit_chinchilla(n_params: Any, tokens: Any, loss: Any, sigma: Any = None) -> PowerLawFit:
    """``L(N, D) = E + A * N^(-alpha) + B * D^(-beta)`` (Hoffmann et al.'s form) over runs' parameters and tokens;
    it needs runs that vary N and D independently (several token budgets per size)."""
    x = np.stack([np.asarray(n_params, dtype=float), np.asarray(tokens, dtype=float)], axis=1)
    return fit_power_law(
        x,
        np.asarray(loss),
        sigma,
        ["E", "A", "alpha", "B", "beta"],
        "L(N, D) = E + A * N^(-alpha) + B * D^(-beta)",
    )
