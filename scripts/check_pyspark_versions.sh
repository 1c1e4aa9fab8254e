#!/usr/bin/env bash
# Verify the PySpark versions pyproject.toml declares: for each version given (default: the oldest and the
# newest of the declared range), install spark-state into a fresh virtualenv with exactly that pyspark, then
# run the fast tests and the Spark end-to-end tests under it. Not part of ./run tests (it takes a while).
#
#   scripts/check_pyspark_versions.sh              # 4.2.0 and 4.3.0
#   scripts/check_pyspark_versions.sh 4.2.1        # any versions
#
# Logs go to build/pyspark-versions/<version>.log; the last lines printed are one summary line per version.
# Exit code 0 only if every version passed both runs.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
versions=("$@")
[ ${#versions[@]} -eq 0 ] && versions=(4.2.0 4.3.0)
out=$root/build/pyspark-versions
mkdir -p "$out"
py=${PYTHON:-python3}
status=0
summary=()
for version in "${versions[@]}"; do
    venv=$out/venv-$version
    log=$out/$version.log
    : > "$log"
    echo "== pyspark $version: installing into $venv (log: $log)"
    rm -rf "$venv"
    if ! { "$py" -m venv "$venv" && "$venv/bin/python" -m pip install -q --upgrade pip \
           && "$venv/bin/python" -m pip install -q -e ".[test]" "pyspark[sql]==$version"; } >> "$log" 2>&1; then
        summary+=("pyspark $version: install FAILED (see $log)")
        status=1
        continue
    fi
    installed=$("$venv/bin/python" -c 'import pyspark; print(pyspark.__version__)')
    export PYSPARK_PYTHON="$venv/bin/python" PYSPARK_DRIVER_PYTHON="$venv/bin/python"
    export PYTHONPATH="$root"
    line="pyspark $installed:"
    for tier in fast spark; do
        if [ $tier = fast ]; then
            args=(-m "not spark and not cluster")
        else
            args=(-m "spark and not cluster" --ignore=tests/test_benchmarks.py)
        fi
        echo "== pyspark $installed: $tier tests" | tee -a "$log"
        "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder "${args[@]}" >> "$log" 2>&1
        rc=$?
        result=$(grep -E "^(=+ )?[0-9]+ (passed|failed)" "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
        [ $rc -ne 0 ] && status=1
        line="$line $tier: ${result:-no result} (exit $rc);"
    done
    summary+=("$line")
done
printf '%s\n' "${summary[@]}"
exit $status
