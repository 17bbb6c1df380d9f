#!/usr/bin/env bash
# Debian packages the test suite needs, installed only where missing (CI starts on a clean clone,
# possibly on a fresh machine). Later stages add theirs here (sshd for the remote profile, Slurm and munge for the Slurm profile, ...).
set -euo pipefail
need=()
# chromium: benchmarks/check_report.py screenshots the HTML report (~30 s to install)
for pair in "rsync:rsync" "sshd:openssh-server" "ssh:openssh-client" "chromium:chromium" "slurmctld:slurm-wlm" "munged:munge"; do
  bin=${pair%%:*}; pkg=${pair#*:}
  command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "== installing Debian packages: ${need[*]}"
  if [ "$(id -u)" != 0 ]; then echo "need root to install ${need[*]}" >&2; exit 1; fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
