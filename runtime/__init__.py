"""A plan-time compiled DAG runtime for security-analysis agent workflows.

Names are imported on first use (PEP 562): ``runtime plan`` should not pay for the
executor at start-up, nor the executor for batches and reports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_MODULES = {
    "BatchOptions": "batch", "BatchSummary": "batch", "run_batch": "batch",
    "DagRuntimeError": "errors", "ExecutionError": "errors", "InputError": "errors",
    "LedgerError": "errors", "PlanFormatError": "errors", "Problem": "errors",
    "TemplateError": "errors", "TopologyError": "errors", "UsageError": "errors",
    "FailureClass": "failures",
    "CompiledPlan": "plan", "Manifest": "plan", "compile_plan": "plan",
    "plan_topology": "plan", "write_plan": "plan",
    "RunSettings": "records", "Redactor": "redact",
    "RunResult": "run", "resume_run": "run", "start_run": "run",
    "Topology": "topology", "load_topology": "topology",
    "verify_plan_dir": "verify",
}

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


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
