#!/usr/bin/env bash
# launch.sh: run one mfgserve training job on several hosts over plain ssh.
#
#   deploy/ssh/launch.sh --hosts hosts.txt --parts /shared/parts/arxiv4 \
#       [--job-dir DIR] [--nproc-per-node N] [--server-config server.yaml] ... \
#       -- --epochs 10 --fanouts 10,10 --batch-size 1024      # trainer-client options
#
# hosts.txt, one host a line ('#' starts a comment):
#   server   cpu01  10.0.0.1     # role, ssh target, address on the cluster network
#   server   cpu02  10.0.0.2     #   (the address defaults to the ssh target; it must be an
#   trainer  gpu01  10.0.0.11    #   IP address or a name the hosts resolve)
#
# What it does: writes the cluster file (JOB_DIR/cluster.yaml; parts spread over the server
# hosts), starts `server-node --cluster ... --host ADDR` on each server host, waits until all
# are ready, starts `torchrun ... trainer-client` on each trainer host (the first is the DDP
# master), and prints the trainers' JSON summary on stdout once they all exit 0. Logs of each
# host go to JOB_DIR/logs/<role>-<host>.out (stdout) and .err (stderr).
#
# Stopping: Ctrl-C (SIGINT) or SIGTERM stops everything it started, as does any host failing
# (a server-node exiting, a trainer exiting non-zero, ssh losing the connection: ssh exits
# 255): the ssh connections' stdin is closed, which deploy/ssh/guard.sh on each host turns
# into SIGTERM to its command (SIGKILL to what is left of it after half of --stop-timeout-s);
# ssh clients still running at 5/6 of --stop-timeout-s get SIGTERM, at the deadline SIGKILL. Exit code: 0 done, 1 a host failed, 2 bad input, 130/143
# on SIGINT/SIGTERM.
#
# Requirements: the repository with its virtual environment (.venv) at the same path on every
# host (a shared filesystem, or the same install), as are the partition set and JOB_DIR;
# passwordless ssh (BatchMode); bash >= 4.3 on every host. MFGSERVE_SSH (default: ssh) is
# the ssh command, MFGSERVE_SSH_OPTS extra options for it.
set -uo pipefail  # no -e: every failure is checked and reported by name

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=deploy/ssh/lib.sh
source "$HERE/lib.sh"
JOB_PROG=launch.sh

usage() {
    sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
    cat >&2 <<'EOF'
Options:
  --hosts FILE             hosts file (required)
  --parts DIR              partition set directory (required; same path on every host)
  --repo DIR               repository on the hosts (default: this script's repository)
  --venv DIR               virtual environment on the hosts (default: REPO/.venv)
  --job-dir DIR            cluster file and logs (default: ./mfgserve-job-<UTC time>)
  --port-base N            first server port (default 15550)
  --replicas N             servers per part (default 1)
  --server-config FILE     server-node --config YAML (sampler threads, timeouts, ...)
  --nproc-per-node N       trainers per trainer host (default 1)
  --master-port N          DDP rendezvous port on the first trainer host (default 29500)
  --startup-timeout-s S    seconds for the servers to be ready (default 300)
  --stop-timeout-s S       seconds to stop everything on Ctrl-C or a failure (default 30)
  --env NAME=VALUE         set this environment variable for every remote command
                           (repeatable), e.g. GLOO_SOCKET_IFNAME=eth0
  -- ARGS...               the rest goes to trainer-client (--cluster is set here)
EOF
    exit 2
}

REPO=$(cd "$HERE/../.." && pwd)
VENV="" HOSTS_FILE="" PARTS="" JOB_DIR="" SERVER_CONFIG=""
PORT_BASE=15550 REPLICAS=1 NPROC=1 MASTER_PORT=29500 STARTUP_TIMEOUT_S=300
JOB_STOP_TIMEOUT_S=30
TRAINER_ARGS=() REMOTE_ENV=()
while (($#)); do
    case $1 in
        --hosts) HOSTS_FILE=$2 ;;
        --parts) PARTS=$2 ;;
        --repo) REPO=$2 ;;
        --venv) VENV=$2 ;;
        --job-dir) JOB_DIR=$2 ;;
        --port-base) PORT_BASE=$2 ;;
        --replicas) REPLICAS=$2 ;;
        --server-config) SERVER_CONFIG=$2 ;;
        --nproc-per-node) NPROC=$2 ;;
        --master-port) MASTER_PORT=$2 ;;
        --startup-timeout-s) STARTUP_TIMEOUT_S=$2 ;;
        --stop-timeout-s) JOB_STOP_TIMEOUT_S=$2 ;;
        --env) [[ $2 == [A-Za-z_]*=* ]] || job_die "--env takes NAME=VALUE, not '$2'"
               REMOTE_ENV+=("$2") ;;
        --) shift; TRAINER_ARGS=("$@"); break ;;
        -h|--help) usage ;;
        *) job_die "unknown option '$1' (see --help)" ;;
    esac
    (($# >= 2)) || job_die "option $1 needs a value"
    shift 2
done
[[ -n $HOSTS_FILE && -n $PARTS ]] || job_die "--hosts and --parts are required (see --help)"
[[ -r $HOSTS_FILE ]] || job_die "cannot read hosts file $HOSTS_FILE"
VENV=${VENV:-$REPO/.venv}
JOB_DIR=${JOB_DIR:-$PWD/mfgserve-job-$(date -u +%Y%m%d-%H%M%S)}
SSH=${MFGSERVE_SSH:-ssh}
read -r -a SSH_OPTS <<<"${MFGSERVE_SSH_OPTS:-}"
# No password prompts; notice a dead host within ~15 s (ssh then exits 255, failing the job).
SSH_OPTS=(-o BatchMode=yes -o ServerAliveInterval=5 -o ServerAliveCountMax=3 "${SSH_OPTS[@]}")

# ---------------------------------------------------------------- hosts file
SERVER_HOSTS=() SERVER_ADDRS=() TRAINER_HOSTS=() TRAINER_ADDRS=()
while read -r line || [[ -n $line ]]; do  # (a last line without newline too)
    read -r role host addr extra <<<"${line%%#*}"  # drop the comment, split the fields
    [[ -z ${role:-} ]] && continue
    [[ -n ${host:-} && -z ${extra:-} ]] || job_die "$HOSTS_FILE: bad line '$line' \
(expected: ROLE SSH-TARGET [ADDRESS])"
    case $role in
        server) SERVER_HOSTS+=("$host"); SERVER_ADDRS+=("${addr:-$host}") ;;
        trainer) TRAINER_HOSTS+=("$host"); TRAINER_ADDRS+=("${addr:-$host}") ;;
        *) job_die "$HOSTS_FILE: unknown role '$role' (expected server or trainer)" ;;
    esac
done <"$HOSTS_FILE"
((${#SERVER_HOSTS[@]})) || job_die "$HOSTS_FILE lists no server host"
((${#TRAINER_HOSTS[@]})) || job_die "$HOSTS_FILE lists no trainer host"
dups=$(printf '%s\n' "${SERVER_HOSTS[@]}" "${TRAINER_HOSTS[@]}" | sort | uniq -d)
[[ -z $dups ]] || job_die "$HOSTS_FILE lists a host twice: $dups (one role per host)"

# ---------------------------------------------------------------- cluster file and logs
mkdir -p "$JOB_DIR/logs" || job_die "cannot create $JOB_DIR/logs"
JOB_DIR=$(cd "$JOB_DIR" && pwd)
JOB_LOGDIR=$JOB_DIR/logs
CLUSTER=$JOB_DIR/cluster.yaml
cd "$REPO" || job_die "cannot cd to $REPO"
PARTS_N=$(num_parts "$VENV/bin/python" "$PARTS") || job_die "cannot read partition set $PARTS"
write_cluster "$VENV/bin/python" "$CLUSTER" "$PORT_BASE" "$REPLICAS" "$PARTS_N" \
    "${SERVER_ADDRS[@]}" || job_die "cannot write $CLUSTER"
job_log "job directory $JOB_DIR: $PARTS_N part(s) on ${#SERVER_HOSTS[@]} server host(s), \
${#TRAINER_HOSTS[@]} trainer host(s) x $NPROC trainer(s)"

# Every ssh reads its stdin from this fifo, which only we hold open for writing: closing it
# (job_polite_stop), or our death, gives each remote guard.sh end-of-file.
rm -f "$JOB_DIR/keepalive"
mkfifo "$JOB_DIR/keepalive" || job_die "cannot create a fifo in $JOB_DIR"
exec {KEEPALIVE}<>"$JOB_DIR/keepalive"
job_polite_stop() { exec {KEEPALIVE}>&-; }
job_traps

# remote HOST CMD...: run CMD under guard.sh on HOST, from the repository directory. Only for
# job_start (it runs this in a background subshell, which exec turns into the ssh process, so
# the recorded pid is ssh's own).
remote() {
    local host=$1 cd_repo run
    shift
    printf -v cd_repo '%q ' cd "$REPO"
    ((${#REMOTE_ENV[@]})) && set -- env "${REMOTE_ENV[@]}" "$@"
    printf -v run '%q ' exec bash "$REPO/deploy/ssh/guard.sh" "$@"
    local cmd="$cd_repo&& MFGSERVE_GUARD_GRACE_S=$((JOB_STOP_TIMEOUT_S / 2)) $run"
    exec "$SSH" "${SSH_OPTS[@]}" "$host" "$cmd" <"$JOB_DIR/keepalive" {KEEPALIVE}>&-
}

# ---------------------------------------------------------------- servers, then trainers
SERVER_CONFIG_ARGS=()
[[ -n $SERVER_CONFIG ]] && SERVER_CONFIG_ARGS=(--config "$SERVER_CONFIG")
for i in "${!SERVER_HOSTS[@]}"; do
    job_start server "server-${SERVER_HOSTS[$i]}" remote "${SERVER_HOSTS[$i]}" \
        "$VENV/bin/server-node" --parts "$PARTS" --cluster "$CLUSTER" \
        --host "${SERVER_ADDRS[$i]}" --startup-timeout-s "$STARTUP_TIMEOUT_S" \
        "${SERVER_CONFIG_ARGS[@]}"
done
for host in "${SERVER_HOSTS[@]}"; do
    job_wait_ready "server-$host" "$STARTUP_TIMEOUT_S"
done

run_dir_args "$JOB_DIR/run" "${TRAINER_ARGS[@]}"  # the run's outputs: JOB_DIR/run
for i in "${!TRAINER_HOSTS[@]}"; do
    job_start trainer "trainer-${TRAINER_HOSTS[$i]}" remote "${TRAINER_HOSTS[$i]}" \
        "$VENV/bin/torchrun" --nnodes "${#TRAINER_HOSTS[@]}" --nproc-per-node "$NPROC" \
        --node-rank "$i" --master-addr "${TRAINER_ADDRS[0]}" --master-port "$MASTER_PORT" \
        "$VENV/bin/trainer-client" --cluster "$CLUSTER" "${RUN_DIR_ARGS[@]}" \
        "${TRAINER_ARGS[@]}"
done
JOB_SUMMARY_STEP=trainer-${TRAINER_HOSTS[0]}

job_monitor
job_print_summary
