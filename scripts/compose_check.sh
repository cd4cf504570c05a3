#!/usr/bin/env bash
# The containers check CI runs (docs/deploy.md, "Testing"): builds the image with podman and runs
# the compose files on the tiny model, as docs/deploy.md tells a user to.
#   1. podman ready (apt-get installs it if missing), a Debian 12 base image (made once, then reused)
#   2. the image, built with the build inputs this machine needs (local torch wheels, CA bundle)
#   3. compose/laptop.yaml: up, healthy, P-MD and P-RLD-MD answers, one trace with spans of all four
#      roles on /dashboard, the WAN's /stats moving, MD killed mid-stream and the answer complete
#      token-exact, operator mistakes refused with one line, down leaving nothing
#   4. compose/dc-a.yaml and compose/dc-b.yaml as two compose projects on separate networks that meet
#      only through published host ports, with the secrets and NATS TLS docs/deploy.md lists: one
#      P-RLD-MD request across, then a second RLD instance that the gateway uses; down
# Exits non-zero with a line saying which step failed and why. Prints each step's time.
# Usage: scripts/compose_check.sh      (as root; run from anywhere)
#   PDD_CONTAINERS_DIR   work directory (default /var/tmp/pdd-containers): containers.conf, logs, secrets
#   PDD_CHECK_PORT_BASE  first of the host ports it publishes (default 18000; it uses 20 from there)
#   PDD_TORCH_WHEELS     a directory with a torch wheel for the build (default: pip's find-links, if it has one)
#   PDD_CA_BUNDLE        CA bundle for pip in the build (default /etc/ssl/certs/ca-certificates.crt)
set -euo pipefail
cd "$(dirname "$0")/.."

W=${PDD_CONTAINERS_DIR:-/var/tmp/pdd-containers}
LOGS=$W/logs
BASE_IMAGE=localhost/debian-base:bookworm
IMAGE=pdd:dev
PORT=${PDD_CHECK_PORT_BASE:-18000}
STEP=""
STEP_BEGAN=0
CHECK_BEGAN=$SECONDS
# Projects of the check's own, so that a stack a developer runs (pdd-laptop, ...) is left alone.
LAPTOP=pdd-check-laptop DC_A=pdd-check-dc-a DC_B=pdd-check-dc-b
PROJECTS=($LAPTOP $DC_A $DC_B)
mkdir -p "$LOGS"

say() { echo "compose-check: $*"; }
step() { STEP=$1 STEP_BEGAN=$SECONDS; say "$STEP ..."; }
ok() { say "$STEP ok ($((SECONDS - STEP_BEGAN)) s)${1:+: $1}"; STEP=""; }
fail() {
  echo "compose-check: FAILED in '$STEP': $*" >&2
  for p in "${PROJECTS[@]}"; do  # every container's log, before the exit trap removes them
    for c in $(podman ps -a --filter "label=io.podman.compose.project=$p" --format '{{.Names}}' 2>/dev/null); do
      podman logs --tail 300 "$c" >"$LOGS/container-$c.log" 2>&1 || true
    done
  done
  echo "compose-check: logs in $LOGS (container-*.log: each container's last 300 lines)" >&2
  exit 1
}
run_probe() {  # run_probe ARGS...: print the probe's line, fail with it
  local out
  out=$(python3 scripts/compose_probe.py "$@") || fail "${out#FAILED: }"
  say "  $out"
}

# --- 1. podman ------------------------------------------------------------------------------------
step "podman"
[ "$(id -u)" = 0 ] || fail "run as root (podman's networks and published ports here are rootful)"
need=""
for c in podman runc debootstrap podman-compose openssl python3 ss; do command -v "$c" >/dev/null || need=1; done
if [ -n "$need" ]; then
  say "  installing podman, podman-compose, debootstrap (apt-get; log in $LOGS/apt.log)"
  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    podman runc debootstrap conmon netavark aardvark-dns iptables containernetworking-plugins \
    catatonit podman-compose openssl python3 ca-certificates iproute2) >"$LOGS/apt.log" 2>&1 \
    || fail "apt-get install failed: see $LOGS/apt.log"
fi
# Root here cannot raise hard limits (crun's setrlimit fails) and cgroups are hybrid (crun refuses):
# runc with the limits we have. A conf of our own, selected by CONTAINERS_CONF, nothing system-wide.
NOFILE=$(ulimit -Hn); NPROC=$(ulimit -Hu)
[ "$NOFILE" = unlimited ] && NOFILE=1048576
if [ "$NPROC" = unlimited ] || [ "$NPROC" -gt 32768 ]; then NPROC=32768; fi
cat > "$W/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=$NOFILE:$NOFILE", "nproc=$NPROC:$NPROC"]
[engine]
runtime = "runc"
CONF
export CONTAINERS_CONF=$W/containers.conf
podman info >/dev/null 2>"$LOGS/podman-info.log" || fail "podman info failed: see $LOGS/podman-info.log"
ok "$(podman --version), podman-compose $(podman-compose version 2>/dev/null | sed -n 's/^podman-compose.* version *//p' | head -n1)"

cleanup() {
  for p in "${PROJECTS[@]}"; do
    ids=$(podman ps -aq --filter "label=io.podman.compose.project=$p" 2>/dev/null || true)
    [ -z "$ids" ] || podman rm -f -t 2 $ids >/dev/null 2>&1 || true
    for n in $(podman network ls -q --filter "name=^${p}_" 2>/dev/null); do podman network rm -f "$n" >/dev/null 2>&1 || true; done
  done
}
trap 'cleanup' EXIT
cleanup  # what a killed earlier run left

# --- 2. the base image and the image ------------------------------------------------------------
step "base image $BASE_IMAGE"
if podman image exists "$BASE_IMAGE"; then
  ok "cached"
else
  MIRROR=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$MIRROR" ] || MIRROR=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$MIRROR" ] || MIRROR=http://deb.debian.org/debian
  rm -rf "$W/rootfs"
  debootstrap --variant=minbase bookworm "$W/rootfs" "$MIRROR" >"$LOGS/debootstrap.log" 2>&1 \
    || fail "debootstrap from $MIRROR failed: see $LOGS/debootstrap.log"
  rm -rf "$W/rootfs/var/cache/apt/archives/"*.deb "$W/rootfs/var/lib/apt/lists/"*
  tar -C "$W/rootfs" -c . | podman import - "$BASE_IMAGE" >/dev/null 2>"$LOGS/import.log" \
    || fail "podman import failed: see $LOGS/import.log"
  rm -rf "$W/rootfs"
  ok "made with debootstrap from $MIRROR"
fi

step "build $IMAGE"
build=(podman build --format docker -t "$IMAGE" --build-arg "BASE_IMAGE=$BASE_IMAGE")
WHEELS=${PDD_TORCH_WHEELS:-$(pip3 config get global.find-links 2>/dev/null || true)}
WHEELS=${WHEELS%% *}
if [ -n "$WHEELS" ] && compgen -G "$WHEELS/torch-*.whl" >/dev/null; then
  build+=(--build-context "torch-wheels=$WHEELS")
fi
CA=${PDD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
[ -s "$CA" ] && build+=(--secret "id=ca_bundle,src=$CA")
say "  ${build[*]} ."
"${build[@]}" . >"$LOGS/build.log" 2>&1 || fail "podman build failed: see the end of $LOGS/build.log"
SIZE=$(podman image inspect "$IMAGE" --format '{{.Size}}')
ok "$((SIZE / 1000000)) MB"

# --- helpers for the stacks -----------------------------------------------------------------------
port_free() { ! ss -Hltn "sport = :$1" | grep -q .; }
require_ports_free() {
  for p in "$@"; do port_free "$p" || fail "host port $p is in use: free it or set PDD_CHECK_PORT_BASE"; done
}
compose() {  # compose PROJECT FILE ARGS...: podman-compose, its output in the step's log
  local project=$1 file=$2; shift 2
  podman-compose -p "$project" -f "$file" "$@" >>"$LOGS/$project.log" 2>&1 \
    || fail "podman-compose -p $project -f $file $* failed: see $LOGS/$project.log"
}
nothing_left() {  # nothing_left PROJECT: no container, no network
  local left
  left=$(podman ps -a --filter "label=io.podman.compose.project=$1" --format '{{.Names}}')
  [ -z "$left" ] || fail "after down, containers of $1 remain: $left"
  for n in $(podman network ls -q --filter "name=^${1}_"); do podman network rm -f "$n" >/dev/null; done
}

# --- 3. the laptop ------------------------------------------------------------------------------------
API=http://127.0.0.1:$PORT
WAN=http://127.0.0.1:$((PORT + 1))
step "laptop: up"
require_ports_free "$PORT" "$((PORT + 1))"
LAPTOP_SECRETS=$W/laptop-secrets
mkdir -p "$LAPTOP_SECRETS"
# docs/deploy.md's KV secret, in a directory of the check's own (PDD_SECRETS_DIR) to leave compose/ alone
openssl rand -hex 32 > "$LAPTOP_SECRETS/kv-secret" && chmod 644 "$LAPTOP_SECRETS/kv-secret"
export PDD_SECRETS_DIR=$LAPTOP_SECRETS PDD_MODEL=tiny PDD_API_PORT=$PORT PDD_WAN_CONTROL_PORT=$((PORT + 1))
: >"$LOGS/$LAPTOP.log"
# podman-compose 1.0.3 (Debian 12) ignores profiles: name the services (all but jaeger).
UP_BEGAN=$SECONDS
compose $LAPTOP compose/laptop.yaml up -d wan nats-a nats-b gateway prefill relay main
out=$(python3 scripts/compose_probe.py healthy "$API/healthz" 240) || fail "${out#FAILED: }"
ok "up to healthy in $((SECONDS - UP_BEGAN)) s"

step "laptop: answers, trace, WAN"
run_probe first "$API" 60
run_probe chat "$API" p-md main
run_probe chat "$API" p-rld-md relay,main
run_probe trace "$API"
run_probe wan-moves "$API" "$WAN"
ok

step "laptop: MD killed mid-stream"
run_probe recovery "$API" "podman kill ${LAPTOP}_main_1"
ok

step "operator mistakes"
mistake() {  # mistake EXPECTED_LAST_LINE PODMAN_RUN_ARGS...: exit status 1 and that one line
  local expected=$1 out code=0; shift
  out=$(podman run --rm "$@" 2>&1) || code=$?
  [ "$code" != 0 ] || fail "podman run $* exited 0"
  [ "$(tail -n1 <<<"$out")" = "$expected" ] || fail "podman run $*: last line '$(tail -n1 <<<"$out")', not '$expected'"
  say "  exit $code: $expected"
}
mistake '--kv-secret-file /run/secrets/kv_secret: No such file or directory: P, RLD and MD each need the same secret file (docs/deploy.md, "Secrets")' \
  "$IMAGE" services.main --model tiny --kv-secret-file /run/secrets/kv_secret
mistake "gateway cannot start: --nats-password-file /run/secrets/nats_password: no such file" \
  "$IMAGE" services.gateway --model tiny --nats-user pdd --nats-password-file /run/secrets/nats_password
mistake "prefill cannot start: --model 'smollm3': not 'smollm2', 'tiny', or a directory with config.json" \
  "$IMAGE" services.prefill --model smollm3
# a host port in use (the laptop's API port, still published): the engine refuses the container
out=$(podman run --rm -d -p "127.0.0.1:$PORT:8000" "$IMAGE" 2>&1) && { podman rm -f "$out" >/dev/null; fail "a second container got host port $PORT"; }
grep -q "address already in use" <<<"$out" || fail "port in use: podman said '$(tail -n1 <<<"$out")'"
say "  port in use: $(tail -n1 <<<"$out")"
ok

step "laptop: down"
compose $LAPTOP compose/laptop.yaml down
nothing_left $LAPTOP
ok
unset PDD_SECRETS_DIR PDD_MODEL PDD_API_PORT PDD_WAN_CONTROL_PORT

# --- 4. two datacenters -------------------------------------------------------------------------------
# Two compose projects, each on its own network; each dials the other only through a port
# published on this host's address, as two machines would.
step "datacenters: secrets and NATS TLS"
[ ! -e compose/.env ] || fail "compose/.env exists: podman-compose 1.0.3 lets it override the check's settings; move it away"
PUBLIC_HOST=${PDD_CHECK_PUBLIC_HOST:-$(hostname -I | awk '{print $1}')}
[ -n "$PUBLIC_HOST" ] || fail "no address of this host to publish the datacenters' ports on (set PDD_CHECK_PUBLIC_HOST)"
D=$W/dc
rm -rf "$D" && mkdir -p "$D/certs"
# compose/.env as docs/deploy.md has an operator write it (kept out of the repository here)
sed -e "s|^DC_A_PUBLIC_HOST=.*|DC_A_PUBLIC_HOST=$PUBLIC_HOST|" -e "s|^DC_B_PUBLIC_HOST=.*|DC_B_PUBLIC_HOST=$PUBLIC_HOST|" \
    -e "s|^PDD_SECRETS_DIR=.*|PDD_SECRETS_DIR=$D/secrets-a|" compose/.env.example > "$D/env"
cat >> "$D/env" <<ENV
PDD_IMAGE=$IMAGE
NATS_IMAGE=$IMAGE
PDD_MODEL=tiny
PDD_DEVICE=cpu
PDD_TORCH_THREADS=1
PDD_API_PORT=$((PORT + 2))
NATS_A_GATEWAY_PORT_1=$((PORT + 10))
NATS_A_GATEWAY_PORT_2=$((PORT + 11))
NATS_A_GATEWAY_PORT_3=$((PORT + 12))
NATS_B_GATEWAY_PORT_1=$((PORT + 13))
NATS_B_GATEWAY_PORT_2=$((PORT + 14))
NATS_B_GATEWAY_PORT_3=$((PORT + 15))
PDD_MD_KV_PORT=$((PORT + 16))
ENV
# docs/deploy.md, "Secrets": a CA, one gateway certificate per datacenter, then each host's directory
(
  cd "$D/certs"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 825 \
    -keyout ca-key.pem -out ca.pem -subj /CN=pdd-nats-ca
  for dc in a b; do
    host=$(grep "^DC_${dc^^}_PUBLIC_HOST=" "$D/env" | cut -d= -f2)
    san=DNS:$host; [[ $host =~ ^[0-9.]+$ ]] && san=IP:$host
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
      -keyout dc-$dc-gateway-key.pem -out dc-$dc.csr -subj /CN=pdd-dc-$dc
    openssl x509 -req -in dc-$dc.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 825 \
      -out dc-$dc-gateway.pem -extfile <(echo "subjectAltName=$san")
  done
) >"$LOGS/openssl.log" 2>&1 || fail "openssl failed: see $LOGS/openssl.log"
for dc in a b; do
  (
    install -d -m 700 "$D/secrets-$dc" && cd "$D/secrets-$dc"
    cp ../certs/ca.pem ca.pem && cp ../certs/dc-$dc-gateway.pem gateway.pem && cp ../certs/dc-$dc-gateway-key.pem gateway-key.pem
    password=$(openssl rand -hex 24)
    printf 'authorization {\n  users: [\n    {user: pdd, password: "%s"}\n  ]\n}\n' "$password" > nats-auth.conf
    printf '%s\n' "$password" > nats-password
    if [ $dc = a ]; then openssl rand -hex 32 > kv-secret; else cp ../secrets-a/kv-secret kv-secret; fi
    chmod 600 ./* && chown 10001 ./*
  ) || fail "making $D/secrets-$dc failed"
done
ok "public host $PUBLIC_HOST"

dc_env() {  # dc_env a|b: the env file, with that datacenter's secrets directory
  set -a; . "$D/env"; PDD_SECRETS_DIR=$D/secrets-$1; set +a
}
DC_API=http://127.0.0.1:$((PORT + 2))
step "datacenters: up"
require_ports_free $((PORT + 2)) $(seq $((PORT + 10)) $((PORT + 16)))
: >"$LOGS/$DC_A.log"; : >"$LOGS/$DC_B.log"
UP_BEGAN=$SECONDS
( dc_env b && compose $DC_B compose/dc-b.yaml up -d ) || exit 1
( dc_env a && compose $DC_A compose/dc-a.yaml up -d ) || exit 1
out=$(python3 scripts/compose_probe.py healthy "$DC_API/healthz" 240) || fail "${out#FAILED: }"
ok "up to healthy in $((SECONDS - UP_BEGAN)) s"

step "datacenters: a P-RLD-MD request across"
run_probe first "$DC_API" 60
run_probe chat "$DC_API" p-rld-md relay,main
ok

step "datacenters: a second RLD"
# podman-compose 1.0.3 ignores --scale; the replicas variable does the same (docs/deploy.md, "Scaling")
( dc_env a && export PDD_RELAY_REPLICAS=2 && compose $DC_A compose/dc-a.yaml up -d relay ) || exit 1
run_probe relays "$DC_API" 2
ok

step "datacenters: down"
# podman-compose 1.0.3 downs the containers the file names: with the replicas the stack has
( dc_env a && export PDD_RELAY_REPLICAS=2 && compose $DC_A compose/dc-a.yaml down ) || exit 1
( dc_env b && compose $DC_B compose/dc-b.yaml down ) || exit 1
nothing_left $DC_A
nothing_left $DC_B
ok

say "passed in $((SECONDS - CHECK_BEGAN)) s"
