"""The ``hpcckpt`` command line: one module per verb, discovered by ``main``."""
