# shellcheck shell=bash
# Job control shared by deploy/ssh/launch.sh and deploy/slurm/mfgserve.sbatch (sourced, not run).
#
# A job is a set of background "steps" (an `ssh HOST ...` or an `srun ...` each), one per
# server host and one per trainer host. The caller starts them with job_start, waits for the
# servers with job_wait_ready, then calls job_monitor, which returns once every trainer step
# exited 0 (success) or fails the job as soon as
#   * any server step exits (a server host died or was stopped: the job cannot go on), or
#   * any trainer step exits non-zero.
# job_stop stops whatever still runs, all under one deadline: the caller's polite hook first
# (launch.sh closes the ssh connections' stdin, which the remote guard turns into SIGTERM,
# and SIGKILL after half the deadline), then SIGTERM to each step still running at 5/6 of
# the deadline (at once without a hook), then SIGKILL at the deadline. Install job_traps so that Ctrl-C
# (SIGINT), SIGTERM (scancel, kill) and every exit path run job_stop.
#
# The caller sets: JOB_PROG (name in messages), JOB_STOP_TIMEOUT_S (seconds), and may define
# job_polite_stop (a function) and JOB_SUMMARY_STEP (the step whose last stdout line is the
# trainers' JSON summary, printed on our stdout when the job succeeds).

JOB_NAMES=()   # step names ("server-cpu01", "trainer-gpu01", ...)
JOB_PIDS=()    # their local pids (the ssh / srun processes)
JOB_ROLES=()   # "server" or "trainer"
JOB_LOGDIR=""  # each step writes $JOB_LOGDIR/<name>.out (stdout) and .err (stderr)
JOB_STOPPED=0

job_log() { printf '%s: %s\n' "$JOB_PROG" "$*" >&2; }

job_die() {  # bad input: message, exit 2 (nothing started yet, or job_stop runs on exit)
    job_log "error: $*"
    exit 2
}

# job_start ROLE NAME CMD...: run CMD in the background, stdout/stderr to the step's log files.
job_start() {
    local role=$1 name=$2
    shift 2
    "$@" >"$JOB_LOGDIR/$name.out" 2>"$JOB_LOGDIR/$name.err" &
    JOB_NAMES+=("$name")
    JOB_PIDS+=("$!")
    JOB_ROLES+=("$role")
    job_log "started $name (pid $!): $*"
}

job_alive() { kill -0 "$1" 2>/dev/null; }

# job_tail NAME: the last lines of a step's stderr, indented (for error messages).
job_tail() { tail -n 15 "$JOB_LOGDIR/$1.err" 2>/dev/null | sed 's/^/    /' >&2; }

# job_fail NAME RC WHAT: report a failed step with its last output and exit 1 (the EXIT trap
# stops the others).
job_fail() {
    job_log "$1 $3 (exit code $2); stopping the job. Last lines of $JOB_LOGDIR/$1.err:"
    job_tail "$1"
    exit 1
}

# job_nap SECONDS: sleep, but let a trapped signal (Ctrl-C, SIGTERM) run its trap at once: the
# wait builtin returns as soon as a trapped signal arrives, whereas a foreground `sleep` defers
# the trap until it exits (a CI run once saw a SIGINT to the launcher never acted on).
job_nap() {
    sleep "$1" &
    wait $! 2>/dev/null
}

# job_wait_ready NAME TIMEOUT_S: wait until server step NAME printed server-node's
# {"event": "ready", ...} line; fail the job if the step exits first or the deadline passes.
job_wait_ready() {
    local name=$1 timeout_s=$2 i pid=""
    for i in "${!JOB_NAMES[@]}"; do
        if [[ ${JOB_NAMES[$i]} == "$name" ]]; then pid=${JOB_PIDS[$i]}; fi
    done
    local deadline=$((SECONDS + timeout_s))
    until grep -q '"event": *"ready"' "$JOB_LOGDIR/$name.out" 2>/dev/null; do
        if ! job_alive "$pid"; then
            local rc=0
            wait "$pid" || rc=$?
            job_fail "$name" "$rc" "exited before its servers were ready"
        fi
        if ((SECONDS > deadline)); then
            job_log "$name: servers not ready within ${timeout_s}s (raise --startup-timeout-s)"
            job_tail "$name"
            exit 1
        fi
        job_nap 0.2
    done
    job_log "$name ready"
}

# job_monitor: return 0 once every trainer step exited 0; exit 1 naming the first failure.
job_monitor() {
    local i rc running
    while :; do
        running=0
        for i in "${!JOB_PIDS[@]}"; do
            [[ -z ${JOB_PIDS[$i]} ]] && continue  # already reaped
            if job_alive "${JOB_PIDS[$i]}"; then
                [[ ${JOB_ROLES[$i]} == trainer ]] && running=$((running + 1))
                continue
            fi
            rc=0
            wait "${JOB_PIDS[$i]}" || rc=$?
            JOB_PIDS[i]=""
            if [[ ${JOB_ROLES[$i]} == server ]]; then
                job_fail "${JOB_NAMES[$i]}" "$rc" "exited while trainers were running"
            elif ((rc != 0)); then
                job_fail "${JOB_NAMES[$i]}" "$rc" "failed"
            fi
            job_log "${JOB_NAMES[$i]} finished"
        done
        ((running == 0)) && return 0
        job_nap 0.5
    done
}

# job_stop: stop every step still running within JOB_STOP_TIMEOUT_S (idempotent).
job_stop() {
    ((JOB_STOPPED)) && return 0
    JOB_STOPPED=1
    local pid alive=()
    for pid in "${JOB_PIDS[@]}"; do
        [[ -n $pid ]] && job_alive "$pid" && alive+=("$pid")
    done
    ((${#alive[@]})) || return 0
    job_log "stopping ${#alive[@]} step(s) (deadline ${JOB_STOP_TIMEOUT_S}s)"
    local deadline=$((SECONDS + JOB_STOP_TIMEOUT_S))
    local term_at=$SECONDS  # without a polite hook: SIGTERM at once
    if declare -F job_polite_stop >/dev/null; then
        # the hook has the steps end on their own (launch.sh: the remote guard escalates to
        # SIGKILL after half the timeout); SIGTERM only to steps still there near the end
        job_polite_stop
        term_at=$((SECONDS + JOB_STOP_TIMEOUT_S * 5 / 6))
    fi
    local termed=0
    while :; do
        alive=()
        for pid in "${JOB_PIDS[@]}"; do
            [[ -n $pid ]] && job_alive "$pid" && alive+=("$pid")
        done
        ((${#alive[@]})) || break
        if ((SECONDS >= deadline)); then
            job_log "still running at the deadline: SIGKILL to pids ${alive[*]}"
            kill -KILL "${alive[@]}" 2>/dev/null
            break
        fi
        if ((!termed && SECONDS >= term_at)); then
            kill -TERM "${alive[@]}" 2>/dev/null
            termed=1
        fi
        sleep 0.2
    done
    for pid in "${JOB_PIDS[@]}"; do
        [[ -n $pid ]] && wait "$pid" 2>/dev/null
    done
    job_log "all steps stopped"
}

job_on_signal() {  # Ctrl-C / scancel / kill: stop everything, exit 128 + signal number
    trap - INT TERM
    job_log "got SIG$1: stopping the job"
    JOB_EXIT_CODE=$2
    exit "$2"
}

job_on_exit() {
    local rc=${JOB_EXIT_CODE:-$?}
    trap - INT TERM EXIT
    job_stop
    exit "$rc"
}

job_traps() {
    trap 'job_on_signal INT 130' INT
    trap 'job_on_signal TERM 143' TERM
    trap job_on_exit EXIT
}

# job_print_summary: the trainers' JSON summary (last stdout line of JOB_SUMMARY_STEP).
job_print_summary() {
    local line
    line=$(grep -v '^[[:space:]]*$' "$JOB_LOGDIR/$JOB_SUMMARY_STEP.out" | tail -n 1)
    if [[ $line != "{"* ]]; then
        job_log "$JOB_SUMMARY_STEP printed no JSON summary (see $JOB_LOGDIR/$JOB_SUMMARY_STEP.out)"
        return 1
    fi
    printf '%s\n' "$line"
}

# run_dir_args DIR TRAINER-ARGS...: sets RUN_DIR_ARGS to (--run-dir DIR) unless the trainer
# options already choose one (--run-dir, or --resume, which finds the run to continue itself).
run_dir_args() {
    local dir=$1 a
    shift
    # shellcheck disable=SC2034  # RUN_DIR_ARGS is read by the sourcing script
    RUN_DIR_ARGS=(--run-dir "$dir")
    for a in "$@"; do
        # shellcheck disable=SC2034
        case $a in --run-dir|--run-dir=*|--resume) RUN_DIR_ARGS=() ;; esac
    done
}

# num_parts PYTHON PARTS: the partition set's number of parts (validates the set too).
num_parts() {
    "$1" -c 'import sys; from partition.layout import PartitionSetMeta
print(PartitionSetMeta.load(sys.argv[1]).num_parts)' "$2"
}

# write_cluster PYTHON FILE PORT_BASE REPLICAS NUM_PARTS ADDR...: a cluster file placing replica
# r of part p on server address (p + r) mod #ADDR, port PORT_BASE + p * REPLICAS + r.
write_cluster() {
    "$1" - "${@:2}" <<'EOF'
import sys
from common.cluster import ClusterSpec
path, base, replicas, parts, *addrs = sys.argv[1:]
base, replicas, parts = int(base), int(replicas), int(parts)
ClusterSpec({p: [f"tcp://{addrs[(p + r) % len(addrs)]}:{base + p * replicas + r}"
                 for r in range(replicas)] for p in range(parts)}).write(path)
EOF
}
