#!/usr/bin/env bash
# `make test`: the suite in two pytest processes against the one stack, side by side.
#   tools/test_lanes.sh PYTHON [pytest args...]
# The tests isolate themselves (a topic and Redis key prefix per test) and mostly wait on the
# broker, Redis and the worker processes they start, so two lanes take about half the time
# of one. The second lane holds the integrations' kill loops and the CLI; the first lane,
# everything else (with the session-wide stacks: secure, registry, Redis Cluster), so no
# session fixture is started twice. The second lane's output follows the first one's.
# PYTEST_ARGS that name tests (tests/cli, tests/x.py::test_y) run them in one lane.
set -uo pipefail

py=$1
shift
# Arguments that name tests (a path: PYTEST_ARGS=tests/producers) choose the tests: one lane.
for arg in "$@"; do
  if [[ $arg != -* && -e ${arg%%::*} ]]; then
    exec "$py" -m pytest -q "$@"
  fi
done
# The CLI's tests whose files went where their module's tests are (tests/<package>/
# test_<module>*.py: the benchmarks' under tests/tools/benchmarks, the CLI as a whole's and
# the tenancy and lease-wait items' beside their modules) stay in the lane they ran in.
# The runner's rebuild-crash tests and the fleet's framework-agent kill tests ride in the
# second lane too: the first was ~6 minutes the longer (1,727 s against 1,369 s in one CI).
second=(
  tests/integrations tests/cli tests/test_doc_examples.py
  tests/tools/benchmarks tests/test_cli_conventions.py tests/test_cli_tenancy.py
  tests/producers/test_opening_tenancy.py tests/producers/test_opening_lease_wait.py
  tests/producers/test_writer_kafka_extra.py tests/consumers/runner
  tests/fleet/test_registry_pydantic_ai.py tests/fleet/test_registry_openai_agents.py
)
ignore=()
for p in "${second[@]}"; do ignore+=("--ignore=$p"); done

out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$py" -m pytest -q "$@" "${second[@]}" >"$out" 2>&1 &
pid=$!
rc1=0
"$py" -m pytest -q "$@" "${ignore[@]}" || rc1=$?
rc2=0
wait "$pid" || rc2=$?
echo "=== second lane: ${second[*]} (ran beside; exit ${rc2}) ==="
cat "$out"
echo "=== test lanes: first exit ${rc1}, second exit ${rc2} ==="
[[ $rc1 -eq 0 && $rc2 -eq 0 ]]
