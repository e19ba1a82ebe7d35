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
