"""The whole-graph executor (``remat.optimize``): the step captured as one joint forward and
backward graph, planned on its dataflow, and run as rewritten forward and backward graphs.

In pipeline order: :mod:`~remat.executors.graph.capture` (the model as ATen ops),
:mod:`~remat.executors.graph.joint` (the joint graph), :mod:`~remat.executors.graph.loss`
(the user's loss in it), :mod:`~remat.executors.graph.to_problem` (the solvers' problem),
:mod:`~remat.executors.graph.analyze` (those stages, timed), then
:mod:`~remat.executors.graph.partition`, :mod:`~remat.executors.graph.run` and
:mod:`~remat.executors.graph.module` turn a plan back into torch;
:mod:`~remat.executors.graph.optimize` is the entry point.
"""
