"""Turn a plan back into torch: forward/backward graphs, an autograd.Function, an nn.Module."""

from remat.rewrite.executor import Executor, build_executor
from remat.rewrite.module import RematModule

__all__ = ["Executor", "RematModule", "build_executor"]
