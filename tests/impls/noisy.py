"""A correct h_aggregate from a library that talks: a logging handler of its own on stderr (made at
import, as TileLang's is), a print, and a C-level write to the stderr descriptor at every call."""
import logging
import os
import sys

import torch

_log = logging.getLogger("noisylib")
_log.addHandler(logging.StreamHandler(sys.stderr))
_log.setLevel(logging.INFO)
_log.propagate = False


def h_aggregate(x, h_pre):
    _log.info("noisylib INFO: compiling a kernel for %s", tuple(x.shape))
    print("noisylib: autotuning done")
    os.write(2, b"noisylib: a C library's line\n")
    return torch.einsum("sbj,sbjc->sbc", h_pre, x)
