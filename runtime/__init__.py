"""A plan-time compiled DAG runtime for security-analysis agent workflows.

Names are imported on first use (PEP 562): ``runtime plan`` should not pay for the
executor at start-up, nor the executor for batches and reports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.batch import BatchOptions, run_batch
    from runtime.errors import (
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
    from runtime.failures import FailureClass
    from runtime.plan.compile import compile_plan, plan_topology, write_plan
    from runtime.plan.manifest import CompiledPlan, Manifest
    from runtime.plan.topology import Topology, load_topology
    from runtime.plan.verify import verify_plan_dir
    from runtime.prompt.redact import Redactor
    from runtime.run.records import RunSettings
    from runtime.run.start import RunResult, resume_run, start_run
    from runtime.run.summary import BatchSummary

_MODULES = {
    "BatchOptions": "batch", "BatchSummary": "run.summary", "run_batch": "batch",
    "DagRuntimeError": "errors", "ExecutionError": "errors", "InputError": "errors",
    "LedgerError": "errors", "PlanFormatError": "errors", "Problem": "errors",
    "TemplateError": "errors", "TopologyError": "errors", "UsageError": "errors",
    "FailureClass": "failures",
    "CompiledPlan": "plan.manifest", "Manifest": "plan.manifest",
    "compile_plan": "plan.compile", "plan_topology": "plan.compile",
    "write_plan": "plan.compile",
    "RunSettings": "run.records", "Redactor": "prompt.redact",
    "RunResult": "run.start", "resume_run": "run.start", "start_run": "run.start",
    "Topology": "plan.topology", "load_topology": "plan.topology",
    "verify_plan_dir": "plan.verify",
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
