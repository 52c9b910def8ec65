set -x
pip install -q --no-index --find-links .device/wheels --target /tmp/site pydantic redis fastapi uvicorn sse-starlette >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
python3 -c "import scipy, matplotlib" 2>&1 | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python3 -u benchmarks/routing_study.py --device cuda --bases 3 --seeds 5 --arms base,none --base /tmp/study/base --jsonl $OUT/device_vanilla.jsonl 2>&1 | grep -v Loading | tail -40
timeout 200 python3 -u benchmarks/routing_study.py --device cuda --bases 1 --seeds 3 --arms activation,activation~placebo --base /tmp/study/base-0 --jsonl $OUT/device_armb.jsonl 2>&1 | grep -v Loading | tail -25
