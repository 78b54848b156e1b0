"""``python -m mhctool.cli``: the ``mhctool`` command."""
from mhctool.cli import main

main()
