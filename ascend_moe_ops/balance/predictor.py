"""Per-expert load prediction from recent ``tokens_per_expert`` observations."""

from __future__ import annotations

from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

from ..ops import _checks

Tensor = torch.Tensor

METHODS = ("last", "window_mean", "ema", "trend", "adaptive_ema", "robust")
ADAPTIVE_ALPHAS = (0.03, 0.1, 0.2, 0.35, 0.6)
SHIFT_RUN = 3          # robust: consecutive out-of-band observations that mark a level shift
SHIFT_SIGMAS = 3.0     # robust: half-width of the band, in noise standard deviations


def _check_counts(x: Tensor) -> None:
    bad = ~torch.isfinite(x) | (x < 0)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"tokens_per_expert must be finite and non-negative counts: entry {i} "
                         f"is {float(x[i])}")


class ExpertLoadPredictor:
    """Predicts each expert's load over the next ``horizon`` steps from the recent past.

    Args:
        num_experts: ``E``.
        window: number of most recent observations kept (``window_mean`` and ``trend`` use them).
        method: ``"last"`` (the last observation), ``"window_mean"`` (mean of the window),
            ``"ema"`` (exponential moving average with ``alpha``), ``"trend"``
            (least-squares line through the window, evaluated at the middle of the next
            ``horizon`` steps, clamped at 0), or ``"adaptive_ema"`` (several EMAs with
            ``alpha`` in ``ADAPTIVE_ALPHAS`` run side by side; the one whose ``horizon``-step-ahead
            forecasts had the smallest recent L1 error is used, so the smoothing follows how
            fast the loads drift relative to the sampling noise; the default: it had the smallest
            forecast error, or tied for it, in every case of ``bench/bench_balance.py``, see
            docs/ops/balance.md).
        alpha: EMA weight of the newest observation (default ``2 / (window + 1)``, the EMA with
            the same mean age as the window).
        horizon: steps the prediction should cover (the re-planning interval); ``trend`` and
            ``adaptive_ema`` use it.
        group: if given, :meth:`update` sums the counts over this group (the DP group) with one
            ``all_reduce`` so every rank predicts the same global load.

    ``update`` must be called on every rank of ``group`` with a ``[E]`` count tensor.
    """

    def __init__(self, num_experts: int, window: int = 32, *, method: str = "adaptive_ema",
                 alpha: Optional[float] = None, horizon: int = 1, group=None):
        _checks.check_int("num_experts", num_experts, minimum=1)
        _checks.check_int("window", window, minimum=1)
        _checks.check_int("horizon", horizon, minimum=1)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if alpha is None:
            alpha = 2.0 / (window + 1)
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.num_experts, self.window, self.method = num_experts, window, method
        self.alpha, self.horizon, self.group = float(alpha), horizon, group
        self.history: deque = deque(maxlen=window)
        self._ema: Optional[Tensor] = None
        self._bank: Optional[Tensor] = None          # [A, E] EMAs for adaptive_ema
        self._bank_hist: deque = deque(maxlen=horizon)
        self._bank_err = torch.zeros(len(ADAPTIVE_ALPHAS), dtype=torch.float64)
        self._disp: Optional[float] = None
        self.shifts = 0
        self.steps = 0

    @torch.no_grad()
    def update(self, tokens_per_expert: Tensor) -> Tensor:
        """Record one step's ``[E]`` counts (summed over ``group`` if set); returns what was recorded."""
        _checks.check_tensor("tokens_per_expert", tokens_per_expert, ndim=1)
        _checks.check_shape("tokens_per_expert", tokens_per_expert, (self.num_experts,),
                            "one count per expert")
        x = tokens_per_expert.detach().to(torch.float64).cpu().clone()
        if self.group is not None:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        _check_counts(x)
        self.history.append(x)
        if self.method in ("adaptive_ema", "robust"):
            a = torch.tensor(ADAPTIVE_ALPHAS, dtype=torch.float64)[:, None]
            if self._bank is None:
                self._bank = x.expand(a.shape[0], -1).clone()
            else:
                if len(self._bank_hist) == self.horizon:
                    # score the forecasts made `horizon` steps ago against this observation
                    err = (self._bank_hist[0] - x).abs().sum(1) / x.abs().sum().clamp(min=1e-12)
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
        """EMA bank on winsorized observations plus per-expert level-shift resets (``robust``).

        Noise model: a count ``c`` of level ``m`` has variance ``d * m``; the dispersion ``d``
        is the median over experts of ``(x_t - x_{t-1})^2 / (2 m)`` (one-step differences cancel
        the slow drift, the median ignores the bursting experts), smoothed over steps. Each EMA
        sees the observation clipped to its own value ``± SHIFT_SIGMAS`` noise deviations, so a
        one- or two-step spike moves it by at most that much. When the last ``SHIFT_RUN``
        observations of an expert all lie outside the band of the selected forecast on the same
        side, the expert's load has shifted (a burst began or ended): every EMA of that expert
        restarts at the median of those observations."""
        level = self._bank[int(torch.argmin(self._bank_err))].clamp(min=1.0)
        if len(self.history) >= 2:
            diff = self.history[-1] - self.history[-2]
            d = float((diff * diff / (2 * level)).median()) / 0.4549   # median of chi2(1)
            self._disp = d if self._disp is None else 0.9 * self._disp + 0.1 * d
        disp = 1.0 if self._disp is None else max(self._disp, 1e-6)
        band = SHIFT_SIGMAS * (disp * self._bank.clamp(min=1.0)).sqrt()        # [A, E]
        xc = torch.minimum(torch.maximum(x, self._bank - band), self._bank + band)
        self._bank = self._bank * (1 - a) + a * xc
        if len(self.history) >= SHIFT_RUN:
            recent = torch.stack(list(self.history)[-SHIFT_RUN:])                 # [m, E]
            half = SHIFT_SIGMAS * (disp * level).sqrt()
            up = (recent > level + half).all(0)
            down = (recent < level - half).all(0)
            shift = up | down
            if bool(shift.any()):
                self._bank[:, shift] = recent[:, shift].median(0).values
                self.shifts += int(shift.sum())

    def reset(self) -> None:
        self.history.clear()
        self._ema = None
        self._bank = None
        self._bank_hist.clear()
        self._bank_err.zero_()
        self._disp = None
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
