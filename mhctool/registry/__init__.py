"""The implementations of the kernel families (:mod:`mhctool.families`): mhctool's own (torch,
compile, Triton, cuTile), and the resolution of ``--impl`` specs (built-in names,
``module:function``, ``FILE.py:function``, ``LIBRARY:TARGET`` through the adapters in
:mod:`mhctool.libraries`).

Imports point down to :mod:`mhctool.families`, :mod:`mhctool.core`, the kernels and the references. Adapters import the
registry; the registry finds them through one table (:data:`mhctool.registry.adapters.BUILT_IN`
and the ``mhctool.adapters`` entry points), never by an import of its own."""
