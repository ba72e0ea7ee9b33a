#!/bin/sh
# What a failed `swift test` run left in its log (make test calls this with .build/test.log): the failed tests and
# their issues; and, when the test process itself died (a crash, a signal), the tests that had started and never
# ended, with the crashed thread's backtrace, since a crash names no test.
log=${1:?usage: test-report.sh LOG}
echo "== failed tests and their issues (full log: $log) =="
grep -E '✘|error:|recorded an issue|Expectation failed' "$log" | grep -v -E '✘ Test run with|^◇' | head -60
if grep -q -E 'exited with unexpected signal|Program crashed' "$log"; then
  echo "== the test process died; tests started and not ended when it did =="
  # mawk compares bytes: each mark (◇ ✔ ✘ ➜) is three, so the names start at the same column.
  awk '
    /^◇ Test .* started\.$/ { n = substr($0, 10); n = substr(n, 1, length(n) - 9); if (n !~ /^case passing/ && n != "run") open[n] = 1 }
    /^(✔|✘) Test .* (passed|failed)/ { n = substr($0, 10); sub(/( with [0-9]+ test cases)? (passed|failed) after .*$/, "", n); delete open[n] }
    /^➜ Test .* skipped/ { n = substr($0, 10); sub(/ skipped.*$/, "", n); delete open[n] }
    END { for (n in open) print "  " n }' "$log"
  echo "== the crash, as the Swift backtracer told it =="
  awk '/\*\*\* Program crashed/ { on = 1 } on && /^Registers:/ { exit } on { print }' "$log" | head -80
fi
