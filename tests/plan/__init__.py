"""The planner, ``sharded_opt.plan``."""
