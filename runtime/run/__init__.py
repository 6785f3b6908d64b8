"""Execution time: run directories, the ledger, scheduler, attempts and engines."""
