"""Benchmarks, run side by side in one process; results go to docs/benchmarks/.

    python -m replay.bench                 # every GPU benchmark (launch, jit, replay, sample)
    python -m replay.bench.keys            # CPU: lean vs full keys
    python -m replay.bench.jit_cpu         # CPU: jit Python-side cost, driver call a no-op

Each writes ``<name>.json`` and ``<name>.md`` (and ``<name>.png`` where a plot reads better)
into ``docs/benchmarks/`` (or ``--out``), with the command that made them and the machine.
"""
