import os

import pytest
import torch

# Triton kernels run through the interpreter on machines without a GPU. It must be set before any
# kernel module is imported, so the tests set it here, not the user.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
