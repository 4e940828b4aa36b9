#!/bin/bash
# The SLURM relay of a container job (lmcore.slurm.relay): started by the batch script on
# the host, it runs the ranks' SLURM commands for them. $1: the job's relay directory; $2: the
# batch shell's pid: the relay ends when that shell has (SLURM ends the job's steps then).
# One background subshell per request, so that a slow sacct does not hold up a requeue. The job's
# signals are ignored: a preemption's SIGTERM leaves it serving the requeue that follows.
d=$1
watch=${2:-$PPID}
trap '' TERM INT HUP USR1 USR2
mkdir -p -- "$d" && rm -f -- "$d"/* || exit 1
exec {tick}<> <(:)  # `read -t` on it sleeps without starting a process
while kill -0 "$watch" 2>/dev/null; do
  for req in "$d"/*.args; do
    [ -e "$req" ] || continue
    id=${req%.args}
    mv -- "$req" "$id.run" 2>/dev/null || continue
    (
      mapfile -d '' -t argv < "$id.run"
      input=/dev/null; [ -e "$id.in" ] && input=$id.in
      case ${argv[0]-} in
        scontrol|sacct|sinfo|squeue|scancel)
          timeout -k 5 120 "${argv[@]}" < "$input" > "$id.out" 2> "$id.err"; rc=$? ;;
        *) printf 'the host relays only scontrol, sacct, sinfo, squeue and scancel, not %q\n' "${argv[0]-}" > "$id.err"
           : > "$id.out"; rc=126 ;;
      esac
      echo "$rc" > "$id.rc.tmp" && mv -- "$id.rc.tmp" "$id.rc"
    ) &
  done
  read -r -t 0.05 -u "$tick" _ || true
done
