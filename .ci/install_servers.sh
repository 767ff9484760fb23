#!/usr/bin/env bash
# Debian packages for the server fixtures: SLURM clusters with accounting, one node and two (tests/slurm), PostgreSQL
# (tests/stores), and headless Chromium for the MLflow UI browser test (tests/ui; with a font, since
# --no-install-recommends leaves Chromium none to draw text with). Idempotent and quiet; always exits 0,
# since without the packages those tests skip and say why. The fixtures start private instances, so the
# packages' own services are kept from starting.
set -uo pipefail

# iproute2: `ip` builds the two-node cluster's bridge and network namespaces (tests/slurm/two_nodes.py; unshare,
# nsenter and mount are util-linux's, always installed)
PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server postgresql chromium fonts-liberation iproute2)

missing=()
for p in "${PACKAGES[@]}"; do
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_servers: all installed (${PACKAGES[*]})"
  exit 0
fi

if ! command -v apt-get >/dev/null; then
  echo "install_servers: no apt-get here, not installing ${missing[*]}; the SLURM/PostgreSQL/browser tests will skip"
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
else
  echo "install_servers: not root and no password-less sudo, not installing ${missing[*]}; those tests will skip"
  exit 0
fi

# on a machine with an init system, installing mariadb-server/postgresql/slurmctld would start system-wide
# daemons nobody uses; "101" tells the maintainer scripts not to (Docker images ship this file already)
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$policy" >/dev/null && "${SUDO[@]}" chmod 755 "$policy"
  trap '"${SUDO[@]}" rm -f "$policy"' EXIT
fi

log=$(mktemp /tmp/install_servers.XXXXXX.log)
echo "install_servers: installing ${missing[*]} (log: $log)"
start=$SECONDS
if "${SUDO[@]}" apt-get update -qq >"$log" 2>&1 &&
   "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
     "${PACKAGES[@]}" >>"$log" 2>&1; then
  echo "install_servers: done in $((SECONDS - start)) s"
else
  echo "install_servers: apt-get failed; the SLURM/PostgreSQL/browser tests will skip. Last lines of $log:"
  tail -n 15 "$log"
fi
exit 0
