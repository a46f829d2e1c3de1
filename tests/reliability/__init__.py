"""Failures: ranks killed or hung, crashes while saving, damaged checkpoints, and the launcher
(``spawn``, ``init_parallel_env``) with its failure reports."""
