#!/usr/bin/env bash
# Store-wide dedup on the fat image (benches/make-fat.sh): the tree built into a store that already holds
# it, without --parent, from the directory and from a tar stream of it (whose blob differs from the
# directory build's: files come in tar order), against the peers in the same run: the first build, the tar
# stream with --parent (the old way to dedup) and with --no-dedup (what a build without --parent stored
# before the index).
# For each: wall time, CPU time, and the bytes the store grew by (every object: blobs, index segments,
# metadata, layers, manifests, tags; a metadata object already there is not written again).
#
# Environment: BENCH_DATA (default /var/tmp/strata-bench), STRATA (default
# $CARGO_TARGET_DIR/release/strata), NO_DROP=1 to keep the page cache between builds (root needed
# otherwise). Prints a markdown table (and writes it to benches/results/dedup-<date>.md).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
D=${BENCH_DATA:-/var/tmp/strata-bench}
STRATA=${STRATA:-${CARGO_TARGET_DIR:-/var/tmp/strata-target}/release/strata}
src=$D/fat
[[ -e $D/fat.done ]] || { echo "missing $src: run benches/make-fat.sh first" >&2; exit 1; }
[[ -x /usr/bin/time ]] || apt-get install -y -q time >/dev/null
W=$D/dedup
rm -rf "$W"
mkdir -p "$W" "$here/results"
store=$W/store
export STRATA_INDEX_CACHE=$W/cache
bytes() { (cd "$store" && du -sbc blobs meta layers manifests index tags 2>/dev/null | tail -n1 | cut -f1); }
drop() { sync; [[ ${NO_DROP:-} == 1 ]] || echo 3 >/proc/sys/vm/drop_caches; }
rows=()
# run NAME dir|tar ARGS...: one build, timed, with the store's growth.
run() {
    local name=$1 how=$2
    shift 2
    drop
    local before
    before=$(bytes 2>/dev/null || echo 0)
    local shown
    if [[ $how == tar ]]; then
        /usr/bin/time -f '%e %U %S' -o "$W/t" bash -c 'tar -C "$1" -cf - . | "$2" --store "file://$3" build --tar - --json "${@:4}"' \
            _ "$src" "$STRATA" "$store" "$@" >"$W/$name.json"
        shown="tar -C fat -cf - . \\| strata build --tar - $*"
    else
        /usr/bin/time -f '%e %U %S' -o "$W/t" "$STRATA" --store "file://$store" build "$src" --json "$@" >"$W/$name.json"
        shown="strata build fat $*"
    fi
    local after
    after=$(bytes)
    read -r wall u s <"$W/t"
    local cpu
    cpu=$(echo "$u + $s" | bc)
    local extra
    extra=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); i=d.get("index",{}); print("%.1f MB new chunk bytes, %d foreign blobs" % (d["stats"]["new_bytes"]/1e6, i.get("foreign_blobs",0)))' "$W/$name.json")
    rows+=("| $name | \`$shown\` | ${wall} s | ${cpu} s | $(( after - before )) | $extra |")
}
run first dir -t fat:v1
run again dir -t fat:v2
run tar tar -t fat:v3
run tar-parent tar -t fat:v4 --parent fat:v1 --no-dedup
run tar-no-dedup tar -t fat:v5 --no-dedup
{
    echo "| build | command | wall | CPU | store grew by (bytes) | notes |"
    echo "|---|---|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
} | tee "$here/results/dedup-$(date -u +%Y-%m-%dT%H%MZ).md"
