"""The public API is what ``runtime.__all__`` exports; changing it is a deliberate act."""

from __future__ import annotations

import runtime

EXPECTED = [
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


def test_exported_members() -> None:
    assert runtime.__all__ == sorted(runtime.__all__)
    assert runtime.__all__ == EXPECTED
    for name in runtime.__all__:
        assert getattr(runtime, name) is not None


def test_every_lazy_name_resolves_and_unknown_names_fail() -> None:
    import pytest

    assert sorted(runtime._MODULES) == sorted(runtime.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = runtime.nope
