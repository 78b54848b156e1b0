"""``python -m mhctool.cli``: the ``mhctool`` command."""
from mhctool.cli.app import main

main()
