#!/usr/bin/env bash
# Optional: TorchRec 1.8 (CPU) in the project's .venv, for the comparisons with it (experiments/,
# flexshard bench) and the tests that plug into it (they skip without it).
# Run after scripts/setup.sh. Idempotent.
#
# torchrec's metadata requires `fbgemm-gpu` (the CUDA build) plus torchmetrics and tqdm, none of which
# its sharded EmbeddingCollection path needs on CPU, so it is installed with --no-deps next to the CPU
# build of fbgemm, and its import-time dependencies are added by hand (also --no-deps, so that none of
# them pulls another torch). Versions: the set verified to run the benchmark's row-wise sharded
# EmbeddingCollection (forward, backward, fused row-wise Adagrad) on CPU with gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "setup_torchrec.sh: no .venv here; run scripts/setup.sh first" >&2
  exit 1
fi
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)

TORCH_VERSION=2.13.0
FBGEMM_VERSION=1.8.0
TORCHREC_VERSION=1.8.0

cuda=$(.venv/bin/python -c "import torch; print(torch.version.cuda or '')" 2>/dev/null || true)
if [ -n "$cuda" ]; then
  # A CUDA torch is installed (GPU machine): fbgemm-gpu-cpu would clash with it. Not what this script
  # was verified on; install the CUDA fbgemm matching torchrec instead and leave torch as it is.
  echo "setup_torchrec.sh: CUDA torch ($cuda) found; installing fbgemm-gpu==$FBGEMM_VERSION (not verified)" >&2
  "${PIP[@]}" "fbgemm-gpu==$FBGEMM_VERSION"
else
  "${PIP[@]}" "torch==$TORCH_VERSION" "fbgemm-gpu-cpu==$FBGEMM_VERSION"
fi
"${PIP[@]}" --no-deps \
  "torchrec==$TORCHREC_VERSION" \
  "tensordict==0.15.3" \
  "pyvers==0.2.3" \
  "cloudpickle==3.1.2" \
  "pyre-extensions==0.0.32" \
  "typing-inspect==0.9.0" \
  "mypy-extensions==1.2.0"

# smoke test: the modules the benchmark's sharded path imports
.venv/bin/python - <<'EOF'
import fbgemm_gpu  # noqa: F401
import torchrec
from torchrec.distributed.embedding import EmbeddingCollectionSharder  # noqa: F401
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: F401
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise  # noqa: F401

print(f"torchrec {torchrec.__version__} ready")
EOF
