#!/bin/sh
# Container entry point: empty the Prometheus multiprocess directory, then run
# `noisy-temp-server serve` with the container's arguments.
#
# The directory must start empty on every run: metric files left by an earlier process (a
# restarted container keeps its filesystem) would be summed into /metrics as stale samples.
set -eu
: "${PROMETHEUS_MULTIPROC_DIR:?must name the Prometheus multiprocess directory}"
mkdir -p "$PROMETHEUS_MULTIPROC_DIR"
find "$PROMETHEUS_MULTIPROC_DIR" -mindepth 1 -delete
exec noisy-temp-server serve "$@"
