# Shared by the benchmark data scripts (sourced, not run).

# The Debian mirror apt uses on this machine (deb822 "URIs:" or one-line "deb URL suite ...").
apt_mirror() {
    local u
    u=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null |
        awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}' |
        grep -E '/debian/?$' | head -n1 || true)
    if [[ -z $u ]]; then
        u=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
            awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; break}}' |
            grep -E '/debian/?$' | head -n1 || true)
    fi
    echo "${u:-http://deb.debian.org/debian}"
}

# Syncs and drops the page cache (unless NO_DROP=1).
drop_caches() {
    sync
    [[ ${NO_DROP:-} == 1 ]] || echo 3 >/proc/sys/vm/drop_caches
}

# measure NAME CMD...: wall, user and system seconds and max RSS (KiB) of CMD after dropping the page
# cache, appended to $RAW as "NAME<TAB>wall user sys rss"; output in $W/NAME.out and $W/NAME.err.
measure() {
    local name=$1
    shift
    drop_caches
    if ! /usr/bin/time -o "$W/$name.time" -f '%e %U %S %M' "$@" >"$W/$name.out" 2>"$W/$name.err"; then
        log "$name failed:"
        cat "$W/$name.err" >&2
        exit 1
    fi
    printf '%s\t%s\n' "$name" "$(tail -n1 "$W/$name.time")" >>"$RAW"
}
