#!/usr/bin/env bash
# A real single-node Slurm cluster (slurmctld + slurmd + slurmdbd/MariaDB accounting + munge)
# for the tests, with all configuration and state under one directory.
#
#   bash scripts/slurm.sh up       install (root + apt-get, when missing), configure, start, wait
#   bash scripts/slurm.sh down     stop every daemon started here (bounded waits, then kill -9)
#   bash scripts/slurm.sh status   one line per daemon; exit 0 only if the cluster accepts jobs
#   bash scripts/slurm.sh env      the exports a caller needs:  eval "$(bash scripts/slurm.sh env)"
#
# SLURM_STATE_DIR (default /tmp/fastckpt-slurm) holds etc/ (slurm.conf, slurmdbd.conf,
# cgroup.conf), spool/, log/, run/ (pid files), munge/ (key and socket) and db/ (MariaDB).
# Every daemon runs as root (SlurmUser=root: a test cluster in a root container). MariaDB listens
# on a socket in the state dir and on 127.0.0.1:$SLURM_DB_PORT (default 3307) for slurmdbd;
# munged on its own socket, so nothing clashes with a system munge or MariaDB.
# Exit codes: 0 ok, 1 failure (the log tails are printed), 3 cannot set up here (not root / no apt).
set -uo pipefail

STATE=${SLURM_STATE_DIR:-/tmp/fastckpt-slurm}
DB_PORT=${SLURM_DB_PORT:-3307}
CLUSTER=fastckpt
ETC=$STATE/etc RUN=$STATE/run LOG=$STATE/log SPOOL=$STATE/spool MUNGE=$STATE/munge DB=$STATE/db
CONF=$ETC/slurm.conf
MUNGE_SOCK=$MUNGE/munge.socket.2
DB_SOCK=$DB/mysqld.sock
DB_PASS=fastckpt-slurm
export SLURM_CONF=$CONF
export PATH=$PATH:/usr/sbin:/sbin
HOST=$(hostname -s)
PACKAGES="slurm-wlm slurmctld slurmd slurm-client slurmdbd munge mariadb-server"

say() { echo "[slurm] $*"; }
now() { echo "$EPOCHREALTIME"; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1fs", b - a }'; }

# wait_for SECONDS WHAT CMD...: run CMD (each try bounded to 10 s) until it succeeds or time is up;
# CMD may be a function of this script (those bound their own commands). When WHAT is a daemon's
# name, give up early once that daemon has been gone (no live pid file) for 5 s.
wait_for() {
  local limit=$1 what=$2; shift 2
  local end=$((SECONDS + limit)) gone=""
  while :; do
    if [ "$(type -t "$1")" = function ]; then "$@"; else timeout 10 "$@"; fi >/dev/null 2>&1 && return 0
    [ $SECONDS -ge $end ] && { say "timed out after ${limit}s waiting for $what"; return 1; }
    case "$what" in munged|mariadb|slurmdbd|slurmctld)
      if running "$what"; then gone=""; elif [ -z "$gone" ]; then gone=$SECONDS
      elif [ $((SECONDS - gone)) -ge 5 ]; then say "$what exited"; return 1; fi ;;
    esac
    sleep 0.5
  done
}

# pid of a running daemon from its pid file (checked against /proc so a reused pid does not count)
pid_of() {
  local name=$1 file=$RUN/$1.pid pid
  [ -s "$file" ] || return 1
  pid=$(tr -dc 0-9 <"$file")
  [ -n "$pid" ] && alive "$pid" || return 1
  case "$name" in mariadb) tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -e mariadbd -e mysqld || return 1 ;;
    *) tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$name" || return 1 ;; esac
  echo "$pid"
}
running() { pid_of "$1" >/dev/null; }

tails() {  # the last lines of every log, for a failure report
  local f
  for f in "$LOG"/*.log; do
    [ -s "$f" ] && [ "$f" != "$LOG/apt.log" ] || continue
    echo "--- tail $f"
    tail -n "${1:-15}" "$f"
  done
}
STARTED=()  # the daemons this 'up' started: a failed 'up' stops them again
fail() {
  local i
  tails 15
  for ((i = ${#STARTED[@]} - 1; i >= 0; i--)); do stop_pid "${STARTED[i]}" 20 >/dev/null; done
  say "FAILED: $*"
  exit 1
}

# ---------------------------------------------------------------- install
have_binaries() {
  local b
  for b in slurmctld slurmd slurmdbd sbatch srun sacct sacctmgr scontrol munged munge; do
    command -v "$b" >/dev/null || return 1
  done
  command -v mariadbd >/dev/null || command -v mysqld >/dev/null || return 1
  command -v mariadb-install-db >/dev/null || command -v mysql_install_db >/dev/null || return 1
  compgen -G "/usr/lib/*/slurm-wlm/accounting_storage_mysql.so" >/dev/null ||
    compgen -G "/usr/lib*/slurm/accounting_storage_mysql.so" >/dev/null || return 1
}

install() {
  have_binaries && return 0
  if ! command -v apt-get >/dev/null; then echo "[slurm] cannot install Slurm: no apt-get"; exit 3; fi
  local t0 policy="" rc
  t0=$(now)
  # the packages' postinst must not start system daemons (a system munged/mysqld on the default paths)
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && policy=1
  fi
  say "apt-get install $PACKAGES"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q -o DPkg::Lock::Timeout=120 --no-install-recommends $PACKAGES >"$LOG/apt.log" 2>&1
  rc=$?
  if [ $rc != 0 ]; then
    say "install failed, running apt-get update first"
    { apt-get update -q && apt-get install -y -q -o DPkg::Lock::Timeout=120 --no-install-recommends $PACKAGES; } >>"$LOG/apt.log" 2>&1
    rc=$?
  fi
  [ -n "$policy" ] && rm -f /usr/sbin/policy-rc.d
  if [ $rc != 0 ] || ! have_binaries; then
    tail -n 20 "$LOG/apt.log"
    echo "[slurm] cannot install Slurm: apt-get install failed (see $LOG/apt.log)"
    exit 3
  fi
  say "install took $(since "$t0")"
}

# ---------------------------------------------------------------- configuration
# proctrack/cgroup when this container lets us make cgroups (v1 freezer, or v2), else linuxproc.
cgroup_works() {
  local probe
  if [ -d /sys/fs/cgroup/freezer ]; then
    probe=/sys/fs/cgroup/freezer/fastckpt-probe.$$
  elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    probe=/sys/fs/cgroup/fastckpt-probe.$$
  else
    return 1
  fi
  mkdir "$probe" 2>/dev/null || return 1
  rmdir "$probe"
}

# FASTCKPT_SLURM_PROCTRACK=cgroup|linuxproc forces one (for this start); otherwise the choice made
# (and checked with a job) on the first start is kept in $STATE/proctrack
choose_proctrack() {
  if [ -n "${FASTCKPT_SLURM_PROCTRACK:-}" ]; then
    echo "$FASTCKPT_SLURM_PROCTRACK" >"$STATE/proctrack.now"
  elif [ -s "$STATE/proctrack" ]; then
    cp "$STATE/proctrack" "$STATE/proctrack.now"
  elif cgroup_works; then
    echo cgroup >"$STATE/proctrack.now"
  else
    echo linuxproc >"$STATE/proctrack.now"
  fi
  cat "$STATE/proctrack.now"
}

node_line() {
  local cpus hw mem
  cpus=$(nproc)
  hw=$(slurmd -C 2>/dev/null | head -n 1)
  mem=$(awk '/^MemAvailable:/ { printf "%d", $2 / 1024 * 0.9 }' /proc/meminfo)
  [ -n "$mem" ] && [ "$mem" -gt 256 ] || mem=1024
  local line="NodeName=$HOST NodeAddr=127.0.0.1 NodeHostname=$HOST"
  # the full topology when slurmd sees as many CPUs as nproc (else just CPUs=nproc)
  if echo "$hw" | grep -q "CPUs=$cpus "; then
    local k
    for k in Boards SocketsPerBoard CoresPerSocket ThreadsPerCore; do
      line="$line $(echo "$hw" | grep -o "$k=[0-9]*")"
    done
  fi
  echo "$line CPUs=$cpus RealMemory=$mem State=UNKNOWN"
}

write_config() {
  local proctrack=$1
  cat >"$CONF" <<EOF
# written by scripts/slurm.sh: a one-node test cluster, every daemon runs as root
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
# cred_expire is left at its default (120 s), as on real clusters: it is also how long a job
# Slurm requeued waits before it may start again (BeginTime ~121 s), the delay that
# `fastckpt resume --requeue` avoids, which tests/test_slurm_jobs.py measures
AuthInfo=socket=$MUNGE_SOCK
CredType=cred/munge
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=none
SwitchType=switch/none
ProctrackType=proctrack/$proctrack
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=5
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
AccountingStoragePass=$MUNGE_SOCK
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2,sched_min_interval=100000
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
KillWait=10
JobRequeue=1
MinJobAge=60
ReturnToService=2
MessageTimeout=20
SlurmdTimeout=120
SlurmctldTimeout=60
InactiveLimit=0
MailProg=/bin/true
Waittime=0
$(node_line)
# main: the default; its jobs are not preempted.  high: preempts low.  low: preemptible; a
# preempted job's srun steps get SIGTERM at once, and when GraceTime=20 is over the whole job
# (batch shell too) gets SIGTERM, KillWait=10 later SIGKILL, and is requeued (--requeue or
# JobRequeue=1); a job that ends by itself within its grace time is not requeued.
PartitionName=main Nodes=ALL Default=YES PriorityTier=1 PreemptMode=OFF MaxTime=INFINITE State=UP
PartitionName=low Nodes=ALL PriorityTier=1 PreemptMode=REQUEUE GraceTime=20 MaxTime=INFINITE State=UP
PartitionName=high Nodes=ALL PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP
EOF
  if [ "$proctrack" = cgroup ]; then
    local plugin=cgroup/v1
    [ -f /sys/fs/cgroup/cgroup.controllers ] && plugin=cgroup/v2
    cat >"$ETC/cgroup.conf" <<EOF
CgroupPlugin=$plugin
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
    [ "$plugin" = cgroup/v2 ] && echo "IgnoreSystemd=yes" >>"$ETC/cgroup.conf"
  else
    rm -f "$ETC/cgroup.conf"
  fi
  (umask 077; cat >"$ETC/slurmdbd.conf" <<EOF
# written by scripts/slurm.sh
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=$HOST
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
  )
  chown root:root "$ETC/slurmdbd.conf"
  chmod 600 "$ETC/slurmdbd.conf"
}

# ---------------------------------------------------------------- daemons
start_munge() {
  running munged && return 0
  STARTED+=(munged)
  if [ ! -s "$MUNGE/munge.key" ]; then
    (umask 077; mungekey --create --keyfile="$MUNGE/munge.key" 2>/dev/null ||
      dd if=/dev/urandom of="$MUNGE/munge.key" bs=1024 count=1 status=none)
  fi
  chmod 600 "$MUNGE/munge.key"
  rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
  munged --key-file="$MUNGE/munge.key" --socket="$MUNGE_SOCK" --pid-file="$RUN/munged.pid" \
    --log-file="$LOG/munged.log" --seed-file="$MUNGE/munged.seed" </dev/null 9>&- >>"$LOG/munged.log" 2>&1 ||
    fail "munged did not start"
  wait_for 20 munged sh -c "munge -n -S '$MUNGE_SOCK' | unmunge -S '$MUNGE_SOCK'" || fail "munge does not answer"
}

mysql_cli() { timeout 30 "$(command -v mariadb || command -v mysql)" --no-defaults -S "$DB_SOCK" -uroot "$@"; }

start_db() {
  running mariadb && return 0
  STARTED+=(mariadb)
  local server opts
  server=$(command -v mariadbd || command -v mysqld)
  opts="--innodb-buffer-pool-size=512M --innodb-log-file-size=64M --innodb-lock-wait-timeout=900"
  if [ ! -d "$DB/data/mysql" ]; then
    rm -rf "$DB/data"
    "$(command -v mariadb-install-db || command -v mysql_install_db)" --no-defaults --user=root \
      --datadir="$DB/data" --skip-test-db --auth-root-authentication-method=socket $opts \
      >"$LOG/db-install.log" 2>&1 || { cat "$LOG/db-install.log"; fail "mariadb-install-db failed"; }
  fi
  rm -f "$DB_SOCK"
  setsid "$server" --no-defaults --user=root --datadir="$DB/data" --socket="$DB_SOCK" \
    --pid-file="$RUN/mariadb.pid" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
    --log-error="$LOG/mariadb.log" $opts </dev/null 9>&- >>"$LOG/mariadb.log" 2>&1 &
  wait_for 60 mariadb mysql_cli -e "select 1" || fail "MariaDB does not answer"
  mysql_cli -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" || fail "cannot create the accounting database"
}

start_dbd() {
  running slurmdbd || { STARTED+=(slurmdbd); slurmdbd </dev/null 9>&- >>"$LOG/slurmdbd.out" 2>&1 || fail "slurmdbd did not start"; }
  wait_for 60 slurmdbd sacctmgr -n show cluster || fail "slurmdbd does not answer"
  if ! timeout 10 sacctmgr -n -P show cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"; then
    timeout 30 sacctmgr -i add cluster "$CLUSTER" >/dev/null || fail "sacctmgr add cluster failed"
  fi
}

start_ctld() {
  running slurmctld || { STARTED+=(slurmctld); slurmctld -f "$CONF" </dev/null 9>&- >>"$LOG/slurmctld.out" 2>&1 || fail "slurmctld did not start"; }
  wait_for 60 slurmctld sh -c "scontrol ping | grep -q UP" || fail "slurmctld does not answer"
}

node_state() { timeout 10 sinfo -h -n "$HOST" -o %T 2>/dev/null | head -n 1; }

start_slurmd() {
  running slurmd || { STARTED+=(slurmd); slurmd -f "$CONF" </dev/null 9>&- >>"$LOG/slurmd.out" 2>&1 || { say "slurmd did not start"; return 1; }; }
  local end=$((SECONDS + 60)) st
  while :; do
    st=$(node_state)
    case "$st" in
      idle*|mixed*|allocated*|completing*) return 0 ;;
      down*|drain*|fail*) timeout 10 scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 ;;
    esac
    [ $SECONDS -ge $end ] && { say "node $HOST is '$st', not idle, after 60s"; return 1; }
    running slurmd || { say "slurmd exited"; return 1; }
    sleep 0.5
  done
}

# a one-task job through the whole path (ctld -> slurmd -> slurmstepd -> proctrack), bounded;
# its job id goes to $STATE/probe_job
probe_job() {
  timeout 60 srun -p main -n 1 -t 1 -J fastckpt-probe sh -c 'echo $SLURM_JOB_ID' >"$STATE/probe_job" 2>>"$LOG/probe.log"
}
# the probe job's record reached the accounting database
probe_accounted() { timeout 10 sacct -n -X -j "$(cat "$STATE/probe_job")" -o State 2>/dev/null | grep -q COMPLETED; }

# alive PID: the process exists and is not a zombie (init here may reap orphans only every few seconds)
alive() { [ -r "/proc/$1/status" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }

stop_pid() {  # stop_pid NAME SECONDS: SIGTERM, bounded wait, then SIGKILL
  local name=$1 limit=$2 pid end t
  pid=$(pid_of "$name") || { rm -f "$RUN/$name.pid"; return 0; }
  t=$(now)
  kill -TERM "$pid" 2>/dev/null
  end=$((SECONDS + limit))
  while alive "$pid" && [ $SECONDS -lt $end ]; do sleep 0.2; done
  if alive "$pid"; then
    say "$name ($pid) still running after ${limit}s: kill -9"
    kill -KILL "$pid" 2>/dev/null
    sleep 0.5
  fi
  rm -f "$RUN/$name.pid"
  say "$name stopped in $(since "$t")"
}

# ---------------------------------------------------------------- commands
cmd_up() {
  # the daemons run as root (SlurmUser=root; slurmd must be root to start jobs)
  if [ "$(id -u)" != 0 ]; then echo "[slurm] cannot start a Slurm cluster: not root"; exit 3; fi
  mkdir -p "$STATE" "$LOG"
  chmod 755 "$STATE"
  exec 9>"$STATE/lock"
  flock -w 600 9 || { say "another 'up' or 'down' holds $STATE/lock"; exit 1; }
  local t0 t
  t0=$(now)
  if running munged && running mariadb && running slurmdbd && running slurmctld && running slurmd &&
    timeout 20 sbatch --test-only -p main -n 1 --wrap true >/dev/null 2>&1; then
    say "already up (proctrack/$(cat "$STATE/proctrack.now")); checked in $(since "$t0")"
    return 0
  fi
  install
  mkdir -p "$ETC" "$RUN" "$SPOOL/ctld" "$SPOOL/d" "$MUNGE" "$DB"
  chmod 755 "$MUNGE"  # munged wants its socket's directory open to all (the key stays 600)
  chmod 700 "$DB"
  local proctrack
  if running slurmctld || running slurmd; then  # keep the configuration they run with
    proctrack=$(sed -n 's|^ProctrackType=proctrack/||p' "$CONF")
  else
    proctrack=$(choose_proctrack)
    write_config "$proctrack"
  fi
  t=$(now); start_munge; say "munged up in $(since "$t")"
  t=$(now); start_db; say "MariaDB up in $(since "$t")"
  t=$(now); start_dbd; say "slurmdbd up in $(since "$t")"
  t=$(now); start_ctld; say "slurmctld up in $(since "$t")"
  t=$(now)
  if ! { start_slurmd && say "slurmd up, node $HOST idle in $(since "$t")" && t=$(now) && probe_job; }; then
    if [ "$proctrack" = cgroup ] && [ -z "${FASTCKPT_SLURM_PROCTRACK:-}" ]; then
      say "slurmd or a job does not work with proctrack/cgroup here: falling back to proctrack/linuxproc"
      tail -n 5 "$LOG/slurmd.log" "$LOG/probe.log" 2>/dev/null
      stop_pid slurmd 20; stop_pid slurmctld 20
      proctrack=linuxproc
      write_config linuxproc
      start_ctld || fail "slurmctld does not answer"
      start_slurmd || fail "slurmd does not start (proctrack/linuxproc)"
      probe_job || fail "a one-task job does not run, even with proctrack/linuxproc"
    else
      fail "slurmd or a one-task job does not work (proctrack/$proctrack)"
    fi
  fi
  [ -n "${FASTCKPT_SLURM_PROCTRACK:-}" ] || echo "$proctrack" >"$STATE/proctrack"
  echo "$proctrack" >"$STATE/proctrack.now"
  say "probe job ran in $(since "$t")"
  wait_for 60 "the probe job in sacct" probe_accounted || fail "sacct does not show the probe job"
  say "accounting checked in $(since "$t")"
  say "up: cluster $CLUSTER, node $HOST, proctrack/$proctrack, accounting slurmdbd; total $(since "$t0")"
  say "SLURM_CONF=$CONF"
}

cmd_down() {
  mkdir -p "$STATE"
  exec 9>"$STATE/lock"
  flock -w 120 9 || say "could not take $STATE/lock in 120s: stopping anyway"
  local t0
  t0=$(now)
  if running slurmctld; then  # cancel the jobs first so no slurmstepd outlives its slurmd
    local jobs
    jobs=$(timeout 10 squeue -h -o %i 2>/dev/null)
    if [ -n "$jobs" ]; then
      timeout 10 scancel $jobs >/dev/null 2>&1
      wait_for 30 "jobs to end" sh -c '[ -z "$(squeue -h -o %i -t R,CG,S 2>/dev/null)" ]'
    fi
  fi
  stop_pid slurmd 20
  stop_pid slurmctld 20
  stop_pid slurmdbd 20
  stop_pid mariadb 30
  stop_pid munged 10
  say "down in $(since "$t0")"
}

cmd_status() {
  local d ok=0 pid
  for d in munged mariadb slurmdbd slurmctld slurmd; do
    if pid=$(pid_of "$d"); then echo "$d: running (pid $pid)"; else echo "$d: stopped"; ok=1; fi
  done
  [ -s "$STATE/proctrack.now" ] && echo "proctrack: proctrack/$(cat "$STATE/proctrack.now")"
  echo "SLURM_CONF=$CONF"
  if [ $ok = 0 ]; then
    echo "node $HOST: $(node_state)"
    if timeout 20 sbatch --test-only -p main -n 1 --wrap true >/dev/null 2>&1; then
      echo "cluster: accepts jobs"
      return 0
    fi
  fi
  echo "cluster: does not accept jobs"
  return 1
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 up|down|status|env   (state in \$SLURM_STATE_DIR, default /tmp/fastckpt-slurm)" >&2; exit 2 ;;
esac
