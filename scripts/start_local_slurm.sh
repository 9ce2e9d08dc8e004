#!/usr/bin/env bash
# Start a Slurm "cluster" on this one machine (localhost only), for tests/functional/test_slurm.py.
#
# - installs Debian's slurm-wlm + munge with apt-get (needs root; skipped when already installed)
# - writes /etc/slurm/slurm.conf for this host with its real CPU count and memory (from `slurmd -C`)
# - starts munged, slurmctld and one slurmd per node directly (no systemd), waits until all are idle
#
# SLURM_LOCAL_NODES (default 2) slurmd daemons run on this host as nodes <host>n1..<host>nN (Debian's
# slurmd supports several per host, each on its own port), so that multi-node jobs (Ray head on one node,
# a worker on another) are exercised for real. Each reports the host's real CPUs and memory: the nodes
# share (oversubscribe) the one machine. SLURM_LOCAL_NODES=1 gives a plain single-node cluster.
#
# Idempotent: a second run with the daemons up and the same config only checks them. Exit codes:
# 0 ready, 2 not root / apt-get unavailable, 3 install failed, 4 a daemon did not come up.
# Env: SLURM_LOCAL_NODES (default 2), SLURM_LOCAL_PARTITION (default "local"), SLURM_LOCAL_TIMEOUT_S (60),
#      SLURM_LOCAL_SKIP_INSTALL=1 (fail instead of installing).
set -euo pipefail

NUM_NODES=${SLURM_LOCAL_NODES:-2}
PARTITION=${SLURM_LOCAL_PARTITION:-local}
TIMEOUT_S=${SLURM_LOCAL_TIMEOUT_S:-60}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
t0=$(date +%s)
log() { echo "[start_local_slurm +$(( $(date +%s) - t0 ))s] $*"; }

if [ "$(id -u)" != 0 ]; then
  echo "start_local_slurm: must run as root (apt-get install, daemons)" >&2
  exit 2
fi

# ---- 1. packages --------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
   || ! command -v sbatch >/dev/null; then
  if [ "${SLURM_LOCAL_SKIP_INSTALL:-0}" = 1 ]; then
    echo "start_local_slurm: slurm not installed and SLURM_LOCAL_SKIP_INSTALL=1" >&2; exit 3
  fi
  if ! command -v apt-get >/dev/null; then
    echo "start_local_slurm: apt-get not available; install slurm-wlm and munge by hand" >&2; exit 2
  fi
  log "installing slurm-wlm munge (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || { echo "start_local_slurm: apt-get update failed" >&2; exit 3; }
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null \
    || { echo "start_local_slurm: apt-get install slurm-wlm munge failed" >&2; exit 3; }
  log "installed: $(slurmctld -V)"
fi

# ---- 2. munge -----------------------------------------------------------------------------------
mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key --force
  else dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; fi
fi
if id munge >/dev/null 2>&1; then
  chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
fi
chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key; chmod 0755 /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "starting munged"
  rm -f /run/munge/munged.pid
  # 9>&-: munged stays up after this script; it must not keep the fd of ../shared/tools/heavy's lock (fd 9), or
  # every later heavy job waits for it
  if id munge >/dev/null 2>&1; then runuser -u munge -- /usr/sbin/munged --force 9>&-
  else /usr/sbin/munged --force 9>&-; fi
  for _ in $(seq 1 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.2; done
  munge -n | unmunge >/dev/null || { echo "start_local_slurm: munged did not start" >&2; exit 4; }
fi

# ---- 3. slurm.conf ------------------------------------------------------------------------------
HOST=$(hostname -s)
NODE_NAMES=()
for ((i = 1; i <= NUM_NODES; i++)); do NODE_NAMES+=("${HOST}n$i"); done
NODE_LIST=$(IFS=,; echo "${NODE_NAMES[*]}")
mkdir -p "$CONF_DIR" /var/spool/slurmctld "$LOG_DIR" /run/slurm
for n in "${NODE_NAMES[@]}"; do mkdir -p "/var/spool/slurmd/$n"; done
# `slurmd -C` prints this node's real hardware: "NodeName=vm CPUs=2 Boards=1 ... RealMemory=24105"
HW=$(slurmd -C | head -1)
CPUS=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$HW"); CPUS=${CPUS:-$(nproc)}
MEM=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$HW")
MEM=${MEM:-$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 ))}
MEM=$(( MEM * 95 / 100 ))   # leave a little for the OS so the node is never drained for low memory
NEW_CONF=$(mktemp)
cat >"$NEW_CONF" <<EOF
# Written by scripts/start_local_slurm.sh: one node, localhost only.
ClusterName=local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=300
KillWait=30
Waittime=0
EOF
for ((i = 1; i <= NUM_NODES; i++)); do
  echo "NodeName=${HOST}n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((17000 + i)) CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
done >>"$NEW_CONF"
echo "PartitionName=$PARTITION Nodes=$NODE_LIST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$NEW_CONF"
CONF_CHANGED=0
if ! cmp -s "$NEW_CONF" "$CONF"; then
  log "writing $CONF (CPUs=$CPUS RealMemory=$MEM)"
  install -m 0644 "$NEW_CONF" "$CONF"; CONF_CHANGED=1
fi
rm -f "$NEW_CONF"

# ---- 4. daemons ---------------------------------------------------------------------------------
running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ "$CONF_CHANGED" = 1 ]; then
  for pidf in /run/slurm/slurmd*.pid /run/slurm/slurmctld.pid; do
    if running "$pidf"; then kill "$(cat "$pidf")" 2>/dev/null || true; fi
  done
  sleep 1
fi
if ! running /run/slurm/slurmctld.pid; then
  log "starting slurmctld"
  # -i: ignore state files from an earlier config of this host
  slurmctld -i
fi
for n in "${NODE_NAMES[@]}"; do
  if ! running "/run/slurm/slurmd-$n.pid"; then
    log "starting slurmd -N $n"
    slurmd -N "$n"
  fi
done

deadline=$(( $(date +%s) + TIMEOUT_S ))
ready=0
while [ "$(date +%s)" -lt "$deadline" ]; do
  ready=0
  while read -r name state; do
    case "$state" in
      idle|mixed|allocated|completing) ready=$((ready + 1)) ;;
      down*|drain*) scontrol update NodeName="$name" State=RESUME 2>/dev/null || true ;;
    esac
  done < <(sinfo -h -N -p "$PARTITION" -o '%N %T' 2>/dev/null || true)
  [ "$ready" -ge "$NUM_NODES" ] && break
  sleep 1
done
if [ "$ready" -lt "$NUM_NODES" ]; then
  echo "start_local_slurm: only $ready of $NUM_NODES nodes ready; see $LOG_DIR/" >&2
  sinfo -N >&2 2>/dev/null || true
  tail -n 20 "$LOG_DIR"/slurm*.log >&2 2>/dev/null || true
  exit 4
fi
log "ready: partition=$PARTITION nodes=$NODE_LIST CPUs=$CPUS RealMemory=$MEM each"
