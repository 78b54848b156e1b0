"""The one-case runner: a case's inputs, every implementation's forward and backward, the native
baseline and the float64 reference, and the judged rows; the determinism and batch-invariance
checks.

It knows nothing of how cases are spread or timed: a caller that runs implementations in
worker processes (:mod:`mhctool.spread.isolation`) or over ranks (:mod:`mhctool.spread.sharded`)
hands the runner an object with the methods it calls."""
