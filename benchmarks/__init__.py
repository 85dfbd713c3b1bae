"""Benchmarks, run side by side in one process; results go to docs/benchmarks/.

One runner, from the root of a checkout (this directory is not part of the installed
packages: it reads docs/ and samples/, which only a checkout has):

    python -m benchmarks                          # every GPU benchmark, then the decode-loop sample
    python -m benchmarks --only keys jit_cpu      # the CPU tables: lean vs full keys, jit Python-side cost

Each benchmark runs in a fresh process and writes ``<name>.json`` and ``<name>.md`` (and
``<name>.png`` where a plot reads better) into ``docs/benchmarks/`` (or ``--out``), with the
runner command that makes that table alone and the machine. They use jitcore and replay
through their public API, the driver interface (``jitcore.backends``) and jitcore's
measuring hooks (``jitcore.hit_path_parts``, ``jitcore.KeyPlan.of``); a test keeps it so.
"""
