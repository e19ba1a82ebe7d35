#!/usr/bin/env bash
# The registry pull benchmark (issue 11): `strata import docker://…` of the fat image from a registry on
# loopback, against the usual way to get a rootfs from a registry — `skopeo copy docker://… oci:…` then
# `umoci unpack` — measured in the same run.
#
# The fat tree (benches/make-fat.sh: $BENCH_DATA/fat) is made once into a one-layer gzip OCI image with
# umoci and pushed with skopeo into Debian's docker-registry (the CNCF distribution server), which this
# script starts on a free loopback port with its storage in $W/registry (kept between runs of the script).
#
# Each of RUNS runs (default 3) drops the page cache before each measurement and measures:
#   import      strata import docker://… into an empty local store (layer streamed, verified, built)
#   skopeo      skopeo copy docker://… oci:DIR (the peer's download, into an empty layout)
#   umoci       umoci unpack of that layout into an empty directory (the peer's extraction)
#   reimport    strata import docker://… again (the layer is reused: only manifest and config fetched)
# and prints a markdown table of medians (also written to benches/results/registry-<stamp>.md).
#
# Environment: BENCH_DATA (default /var/tmp/strata-bench), RUNS (3), STRATA (default
# $CARGO_TARGET_DIR/release/strata), NO_DROP=1 to keep the page cache (quick trials only). Needs root,
# umoci, skopeo, docker-registry, curl.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
D=${BENCH_DATA:-/var/tmp/strata-bench}
RUNS=${RUNS:-3}
STRATA=${STRATA:-${CARGO_TARGET_DIR:-/var/tmp/strata-target}/release/strata}
W=$D/registry-pull
stamp=$(date -u +%Y-%m-%dT%H%MZ)
log() { printf '[registry] %s\n' "$*" >&2; }
# shellcheck source=benches/lib.sh
. "$here/lib.sh"

[[ -e $D/fat.done ]] || { log "missing $D/fat: run benches/make-fat.sh first"; exit 1; }
[[ -x $STRATA ]] || { log "no strata binary at $STRATA (cargo build --release -p strata-tools)"; exit 1; }
for c in umoci skopeo docker-registry curl; do
    command -v $c >/dev/null || { log "$c is not installed (scripts/setup installs it)"; exit 1; }
done
mkdir -p "$W"


# The image, once.
L=$W/layout
if [[ ! -e $W/image.done ]]; then
    log "building the OCI image of $D/fat in $L"
    rm -rf "$L" "$W/bundle"
    umoci init --layout "$L"
    umoci new --image "$L:fat"
    umoci unpack --image "$L:fat" "$W/bundle" >/dev/null
    cp -a "$D/fat/." "$W/bundle/rootfs/"
    umoci repack --image "$L:fat" "$W/bundle"
    umoci config --image "$L:fat" --config.cmd /bin/bash --config.env PATH=/usr/bin:/bin
    rm -rf "$W/bundle"
    touch "$W/image.done"
fi

# The registry.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat >"$W/registry.yml" <<YML
version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $W/registry
http:
  addr: 127.0.0.1:$port
YML
docker-registry serve "$W/registry.yml" >"$W/registry.log" 2>&1 &
reg_pid=$!
trap 'kill $reg_pid 2>/dev/null; wait $reg_pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$port/v2/" >/dev/null && break
    sleep 0.1
done
REF=127.0.0.1:$port/bench/fat:v1
log "pushing to $REF"
skopeo copy -q --dest-tls-verify=false "oci:$L:fat" "docker://$REF"
read -r blob_bytes layer_bytes < <(skopeo inspect --raw --tls-verify=false "docker://$REF" | python3 -c '
import json, sys
m = json.load(sys.stdin)
print(m["config"]["size"] + sum(l["size"] for l in m["layers"]), sum(l["size"] for l in m["layers"]))')
log "image: $layer_bytes bytes of layer blobs"

RAW=$W/registry-$stamp.tsv
: >"$RAW"

for run in $(seq "$RUNS"); do
    log "run $run/$RUNS (load: $(cut -d' ' -f1-3 /proc/loadavg))"
    rm -rf "$W/store" "$W/pulled" "$W/unpacked"
    measure import "$STRATA" --store "file://$W/store" import "docker://$REF" -t bench/fat:v1 --json
    cp "$W/import.out" "$W/import-$run.json"
    measure skopeo skopeo copy -q --src-tls-verify=false "docker://$REF" "oci:$W/pulled:fat"
    measure umoci umoci unpack --image "$W/pulled:fat" "$W/unpacked"
    measure reimport "$STRATA" --store "file://$W/store" import "docker://$REF" -t bench/fat:v2 --json
done
rm -rf "$W/pulled" "$W/unpacked"

table=$(python3 - "$RAW" "$blob_bytes" "$layer_bytes" "$W" "$RUNS" <<'PY'
import json, statistics, sys
raw, blob, layers, W, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
rows = {}
for line in open(raw):
    name, rest = line.rstrip('\n').split('\t')
    rows.setdefault(name, []).append([float(x) for x in rest.split()])
med = lambda name, i=0: statistics.median(r[i] for r in rows[name])
cpu = lambda name: med(name, 1) + med(name, 2)
rss = lambda name: f"{med(name, 3) / 1024:.0f} MiB"
imp = [json.load(open(f'{W}/import-{r}.json')) for r in range(1, runs + 1)]
stored = statistics.median(j['stored_bytes'] for j in imp)
mib = lambda b: f'{b / 2**20:.1f} MiB'
print(f'Image: the fat tree as one gzip layer (umoci), {mib(layers)} of layer blobs, pulled from '
      f'docker-registry on loopback (plain HTTP). Medians of {runs} runs, page cache dropped before each.\n')
print('| step | wall | CPU (user+sys) | max RSS | result |')
print('|---|---|---|---|---|')
print(f"| `strata import docker://…` into an empty store | {med('import'):.2f} s | {cpu('import'):.2f} s | "
      f"{rss('import')} | image stored ({mib(stored)}) |")
print(f"| peer: `skopeo copy docker://… oci:` | {med('skopeo'):.2f} s | {cpu('skopeo'):.2f} s | "
      f"{rss('skopeo')} | layout ({mib(blob)}) |")
print(f"| peer: `umoci unpack` of it | {med('umoci'):.2f} s | {cpu('umoci'):.2f} s | {rss('umoci')} | rootfs |")
tot = med('skopeo') + med('umoci')
print(f"| peer total (skopeo + umoci) | {tot:.2f} s | {cpu('skopeo') + cpu('umoci'):.2f} s | — | "
      f"strata {tot / med('import'):.2f}x |")
print(f"| `strata import docker://…` again (layer reused) | {med('reimport'):.2f} s | {cpu('reimport'):.2f} s | "
      f"{rss('reimport')} | 0 B stored |")
PY
)
mkdir -p "$here/results"
printf '%s\n' "$table" | tee "$here/results/registry-$stamp.md"
log "raw figures: $RAW; JSON outputs in $W"
