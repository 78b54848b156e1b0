"""The ways cases and calls are spread: a pool of worker processes over CPU cores or GPUs (or
Ray tasks), isolation workers that run code under test in a child process (and the fork server
they start from), and ranks that split one case's tokens over GPUs.

Imports point down to :mod:`mhctool.runner`, :mod:`mhctool.registry` and :mod:`mhctool.core`."""
