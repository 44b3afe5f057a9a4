"""Tensor redistribution, one concept per module: :mod:`.steps` (the steps and the
plan), :mod:`.unify` (common device matrices), :mod:`.planner` (search and cache),
:mod:`.reference` (the Python planner), :mod:`.executor` (running a plan).
:mod:`dualmode.parallel.redistribute` is the public entry point."""
