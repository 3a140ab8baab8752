#!/usr/bin/env bash
# Run a miner or a validator under pm2, kept on the newest release of this repository by scripts/auto_update.py.
#
#   scripts/run_neuron.sh miner|validator NAME [--every MINUTES] -- NEURON FLAGS...
#   e.g. scripts/run_neuron.sh miner miner1 --every 5 -- --netuid 38 --subtensor.network finney \
#            --wallet.name miner --wallet.hotkey default --axon.port 8091 --axon.external_ip 1.2.3.4
#
# pm2 keeps the updater alive (process NAME); the updater runs the neuron, checks the git remote every MINUTES
# (default 5), and on a new release (a change of template.__version__) asks the neuron to stop after its round, pulls,
# reinstalls (pip install -e . with .venv's Python), restarts it from its checkpoint, and rolls back to the last good
# commit, saying so in the log, if the new version fails to start. `pm2 logs NAME` shows the updater and the neuron;
# `pm2 stop NAME` stops both (pm2 sends them SIGINT; the updater follows up with SIGTERM, SIGKILL after 30 s).
# Exit status: 0 started; 2 bad arguments, pm2 or the virtualenv missing.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 2 ] || usage
role=$1 name=$2
shift 2
case "$role" in miner | validator) ;; *) usage ;; esac
every=5
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    case "$1" in
        --every) [ $# -ge 2 ] || usage; every=$2; shift 2 ;;
        *) usage ;;
    esac
done
[ "${1:-}" = "--" ] && shift

python=${PYTHON:-$PWD/.venv/bin/python}
[ -x "$python" ] || { echo "error: $python not found: run 'make venv' first (or set PYTHON)" >&2; exit 2; }
command -v pm2 >/dev/null || { echo "error: pm2 is not installed: npm install -g pm2" >&2; exit 2; }

# pm2 stops with SIGINT and kills after --kill-timeout: the updater needs up to --stop-grace (30 s) for the neuron.
exec pm2 start "$PWD/scripts/auto_update.py" --name "$name" --interpreter "$python" --kill-timeout 60000 \
    --restart-delay 10000 -- --repo "$PWD" --every "$every" -- "$python" "neurons/$role.py" "$@"
