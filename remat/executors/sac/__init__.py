"""The selective-checkpoint executor (``remat.apply``): PyTorch's checkpoint with one
policy per region of the user's own blocks, wrapped in place.

In pipeline order: :mod:`~remat.executors.sac.regions` (which blocks, and how a policy
runs them), :mod:`~remat.executors.sac.trace` (the step run on a FakeTensor copy, recorded
by :mod:`~remat.executors.sac.recorder` as :mod:`~remat.executors.sac.events`),
:mod:`~remat.executors.sac.dataflow` (a trace as the solvers' problem),
:mod:`~remat.executors.sac.planner` (a policy per block, every candidate traced), then
:mod:`~remat.executors.sac.state` and :mod:`~remat.executors.sac.report` (what a model
carries afterwards); :mod:`~remat.executors.sac.apply` is the entry point.
"""
