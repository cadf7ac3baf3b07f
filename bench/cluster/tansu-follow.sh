#!/usr/bin/env bash
# Reproduces, without the relay, what made route tables diverge (finding 2
# of the cluster section of bench/RESULTS.md): tansu serving a live
# follower the batches of one partition out of offset order, and now and
# then never serving a batch at all, while several producers write to it.
#
#   bench/cluster/tansu-follow.sh
#
# Per round: a fresh 6-partition topic, 3 readers following it from the
# beginning the way a node reads the routes topic (partitions assigned, no
# group, fetch.wait.max.ms=10), 5 producers writing 10,000 records each at
# RATE (3333) records/s in batches of BATCH (5), then one more reader from
# the beginning after the producers are done. A reader reports offsets that
# arrived after a higher offset (`backwards`), the gaps it saw, and the
# records it got (each should get 50,000). BURN (4) busy loops load the CPU
# meanwhile: on a quiet machine it rarely happens. ROUNDS (10).
source "$(dirname "$0")/lib.sh"

ROUNDS=${ROUNDS:-10}
RATE=${RATE:-3333}
BATCH=${BATCH:-5}
BURN=${BURN:-4}

check_prerequisites
build
start_tansu
for _ in $(seq 1 "$BURN"); do
  (while :; do :; done) &
  STARTED_PIDS+=($!)
done
out_of_order=0; lost=0; fresh_lost=0
for round in $(seq 1 "$ROUNDS"); do
  topic="follow-$round"
  create_topics "$topic:6"
  readers=()
  for r in 1 2 3; do
    "$TOOL" tail-count --bootstrap "$BOOTSTRAP" --topic "$topic" --idle-s 8 >"$RUN_DIR/r$round-$r.json" 2>/dev/null &
    readers+=($!); STARTED_PIDS+=($!)
  done
  sleep 1
  producers=()
  for p in 1 2 3 4 5; do
    "$TOOL" produce --bootstrap "$BOOTSTRAP" --topic "$topic" --count 10000 --size 60 \
      --process-id "p$p" --rate "$RATE" --batch "$BATCH" >/dev/null 2>&1 &
    producers+=($!); STARTED_PIDS+=($!)
  done
  for pid in "${producers[@]}" "${readers[@]}"; do wait "$pid"; done
  "$TOOL" tail-count --bootstrap "$BOOTSTRAP" --topic "$topic" --idle-s 3 >"$RUN_DIR/r$round-fresh.json" 2>/dev/null
  for r in 1 2 3 fresh; do
    line=$(cat "$RUN_DIR/r$round-$r.json")
    echo "round $round, reader $r: $line"
    read -r backwards records < <(python3 -c 'import json,sys; j=json.loads(sys.argv[1]); print(j["backwards"], j["records"])' "$line")
    if [[ $r == fresh ]]; then
      fresh_lost=$((fresh_lost + 50000 - records))
    else
      if (( backwards > 0 )); then out_of_order=$((out_of_order + 1)); fi
      lost=$((lost + 50000 - records))
    fi
  done
done
echo
describe_run
echo "following readers: $out_of_order of $((ROUNDS * 3)) saw batches out of offset order; $lost records never reached them"
echo "readers from the beginning after the writes: $fresh_lost records missing (0: the records are in the topic)"
