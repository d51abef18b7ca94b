"""What users do with a plan (the plan itself is :class:`remat.solver.plan.Plan`): save and
load it as a file, read it as a report, draw it."""
