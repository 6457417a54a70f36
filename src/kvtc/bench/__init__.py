"""``kvtc bench``: when does KV-cache compression pay on this machine and model, and at which ratio.

* :mod:`.arith`: the break-even arithmetic (pure functions: TTFT per path, break-even bandwidths, capacity).
* :mod:`.model`: the device, the model (real or random weights of a config), its calibration, the context ids.
* :mod:`.measure`: prefill, encode and decode timings and blob sizes.
* :mod:`.report`: derived figures, the terminal table and recommendation, bench.json and the plot.
* :mod:`.cli`: the subcommand, registered by :mod:`kvtc.cli` through ``register(subparsers)``.

Definitions: docs/BENCH.md. Nothing here imports torch at import time.
"""
