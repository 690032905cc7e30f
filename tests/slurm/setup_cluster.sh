#!/usr/bin/env bash
# A real (tiny) SLURM cluster on this host, for tests/test_slurm.py and for trying
# profiles/slurm-cpu by hand.  Debian 12 packages, run as root, idempotent:
#
#   sudo tests/slurm/setup_cluster.sh          # install (once), configure, start, wait for idle
#   sudo tests/slurm/setup_cluster.sh --stop   # stop the daemons this script started (munged too)
#
# The cluster: one controller and NODES compute nodes (default 2: node1, node2), every node
# a slurmd on this host (NodeHostname=localhost, one port each) that offers the host's CPUs
# and CPU_MEM_MB of memory.  No GPUs (no Gres), no cgroups (proctrack/linuxproc,
# task/none: works in containers), no accounting database: `sacct` is unavailable and every
# finished job is written to JOBCOMP (jobcomp/filetxt) instead; squeue keeps finished jobs for
# MinJobAge=3600 s, so the Snakemake plugin can poll them with `--slurm-status-command squeue`.
set -euo pipefail

NODES=${NODES:-2}
CONF=/etc/slurm/slurm.conf
STATE=/var/spool/slurmctld
SPOOL=/var/spool/slurmd
LOGDIR=/var/log/slurm
RUNDIR=/run/slurm
JOBCOMP=${JOBCOMP:-$LOGDIR/jobcomp.log}
WAIT_S=${WAIT_S:-120}  # a restart can wait ~60 s for the old slurmd port
MUNGED_OURS=/run/munge/started-by-setup-cluster

log() { echo "setup_cluster: $*" >&2; }
die() { log "$*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts daemons)"

stop_daemons() {
    # SLURM's own shutdown first (controller and every slurmd), then whatever the pid
    # files still name.
    scontrol shutdown >/dev/null 2>&1 || true
    local pidfile
    for pidfile in "$RUNDIR"/slurmd-*.pid "$RUNDIR"/slurmctld.pid; do
        [ -f "$pidfile" ] || continue
        local pid
        pid=$(cat "$pidfile")
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid"
            # Wait for it to exit: a restart must find its port free.
            for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            log "stopped $(basename "$pidfile" .pid) (pid $pid)"
        fi
        rm -f "$pidfile"
    done
}

if [ "${1:-}" = "--stop" ]; then
    stop_daemons
    # munged too, when this script started it (a munged the host runs for itself stays).
    if [ -f "$MUNGED_OURS" ] && [ -f /run/munge/munged.pid ]; then
        kill "$(cat /run/munge/munged.pid)" 2>/dev/null && log "stopped munged"
    fi
    rm -f "$MUNGED_OURS"
    exit 0
fi

# 1. Packages (skipped when installed).
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
    log "installing slurmctld slurmd munge slurm-client"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd munge slurm-client >/dev/null
fi

# 2. Munge: a key (the package usually creates one) and a running munged.
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge
install -d -o munge -g munge -m 0711 /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
    log "creating /etc/munge/munge.key"
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
fi
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    log "starting munged"
    rm -f /run/munge/munged.pid
    runuser -u munge -- /usr/sbin/munged --force
    touch "$MUNGED_OURS"
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
    munge -n </dev/null | unmunge >/dev/null || die "munged does not answer"
fi

# 3. slurm.conf: NODES nodes on localhost, each with this host's CPUs.
CPUS=$(nproc)
TOTAL_MB=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
# Each node advertises most of the memory (the nodes share it: SLURM only counts).
CPU_MEM_MB=${CPU_MEM_MB:-$((TOTAL_MB * 8 / 10))}
install -d -m 0755 "$STATE" "$SPOOL" "$LOGDIR" "$RUNDIR"
touch "$JOBCOMP"
NEW_CONF=$(mktemp)
cat >"$NEW_CONF" <<EOF
# Written by draftsmith tests/slurm/setup_cluster.sh: a test cluster on one host.
ClusterName=draftsmith
SlurmctldHost=localhost
SlurmctldPort=6817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE
SlurmdSpoolDir=$SPOOL/%n
SlurmctldPidFile=$RUNDIR/slurmctld.pid
SlurmdPidFile=$RUNDIR/slurmd-%n.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd-%n.log
# No cgroups: containers rarely allow them, and the test needs none.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
# Without slurmdbd there is no sacct: every finished job is one line of this file.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$JOBCOMP
# squeue --states=all keeps reporting finished jobs for an hour (the plugin's squeue mode).
MinJobAge=3600
ReturnToService=2
SlurmdTimeout=120
InactiveLimit=0
KillWait=30
MpiDefault=none
NodeName=node[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((6817 + 1))-$((6817 + NODES)) CPUs=$CPUS RealMemory=$CPU_MEM_MB State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
if ! cmp -s "$NEW_CONF" "$CONF"; then
    log "writing $CONF (a change restarts the daemons)"
    install -m 0644 "$NEW_CONF" "$CONF"
    stop_daemons
fi
rm -f "$NEW_CONF"

# 4. Daemons (started only when not already running).
running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
# The controller answers pings (a pid file can be stale: slurmctld removes it on exit).
if ! scontrol ping 2>/dev/null | grep -q 'is UP'; then
    log "starting slurmctld"
    /usr/sbin/slurmctld
    for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.1; done
fi
for i in $(seq 1 "$NODES"); do
    install -d -m 0755 "$SPOOL/node$i"
    if ! running "$RUNDIR/slurmd-node$i.pid"; then
        log "starting slurmd for node$i"
        /usr/sbin/slurmd -N "node$i"
    fi
done

# 5. Wait until every node is idle (or mixed/allocated: busy with test jobs).
for _ in $(seq $((WAIT_S * 2))); do
    states=$(sinfo --noheader --Node --format='%N %t' 2>/dev/null || true)
    ready=$(echo "$states" | grep -c -E ' (idle|mix|alloc)$' || true)
    if [ "$ready" -ge "$NODES" ]; then
        log "ready: $NODES node(s), $CPUS CPU(s) and ${CPU_MEM_MB} MB each; finished jobs in $JOBCOMP"
        sinfo --Node --format='%N %P %t %c %m'
        exit 0
    fi
    # A node left down/drained by an earlier crash comes back with a resume.
    for node in $(echo "$states" | awk '$2 ~ /down|drain/ {print $1}'); do
        scontrol update NodeName="$node" State=RESUME 2>/dev/null || true
    done
    sleep 0.5
done
log "nodes not idle after ${WAIT_S}s:"
sinfo --Node --long >&2 || true
tail -n 20 "$LOGDIR/slurmctld.log" "$LOGDIR"/slurmd-node*.log >&2 || true
exit 1
