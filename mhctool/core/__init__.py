"""The foundations every layer stands on: errors, names, dtypes and shapes; seeded inputs and
poisoned outputs; the error metrics and the verdict rule; the report schema and its atomic
writes; what the environment has (torch, Triton, cuTile, the GPU); phase timings.

Nothing here imports another package of mhctool: these modules import each other, the kernels
and the references only."""
