#!/usr/bin/env bash
# Makes the node daemon benchmark's data sets under ${BENCH_DATA:-/var/tmp/strata-bench} (see
# benches/coldstart.py). Idempotent: a step whose "<name>.done" marker exists is skipped.
#
#   fat/        the "fat" agent base: debootstrap --variant=minbase with python3-numpy, python3-pandas,
#               python3-scipy, git and build-essential (bookworm; ~1.3 GB, ~42k entries)
#   bigfile/    one 1 GiB file for the sequential read benchmark, big-file/data: 1 MiB blocks, each
#               half random bytes (incompressible) and half a repeated 64-byte text line (compresses
#               ~100x), so that the stored chunks are about half the size (like binaries and data
#               files mixed); generated from a fixed seed, so every run makes the same bytes.
#
# Needs root (debootstrap). Downloads only from the Debian mirror apt uses here.
# Environment: BENCH_DATA, MIRROR (default: the first Debian URI in apt's sources).
set -euo pipefail

D=${BENCH_DATA:-/var/tmp/strata-bench}
mkdir -p "$D"
log() { printf '[make-fat] %s\n' "$*" >&2; }

# shellcheck source=benches/lib.sh
. "$(dirname "$0")/lib.sh"
MIRROR=${MIRROR:-$(apt_mirror)}
command -v debootstrap >/dev/null || apt-get install -y -q debootstrap >/dev/null

# ---- (a) the fat agent base ----
if [[ ! -e $D/fat.done ]]; then
    pkgs=python3-numpy,python3-pandas,python3-scipy,git,build-essential
    log "debootstrap --variant=minbase --include=$pkgs bookworm $D/fat $MIRROR"
    rm -rf "$D/fat"
    debootstrap --variant=minbase --include=$pkgs bookworm "$D/fat" "$MIRROR" >"$D/fat.log" 2>&1 ||
        { tail -n 20 "$D/fat.log" >&2; exit 1; }
    # debootstrap leaves the downloaded .debs in the apt cache: drop them, as image builds do.
    rm -f "$D/fat/var/cache/apt/archives/"*.deb
    touch "$D/fat.done"
fi

# ---- (b) one 1 GiB file, half compressible ----
if [[ ! -e $D/bigfile.done ]]; then
    log "1 GiB file in $D/bigfile/data"
    rm -rf "$D/bigfile"
    mkdir -p "$D/bigfile"
    python3 - "$D/bigfile/data" <<'PY'
import random, sys
rng = random.Random(8)
line = b"strata sequential read benchmark: half random, half this line.\n"
half = 512 * 1024
text = (line * (half // len(line) + 1))[:half]
with open(sys.argv[1], "wb") as f:
    for _ in range(1024):
        f.write(rng.randbytes(half))
        f.write(text)
PY
    touch "$D/bigfile.done"
fi

for t in fat bigfile; do
    printf '%-8s %6s MiB %6s entries\n' "$t" \
        "$(( $(du -sb "$D/$t" | cut -f1) / 1048576 ))" "$(find "$D/$t" | wc -l)" >&2
done
