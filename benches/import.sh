#!/usr/bin/env bash
# The OCI import benchmark (issue 5): `strata import` of a realistic multi-layer OCI image, its wall time
# and the bytes it stores against the size of the image's OCI blobs, with `umoci unpack` of the same
# image (the usual way a runtime turns it into a rootfs) measured in the same run as the peer.
#
# The image is built once with umoci from the debootstrap trees of benches/make-data.sh, as a three-layer
# image would come from a registry: layer 1 = Debian minbase without /usr/share, layer 2 = /usr/share,
# layer 3 = the upgrade to minbase-up (rsync --delete: changed packages, deleted files become whiteouts).
# umoci writes gzip layers, as registries serve them.
#
# Each of RUNS runs (default 3) drops the page cache before each measurement and measures:
#   import      strata import into an empty local store (every layer built)
#   umoci       umoci unpack of the same image into an empty directory (the peer)
#   reimport    strata import of the same image again (every layer reused: blobs only verified)
#   flatten     strata import --flatten into the store of `import` (layers reused, one layer made)
# and prints a markdown table of medians (also written to benches/results/import-<stamp>.md).
#
# Environment: BENCH_DATA (default /var/tmp/strata-bench), RUNS (3), STRATA (default
# $CARGO_TARGET_DIR/release/strata, CARGO_TARGET_DIR defaulting to /var/tmp/strata-target), NO_DROP=1 to
# keep the page cache (quick trials only). Needs root (page cache, device nodes), umoci, rsync.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
D=${BENCH_DATA:-/var/tmp/strata-bench}
RUNS=${RUNS:-3}
STRATA=${STRATA:-${CARGO_TARGET_DIR:-/var/tmp/strata-target}/release/strata}
W=$D/oci-import
stamp=$(date -u +%Y-%m-%dT%H%MZ)
log() { printf '[import] %s\n' "$*" >&2; }
# shellcheck source=benches/lib.sh
. "$here/lib.sh"

for d in minbase minbase-up; do
    [[ -e $D/$d.done ]] || { log "missing $D/$d: run benches/make-data.sh first"; exit 1; }
done
[[ -x $STRATA ]] || { log "no strata binary at $STRATA (cargo build --release --workspace)"; exit 1; }
for c in umoci rsync; do
    command -v $c >/dev/null || { log "$c is not installed (apt-get install $c)"; exit 1; }
done


# The image, once.
L=$W/layout
if [[ ! -e $W/image.done ]]; then
    log "building the OCI image in $L"
    rm -rf "$W" && mkdir -p "$W"
    umoci init --layout "$L"
    umoci new --image "$L:minbase"
    umoci unpack --image "$L:minbase" "$W/bundle" >/dev/null
    R=$W/bundle/rootfs
    rsync -aHAX --exclude=/usr/share "$D/minbase/" "$R/"
    umoci repack --refresh-bundle --image "$L:minbase" "$W/bundle"
    rsync -aHAX "$D/minbase/usr/share/" "$R/usr/share/"
    umoci repack --refresh-bundle --image "$L:minbase" "$W/bundle"
    rsync -aHAX --delete "$D/minbase-up/" "$R/"
    umoci repack --refresh-bundle --image "$L:minbase" "$W/bundle"
    umoci config --image "$L:minbase" --config.cmd /bin/bash --config.env PATH=/usr/bin:/bin
    rm -rf "$W/bundle"
    touch "$W/image.done"
fi

# Blob and uncompressed sizes of the layers.
read -r blob_bytes layer_bytes tar_bytes nlayers < <(python3 - "$L" <<'EOF'
import gzip, json, os, sys
L = sys.argv[1]
blob = lambda d: os.path.join(L, 'blobs', 'sha256', d.split(':')[1])
idx = json.load(open(os.path.join(L, 'index.json')))
m = idx['manifests'][0]
man = json.load(open(blob(m['digest'])))
layers = sum(l['size'] for l in man['layers'])
tars = 0
for l in man['layers']:
    with gzip.open(blob(l['digest'])) as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                break
            tars += len(b)
print(m['size'] + man['config']['size'] + layers, layers, tars, len(man['layers']))
EOF
)
log "image: $nlayers layers, $layer_bytes bytes of layer blobs, $tar_bytes bytes of tar"

RAW=$W/import-$stamp.tsv
: >"$RAW"

for run in $(seq "$RUNS"); do
    log "run $run/$RUNS (load: $(cut -d' ' -f1-3 /proc/loadavg))"
    rm -rf "$W/store" "$W/unpacked"
    measure import "$STRATA" --store "file://$W/store" import "oci:$L:minbase" -t bench/minbase:v1 --json
    cp "$W/import.out" "$W/import-$run.json"
    printf 'stored\t%s\n' "$(du -sb "$W/store" | cut -f1)" >>"$RAW"
    measure umoci umoci unpack --image "$L:minbase" "$W/unpacked"
    measure reimport "$STRATA" --store "file://$W/store" import "oci:$L:minbase" -t bench/minbase:v2 --json
    measure flatten "$STRATA" --store "file://$W/store" import "oci:$L:minbase" -t bench/minbase:flat --flatten --json
    cp "$W/flatten.out" "$W/flatten-$run.json"
    printf 'stored_after_flatten\t%s\n' "$(du -sb "$W/store" | cut -f1)" >>"$RAW"
done
rm -rf "$W/unpacked"

table=$(python3 - "$RAW" "$blob_bytes" "$layer_bytes" "$tar_bytes" "$nlayers" "$W" "$RUNS" <<'EOF'
import json, statistics, sys
raw, blob, layers, tars, n, W, runs = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6], int(sys.argv[7])
rows = {}
for line in open(raw):
    name, rest = line.rstrip('\n').split('\t')
    rows.setdefault(name, []).append([float(x) for x in rest.split()])
med = lambda name, i=0: statistics.median(r[i] for r in rows[name])
imp = [json.load(open(f'{W}/import-{r}.json')) for r in range(1, runs + 1)]
flat = [json.load(open(f'{W}/flatten-{r}.json')) for r in range(1, runs + 1)]
stored = statistics.median(j['stored_bytes'] for j in imp)
flat_stored = statistics.median(j['stored_bytes'] for j in flat)
mib = lambda b: f'{b / 2**20:.1f} MiB'
print(f'Image: {n} gzip layers (umoci), {mib(layers)} of layer blobs ({mib(blob)} with manifest and config), '
      f'{mib(tars)} of uncompressed tar. Medians of {runs} runs, page cache dropped before each.\n')
print('| step | wall | CPU (user+sys) | stored | vs OCI blobs |')
print('|---|---|---|---|---|')
cpu = lambda name: med(name, 1) + med(name, 2)
print(f"| `strata import` into an empty store | {med('import'):.2f} s | {cpu('import'):.2f} s | "
      f"{mib(stored)} (store on disk {mib(med('stored'))}) | {stored / blob:.2f}x |")
print(f"| `umoci unpack` (peer, same image) | {med('umoci'):.2f} s | {cpu('umoci'):.2f} s | "
      f"{mib(tars)} of files (uncompressed) | — |")
print(f"| `strata import` again (all layers reused) | {med('reimport'):.2f} s | {cpu('reimport'):.2f} s | 0 | — |")
print(f"| `strata import --flatten` (layers reused, one layer made) | {med('flatten'):.2f} s | "
      f"{cpu('flatten'):.2f} s | {mib(flat_stored)} | — |")
import os
blob = lambda d: os.path.join(W, 'layout', 'blobs', 'sha256', d.split(':')[1])
idx = json.load(open(os.path.join(W, 'layout', 'index.json')))
man = json.load(open(blob(idx['manifests'][0]['digest'])))
print('\n| layer | OCI blob (gzip) | strata stored (zstd chunks + metadata) | entries | whiteouts |')
print('|---|---|---|---|---|')
for n, (l, s) in enumerate(zip(man['layers'], imp[0]['layers']), 1):
    print(f"| {n} | {mib(l['size'])} | {mib(s['stored_bytes'])} ({s['stored_bytes'] / l['size']:.2f}x) | "
          f"{s['entries']} | {s['whiteouts']} |")
EOF
)
mkdir -p "$here/results"
printf '%s\n' "$table" | tee "$here/results/import-$stamp.md"
log "raw figures: $RAW; JSON outputs in $W"
