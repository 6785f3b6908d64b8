#!/bin/sh
# Hostile agent: tries to reach past its workspace. Usage: escape.sh RUN_DIR OTHER_NODE
# Every attempt is logged to attempts.txt as "<what> ok|denied"; the agent then writes
# its declared artifact so the run can succeed and be checked.
run_dir=$1 other=$2
try() { what=$1; shift; if "$@" >/dev/null 2>&1; then echo "$what ok"; else echo "$what denied"; fi; }
{
  try ledger-relative  sh -c 'echo "{\"event\":\"run.finished\"}" >> ../../../../ledger.jsonl'
  try ledger-absolute  sh -c "echo '{\"event\":\"run.finished\"}' >> '$run_dir/ledger.jsonl'"
  try state-read       cat "$run_dir/state.json"
  try plan-read        cat "$run_dir/plan.json"
  try other-workspace  sh -c "echo poison > '$run_dir/nodes/$other/workspace/$other.json'"
  try other-prompt     sh -c "echo forged > '$run_dir/nodes/$other/prompt.rendered.md'"
  try own-prompt-write sh -c 'echo forged >> "$RUNTIME_PROMPT_FILE"'
  try input-write      sh -c "echo poison > 'inputs/$other/$other.json'"
  try input-read       cat "inputs/$other/$other.json"
  try prompt-read      cat "$RUNTIME_PROMPT_FILE"
  try context-read     cat "$RUNTIME_ATTEMPT_CONTEXT"
  try host-write       touch /usr/hostile
  try tmp-write        touch /tmp/hostile
} > attempts.txt
printf '{"ok": true}' > "$RUNTIME_NODE.json"
