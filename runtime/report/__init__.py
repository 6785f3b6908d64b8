"""Reports and findings, read through ``run.read`` and rendered."""
