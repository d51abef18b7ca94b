"""Parallel layouts ``remat.apply`` plans inside: tensor parallelism on a fake world, a
pipeline stage under its schedule, a model cut into stages, every stage planned at once."""
