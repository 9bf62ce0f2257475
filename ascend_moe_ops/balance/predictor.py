"""Per-expert load prediction from recent ``tokens_per_expert`` observations."""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

from ..ops import checks as _checks
from .aux_loss import _check_num_experts
from .executor import ArgumentCheck

Tensor = torch.Tensor

METHODS = ("last", "window_mean", "ema", "trend", "adaptive_ema", "robust")
ADAPTIVE_ALPHAS = (0.03, 0.1, 0.2, 0.35, 0.6)
JUMP_SIGMAS = 4.0      # robust: a jump member restarts at an observation this many noise sigmas away


_MAX_COUNT = float(2 ** 53)  # token counts above it are not exact in fp64 (and their squares, kept
                            # by the robust method's noise estimate, would overflow long before 1e308)


def _check_counts(x: Tensor) -> None:
    bad = ~torch.isfinite(x) | (x < 0) | (x > _MAX_COUNT)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"tokens_per_expert must be finite and non-negative counts of at most 2**53: "
                         f"entry {i} is {float(x[i])}")


class ExpertLoadPredictor:
    """Predicts each expert's load over the next ``horizon`` steps from the recent past.

    Args:
        num_experts: ``E``.
        window: number of most recent observations kept (``window_mean`` and ``trend`` use them).
        method: ``"last"`` (the last observation), ``"window_mean"`` (mean of the window),
            ``"ema"`` (exponential moving average with ``alpha``), ``"trend"``
            (least-squares line through the window, evaluated at the middle of the next
            ``horizon`` steps, clamped at 0), ``"adaptive_ema"`` (several EMAs with
            ``alpha`` in ``ADAPTIVE_ALPHAS`` run side by side; the one whose ``horizon``-step-ahead
            forecasts had the smallest recent L1 error is used, so the smoothing follows how
            fast the loads drift relative to the sampling noise), or ``"robust"`` (the
            default: ``adaptive_ema`` plus a drift-tracking member — a local-level (Kalman)
            filter whose per-expert gain follows from the relative drift variance and the
            sampling dispersion, both pooled over experts from lag-1 and lag-2 differences, so
            hot experts (less relative noise) follow the drift faster than cold ones — and every
            member a second time with level-shift jumps — an expert whose count lands more than
            ``JUMP_SIGMAS`` noise deviations from the member's value restarts there — so bursts
            are followed at once while quiet experts stay smoothed; the error score chooses
            among plain, drift-tracking and jumping members, see docs/ops/balance.md for the
            study behind the default).
        alpha: EMA weight of the newest observation (default ``2 / (window + 1)``, the EMA with
            the same mean age as the window).
        horizon: steps the prediction should cover (the re-planning interval); ``trend``,
            ``adaptive_ema`` and ``robust`` use it.
        group: if given, :meth:`update` sums the counts over this group (the DP group) with one
            ``all_reduce`` so every rank predicts the same global load (first one tiny all-gather:
            a ``num_experts`` that differs between ranks raises the same ``ValueError`` on each,
            and a ``tokens_per_expert`` one rank rejects raises there and a ``ValueError`` naming
            that rank on the others).

    ``update`` must be called on every rank of ``group`` with a ``[E]`` count tensor; counts
    that are NaN, infinite or negative raise a ``ValueError`` (on every rank: the check runs on
    the summed counts) and are not recorded. ``shifts`` counts the level shifts the best-scoring
    jump member of ``robust`` has jumped at (a diagnostic).
    """

    def __init__(self, num_experts: int, window: int = 32, *, method: str = "robust",
                 alpha: Optional[float] = None, horizon: int = 1, group=None):
        _checks.check_int("num_experts", num_experts, minimum=1)
        window = _checks.check_int("window", window, minimum=1)  # a numpy int becomes an int
        horizon = _checks.check_int("horizon", horizon, minimum=1)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if alpha is None:
            alpha = 2.0 / (window + 1)
        alpha = _checks.check_float("alpha", alpha)
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.num_experts, self.window, self.method = num_experts, window, method
        self.alpha, self.horizon, self.group = float(alpha), horizon, group
        self.history: deque = deque(maxlen=window)
        self._ema: Optional[Tensor] = None
        self._bank: Optional[Tensor] = None          # [A, E] EMAs of adaptive_ema ([2(A+1), E] robust)
        self._bank_hist: deque = deque(maxlen=horizon)
        self._obs: deque = deque(maxlen=horizon)      # robust: the last `horizon` observations
        n_members = len(ADAPTIVE_ALPHAS) + (1 if method == "robust" else 0)
        self._bank_err = torch.zeros(n_members * (2 if method == "robust" else 1),
                                     dtype=torch.float64)
        self._q: Optional[float] = None               # robust: relative drift variance per step
        self._d2: Optional[float] = None              # robust: sampling dispersion (lag model)
        self._disp: Optional[float] = None
        self.shifts = 0
        self.steps = 0

    @torch.no_grad()
    def update(self, tokens_per_expert: Tensor) -> Tensor:
        """Record one step's ``[E]`` counts (summed over ``group`` if set); returns what was recorded."""
        with ArgumentCheck() as args:      # with group: the error reaches every rank
            _checks.check_tensor("tokens_per_expert", tokens_per_expert, ndim=1)
            _checks.check_shape("tokens_per_expert", tokens_per_expert, (self.num_experts,),
                                "one count per expert")
        if self.group is not None:
            _check_num_experts(self.num_experts, self.group, "num_experts (ExpertLoadPredictor)",
                               args=args, caller="ExpertLoadPredictor.update")
        args.raise_error()
        x = tokens_per_expert.detach().to(torch.float64).cpu().clone()
        if self.group is not None:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        _check_counts(x)
        self.history.append(x)
        if self.method == "robust":
            self._obs.append(x)
        if self.method in ("adaptive_ema", "robust"):
            a = torch.tensor(ADAPTIVE_ALPHAS, dtype=torch.float64)[:, None]
            if self.method == "robust":
                if self._bank is not None:
                    self._update_drift()
                a = a.expand(-1, self.num_experts)
                a = torch.cat([a, self._kalman_gain()[None]])   # + the drift-tracking member
                a = torch.cat([a, a])                  # plain members, then jump members
            if self._bank is None:
                self._bank = x.expand(a.shape[0], -1).clone()
            else:
                if len(self._bank_hist) == self.horizon:
                    # score the forecasts made `horizon` steps ago against this observation
                    # (robust: against the mean of the `horizon` observations since, the load
                    # the planner's placement actually serves)
                    target = x
                    if self.method == "robust":
                        target = torch.stack(list(self._obs)).mean(0)
                    err = ((self._bank_hist[0] - target).abs().sum(1)
                           / target.abs().sum().clamp(min=1e-12))
                    self._bank_err.mul_(0.9).add_(err, alpha=0.1)
                if self.method == "robust":
                    self._robust_update(x, a)
                else:
                    self._bank = self._bank * (1 - a) + a * x
            self._bank_hist.append(self._bank.clone())
        if self._ema is None:
            self._ema = x.clone()
        else:
            self._ema.mul_(1 - self.alpha).add_(x, alpha=self.alpha)
        self.steps += 1
        return x

    def _robust_update(self, x: Tensor, a: Tensor) -> None:
        """``robust``: the bank holds every EMA twice, plain and with level-shift jumps.

        Noise model: a count of level ``m`` has variance ``d * m``; the dispersion ``d`` is the
        median over experts of ``(x_t - x_{t-1})^2 / (2 m)`` divided by the median of a
        chi-square(1) (one-step differences cancel the slow drift, the median ignores the
        bursting experts), smoothed over steps. In a jump member, an observation more than
        ``JUMP_SIGMAS`` noise deviations away from the member's value marks a level shift (a
        burst began or ended) and that expert's value restarts at the observation: bursts are
        followed at once while quiet experts keep the member's smoothing. The error score picks
        among all members, so jumps are used where they pay (short horizons, bursty loads) and
        plain smoothing where a burst is not expected to last the horizon."""
        A = a.shape[0] // 2
        level = self._bank[int(torch.argmin(self._bank_err))]
        m = level.clamp(min=1.0)
        if len(self.history) >= 2:
            diff = self.history[-1] - self.history[-2]
            d = float((diff * diff / (2 * m)).median()) / 0.4549   # median of chi2(1)
            self._disp = d if self._disp is None else 0.9 * self._disp + 0.1 * d
        disp = 1.0 if self._disp is None else max(self._disp, 1e-6)
        prev = self._bank[A:]
        jump = (x - prev).abs() > JUMP_SIGMAS * (disp * prev.clamp(min=1.0)).sqrt()   # [A, E]
        self._bank = self._bank * (1 - a) + a * x
        self._bank[A:] = torch.where(jump, x.expand_as(prev), self._bank[A:])
        self.shifts += int(jump[int(torch.argmin(self._bank_err[A:]))].sum())

    def _update_drift(self) -> None:
        """``robust``: pooled drift model of the drift-tracking member. A count of level ``m``
        drifts by ``q * m^2`` per step (relative drift variance ``q``) and is observed with
        sampling noise ``d * m``; with ``E|x_t - x_{t-k}|^2 = k q m^2 + 2 d m`` summed over experts,
        the lag-1 and lag-2 differences of the last three observations give ``q`` and ``d``
        (smoothed over steps). Level shifts (bursts) inflate ``q``: on the ``bursty`` trace it is
        ~10x the drift's, which makes this member fast there and the error score then prefers a
        jumping EMA."""
        if len(self.history) < 3:
            return
        m = self._bank[int(torch.argmin(self._bank_err))].clamp(min=1.0)
        a1 = (self.history[-1] - self.history[-2]).pow(2).sum()
        a2 = (self.history[-1] - self.history[-3]).pow(2).sum()
        q = float((a2 - a1) / (m * m).sum())
        d = float((2 * a1 - a2) / (2 * m.sum()))
        self._q = q if self._q is None else 0.95 * self._q + 0.05 * q
        self._d2 = d if self._d2 is None else 0.95 * self._d2 + 0.05 * d

    def _kalman_gain(self) -> Tensor:
        """``[E]`` steady-state gain of a local-level filter under the pooled drift model of
        :meth:`_update_drift`: signal-to-noise ``r = q m / d`` per expert, prior variance
        ``P = (r + sqrt(r^2 + 4 r)) / 2`` (in units of the noise), gain ``P / (P + 1)``; hot
        experts (larger ``m``, less relative noise) get the larger gain. 0.2 before the model
        has data."""
        if self._q is None or self._bank is None:
            return torch.full((self.num_experts,), 0.2, dtype=torch.float64)
        m = self._bank[int(torch.argmin(self._bank_err))].clamp(min=1.0)
        r = max(self._q, 1e-8) * m / max(self._d2, 1e-3)
        p = (r + (r * r + 4 * r).sqrt()) / 2
        return p / (p + 1)

    def reset(self) -> None:
        self.history.clear()
        self._ema = None
        self._bank = None
        self._bank_hist.clear()
        self._obs.clear()
        self._bank_err.zero_()
        self._disp = None
        self._q = self._d2 = None
        self.shifts = 0
        self.steps = 0

    @torch.no_grad()
    def predict(self) -> Tensor:
        """``[E]`` fp64 predicted load (tokens per step). Raises before the first ``update``."""
        if not self.history:
            raise RuntimeError("ExpertLoadPredictor.predict() called before any update()")
        if self.method == "last":
            return self.history[-1].clone()
        if self.method == "ema":
            return self._ema.clone()
        if self.method in ("adaptive_ema", "robust"):
            return self._bank[int(torch.argmin(self._bank_err))].clone()
        h = torch.stack(list(self.history))                                           # [W, E]
        if self.method == "window_mean" or h.shape[0] < 3:
            return h.mean(0)
        # trend: ordinary least squares per expert over t = 0..W-1, evaluated at the middle of
        # the next `horizon` steps, t* = W - 1 + (horizon + 1) / 2
        W = h.shape[0]
        t = torch.arange(W, dtype=torch.float64)
        tc = t - t.mean()
        slope = (tc[:, None] * (h - h.mean(0))).sum(0) / (tc * tc).sum()
        t_star = (W - 1 + (self.horizon + 1) / 2.0) - t.mean()
        return (h.mean(0) + slope * t_star).clamp(min=0)
