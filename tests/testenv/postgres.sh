#!/usr/bin/env bash
# PostgreSQL for spire-server's datastore, when a test or benchmark asks for it
# (`--datastore postgres`). Debian's server package, installed only where missing; the Rust
# harness (tests/common/postgres.rs) runs it in a throwaway directory and stops it.
# Prints the directory holding initdb and postgres on the last line.
set -euo pipefail
log() { printf '[testenv-postgres] %s\n' "$*" >&2; }

find_bin() {
  local dir
  for dir in /usr/lib/postgresql/*/bin; do
    if [[ -x "$dir/initdb" && -x "$dir/postgres" ]]; then
      echo "$dir"
      return 0
    fi
  done
  return 1
}

if ! bin=$(find_bin); then
  log "installing Debian's postgresql (server) package"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  bin=$(find_bin) || { log "postgresql installed, but no initdb/postgres found"; exit 1; }
fi
# The package's own cluster is not used; the harness starts its own per test bed.
log "using $bin ($("$bin/postgres" --version))"
echo "$bin"
