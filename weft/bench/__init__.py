"""`weft bench SUITE`: weft and its baselines timed in one run, on the same inputs.

Each suite module defines `SUITE` (name), `add_arguments(parser)` and
`run(args) -> list[Row]`; `python -m weft.bench SUITE` runs it on every rank
and rank 0 writes JSON, a markdown table and a PNG plot.
"""
