"""What each command runs, without its options and printing: the parity engine and its
scenarios, identify, stability sweeps, training runs, the gate, golden values and timing.

Imports point down to :mod:`mhctool.spread`, :mod:`mhctool.runner`, :mod:`mhctool.registry`,
:mod:`mhctool.families` and :mod:`mhctool.core`."""
