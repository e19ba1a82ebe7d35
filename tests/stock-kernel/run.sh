# The stock-kernel tier's test, run by the guest's init (tests/stock-kernel/init) from the data drive:
# stratad on Debian 12's stock 6.1 kernel. For `auto` (which must pick `loop` there) and for `fuse`
# forced (when this stratad has it), on a state directory on the ext4 drive: start stratad, mount the
# image (two layers: a tricky tree, then whiteouts, an opaque directory and new files), compare the
# `treelist` listing of the sandbox with the host's listing of the tree it must equal, then read the
# whole tree again and again (page cache dropped) while the server is killed with SIGKILL, and check
# the reader ended without error within a deadline — a hung read is reported as HANG, and the FUSE
# connection aborted so the run can go on. Before that: cold reads of the bench files through the
# mode (stratad started with --no-prefetch, so the first read fetches from the store), and (once) through
# kernel EROFS on loop devices of a materialized copy of the layer.
# Each result is a console line `strata-61: ...`; the last one is `strata-61: PASS` or
# `strata-61: FAIL <count>`.

B=/data/bin
IMG=$(cat /data/image)
export STRATA_INDEX_CACHE=/data/index-cache STRATA_LOG=warn
STORE=file:///data/store
fails=0
say() { echo "strata-61: $*"; }
fail() { say "FAIL $*"; fails=$((fails + 1)); }
# Centiseconds since boot (busybox's date has no %N).
cs() { read -r up _ < /proc/uptime; echo "${up%.*}${up#*.}"; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
# cold FILE...: prints "NAME MiB/s (ms)" per file, page cache dropped before each read.
cold() {
  for f in "$@"; do
    drop
    size=$(wc -c < "$f")
    [ "$size" -gt 0 ] || continue
    t0=$(cs); cat "$f" > /dev/null || { echo "${f##*/} read error"; continue; }; t1=$(cs)
    ms=$(( (t1 - t0) * 10 ))
    [ "$ms" -gt 0 ] || ms=10
    echo "${f##*/} $((size / 1048576))MiB ${ms}ms $((size * 1000 / ms / 1048576))MiB/s"
  done
}
status_field() { # status_field SOCKET KEY: a top-level field of GET /v1/status
  $B/strata --socket "$1" daemon status 2>/dev/null | tr -d ' \n' | grep -o "\"$2\":[^,}]*" | head -1 | cut -d: -f2 | tr -d '"'
}

mode_test() { # mode_test MODE(auto|fuse) WANT
  mode=$1
  want=$2
  state=/data/state-$mode
  run=/run/strata-$mode
  sock=$run/stratad.sock
  mkdir -p "$state"
  report=$($B/stratad --config /dev/null --check --mount-mode "$mode" --state-dir "$state" 2>&1)
  rc=$?
  echo "$report" | sed "s/^/strata-61: check $mode: /"
  if [ $rc -ne 0 ]; then
    if echo "$report" | grep -q "not built"; then
      say "SKIP $mode: this stratad has no $mode mode yet ($(echo "$report" | grep "not built" | head -1))"
      return
    fi
    fail "$mode: stratad --check exits $rc"
    return
  fi
  $B/stratad --config /dev/null --store $STORE --state-dir "$state" --runtime-dir "$run" \
    --mount-mode "$mode" --no-prefetch > "/data/stratad-$mode.log" 2>&1 &
  holder=$!
  i=0
  until [ -S "$sock" ] && $B/strata --socket "$sock" daemon status > /dev/null 2>&1; do
    i=$((i + 1))
    [ $i -gt 600 ] && { fail "$mode: stratad did not start: $(tail -5 /data/stratad-$mode.log)"; return; }
    sleep 0.1
  done
  got=$(status_field "$sock" mount_mode)
  say "$mode: stratad runs in mount mode $got"
  [ "$got" = "$want" ] || fail "$mode: mount_mode is $got, not $want"
  mnt=$($B/strata --socket "$sock" --store $STORE mount "$IMG" --sandbox "s-$mode" 2>/tmp/mount.err) \
    || { fail "$mode: strata mount: $(cat /tmp/mount.err)"; return; }
  say "$mode: mounted $IMG at $mnt"
  cold "$mnt"/bench/* | sed "s/^/strata-61: bench $mode cold: /"
  cold "$mnt"/bench/* | sed "s/^/strata-61: bench $mode chunk-cached: /"
  if $B/treelist "$mnt" > /tmp/got 2>/tmp/treelist.err && cmp -s /tmp/got /data/expected.txt; then
    say "$mode: the mounted image lists and reads identical to its source ($(wc -l < /tmp/got) entries)"
  else
    fail "$mode: listing differs: $(cat /tmp/treelist.err | head -3)"
    diff /data/expected.txt /tmp/got | head -20
  fi
  # In fuse mode the layer's own tree connection is killed with the server too: the holder keeps it,
  # and the successor answers what the dead server left open from its journal (no FUSE_NOTIFY_RESEND
  # before 6.9).
  kill9 "$mode" "$sock" "$mnt"
  $B/strata --socket "$sock" umount --sandbox "s-$mode" --purge > /dev/null 2>&1 || fail "$mode: strata umount"
  kill -TERM "$holder" 2>/dev/null
}

kill9() { # kill9 MODE SOCKET MOUNT: readers of the whole tree while the server is killed twice
  mode=$1
  sock=$2
  mnt=$3
  t0=$(cs)
  (
    for pass in 1 2 3 4; do
      echo "pass $pass of 4, $(( ($(cs) - t0) * 10 )) ms after the start" > /tmp/reader.pass
      drop
      $B/treelist "$mnt" > /tmp/pass 2> /tmp/pass.err || { echo "pass $pass: $(head -2 /tmp/pass.err)"; exit 1; }
      cmp -s /tmp/pass /data/expected.txt || { echo "pass $pass: wrong listing"; exit 1; }
    done
  ) > /tmp/reader.out 2>&1 &
  reader=$!
  for k in 1 2; do
    sleep 1
    old=$(status_field "$sock" pid)
    [ -n "$old" ] || { fail "$mode: no server pid in status"; break; }
    kill -9 "$old"
    i=0
    while new=$(status_field "$sock" pid); [ -z "$new" ] || [ "$new" = "$old" ]; do
      i=$((i + 1))
      [ $i -gt 300 ] && { fail "$mode: no new server 30 s after kill -9 of $old"; break; }
      sleep 0.1
    done
    say "$mode: server $old killed with SIGKILL $(( ($(cs) - t0) * 10 )) ms after the start, server $new answers"
  done
  i=0
  while kill -0 "$reader" 2>/dev/null && [ $i -lt 600 ]; do
    sleep 0.1
    i=$((i + 1))
  done
  if kill -0 "$reader" 2>/dev/null; then
    fail "$mode: HANG: the reader did not finish within 60 s of the kills (on $(cat /tmp/reader.pass 2>/dev/null || echo '?'))"
    for p in /proc/[0-9]*; do
      c=$(tr '\0' ' ' < "$p/cmdline" 2>/dev/null)
      case "$c" in *treelist*|*cat*) echo "  ${p#/proc/} $(grep State "$p/status") wchan=$(cat "$p/wchan") $c" ;; esac
    done
    for c in /sys/fs/fuse/connections/*/abort; do echo 1 > "$c"; done
    sleep 1
    return
  fi
  wait "$reader"
  rc=$?
  t1=$(cs)
  if [ $rc -eq 0 ]; then
    say "$mode: 4 reads of the whole tree under 2 kill -9 of the server: no error, no hang ($(( (t1 - t0) * 10 )) ms)"
  else
    fail "$mode: the reader failed under kill -9: $(cat /tmp/reader.out)"
  fi
}

demo_test() { # scripts/demo-run, the very file: what scripts/demo does once the machine is set up and built
  if STRATA_BIN=$B DEMO_DIR=/data/demo sh /data/demo-run > /data/demo.out 2>&1 &&
    grep -q 'NAME="strata demo"' /data/demo.out && grep -q 'mount mode: loop' /data/demo.out; then
    say "demo: scripts/demo-run unchanged: built, mounted ($(grep -o 'mount mode: [a-z]*' /data/demo.out)), and bwrap ran a command in the sandbox on this kernel"
  else
    fail "demo: scripts/demo-run: $(tail -5 /data/demo.out)"
  fi
}

say "kernel $(uname -r)"
mode_test auto loop
mode_test fuse fuse
demo_test

# Kernel EROFS on loop devices of a materialized copy of the bench layer (no stratad).
if [ -f /data/materialized/meta.erofs ]; then
  opts=ro
  # busybox's losetup has no --show: take the first free device, then bind it.
  bind() { l=$(losetup -f) && losetup -r "$l" "$1" && echo "$l"; }
  for d in /data/materialized/devices/*; do
    opts="$opts,device=$(bind "$d")"
  done
  meta=$(bind /data/materialized/meta.erofs)
  mkdir -p /tmp/mat
  if mount -t erofs -o "$opts" "$meta" /tmp/mat; then
    cold /tmp/mat/bench/* | sed "s/^/strata-61: bench erofs-materialized cold: /"
    umount /tmp/mat
  else
    fail "mounting the materialized layer ($opts)"
  fi
fi

if [ $fails -eq 0 ]; then say PASS; else say "FAIL $fails"; fi
[ $fails -eq 0 ]
