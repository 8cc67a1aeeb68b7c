#!/usr/bin/env bash
# make compose-check: the mesh for real under Docker on a machine without GPUs
# (docker-compose.yml + docker-compose.cpu.yml, host network, 127.0.0.1 ports 23051-23081).
#
#   1. a Debian base image without any registry: debootstrap --variant=minbase + docker import
#      (skipped when $HYPIC_CPU_BASE exists);
#   2. docker/local/: this host's CA certificates and pip configuration for the image build
#      (pip inside the build needs them to reach the package index; the CPU torch wheel is
#      taken from the host's wheel directory when there is one);
#   3. docker compose build + up --wait; a request with the SDK (timed);
#   4. the scatter's process is killed with SIGKILL (a crash: the restart policy applies, as it
#      does not after `docker stop`), compose restarts it, the next request is answered;
#   5. down -v.
# Needs root (or the docker group) and compose v2 (`docker compose` or a `docker-compose` v2).
# Not part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PROJECT=${HYPIC_COMPOSE_PROJECT:-hypic-check}
export HYPIC_CPU_BASE=${HYPIC_CPU_BASE:-hypic-cpu-base:bookworm}
PY=${PYTHON:-$ROOT/.venv/bin/python}
ROUTER=127.0.0.1:23051
t0=$(date +%s)
say() { printf '[compose-check %4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*" >&2; }

if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose)
elif docker-compose version 2>/dev/null | grep -q 'v2\.'; then COMPOSE=(docker-compose)
else echo "compose v2 is needed (docker compose plugin or docker-compose v2)" >&2; exit 2; fi
DC=("${COMPOSE[@]}" -p "$PROJECT" -f docker-compose.yml -f docker-compose.cpu.yml)

if ! docker info >/dev/null 2>&1; then
    say "starting dockerd (no bridge, no iptables)"
    (dockerd --bridge=none --iptables=false >/tmp/hypic-dockerd.log 2>&1 &)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null
fi

if ! docker image inspect "$HYPIC_CPU_BASE" >/dev/null 2>&1; then
    say "building the base image $HYPIC_CPU_BASE with debootstrap"
    rootfs=$(mktemp -d)
    debootstrap --variant=minbase bookworm "$rootfs" >/tmp/hypic-debootstrap.log
    tar -C "$rootfs" -c . | docker import - "$HYPIC_CPU_BASE" >/dev/null
    rm -rf "$rootfs"
fi

mkdir -p docker/local/wheels
cp /usr/local/share/ca-certificates/*.crt docker/local/ 2>/dev/null || true
{
    echo "[global]"
    echo "cert = /etc/ssl/certs/ca-certificates.crt"
    echo "find-links = /tmp/hypic-docker/local/wheels"
    idx=$(pip config get global.index-url 2>/dev/null || true)
    [ -n "$idx" ] && echo "index-url = $idx"
} > docker/local/pip.conf
for d in $(pip config get global.find-links 2>/dev/null || true); do
    cp "$d"/torch-2.13.0*cpu*.whl docker/local/wheels/ 2>/dev/null || true
done

cleanup() { say "down -v"; "${DC[@]}" down -v --remove-orphans >/dev/null 2>&1 || true; }
trap cleanup EXIT

say "build"
"${DC[@]}" build
say "up"
"${DC[@]}" up -d --wait
say "up and healthy"

ask() {
    local s=$(date +%s%N)
    "$PY" -m hypic generate --address "$ROUTER" --segment "alice likes tea . bob likes milk ." \
        --segment "the quick brown fox jumps over the lazy dog ." --query "who likes milk ?" \
        --max-tokens 8 --json --timeout 300
    say "answered in $(( ($(date +%s%N) - s) / 1000000 )) ms"
}
first=$(ask); echo "$first"

cid=$("${DC[@]}" ps -q scatter)
pid=$(docker inspect -f '{{.State.Pid}}' "$cid")
restarts=$(docker inspect -f '{{.RestartCount}}' "$cid")
say "killing scatter (container ${cid:0:12}, pid $pid) with SIGKILL"
kill -9 "$pid"
for _ in $(seq 300); do
    now=$(docker inspect -f '{{.RestartCount}} {{.State.Health.Status}}' "$cid")
    [ "${now%% *}" -gt "$restarts" ] && [ "${now#* }" = healthy ] && break
    sleep 1
done
[ "${now%% *}" -gt "$restarts" ] || { echo "scatter was not restarted" >&2; exit 1; }
say "scatter restarted by compose and healthy ($now)"
second=$(ask); echo "$second"
"$PY" - "$first" "$second" <<'PYEOF'
import json, sys
a, b = (json.loads(x) for x in sys.argv[1:])
assert a["tokens"] == b["tokens"], (a["tokens"], b["tokens"])
print("same answer before and after the crash:", a["tokens"])
PYEOF
say "ok"
