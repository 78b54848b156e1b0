"""Imported first by the fork server (``forkserver.FORKSERVER_PRELOAD``): it and every process
forked from it (pool and isolation workers) ignore SIGINT and SIGTERM, which a terminal's Ctrl-C
and ``timeout``'s signal to the process group deliver to them as to mhctool. mhctool decides what a
signal means (finish the case in hand, or stop at once) and stops its workers with SIGKILL.
Without it, a signal that landed while the server imported torch printed a KeyboardInterrupt
traceback under mhctool's sentence, and a worker killed by it failed the case in hand."""
import signal

for _s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_s, signal.SIG_IGN)
