# Sourced by scripts/build-image and tests/container_test.sh: picks the container engine.
#
#   pick_container_engine [--install]   sets ENGINE to podman or docker, or returns 1 with WHY set
#
# podman first, then docker, each only if it can run a container here (`info` answers: a docker
# client without a daemon does not count). With --install and neither working, installs Debian's
# podman (and runc, which scripts/podman-containers.conf names). podman gets CONTAINERS_CONF set
# to scripts/podman-containers.conf unless the caller set one.

container_engine_conf=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/podman-containers.conf

_engine_works() {
  case "$1" in
    podman)
      command -v podman >/dev/null && command -v runc >/dev/null &&
        CONTAINERS_CONF=${CONTAINERS_CONF:-$container_engine_conf} podman info >/dev/null 2>&1 ;;
    docker) command -v docker >/dev/null && docker info >/dev/null 2>&1 ;;
  esac
}

pick_container_engine() {
  ENGINE=""
  WHY=""
  local e
  for e in podman docker; do
    if _engine_works "$e"; then ENGINE=$e; break; fi
  done
  if [ -z "$ENGINE" ] && [ "${1:-}" = "--install" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "installing podman (apt): neither podman nor docker can run containers here" >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman runc >/dev/null ||
        { WHY="apt-get install podman runc failed"; return 1; }
      _engine_works podman && ENGINE=podman
    fi
  fi
  if [ -z "$ENGINE" ]; then
    if command -v podman >/dev/null; then
      WHY="podman is installed but cannot run containers here (podman info fails$(command -v runc >/dev/null || echo '; runc is missing'))"
    elif command -v docker >/dev/null; then
      WHY="docker is installed but its daemon does not answer (docker info fails), and podman is not installed"
    else
      WHY="neither podman nor docker is installed"
    fi
    return 1
  fi
  if [ "$ENGINE" = podman ]; then
    export CONTAINERS_CONF=${CONTAINERS_CONF:-$container_engine_conf}
  fi
  return 0
}
