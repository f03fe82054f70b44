"""Planning, pure: the cost and communication models, the planner with its model, searches and integer
solver, the profile reports it reads, and the live re-balancing policy with its refit arithmetic.
Imports nothing of `gateway.job` (the job room uses this one)."""
