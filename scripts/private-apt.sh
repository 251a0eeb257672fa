# shellcheck shell=bash
# Sourced by scripts that take packages from another Debian suite without touching the
# system's apt sources, dpkg database or C library (install-criu, native-check-headers).
# private_apt_init DIR SUITE [MIRROR]: sets APT_OPTS (an array) for apt-get/apt-cache
# with all state under DIR and fetches that suite's index.
private_apt_init() {
  local dir="$1" suite="$2" mirror="${3:-http://deb.debian.org/debian}"
  local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  [ -r "$keyring" ] || { echo "private-apt: missing $keyring: apt-get install debian-archive-keyring" >&2; return 1; }
  mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial" "$dir/debs"
  echo "deb [signed-by=$keyring] $mirror $suite main" > "$dir/sources.list"
  # An empty dpkg status: a closure must not be trimmed by what this host has installed.
  : > "$dir/status"
  APT_OPTS=(
    -o "Dir::Etc::SourceList=$dir/sources.list"
    -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::State::Lists=$dir/lists"
    -o "Dir::State::status=$dir/status"
    -o "Dir::Cache=$dir/cache"
    -o "APT::Sandbox::User=root"
    -o "Debug::NoLocking=1"
    -q
  )
  apt-get "${APT_OPTS[@]}" update >/dev/null
}
