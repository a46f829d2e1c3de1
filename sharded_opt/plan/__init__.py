"""``python -m sharded_opt.plan``: what each mode costs in bytes and time, and which to pick.

Pure parts, one job each: ``config`` (what the planner is told), ``model`` (a model on the meta
device, the optimizer's state per element), ``memory`` (bytes from a layout plan), ``wire``
(bytes each collective sends, exact or compressed), ``cost`` (one collective's alpha-beta time),
``schedule`` (a step's timeline per mode), ``planner`` (all of it per mode, and the pick).
``calibrate`` measures compute and the link on this machine.
"""

from sharded_opt.plan.config import AlphaBeta, Cluster, CollectiveCosts, ComputeTimes, LinkModel
from sharded_opt.plan.memory import MemoryBytes
from sharded_opt.plan.planner import ModePlan, TrainingPlan, format_plan, plan_training
from sharded_opt.plan.wire import StepWire

__all__ = [
    "AlphaBeta",
    "Cluster",
    "CollectiveCosts",
    "ComputeTimes",
    "LinkModel",
    "MemoryBytes",
    "ModePlan",
    "StepWire",
    "TrainingPlan",
    "format_plan",
    "plan_training",
]
