#!/usr/bin/env bash
# Regenerates Fixtures/carebundle: synthetic, deterministic R4 transaction Bundles (never real patients) from
# carebundle, the generator of US Core data, in its own venv under .peers. The output is committed; make test
# does not run this.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.peers/fixtures"
if [ ! -x "$venv/bin/carebundle" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "carebundle==0.5.0"
fi
rm -rf "$root/Fixtures/carebundle"
# 10 patients of the mixed cohort, lean panels: 209 resources in 10 Bundles, every reference to an entry's fullUrl.
"$venv/bin/carebundle" generate --profile mixed --count 10 --seed 7 --panels lean --out "$root/Fixtures/carebundle"
