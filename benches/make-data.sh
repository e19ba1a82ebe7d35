#!/usr/bin/env bash
# Makes the builder benchmark's data sets under ${BENCH_DATA:-/var/tmp/strata-bench}.
# Idempotent: a step whose "<name>.done" marker exists is skipped (delete the marker to redo it).
#
#   minbase/        Debian 12 (bookworm) minbase rootfs from debootstrap (~190 MiB, ~7k entries)
#   venv/           a Python venv with numpy and pandas from PyPI (~170 MiB)
#   minbase-up/     a copy of minbase/ with ONE package upgraded to the version in bookworm-security or
#                   bookworm-updates (see UPGRADE_PKG below), installed with `dpkg --root`
#   minbase-up.changed   how many bytes differ between minbase/ and minbase-up/ (see changed_bytes)
#
# Needs root (debootstrap, dpkg --root). Downloads only from the Debian mirror apt uses here and from PyPI.
# Environment: BENCH_DATA, MIRROR (default: the first Debian URI in apt's sources), UPGRADE_PKG (a
# package of the minbase set that has a newer version in the security/updates suites; default: the
# smallest such package that ships files, chosen automatically).
set -euo pipefail

D=${BENCH_DATA:-/var/tmp/strata-bench}
mkdir -p "$D"
log() { printf '[make-data] %s\n' "$*" >&2; }

# shellcheck source=benches/lib.sh
. "$(dirname "$0")/lib.sh"
MIRROR=${MIRROR:-$(apt_mirror)}

need() { command -v "$1" >/dev/null || { log "installing $2"; apt-get install -y -q "$2" >/dev/null; }; }
need debootstrap debootstrap

# ---- (a) Debian minbase ----
if [[ ! -e $D/minbase.done ]]; then
    log "debootstrap --variant=minbase bookworm $D/minbase $MIRROR"
    rm -rf "$D/minbase"
    debootstrap --variant=minbase bookworm "$D/minbase" "$MIRROR" >"$D/minbase.log" 2>&1 ||
        { tail -n 20 "$D/minbase.log" >&2; exit 1; }
    # debootstrap leaves the downloaded .debs in the apt cache: drop them, as image builds do.
    rm -f "$D/minbase/var/cache/apt/archives/"*.deb
    touch "$D/minbase.done"
fi

# ---- (b) Python venv with numpy and pandas ----
if [[ ! -e $D/venv.done ]]; then
    log "python3 -m venv $D/venv; pip install numpy pandas"
    rm -rf "$D/venv"
    python3 -m venv "$D/venv"
    "$D/venv/bin/pip" install -q --no-cache-dir numpy pandas >"$D/venv.log" 2>&1 ||
        { tail -n 20 "$D/venv.log" >&2; exit 1; }
    "$D/venv/bin/pip" freeze >"$D/venv.freeze"
    touch "$D/venv.done"
fi

# ---- (c) minbase with one package upgraded ----
# Bytes that differ from OLD in NEW: sizes of regular files added or whose content (or type) differs,
# plus symlinks added or retargeted (their target length). Prints "changed_bytes changed_files
# removed_files".
changed_bytes() {
    python3 - "$1" "$2" <<'EOF'
import filecmp, os, stat, sys
old, new = sys.argv[1], sys.argv[2]
def walk(root):
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = os.lstat(p)
    return out
a, b = walk(old), walk(new)
changed = nbytes = 0
for rel, st in b.items():
    o = a.get(rel)
    if stat.S_ISREG(st.st_mode):
        same = (o is not None and stat.S_ISREG(o.st_mode) and o.st_size == st.st_size
                and filecmp.cmp(os.path.join(old, rel), os.path.join(new, rel), shallow=False))
        if not same:
            changed += 1; nbytes += st.st_size
    elif stat.S_ISLNK(st.st_mode):
        if o is None or not stat.S_ISLNK(o.st_mode) or \
                os.readlink(os.path.join(old, rel)) != os.readlink(os.path.join(new, rel)):
            changed += 1; nbytes += st.st_size
removed = sum(1 for rel in a if rel not in b)
print(nbytes, changed, removed)
EOF
}

if [[ ! -e $D/minbase-up.done ]]; then
    rm -rf "$D/minbase-up" "$D/debs"
    mkdir -p "$D/debs"
    admin=$D/minbase/var/lib/dpkg
    # A private apt configuration listing bookworm, bookworm-updates and bookworm-security from the
    # same mirror, so that the host's own apt state is not touched.
    A=$D/apt
    mkdir -p "$A/lists/partial" "$A/cache/archives/partial" "$A/etc/preferences.d"
    sec=${MIRROR%/debian}/debian-security
    grep -q "debian-security" <(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null) &&
        sec=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null |
            awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}' | grep -E 'debian-security/?$' | head -n1)
    cat >"$A/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb ${sec:-http://deb.debian.org/debian-security} bookworm-security main
EOF
    APT=(-o Dir::Etc::SourceList="$A/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o Dir::Etc::PreferencesParts="$A/etc/preferences.d"
        -o Dir::State::Lists="$A/lists" -o Dir::Cache="$A/cache" -o Dir::State::status="$admin/status"
        -o Debug::NoLocking=1 -o APT::Architecture=amd64)
    log "apt-get update (private lists in $A)"
    apt-get "${APT[@]}" update -q >"$D/apt-update.log" 2>&1 ||
        { tail -n 20 "$D/apt-update.log" >&2; exit 1; }
    pkg=${UPGRADE_PKG:-}
    if [[ -z $pkg ]]; then
        # Upgradable packages of minbase whose new version depends on nothing else new: pick the one
        # with the smallest installed size that still ships files (a realistic small upgrade).
        mapfile -t up < <(apt-get "${APT[@]}" -s upgrade 2>/dev/null | awk '$1 == "Inst" {print $2}')
        log "upgradable in minbase: ${up[*]:-none}"
        best= bestsize=
        for p in "${up[@]}"; do
            # Only packages upgradable alone (no new dependency needed).
            n=$(apt-get "${APT[@]}" -s install --only-upgrade "$p" 2>/dev/null | grep -c '^Inst' || true)
            [[ $n == 1 ]] || continue
            s=$(dpkg-query --admindir="$admin" -W -f='${Installed-Size}' "$p" 2>/dev/null || echo 0)
            [[ ${s:-0} -ge 16 ]] || continue
            if [[ -z $best || $s -lt $bestsize ]]; then best=$p bestsize=$s; fi
        done
        pkg=$best
    fi
    [[ -n $pkg ]] || { log "no upgradable package found: set UPGRADE_PKG"; exit 1; }
    oldv=$(dpkg-query --admindir="$admin" -W -f='${Version}' "$pkg")
    log "upgrading $pkg ($oldv) in the copy"
    (cd "$D/debs" && apt-get "${APT[@]}" download -q "$pkg" >/dev/null)
    cp -a "$D/minbase" "$D/minbase-up"
    # dpkg --root runs the maintainer scripts chrooted into the copy; no mounts are needed for them.
    dpkg --root="$D/minbase-up" --force-not-root -i "$D/debs/"*.deb >"$D/minbase-up.log" 2>&1 ||
        { tail -n 20 "$D/minbase-up.log" >&2; exit 1; }
    rm -f "$D/minbase-up/var/cache/apt/archives/"*.deb
    newv=$(dpkg-query --admindir="$D/minbase-up/var/lib/dpkg" -W -f='${Version}' "$pkg")
    echo "$pkg $oldv $newv" >"$D/minbase-up.pkg"
    read -r cb cf rf < <(changed_bytes "$D/minbase" "$D/minbase-up")
    echo "$cb $cf $rf" >"$D/minbase-up.changed"
    log "$pkg $oldv -> $newv: $cb bytes in $cf changed files, $rf removed"
    touch "$D/minbase-up.done"
fi

for t in minbase venv minbase-up; do
    printf '%-11s %6s MiB %6s entries\n' "$t" \
        "$(( $(du -sb "$D/$t" | cut -f1) / 1048576 ))" "$(find "$D/$t" | wc -l)" >&2
done
printf 'upgrade: %s; changed: %s bytes in %s files, %s removed\n' \
    "$(cat "$D/minbase-up.pkg")" $(cat "$D/minbase-up.changed") >&2
