"""The torch side: capture, joint graph, costs, and the solver-facing problem."""
