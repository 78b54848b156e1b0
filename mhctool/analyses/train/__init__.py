"""``mhctool train``: from a kernel's error to a training run's drift.

The small mHC language model of :mod:`mhctool.references.model` is trained three times from one
seed, on the same synthetic tokens: with the implementation under test plugged into every mHC
family it has (the others run natively, and the run says which ran what), with the native
PyTorch implementation, and with the mHC pieces in float64 (the reference trajectory). Every
step records Megatron's golden-value metrics (``lm loss``, ``num-zeros`` counted over the
gradients as ``--log-num-zeros-in-grad`` counts them, ``grad-norm``, ``iteration-time``, memory
on a GPU) and mHC health per layer (H_res's row- and column-sum deviation from 1 and its
smallest entry, the largest Sinkhorn logit, non-finite counts of every mHC output), and where
the zeros are (per parameter).

The drift is judged like a kernel's error: per metric, the implementation's median distance from
the reference trajectory over the steps may be at most ``kappa`` times the native trajectory's,
plus a floor of the dtype's rounding; where it is more, the first step past native's envelope is
where the run parts.
A drift is traced to a knob by rerunning the native implementation with each convention in
which the kernel differs from the contract (declared, or fitted by ``mhctool identify``): the
one whose run the implementation's stays with is the cause; if none, the drift is the kernel's
own. A run that goes non-finite names the first layer and mHC output that did.

The rooms, in the order they build on each other: :mod:`.setup` (the configuration and the
data), :mod:`.pieces` (what each family runs), :mod:`.trajectory` (one run), :mod:`.verdict`
(the drift judged), :mod:`.trace` (a drift traced to a knob), :mod:`.session` (a whole run).
This package's names below are what the command, the gate and the tests use.
"""
from mhctool.analyses.train.pieces import (
    Piece,
    assign,
    impl_pieces,
    native_piece,
    reference_piece,
)
from mhctool.analyses.train.session import (
    Outcome,
    parse_knobs,
    report_rows,
    rows,
    session,
    settings,
)
from mhctool.analyses.train.setup import (
    DEFAULT_SEEDS,
    FAMILIES,
    GOLDEN_METRICS,
    JUDGED,
    MarkovSource,
    TrainConfig,
    config,
    default_seeds,
    from_dict,
    to_dict,
)
from mhctool.analyses.train.trajectory import (
    Step,
    Trajectory,
    param_count,
    run,
    to_golden,
    zero_sources,
)
from mhctool.analyses.train.verdict import Drift, judge, nonfinite_sentence

__all__ = ["DEFAULT_SEEDS", "default_seeds", "FAMILIES", "GOLDEN_METRICS", "JUDGED", "Drift", "MarkovSource", "Outcome", "Piece", "Step",
           "TrainConfig", "Trajectory", "assign", "config", "from_dict", "impl_pieces", "judge", "native_piece",
           "nonfinite_sentence", "param_count", "parse_knobs", "reference_piece", "report_rows", "rows", "run",
           "session", "settings", "to_dict", "to_golden", "zero_sources"]
