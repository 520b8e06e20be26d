#!/usr/bin/env bash
# guard.sh CMD...: run CMD on a remote host for launch.sh and stop it when the ssh connection
# goes away.
#
# ssh without a terminal does not signal the remote command when the client is killed or the
# connection drops; the command's stdin does reach end-of-file then. So CMD runs in the
# background with stdin from /dev/null while this script watches its own stdin (the ssh
# channel, which launch.sh never writes to): end-of-file means the launcher closed it (it is
# stopping the job), died, or lost the connection, and CMD gets SIGTERM, then (with every
# process left in its process group) SIGKILL after MFGSERVE_GUARD_GRACE_S seconds (default
# 15; launch.sh sets half its --stop-timeout-s). Exits with CMD's exit code.
set -u
grace=${MFGSERVE_GUARD_GRACE_S:-15}

exec 3<&0 </dev/null
setsid "$@" 3<&- &  # its own process group (setsid execs: a background job is no leader)
cmd=$!
# The watcher: a subshell (no child processes) that returns at end-of-file on fd 3.
(while read -r -u 3 _; do :; done) &
watcher=$!
exec 3<&-

wait -n  # the first of the two to finish (only these two are our children)
if ! kill -0 "$cmd" 2>/dev/null; then  # CMD ended on its own: pass its exit code on
    wait "$cmd"
    rc=$?
    kill "$watcher" 2>/dev/null
    exit "$rc"
fi

echo "guard.sh: connection to the launcher closed: stopping pid $cmd ($1)" >&2
kill -TERM "$cmd" 2>/dev/null
for ((i = 0; i < grace * 10; i++)); do
    kill -0 "$cmd" 2>/dev/null || break
    sleep 0.1
done
kill -KILL -- "-$cmd" 2>/dev/null  # CMD and whatever it started in its group
wait "$cmd"
