"""Plan time: topology to sealed plan.

Load and validate a topology, render its prompts, write and verify the sealed plan.
Nothing here imports the execution side.
"""
