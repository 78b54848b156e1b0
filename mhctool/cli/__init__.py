"""The command line: one module per command (its options and printing only) and :mod:`.kit`,
the options and printing they share. The Typer app is :data:`mhctool.cli.app.app`; ``mhctool``
runs :func:`mhctool.cli.app.main`."""
