#!/usr/bin/env bash
# The whole chain on an embedded world, stage by stage, timing each. Called by `make demo` (the tiny
# Kimi-shaped world) and `make bench-real` (SmolLM2-135M-Instruct: BUILDER=00_build_smollm2_world.py).
set -euo pipefail
WORK=${WORK:-runs/tiny}
CONFIG=${CONFIG:-configs/tiny.yaml}
BUILDER=${BUILDER:-00_build_tiny_world.py}
PY=${PY:-.venv/bin/python}
# One thread: the tiny models are too small for intra-op parallelism to pay, and two busy threads on
# a shared 2-core machine spin-wait (measured 13x slower generation under load).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

run() {
  local t0=$SECONDS
  echo "==> $*"
  "$PY" "$@"
  echo "<== $1 took $((SECONDS - t0)) s"
}

run "$BUILDER" --config "$CONFIG"
# Every stage but 05b, the serving benchmark: it needs an engine (`make bench-serve` runs it on SmolLM2).
for stage in 01_prepare_datasets.py 01b_generate_synthetic.py 01c_merge_datasets.py \
             02b_extract_hidden_states_sglang.py 03_build_vocab_mapping.py 04_train.py 05_benchmark.py; do
  if [ -f "$stage" ]; then run "$stage" --config "$CONFIG" --work-dir "$WORK"; fi
done
report="$WORK/05_benchmark/reference/report.md"
if [ -f "$report" ]; then
  echo; "$PY" benchmarks/demo_table.py "$WORK"   # the README's result block, from 05's files
  if [ "$BUILDER" = 00_build_tiny_world.py ]; then
    # The draft can only be as good as what it imitates: show how varied the target's own text is.
    "$PY" -c "import json,sys; q=json.load(open(sys.argv[1]))['quality']; print('tiny target quality:', ', '.join(f'{k} {q[k]}' for k in ('held_out_loss','distinct_token_ids','repeated_4gram_rate','ends_with_im_end_share')))" build/tiny-kimi/manifest.json
  fi
fi
echo "outputs are under $WORK/ (report: $report)"
