#!/usr/bin/env bash
# The sqlite3 shell, for `--datastore sqlite-analyzed` (tests/common/sqlite.rs): Debian's
# package, installed only where missing. Prints the path of the sqlite3 binary on the last line.
set -euo pipefail
log() { printf '[testenv-sqlite3] %s\n' "$*" >&2; }

if ! bin=$(command -v sqlite3); then
  log "installing Debian's sqlite3 package"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq sqlite3 >/dev/null
  bin=$(command -v sqlite3) || { log "sqlite3 installed, but not on PATH"; exit 1; }
fi
log "using $bin ($("$bin" --version | cut -d' ' -f1))"
echo "$bin"
