#!/usr/bin/env bash
# The builder benchmark: strata build against the usual ways of packing a tree, on the data sets of
# benches/make-data.sh. For each data set and tool: RUNS runs (default 3), each after waiting for an idle
# CPU and dropping the page cache; the median wall time, CPU time (user+sys of the whole command, children
# included) and stored bytes. Then the rebuild: `strata build minbase-up --parent <minbase layer>` into the
# store of each minbase run, the bytes it added against the bytes that changed between the two trees.
#
# Prints a markdown table and writes it to benches/results/build-<date>T<time>Z.md; the raw figures (one
# line a run) go to $BENCH_DATA/build-<date>T<time>Z.tsv, strata's --json outputs beside them.
#
# Environment: BENCH_DATA (default /var/tmp/strata-bench), RUNS (3), DATASETS ("minbase venv"),
# TOOLS ("strata tar-zstd mkfs.erofs mksquashfs mksquashfs-l3"), STRATA (the binary; default
# $CARGO_TARGET_DIR/release/strata, CARGO_TARGET_DIR defaulting to /var/tmp/strata-target), QUIET_MAX
# (seconds to wait for an idle CPU, 300), NO_DROP=1 to keep the page cache (quick trials only),
# KEEP_STORES=1 to keep the strata stores. Needs root (to drop the page cache).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
D=${BENCH_DATA:-/var/tmp/strata-bench}
RUNS=${RUNS:-3}
DATASETS=${DATASETS:-minbase venv}
TOOLS=${TOOLS:-strata tar-zstd mkfs.erofs mksquashfs mksquashfs-l3}
STRATA=${STRATA:-${CARGO_TARGET_DIR:-/var/tmp/strata-target}/release/strata}
stamp=$(date -u +%Y-%m-%dT%H%MZ)
OUT=$D/out                       # peers' outputs, replaced at each run
RAW=$D/build-$stamp.tsv
JSONDIR=$D/build-$stamp.json
mkdir -p "$OUT" "$JSONDIR" "$here/results"
: >"$RAW"
log() { printf '[build] %s\n' "$*" >&2; }

[[ -x /usr/bin/time ]] || apt-get install -y -q time >/dev/null
for d in $DATASETS; do
    [[ -e $D/$d.done ]] || { log "missing $D/$d: run benches/make-data.sh first"; exit 1; }
done
if [[ " $TOOLS " == *" strata "* && ! -x $STRATA ]]; then
    log "no strata binary at $STRATA (cargo build --release -p strata-tools): skipping strata"
    TOOLS=${TOOLS//strata/}
fi

drop_caches() {
    sync
    [[ ${NO_DROP:-} == 1 ]] || echo 3 >/proc/sys/vm/drop_caches
}

# Waits (up to QUIET_MAX seconds, default 300) until the machine is idle (under 15 % CPU busy over one
# second), so that other work (a compile, another benchmark) does not skew a measurement. Counts the
# measurements that could not wait for quiet in $noisy.
noisy=0
cpu_busy() { # percent busy over one second, from /proc/stat
    local a b
    a=($(head -n1 /proc/stat)); sleep 1; b=($(head -n1 /proc/stat))
    local idle=$(( (b[4] + b[5]) - (a[4] + a[5]) )) tot=0 i
    for i in 1 2 3 4 5 6 7 8; do tot=$(( tot + b[i] - a[i] )); done
    echo $(( tot > 0 ? 100 * (tot - idle) / tot : 0 ))
}
wait_quiet() {
    local start=$SECONDS
    while (( $(cpu_busy) >= 15 )); do
        if (( SECONDS - start >= ${QUIET_MAX:-300} )); then
            noisy=$((noisy + 1)); log "machine still busy after ${QUIET_MAX:-300}s: measuring anyway"
            return
        fi
    done
}

# timed FILE CMD...: runs CMD after dropping the page cache; writes "wall cpu" (seconds) to FILE.
timed() {
    local f=$1
    shift
    wait_quiet
    drop_caches
    /usr/bin/time -f '%e %U %S' -o "$f.t" "$@"
    awk '{printf "%.2f %.2f\n", $1, $2 + $3}' "$f.t" >"$f"
    rm -f "$f.t"
}

# Stored bytes of a local strata store: objects a reader needs (blobs, metadata, layer descriptors), not
# the local index or temporary files.
store_bytes() { (cd "$1" && du -sbc blobs meta layers 2>/dev/null | tail -n1 | cut -f1); }
jget() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval("d"+sys.argv[2]))' "$@"; }

t=$(mktemp)
trap 'rm -f "$t" "$t.t"' EXIT

# record DATASET TOOL RUN WALL CPU BYTES [EXTRA...]: one line of the raw figures.
record() { (IFS=$'\t'; echo "$*") >>"$RAW"; }

for ds in $DATASETS; do
    src=$D/$ds
    for r in $(seq 1 "$RUNS"); do
        for tool in $TOOLS; do
            rm -rf "${OUT:?}"/*
            case $tool in
            strata)
                store=$D/store-$ds-$r
                rm -rf "$store"
                j=$JSONDIR/$ds-$r.json
                timed "$t" "$STRATA" --store "file://$store" build "$src" --kind base --json >"$j"
                read -r wall cpu <"$t"
                # extra: stats.stored_bytes, metadata bytes, chunks, file_bytes
                record "$ds" strata "$r" "$wall" "$cpu" "$(store_bytes "$store")" \
                    "$(jget "$j" "['stats']['stored_bytes']")" \
                    "$(du -sbc "$store"/meta | tail -n1 | cut -f1)" \
                    "$(jget "$j" "['stats']['chunks']")" "$(jget "$j" "['stats']['file_bytes']")"
                ;;
            tar-zstd)
                timed "$t" bash -c 'tar -cf - -C "$1" . | zstd -q -3 -T0 >"$2"' _ "$src" "$OUT/out.tar.zst"
                read -r wall cpu <"$t"
                record "$ds" tar-zstd "$r" "$wall" "$cpu" "$(stat -c %s "$OUT/out.tar.zst")"
                ;;
            mkfs.erofs)
                timed "$t" mkfs.erofs --quiet --chunksize=1048576 --blobdev="$OUT/erofs.blob" \
                    "$OUT/erofs.meta" "$src"
                read -r wall cpu <"$t"
                record "$ds" mkfs.erofs "$r" "$wall" "$cpu" \
                    "$(( $(stat -c %s "$OUT/erofs.meta") + $(stat -c %s "$OUT/erofs.blob") ))" \
                    "$(stat -c %s "$OUT/erofs.meta")"
                ;;
            mksquashfs)
                timed "$t" mksquashfs "$src" "$OUT/out.sqfs" -comp zstd -noappend -processors 2 \
                    -quiet -no-progress
                read -r wall cpu <"$t"
                record "$ds" mksquashfs "$r" "$wall" "$cpu" "$(stat -c %s "$OUT/out.sqfs")"
                ;;
            mksquashfs-l3) # the same at zstd level 3 (mksquashfs's zstd default is level 15)
                timed "$t" mksquashfs "$src" "$OUT/out.sqfs" -comp zstd -Xcompression-level 3 -noappend \
                    -processors 2 -quiet -no-progress
                read -r wall cpu <"$t"
                record "$ds" mksquashfs-l3 "$r" "$wall" "$cpu" "$(stat -c %s "$OUT/out.sqfs")"
                ;;
            *) log "unknown tool $tool"; exit 1 ;;
            esac
            log "$ds $tool run $r: $(tail -n1 "$RAW" | cut -f4- | tr '\t' ' ')"
        done
    done
done
rm -rf "${OUT:?}"/*

# The rebuild after one package upgrade, into the store of each minbase run (each run starts from the
# same state: v1 only).
if [[ " $TOOLS " == *" strata "* && " $DATASETS " == *" minbase "* && -e $D/minbase-up.done ]]; then
    read -r changed _ <"$D/minbase-up.changed"
    for r in $(seq 1 "$RUNS"); do
        store=$D/store-minbase-$r
        parent=$(jget "$JSONDIR/minbase-$r.json" "['digest']")
        before=$(store_bytes "$store")
        j=$JSONDIR/minbase-up-$r.json
        timed "$t" "$STRATA" --store "file://$store" build "$D/minbase-up" --kind base \
            --parent "$parent" --json >"$j"
        read -r wall cpu <"$t"
        # extra: bytes added to the store (du), new chunks, new bytes, metadata bytes, bytes changed
        record minbase-up strata-rebuild "$r" "$wall" "$cpu" "$(jget "$j" "['stats']['stored_bytes']")" \
            "$(( $(store_bytes "$store") - before ))" "$(jget "$j" "['stats']['new_chunks']")" \
            "$(jget "$j" "['stats']['new_bytes']")" "$changed"
        log "rebuild run $r: $(tail -n1 "$RAW" | cut -f4- | tr '\t' ' ')"
    done
fi

# The stores hold about 1.2 copies of the compressed data each: keep them only on request.
[[ ${KEEP_STORES:-} == 1 ]] || rm -rf "$D"/store-*

# The table: the median of each column over the runs.
table=$(python3 "$here/build-table.py" "$RAW" "$D")
{
    echo "# Builder benchmark, $stamp"
    echo
    echo "Machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo) RAM," \
        "Linux $(uname -r), $(df -T "$D" | awk 'NR==2 {print $2}') on $(df "$D" | awk 'NR==2 {print $1}');" \
        "zstd $(zstd --version | grep -o 'v[0-9.]*' | head -n1)," \
        "erofs-utils $(dpkg-query -W -f='${Version}' erofs-utils)," \
        "squashfs-tools $(dpkg-query -W -f='${Version}' squashfs-tools)."
    echo
    echo "$table"
    if (( noisy > 0 )); then
        echo
        echo "**Warning:** $noisy measurement(s) started while other work kept the CPU over 15 % busy."
    fi
} | tee "$here/results/build-$stamp.md"
