#!/usr/bin/env bash
# Every process-killing test binary N times in a row under load, two binaries at once as the suite
# runs them, tallied: `N=10 scripts/repeat-chaos.sh [OUT]` (OUT: /tmp/trainerd-repeat by default;
# OUT/tally gets a line per run, OUT/NAME.I.log its output, kept whatever the exit status).
# `ONLY="sharded@chaos returns@chaos"` runs those binaries alone, two at once. The binaries (the
# test executables, trainerd and the plugins) are copied to OUT/build first, so that a build
# meanwhile does not change what runs. Exit status 1 if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
source scripts/env.sh
N=${N:-10}
out=${1:-/tmp/trainerd-repeat}
mkdir -p "$out/build/deps"
: > "$out/tally"
cargo build --release --workspace >/dev/null 2>&1 || { echo "repeat-chaos: cargo build --release --workspace failed" >&2; exit 1; }
cp target/release/trainerd target/release/*.so "$out/build/"
declare -A exe
while IFS=' ' read -r name path; do
    cp "$path" "$out/build/deps/$name"
    exe[$name]="$out/build/deps/$name"
done < <(cargo test --workspace --release --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
want = {"fault_tolerance", "elastic", "integrity", "kill", "kernels", "data", "soak", "models", "operations",
        "python_model", "torchscript", "partition", "sharded", "catch_up", "returns", "keras"}
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"] \
            and m["target"]["name"] in want:
        print(m["target"]["name"] + ("@chaos" if "chaos" in m["package_id"] else "@daemon"), m["executable"])')
dir_of() { case "$1" in *@chaos) echo "$root/chaos-tests" ;; *) echo "$root/daemon" ;; esac; }
one() {
    local name=$1 i=$2 start status
    start=$(date +%s)
    (cd "$(dir_of "$name")" && "${exe[$name]}" > "$out/$name.$i.log" 2>&1)
    status=$?
    echo "$name run $i exit $status $(( $(date +%s) - start ))s" >> "$out/tally"
}
pairs=("fault_tolerance@chaos elastic@chaos" "integrity@chaos kill@chaos" "kernels@chaos data@chaos"
       "soak@chaos partition@chaos" "sharded@chaos catch_up@chaos" "returns@chaos sharded@daemon"
       "models@daemon operations@daemon" "python_model@daemon torchscript@daemon" "keras@daemon")
if [ -n "${ONLY:-}" ]; then
    read -r -a only <<< "$ONLY"
    pairs=()
    for ((k = 0; k < ${#only[@]}; k += 2)); do pairs+=("${only[k]} ${only[k + 1]:-}"); done
fi
for i in $(seq 1 "$N"); do
    for pair in "${pairs[@]}"; do
        read -r a b <<< "$pair"
        one "$a" "$i" & first=$!
        if [ -n "${b:-}" ]; then
            one "$b" "$i" & second=$!
            wait "$first" "$second"
        else
            wait "$first"
        fi
    done
done
failed=$(grep -cv " exit 0 " "$out/tally")
echo "repeat-chaos: $(wc -l < "$out/tally") runs, $failed failed (tally in $out/tally)"
[ "$failed" -eq 0 ]
