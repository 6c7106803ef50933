# scripts/gpu/step.sh — sourced by the GPU scripts that run timed steps within one device call's budget.
# The caller sets BUDGET (seconds for the whole call), START (its start, date +%s), LOGS (a folder) and SUMMARY (a
# file); STEP_TAIL (default 30) lines of each step's log are printed after it.
#   step NAME MAX_SECONDS command...   runs the command into $LOGS/NAME.log, capped at MAX_SECONDS and at what is left
#                                      of BUDGET; appends "NAME ok|FAILED (rc N)|TIMED OUT after Ns|SKIPPED Ns" to
#                                      $SUMMARY and returns the command's exit code (99 when skipped).
step() {
  local name=$1 max=$2 left cap rc t0 status
  shift 2
  left=$((BUDGET - ($(date +%s) - START)))
  cap=$max
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 10 ]; then echo "$name SKIPPED (budget spent)" | tee -a "$SUMMARY"; return 99; fi
  t0=$(date +%s)
  timeout -k 10 "$cap" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  status=ok
  [ $rc -ne 0 ] && status="FAILED (rc $rc)"
  [ $rc -eq 124 ] && status="TIMED OUT after ${cap}s"
  echo "$name $status $(($(date +%s) - t0))s" | tee -a "$SUMMARY"
  tail -n "${STEP_TAIL:-30}" "$LOGS/$name.log"
  return $rc
}
