"""Imported by the fork server alone (``forkserver.FORKSERVER_PRELOAD``): what each child forked from
it would otherwise do at its first Triton kernel, done once here (:mod:`mhctool.spread.prewarm`)."""
from mhctool.spread.prewarm import gpu_machine, triton_hash

if gpu_machine():
    triton_hash()
