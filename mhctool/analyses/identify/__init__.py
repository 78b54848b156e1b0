"""``mhctool identify``: which convention does an implementation compute?

An implementation runs once per probe (input families chosen so the candidate conventions give
visibly different results: dead rows and columns make eps visible, a slowly converging matrix
separates iteration counts and orders, tiny norms separate eps placements, asymmetric mixing
matrices separate H from H^T). Its outputs are then compared with the float64 reference under
every candidate convention: the discrete knobs exhaustively, the continuous ones on a coarse grid,
then refined and snapped to a round value where the fit is as good. The best candidates are judged
by mhctool's verdict rule, forward and backward (the native implementation under the same
convention sets the threshold), so a match is a pass, and a kernel that no convention fits is a
defect.

The implementation is always called with the knobs asked for (``--knob``, else the family's
defaults); only the reference and the native baseline change with the candidate. A knob whose
asked value does not change its outputs (a function that takes no iteration count, or takes one
and runs its own) is said to be ignored, and its value is fitted over its whole range like any
other.

Some probes are guards (Sinkhorn's large logits): never fitted, but judged. An implementation that
returns non-finite values there, where the float64 contract is finite, fits no convention,
whatever its finite outputs match: an overflow is never a convention. A candidate whose native
baseline overflows on a guard where the implementation stays finite is not what it computes.

The rooms: :mod:`.space` (the candidates, the probes that tell them apart, how a fitted value is
classified), :mod:`.subject` (the implementation and what it is asked), :mod:`.probing`,
:mod:`.fitting`, :mod:`.judging` (the three stages, each a class the :class:`Identifier` is
made of), :mod:`.conclusion` (what is concluded, the line a user reads, the report rows).
"""
from mhctool.analyses.identify.conclusion import Candidate, Identification, Probe, rows
from mhctool.analyses.identify.identifier import Identifier, identify
from mhctool.analyses.identify.space import (
    FP32_EPS,
    IDENTIFIABLE,
    check_kernel,
    checked_knobs,
    classify,
    fmt_knobs,
    fmt_value,
    space,
)

__all__ = ["FP32_EPS", "IDENTIFIABLE", "Candidate", "Identification", "Identifier", "Probe", "check_kernel",
           "checked_knobs", "classify", "fmt_knobs", "fmt_value", "identify", "rows", "space"]
