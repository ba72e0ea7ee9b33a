#!/bin/bash
# A Debian package of dq, made with dpkg-deb alone (no network, no debhelper), and its install/remove test.
#
#   scripts/deb.sh build BINARY OUTDIR [MANPAGE]   # OUTDIR/dq_<version>_<arch>.deb; prints its path
#   scripts/deb.sh test BINARY                     # build, dpkg -i, check, dpkg -r, dpkg -P (root only)
#
# `make deb` builds it from the release binary (static Swift runtime); `make test` runs `test` on the debug
# binary, whose Swift runtime comes from the toolchain on this machine.
#
# The package: /usr/bin/dq, bash/zsh/fish completions, the man page when given, the systemd units of
# Examples/systemd (with /usr/bin/dq), /etc/dq/dq.json as a conffile (root:dq 0640),
# a `dq` system user and group, /var/lib/dq (dq:dq 2770: shared with the group, see README "Sharing a queue"). Nothing is started or enabled: the conffile names an
# example server. `dpkg -r` leaves /etc/dq/dq.json and /var/lib/dq; `dpkg -P` removes the conffile and keeps
# /var/lib/dq, which may hold undelivered resources.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)

die() { echo "deb.sh: $*" >&2; exit 1; }

# Whatever this script made is removed when it exits, however it exits (errexit included).
STAGE=""
MADE_SYSTEM_STATE=0
cleanup() {
    local rc=$?
    set +e
    [ -n "$STAGE" ] && rm -rf "$STAGE"
    if [ "$MADE_SYSTEM_STATE" = 1 ]; then
        dpkg -P dq >/dev/null 2>&1
        userdel dqproducer 2>/dev/null
        rm -rf /var/lib/dq
        userdel dq 2>/dev/null
        groupdel dq 2>/dev/null
    fi
    exit $rc
}
trap cleanup EXIT

build() {
    local binary=$1 out=$2 manpage=${3:-}
    [ -x "$binary" ] || die "no dq binary at $binary (make release, or swift build)"
    binary=$(realpath "$binary")
    command -v dpkg-deb >/dev/null || die "dpkg-deb is missing (apt-get install dpkg)"
    local version arch stage
    version=$("$binary" version | awk '{print $2}')
    [[ "$version" =~ ^[0-9][0-9A-Za-z.+~-]*$ ]] || die "cannot read a Debian version from '$binary version'"
    arch=$(dpkg --print-architecture)
    STAGE=$(mktemp -d)
    stage=$STAGE
    chmod 0755 "$stage"

    # The binary, completions and units as `make install` lays them out, in Debian's folders.
    make -s --no-print-directory -C "$ROOT" install-files DESTDIR="$stage" PREFIX=/usr INSTALL_BIN="$binary" MANPAGE= \
        ZSH_COMPLETIONS=/usr/share/zsh/vendor-completions SYSTEMD_UNITS=/lib/systemd/system >/dev/null
    install -d "$stage/DEBIAN" "$stage/etc/dq" "$stage/usr/share/doc/dq"
    if [ -n "$manpage" ]; then
        install -d "$stage/usr/share/man/man1"
        gzip -9n < "$manpage" > "$stage/usr/share/man/man1/dq.1.gz"
    fi
    cat > "$stage/etc/dq/dq.json" <<'EOF'
{
  "server": "https://fhir.example.org/r4",
  "database": "/var/lib/dq/queue.sqlite"
}
EOF
    chmod 0640 "$stage/etc/dq/dq.json"
    cat > "$stage/usr/share/doc/dq/README.Debian" <<'EOF'
dq for Debian
=============
Edit /etc/dq/dq.json (root:dq, 0640: it may hold a token), then either
  systemctl enable --now dq.service          # dq run: delivers continuously
or
  systemctl enable --now dq-flush.timer      # the cron mode: dq flush every 5 minutes
To receive from C3-PRO apps, write /etc/dq/serve.json (see the README: "serve", "at_rest") and
  systemctl enable --now dq-serve.service    # dq serve: receives, then forwards
The queue is /var/lib/dq/queue.sqlite. /var/lib/dq is dq:dq 2770 (setgid, group-writable), so dq makes the
queue's files 0660 there: a producer of another user enqueues once it is in the dq group
(adduser alice dq; then, as alice: dq enqueue FILE). Removing the package keeps /var/lib/dq: it may hold
undelivered resources.
EOF

    # Depends: the Debian packages that own the shared libraries the binary loads (a debug build's Swift
    # runtime belongs to no package and is left out: that package only runs where the toolchain is).
    local depends
    depends=$(ldd "$binary" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
        dpkg -S "$(readlink -f "$lib")" 2>/dev/null || dpkg -S "$lib" 2>/dev/null || true
    done | cut -d: -f1 | sort -u | paste -sd, | sed 's/,/, /g')
    local size
    size=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
    cat > "$stage/DEBIAN/control" <<EOF
Package: dq
Version: $version
Architecture: $arch
Maintainer: dq developers <dq@example.org>
Installed-Size: $size
Depends: adduser | passwd${depends:+, $depends}
Section: net
Priority: optional
Homepage: https://github.com/dq-project/dq
Description: offline-first, encrypted FHIR data queue
 dq delivers FHIR resources to a FHIR server, keeping each one in a durable
 SQLite (or PostgreSQL) queue until the server has it, in order, at most once,
 optionally encrypted for C3-PRO receivers.
EOF
    echo /etc/dq/dq.json > "$stage/DEBIAN/conffiles"
    cat > "$stage/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = configure ]; then
    if ! getent passwd dq >/dev/null; then
        if command -v adduser >/dev/null; then
            adduser --system --group --home /var/lib/dq --no-create-home --quiet dq
        else
            useradd --system --user-group --home-dir /var/lib/dq --shell /usr/sbin/nologin dq
        fi
    fi
    # Shared with the dq group (setgid, group-writable): dq makes the queue's files 0660 there, so producers
    # in that group enqueue and the service flushes.
    install -d -m 2770 -o dq -g dq /var/lib/dq
    chown root:dq /etc/dq/dq.json
    chmod 0640 /etc/dq/dq.json
    if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi
fi
EOF
    cat > "$stage/DEBIAN/prerm" <<'EOF'
#!/bin/sh
set -e
if [ -d /run/systemd/system ] && [ "$1" = remove ]; then
    systemctl stop dq.service dq-serve.service dq-flush.timer dq-flush.service 2>/dev/null || true
fi
EOF
    cat > "$stage/DEBIAN/postrm" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = purge ]; then
    rmdir /etc/dq 2>/dev/null || true
fi
if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi
EOF
    chmod 0755 "$stage/DEBIAN/postinst" "$stage/DEBIAN/prerm" "$stage/DEBIAN/postrm"
    mkdir -p "$out"
    local deb="$out/dq_${version}_${arch}.deb"
    dpkg-deb --root-owner-group --build "$stage" "$deb" >/dev/null
    rm -rf "$stage"
    STAGE=""
    echo "$deb"
}

# Installs, checks and removes the package on this machine. Refuses to touch a machine where dq is already
# installed or configured (it would replace that dq and its /etc/dq/dq.json).
test_package() {
    local binary=$1
    [ "$(id -u)" = 0 ] || die "the package test installs into /usr/bin and /etc: run it as root"
    # It installs and then removes the package, the dq user and /var/lib/dq: never on a machine that has any of
    # them already (a kept /var/lib/dq may hold undelivered resources).
    if dpkg -s dq >/dev/null 2>&1 || [ -e /usr/bin/dq ] || [ -e /etc/dq ] || [ -e /var/lib/dq ] \
        || getent passwd dq >/dev/null || getent group dq >/dev/null || getent passwd dqproducer >/dev/null; then
        die "dq is installed or was here (the package, /usr/bin/dq, /etc/dq, /var/lib/dq or a dq user): not touching it"
    fi
    local deb failed=0 out
    out=$(mktemp -d)
    STAGE=$out  # removed on exit with the staging files
    MADE_SYSTEM_STATE=1
    build "$binary" "$out" >/dev/null
    STAGE=$out
    deb=$(ls "$out"/dq_*.deb)
    # (No `| grep -q` in a check: with pipefail, grep leaving early can fail the writer with SIGPIPE.)
    check() { if eval "$2"; then echo "  ok: $1"; else echo "  FAILED: $1"; failed=1; fi; }
    echo "deb: $(basename "$deb")"
    check "the package's fields are sound" "dpkg-deb --info '$deb' | grep '^ Package: dq$' >/dev/null"
    check "/etc/dq/dq.json is a conffile" "dpkg-deb --ctrl-tarfile '$deb' | tar -xO ./conffiles | grep -x /etc/dq/dq.json >/dev/null"
    dpkg -i "$deb" >/dev/null
    check "dpkg -i: installed" "dpkg -s dq | grep '^Status: install ok installed$' >/dev/null"
    check "dq version from /usr/bin" "[ \"\$(/usr/bin/dq version)\" = \"\$('$binary' version)\" ]"
    check "a dq system user and group" "getent passwd dq >/dev/null && getent group dq >/dev/null && [ \$(id -u dq) -lt 1000 ]"
    check "/etc/dq/dq.json root:dq 0640" "[ \"\$(stat -c '%U:%G %a' /etc/dq/dq.json)\" = 'root:dq 640' ]"
    check "/var/lib/dq dq:dq 2770" "[ \"\$(stat -c '%U:%G %a' /var/lib/dq)\" = 'dq:dq 2770' ]"
    check "the units name /usr/bin/dq and the dq user" \
        "grep -q '^ExecStart=/usr/bin/dq run' /lib/systemd/system/dq.service && grep -q '^User=dq$' /lib/systemd/system/dq.service && ! grep -q DynamicUser /lib/systemd/system/dq-flush.service"
    if command -v systemd-analyze >/dev/null; then
        check "systemd-analyze verify accepts the installed units" \
            "systemd-analyze verify /lib/systemd/system/dq.service /lib/systemd/system/dq-serve.service /lib/systemd/system/dq-flush.service /lib/systemd/system/dq-flush.timer"
    fi
    check "the installed dq reads the conffile" "/usr/bin/dq config | grep '/etc/dq/dq.json: server' >/dev/null"
    # A producer of another user, in the dq group, makes the queue; the service's user enqueues into it too and
    # sees both items: the files dq made in the shared directory are 0660, group dq.
    echo '{"resourceType":"Basic","code":{"text":"deb"}}' > "$out/r.json"
    chmod 0644 "$out/r.json"; chmod 0755 "$out"
    useradd --no-create-home --shell /usr/sbin/nologin --groups dq dqproducer
    # setpriv, not su: no PAM session (su may start a systemd user manager that outlives it and blocks userdel).
    as() { local user=$1; shift; (cd / && env -i PATH=/usr/bin:/bin HOME=/ setpriv --reuid="$user" --regid="$user" --init-groups "$@"); }
    check "a producer in the dq group enqueues into /var/lib/dq" \
        "as dqproducer sh -c \"umask 077; exec /usr/bin/dq enqueue '$out/r.json'\" >/dev/null"
    check "the queue's files are 0660, group dq" \
        "(for f in /var/lib/dq/queue.sqlite*; do [ \"\$(stat -c '%G %a' \$f)\" = 'dq 660' ] || { stat -c '%n %U:%G %a' \$f; exit 1; }; done)"
    check "the dq user enqueues into the producer's queue and sees both items" \
        "as dq sh -c \"/usr/bin/dq enqueue '$out/r.json' && /usr/bin/dq status --json\" | grep '\"pending\" *: *2' >/dev/null"
    # The delivery loop runs: the server refuses, the two items stay queued, and SIGTERM ends it with 0. With the
    # release build (`scripts/deb.sh test .build/release/dq`) this is the check that Swift 6.3.1's optimizer has not
    # broken it again: it built a dq that died with SIGSEGV at its first flush (TaskLocal.withValue of an optional
    # closure, Heartbeat.current), which no debug build showed.
    check "the installed dq run flushes and stops on SIGTERM with 0" \
        "as dq sh -c '/usr/bin/dq run --server http://127.0.0.1:9/fhir --poll-interval 0.2 2>/dev/null & p=\$!; sleep 3; kill -TERM \$p; wait \$p' && as dq /usr/bin/dq status --json | grep '\"pending\" *: *2' >/dev/null"
    echo '{"server": "https://fhir.edited.example/r4", "database": "/var/lib/dq/queue.sqlite"}' > /etc/dq/dq.json
    dpkg -i "$deb" >/dev/null
    check "a reinstall keeps an edited conffile" "grep -q fhir.edited.example /etc/dq/dq.json && [ -x /usr/bin/dq ]"
    dpkg -r dq >/dev/null
    check "dpkg -r: the binary and units gone" "[ ! -e /usr/bin/dq ] && [ ! -e /lib/systemd/system/dq.service ]"
    check "dpkg -r: the conffile and the queue kept" "[ -e /etc/dq/dq.json ] && [ -e /var/lib/dq/queue.sqlite ]"
    dpkg -P dq >/dev/null
    check "dpkg -P: the conffile gone, the queue kept" "[ ! -e /etc/dq ] && [ -e /var/lib/dq/queue.sqlite ]"
    # The trap removes the test's queue, users and anything left on a failure.
    [ $failed = 0 ] || die "the package test failed"
    echo "deb: install, reinstall and removal ok"
}

case "${1:-}" in
    build) shift; [ $# -ge 2 ] || die "usage: deb.sh build BINARY OUTDIR [MANPAGE]"; build "$@" ;;
    test) shift; [ $# -eq 1 ] || die "usage: deb.sh test BINARY"; test_package "$1" ;;
    *) die "usage: deb.sh build BINARY OUTDIR [MANPAGE] | deb.sh test BINARY" ;;
esac
