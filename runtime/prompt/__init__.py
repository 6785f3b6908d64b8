"""Prompt assembly, shared by both halves.

The fixed assembly order, the retry preamble and the redaction of untrusted text;
pure functions.
"""
