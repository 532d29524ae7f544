"""The lab: benchmarks and measuring tools, beside the product and never installed with it.

Run from a checkout (the repository root on ``sys.path``): ``python -m benchmarks NAME [options]``, NAME one of
``comm``, ``weights``, ``rollout``, ``engine``, ``ray`` (benchmarks) and ``plan`` (bandwidth budgets and the
placement plan of a config); ``python -m benchmarks --help`` lists them. They use the installed package
(``mrl_plugins``: its stages, ``mrl compare``'s runs); nothing in the package imports them. Their results and
history: ``benchmarks/README.md``; the GPU check: ``benchmarks/gpu``.
"""
