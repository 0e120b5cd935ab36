"""The ``xla-ckpt`` command line (see DESIGN layers).

Public face: :mod:`xla_ckpt.cli.main`, whose ``main(argv) -> exit code`` is the console script.
Nothing is imported here: were this package to import that module, ``python -m xla_ckpt.cli.main``
(torchrun, the tests) would load it twice and runpy would warn about it.
"""

__all__ = ["main"]
