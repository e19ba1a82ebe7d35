# The guest side of benches/stock-guest.py, run as /data/run.sh by tests/stock-kernel/init inside Debian
# 12's stock 6.1 kernel (busybox sh; its output goes to the console, read by the host script).
#
# For ROUNDS rounds (from /data/bench.conf, with IMAGE and the arms' order), each round running every arm
# once, the order rotated from round to round:
#   loop    a fresh stratad (empty state directory on /data: empty chunk cache, --no-prefetch so no plan
#           is warmed) in `loop` mode on the file:// store /data/store; `strata mount IMAGE`; page cache
#           dropped; `python3 -c 'import numpy, pandas'` in the sandbox rootfs; stratad stopped, its
#           state removed
#   fuse    the same with `--mount-mode fuse`
#   kernel  kernel EROFS on loop devices (read-only) of the materialized copy /data/fat-mat (meta.erofs,
#           devices/N; multi-device, as 6.1 has no file-backed mounts); page cache dropped; the same import
#           in the mount (read-only); unmounted, loop devices detached
# The import runs under bubblewrap (the sandbox rootfs as /, as benches/coldstart.py), or under chroot
# when bubblewrap cannot start a command in the image here (said on a `runner` line). The page cache is
# dropped before each mount and again before each import. Times are centiseconds of /proc/uptime.
#
# Console lines (all prefixed `strata-61: `):
#   runner bwrap|chroot ...
#   start arm=A round=N                        just before the timed import (the host times it too)
#   end arm=A round=N                          just after it
#   bench arm=A round=N mount_s=S import_s=S rc=C [fetched=B unattributed=B cache_used=B mode=M]
#   bench arm=A round=N error=WORD ...         an arm that could not be measured
#   median arm=A import_s=S mount_s=S runs=N
#   done

B=/data/bin
. /data/bench.conf
STORE=file:///data/store
MAT=/data/fat-mat
W=/data/work
WORKLOAD='import numpy, pandas'
GUEST_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export STRATA_LOG=warn
mkdir -p $W /tmp/kmnt
: > $W/results

say() { echo "strata-61: $*"; }
# Centiseconds since boot (busybox's date has no %N).
cs() { read -r up _ < /proc/uptime; echo "${up%.*}${up#*.}"; }
secs() { printf '%d.%02d' $(($1 / 100)) $(($1 % 100)); }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
status_field() { # status_field SOCKET KEY: a top-level field of GET /v1/status
  $B/strata --socket "$1" daemon status 2>/dev/null | tr -d ' \n' | grep -o "\"$2\":[^,}]*" | head -1 | cut -d: -f2 | tr -d '"'
}

# run_in ROOT ro|rw: the workload in ROOT as its root filesystem.
run_in() {
  if [ "$RUNNER" = bwrap ]; then
    if [ "$2" = ro ]; then bind=--ro-bind; else bind=--bind; fi
    $B/bwrap $bind "$1" / --proc /proc --dev /dev --unshare-pid --die-with-parent \
      --setenv PATH $GUEST_PATH -- python3 -c "$WORKLOAD"
  else
    mount -t proc proc "$1/proc" 2>/dev/null
    chroot "$1" /usr/bin/env PATH=$GUEST_PATH python3 -c "$WORKLOAD"
    rc=$?
    umount "$1/proc" 2>/dev/null
    return $rc
  fi
}

# The kernel arm's mount: loop devices (read-only, bound by busybox's losetup: buffered) of the
# materialized copy, devices in their table's order.
bind() { l=$(losetup -f) && losetup -r "$l" "$1" && echo "$l"; }
detach() { # detach PREFIX...: the loop devices whose backing file is under one of the PREFIXes
  for f in /sys/block/loop*/loop/backing_file; do
    [ -f "$f" ] || continue
    b=$(cat "$f")
    for p in "$@"; do
      case "$b" in "$p"*) d=${f%/loop/backing_file}; losetup -d "/dev/${d##*/}" 2>/dev/null ;; esac
    done
  done
}
kernel_mount() {
  opts=ro
  for n in $(ls $MAT/devices | sort -n); do
    d=$(bind $MAT/devices/$n) || return 1
    opts="$opts,device=$d"
  done
  meta=$(bind $MAT/meta.erofs) || return 1
  mount -t erofs -o "$opts" "$meta" /tmp/kmnt
}
kernel_umount() {
  umount /tmp/kmnt 2>/dev/null
  detach $MAT
}

# Which runner works in this guest: bubblewrap first, chroot else.
RUNNER=
if kernel_mount; then
  if out=$($B/bwrap --ro-bind /tmp/kmnt / --proc /proc --dev /dev --unshare-pid --die-with-parent \
      --setenv PATH $GUEST_PATH -- python3 -c 'import sys; print(sys.version.split()[0])' 2>&1); then
    RUNNER=bwrap
    say "runner bwrap (python $out)"
  else
    say "runner: bubblewrap fails here: $(echo "$out" | head -3 | tr '\n' ' ')"
    if out=$(chroot /tmp/kmnt /usr/bin/env PATH=$GUEST_PATH python3 -c 'import sys; print(sys.version.split()[0])' 2>&1); then
      RUNNER=chroot
      say "runner chroot (python $out)"
    else
      say "runner: chroot fails too: $(echo "$out" | head -3 | tr '\n' ' ')"
    fi
  fi
  kernel_umount
else
  say "error: the materialized copy does not mount with kernel EROFS"
fi
[ -n "$RUNNER" ] || { say done; exit 1; }

# timed_import ARM ROUND ROOT ro|rw: prints "IMPORT_CS RC" (output of the import in $W/import-ARM-ROUND).
timed_import() {
  drop
  say "start arm=$1 round=$2" > /dev/console
  t0=$(cs)
  run_in "$3" "$4" > "$W/import-$1-$2" 2>&1
  rc=$?
  t1=$(cs)
  say "end arm=$1 round=$2" > /dev/console
  echo "$((t1 - t0)) $rc"
}

result() { # result ARM ROUND MOUNT_CS IMPORT_CS RC [EXTRA]
  say "bench arm=$1 round=$2 mount_s=$(secs $3) import_s=$(secs $4) rc=$5 $6"
  [ "$5" = 0 ] && echo "$1 $3 $4" >> $W/results
  [ "$5" = 0 ] || say "import output: $(tail -3 "$W/import-$1-$2" | tr '\n' ' ')"
}

kernel_arm() { # kernel_arm ROUND
  drop
  t0=$(cs)
  kernel_mount || { say "bench arm=kernel round=$1 error=mount"; kernel_umount; return; }
  t1=$(cs)
  set -- "$1" $(timed_import kernel "$1" /tmp/kmnt ro)
  result kernel "$1" $((t1 - t0)) "$2" "$3"
  kernel_umount
}

daemon_arm() { # daemon_arm MODE ROUND
  mode=$1
  r=$2
  state=$W/state-$mode-$r
  run=/run/strata-$mode-$r
  sock=$run/stratad.sock
  rm -rf "$state" "$run"
  mkdir -p "$state"
  STRATA_INDEX_CACHE=$W/index-$mode-$r $B/stratad --config /dev/null --store $STORE --state-dir "$state" \
    --runtime-dir "$run" --mount-mode "$mode" --no-prefetch > "$W/stratad-$mode-$r.log" 2>&1 &
  holder=$!
  i=0
  until [ -S "$sock" ] && $B/strata --socket "$sock" daemon status > /dev/null 2>&1; do
    i=$((i + 1))
    if [ $i -gt 1200 ] || ! kill -0 $holder 2>/dev/null; then
      say "bench arm=$mode round=$r error=start $(tail -3 "$W/stratad-$mode-$r.log" | tr '\n' ' ')"
      daemon_stop
      return
    fi
    sleep 0.1
  done
  got=$(status_field "$sock" mount_mode)
  if [ "$got" != "$mode" ]; then
    say "bench arm=$mode round=$r error=mode stratad runs in mode $got"
    daemon_stop
    return
  fi
  drop
  t0=$(cs)
  mnt=$($B/strata --socket "$sock" --store $STORE mount "$IMAGE" --sandbox s 2> "$W/mount.err")
  mrc=$?
  t1=$(cs)
  if [ $mrc -ne 0 ]; then
    say "bench arm=$mode round=$r error=mount $(tail -3 "$W/mount.err" | tr '\n' ' ')"
    daemon_stop
    return
  fi
  set -- "$mode" "$r" $(timed_import "$mode" "$r" "$mnt" rw)
  # Bytes fetched from the store: for the sandbox (its misses through the tree), for no sandbox (in
  # loop mode the loop devices' reads of the blob files), and the chunk cache's size afterwards.
  ps=$($B/strata --socket "$sock" ps --json 2>/dev/null | tr -d ' \n')
  fetched=$(echo "$ps" | grep -o '"fetched_bytes":[0-9]*' | head -1 | cut -d: -f2)
  unattr=$(echo "$ps" | grep -o '"fetched_unattributed":[0-9]*' | head -1 | cut -d: -f2)
  cache=$(echo "$ps" | grep -o '"cache":{[^}]*}' | grep -o '"used":[0-9]*' | head -1 | cut -d: -f2)
  result "$mode" "$r" $((t1 - t0)) "$3" "$4" "fetched=${fetched:-?} unattributed=${unattr:-?} cache_used=${cache:-?} mode=$got"
  daemon_stop
}

daemon_stop() { # stops the arm's stratad; removes whatever it left mounted, its loop devices, its state
  [ -S "$sock" ] && $B/strata --socket "$sock" rm --force s > /dev/null 2>&1
  kill -TERM $holder 2>/dev/null
  i=0
  while kill -0 $holder 2>/dev/null && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done
  kill -0 $holder 2>/dev/null && { say "stratad $mode did not stop in 60 s: SIGKILL"; kill -9 $holder; }
  wait $holder 2>/dev/null
  for m in $(awk '{print $2}' /proc/mounts | grep -e "^$run" -e "^$state" | sort -r); do
    umount -l "$m" 2>/dev/null
  done
  detach "$run" "$state"
  rm -rf "$state" "$run" "$W/index-$mode-$r"
}

say "kernel $(uname -r), $(grep -c ^processor /proc/cpuinfo) CPUs, $(awk '/MemTotal/ {print $2 / 1024 " MiB"}' /proc/meminfo), image $IMAGE, $ROUNDS rounds of: $ARMS"
r=1
while [ $r -le "$ROUNDS" ]; do
  # Rotate the order by one arm per round.
  set -- $ARMS
  k=1
  while [ $k -lt $r ]; do first=$1; shift; set -- "$@" "$first"; k=$((k + 1)); done
  for arm in "$@"; do
    case "$arm" in
      kernel) kernel_arm $r ;;
      *) daemon_arm "$arm" $r ;;
    esac
  done
  r=$((r + 1))
done

for arm in $ARMS; do
  awk -v a="$arm" '
    BEGIN { n = 0 }
    $1 == a { m[n] = $2; i[n] = $3; n++ }
    function med(v, n,   j, k, t) {
      for (j = 0; j < n; j++) for (k = j + 1; k < n; k++) if (v[k] < v[j]) { t = v[j]; v[j] = v[k]; v[k] = t }
      return n % 2 ? v[(n - 1) / 2] : (v[n / 2 - 1] + v[n / 2]) / 2
    }
    END { if (n) printf "strata-61: median arm=%s import_s=%.2f mount_s=%.2f runs=%d\n", a, med(i, n) / 100, med(m, n) / 100, n }
  ' $W/results
done
say done
