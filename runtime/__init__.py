"""A plan-time compiled DAG runtime for security-analysis agent workflows."""

from .errors import (
    DagRuntimeError,
    ExecutionError,
    InputError,
    LedgerError,
    PlanFormatError,
    Problem,
    TemplateError,
    TopologyError,
    UsageError,
)
from .failures import FailureClass
from .plan import CompiledPlan, Manifest, compile_plan, plan_topology, write_plan
from .topology import Topology, load_topology
from .verify import verify_plan_dir

__all__ = [
    "CompiledPlan",
    "DagRuntimeError",
    "ExecutionError",
    "FailureClass",
    "InputError",
    "LedgerError",
    "Manifest",
    "PlanFormatError",
    "Problem",
    "TemplateError",
    "Topology",
    "TopologyError",
    "UsageError",
    "compile_plan",
    "load_topology",
    "plan_topology",
    "verify_plan_dir",
    "write_plan",
]
