"""Chapter 03: streaming statistics of one site: exact zeros apart, and a histogram of log10|x|
from which any magnitude quantile can be read back, in constant memory."""

import torch

LOW, HIGH, PER_DECADE = -8, 4, 100  # the histogram spans 10^LOW .. 10^HIGH, 100 bins per decade
BINS = (HIGH - LOW) * PER_DECADE


class SiteStats:
    def __init__(self, width):
        self.width = width
        self.count = 0  # entries seen, zeros included
        self.zeros = 0  # entries exactly 0
        # hist[0]: below 10^LOW, hist[1 .. BINS]: the bins, hist[BINS + 1]: 10^HIGH and above
        self.hist = torch.zeros(BINS + 2, dtype=torch.float64)

    def update(self, x):
        a = x.detach().reshape(-1, self.width).float().abs()  # [batch, seq, width] -> rows
        nonzero = a[a > 0]
        self.count += a.numel()
        self.zeros += a.numel() - nonzero.numel()
        logs = nonzero.log10()
        self.hist[0] += int((logs < LOW).sum())
        self.hist[-1] += int((logs >= HIGH).sum())
        inside = logs[(logs >= LOW) & (logs < HIGH)]
        # floor of the position in bins (positive, so long() floors); float32 may round a value
        # just under 10^HIGH up to BINS: keep it in the last bin
        k = ((inside - LOW) * PER_DECADE).long().clamp(max=BINS - 1)
        self.hist[1:-1] += torch.bincount(k, minlength=BINS).double().cpu()

    def quantile(self, q):
        target = q * self.count - self.zeros  # nonzero entries that must lie at or below t
        if target <= 0:
            return 0.0  # the zeros alone cover the share q
        cum = self.hist.cumsum(0)
        # the first bin whose cumulative count reaches the target: cum[i] >= target
        i = int(torch.searchsorted(cum, torch.tensor(target, dtype=torch.float64)))
        if i == 0:
            return 10.0**LOW  # below the histogram: as good as zero
        if i > BINS:
            return 10.0**HIGH
        within = (target - float(cum[i - 1])) / float(self.hist[i])  # share of bin i needed
        return 10.0 ** (LOW + (i - 1 + within) / PER_DECADE)
