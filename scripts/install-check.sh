#!/bin/bash
# `make install` and `make uninstall` into a scratch DESTDIR, with BINARY (make test's debug build) as the dq
# installed: every file where bash-completion, zsh, fish and systemd look, the units naming $PREFIX/bin/dq,
# the installed dq runs, its man page is where man looks, and uninstall leaves no file behind.
#
#   scripts/install-check.sh BINARY MANPAGE
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
binary=$1
manpage=$2
[ -s "$manpage" ] || { echo "install-check: no man page at $manpage" >&2; exit 1; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
prefix=/opt/dq-check
fail() { echo "install-check: $*" >&2; exit 1; }

make -C "$ROOT" --no-print-directory install-files INSTALL_BIN="$binary" MANPAGE="$manpage" DESTDIR="$stage" PREFIX="$prefix" > "$stage.log" 2>&1 \
    || { cat "$stage.log" >&2; rm -f "$stage.log"; fail "make install-files failed"; }
rm -f "$stage.log"
root="$stage$prefix"
for file in bin/dq share/bash-completion/completions/dq share/zsh/site-functions/_dq share/fish/vendor_completions.d/dq.fish \
    share/man/man1/dq.1 lib/systemd/system/dq.service lib/systemd/system/dq-serve.service lib/systemd/system/dq-flush.service \
    lib/systemd/system/dq-flush.timer; do
    [ -s "$root/$file" ] || fail "$prefix/$file was not installed"
done
[ "$(stat -c %a "$root/bin/dq")" = 755 ] || fail "bin/dq is not mode 755"
grep -q "^ExecStart=$prefix/bin/dq run " "$root/lib/systemd/system/dq.service" || fail "dq.service does not run $prefix/bin/dq"
grep -q "^ExecStart=$prefix/bin/dq flush " "$root/lib/systemd/system/dq-flush.service" || fail "dq-flush.service does not run $prefix/bin/dq"
grep -q "^ExecStart=$prefix/bin/dq serve " "$root/lib/systemd/system/dq-serve.service" || fail "dq-serve.service does not run $prefix/bin/dq"
# dq-serve.service is hardened as dq.service is: the same sandbox lines, from User= to the end of [Service].
sandbox() { sed -n '/^User=/,/^\[Install\]/p' "$1" | grep -v '^#'; }
[ "$(sandbox "$root/lib/systemd/system/dq.service")" = "$(sandbox "$root/lib/systemd/system/dq-serve.service")" ] \
    || fail "dq-serve.service is not sandboxed as dq.service is: $(diff <(sandbox "$root/lib/systemd/system/dq.service") <(sandbox "$root/lib/systemd/system/dq-serve.service"))"
grep -q '^WatchdogSec=' "$root/lib/systemd/system/dq-serve.service" || fail "dq-serve.service has no WatchdogSec="
if grep -rq /usr/local/bin "$root/lib/systemd/system"; then fail "a unit still names /usr/local/bin"; fi
grep -q '^\.Dt DQ 1' "$root/share/man/man1/dq.1" || fail "share/man/man1/dq.1 is not dq's man page"
grep -q "dq flush" "$root/share/man/man1/dq.1" || fail "the man page does not describe dq flush"
grep -q "^complete .*-F _dq dq" "$root/share/bash-completion/completions/dq" || fail "the bash completion is not a completion script"
version=$("$root/bin/dq" version) || fail "the installed dq does not run"
[[ "$version" == dq\ * ]] || fail "the installed dq version printed: $version"

make -C "$ROOT" --no-print-directory uninstall DESTDIR="$stage" PREFIX="$prefix" > /dev/null
left=$(find "$stage" -type f -o -type l)
[ -z "$left" ] || fail "make uninstall left: $left"
echo "== make install / make uninstall ($prefix in a scratch DESTDIR): ok =="
