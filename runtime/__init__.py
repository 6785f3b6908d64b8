"""A plan-time compiled DAG runtime for security-analysis agent workflows."""

from .batch import BatchOptions, BatchSummary, run_batch
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
from .records import RunSettings
from .redact import Redactor
from .run import RunResult, resume_run, start_run
from .topology import Topology, load_topology
from .verify import verify_plan_dir

__all__ = [
    "BatchOptions",
    "BatchSummary",
    "CompiledPlan",
    "DagRuntimeError",
    "ExecutionError",
    "FailureClass",
    "InputError",
    "LedgerError",
    "Manifest",
    "PlanFormatError",
    "Problem",
    "Redactor",
    "RunResult",
    "RunSettings",
    "TemplateError",
    "Topology",
    "TopologyError",
    "UsageError",
    "compile_plan",
    "load_topology",
    "plan_topology",
    "resume_run",
    "run_batch",
    "start_run",
    "verify_plan_dir",
    "write_plan",
]
