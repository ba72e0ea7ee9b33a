# dq: make test (all tests against real servers), make demo (the main job on loopback).
SWIFT ?= swift
APT_PACKAGES := libsqlite3-dev libssl-dev sqlite3 curl openssl python3-venv systemd postgresql pgbouncer squid nginx-light
export DQ_BIN := $(CURDIR)/.build/debug/dq
export DQ_GATEWAY_BIN := $(CURDIR)/.build/debug/Gateway

BENCH_APT := apache2-utils wrk
.PHONY: all build gateway release install install-files uninstall deb deps peers test unit demo bench torture sanitize lint man docs clean

all: build

# System packages: installed when missing (needs root, as on CI); otherwise names what to install.
# Installs the Debian packages of $(1) that are missing (as root; else it says which to install).
define apt_install
	@missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "install:$$missing (sudo apt-get install$$missing)"; exit 1; fi; \
	fi
endef

deps:
	$(call apt_install,$(APT_PACKAGES))

build: deps
	$(SWIFT) build --build-tests

# Examples/Gateway, a Hummingbird service that embeds dq: a target of this package (`swift build --build-tests`
# builds it), which an integration test drives.
gateway: build

# A release dq that links the Swift runtime and Foundation statically: it runs on machines without a Swift
# toolchain and starts about a third faster (no symbol lookups in a dozen shared libraries).
RELEASE_FLAGS := -c release --static-swift-stdlib -Xlinker -s

release: deps
	$(SWIFT) build $(RELEASE_FLAGS) --product dq

# dq alone (one static binary), its man page, its shell completions and the systemd units of Examples/systemd
# (in $PREFIX/lib/systemd/system, naming $PREFIX/bin/dq). DESTDIR for packaging.
PREFIX ?= /usr/local
install: release
	$(SWIFT) package generate-manual --configuration release >/dev/null
	@$(MAKE) --no-print-directory install-files INSTALL_BIN=.build/release/dq MANPAGE=.build/plugins/GenerateManual/outputs/dq/dq.1

# What `install` copies, from INSTALL_BIN (and MANPAGE when set): `make test` installs its debug build into a
# scratch DESTDIR with it (scripts/install-check.sh).
# scripts/deb.sh stages its package with it too (PREFIX=/usr, Debian's zsh and unit folders).
INSTALL_BIN ?= .build/release/dq
ZSH_COMPLETIONS ?= $(PREFIX)/share/zsh/site-functions
SYSTEMD_UNITS ?= $(PREFIX)/lib/systemd/system
UNITS := dq.service dq-serve.service dq-flush.service dq-flush.timer
install-files:
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/bash-completion/completions \
	  $(DESTDIR)$(ZSH_COMPLETIONS) $(DESTDIR)$(PREFIX)/share/fish/vendor_completions.d $(DESTDIR)$(SYSTEMD_UNITS)
	install -m 755 $(INSTALL_BIN) $(DESTDIR)$(PREFIX)/bin/dq
	if [ -n "$(MANPAGE)" ]; then install -d $(DESTDIR)$(PREFIX)/share/man/man1 && \
	  install -m 644 $(MANPAGE) $(DESTDIR)$(PREFIX)/share/man/man1/dq.1; fi
	$(INSTALL_BIN) --generate-completion-script bash > $(DESTDIR)$(PREFIX)/share/bash-completion/completions/dq
	$(INSTALL_BIN) --generate-completion-script zsh > $(DESTDIR)$(ZSH_COMPLETIONS)/_dq
	$(INSTALL_BIN) --generate-completion-script fish > $(DESTDIR)$(PREFIX)/share/fish/vendor_completions.d/dq.fish
	for unit in $(UNITS); do \
	  sed 's|/usr/local/bin/dq|$(PREFIX)/bin/dq|g' Examples/systemd/$$unit > $(DESTDIR)$(SYSTEMD_UNITS)/$$unit; \
	  chmod 644 $(DESTDIR)$(SYSTEMD_UNITS)/$$unit; done

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/bin/dq $(DESTDIR)$(PREFIX)/share/man/man1/dq.1 \
	  $(DESTDIR)$(PREFIX)/share/bash-completion/completions/dq $(DESTDIR)$(ZSH_COMPLETIONS)/_dq \
	  $(DESTDIR)$(PREFIX)/share/fish/vendor_completions.d/dq.fish \
	  $(addprefix $(DESTDIR)$(SYSTEMD_UNITS)/,$(UNITS))

# A Debian package (dpkg-deb, no network) of the release dq, with its man page, completions, units and a
# dq system user: .build/deb/dq_<version>_<arch>.deb. See scripts/deb.sh.
deb: release
	$(SWIFT) package generate-manual --configuration release >/dev/null
	scripts/deb.sh build .build/release/dq .build/deb .build/plugins/GenerateManual/outputs/dq/dq.1

peers:
	scripts/peers.sh install

# The libraries' documentation (DocC: the API, and the articles in Sources/FHIRDataQueue/FHIRDataQueue.docc and
# Sources/FHIRDataQueueServer/FHIRDataQueueServer.docc),
# as a static site in .build/docs; warnings (a broken link, an undocumented symbol in a topic) fail it.
docs:
	$(SWIFT) package --allow-writing-to-directory .build/docs generate-documentation --target FHIRDataQueue --target FHIRDataQueueServer \
	  --warnings-as-errors --disable-indexing --transform-for-static-hosting --output-path .build/docs

# Every test: a short torture run, then unit and integration tests against real servers started here.
test: build gateway peers
	.peers/venv/bin/python scripts/torture.py --quick
	@scripts/peers.sh start
	@set -a; . .peers/env; set +a; export DQ_REQUIRE_PEERS=1; \
	{ $(SWIFT) test --skip-build; echo $$? > .build/test.rc; } 2>&1 | tee .build/test.log; \
	rc=$$(cat .build/test.rc); scripts/peers.sh stop; \
	if [ "$$rc" != 0 ]; then scripts/test-report.sh .build/test.log; fi; \
	exit $$rc
	@# The Debian package installed, checked and removed, alone: an installed /etc/dq/dq.json is every dq's config.
	@if [ "$$(id -u)" = 0 ]; then scripts/deb.sh test $(DQ_BIN); \
	else echo "== the Debian package test was NOT run: it installs into /usr and /etc, so it needs root =="; fi
	@$(SWIFT) package generate-manual --configuration debug >/dev/null
	@# The DocC catalog builds with warnings as errors (a broken link, an undocumented parameter).
	@$(MAKE) --no-print-directory docs >/dev/null
	@scripts/install-check.sh $(DQ_BIN) .build/plugins/GenerateManual/outputs/dq/dq.1

# The full crash, fault, concurrency, exhaustion and bad-input runs (about 10 minutes).
torture: build peers
	.peers/venv/bin/python scripts/torture.py --out Benchmarks/torture.md

# The unit tests and the quick torture under AddressSanitizer, then ThreadSanitizer, each on a build of its own
# (.build/asan, .build/tsan; about 10 minutes each to build the first time). Reports go to files; any report
# fails the run. LeakSanitizer is off: the Swift runtime's caches read as leaks.
SANITIZERS ?= address thread
# The suites that hash client secrets run on their own, after the others. scrypt is memory-hard on purpose (32 MiB,
# hundreds of millions of memory accesses per hash); under ThreadSanitizer each hash stalls the whole test process
# for seconds, and beside the other suites it held a flush test's loopback request past its 10 s timeout (measured:
# the unit tests failed 4 runs in 4 on a 2-core machine, 194 s a run; without these two suites, 242 tests in 48 s).
SANITIZE_ALONE = ClientSecretsTests|ClientRegistryTests
sanitize: deps peers
	@set -e; for s in $(SANITIZERS); do \
	  case $$s in address) dir=.build/asan;; thread) dir=.build/tsan;; *) echo "unknown sanitizer $$s"; exit 2;; esac; \
	  rm -rf $$dir/reports; mkdir -p $$dir/reports; \
	  echo "== $$s: build =="; $(SWIFT) build --build-tests --sanitize=$$s --scratch-path $$dir; \
	  export ASAN_OPTIONS="log_path=$(CURDIR)/$$dir/reports/report:detect_leaks=0" \
	         TSAN_OPTIONS="log_path=$(CURDIR)/$$dir/reports/report:halt_on_error=0:suppressions=$(CURDIR)/Tests/tsan-suppressions.txt"; \
	  rc=0; echo "== $$s: unit tests =="; \
	  $(SWIFT) test --skip-build --sanitize=$$s --scratch-path $$dir --filter FHIRDataQueueTests --skip '$(SANITIZE_ALONE)' || rc=$$?; \
	  if [ $$rc = 0 ]; then $(SWIFT) test --skip-build --sanitize=$$s --scratch-path $$dir --filter '$(SANITIZE_ALONE)' || rc=$$?; fi; \
	  if [ $$rc = 0 ]; then echo "== $$s: quick torture =="; \
	    DQ_SANITIZER=$$s DQ_BIN=$(CURDIR)/$$dir/debug/dq .peers/venv/bin/python scripts/torture.py --quick || rc=$$?; fi; \
	  if ls $$dir/reports/report* >/dev/null 2>&1; then echo "== $$s: reports =="; cat $$dir/reports/report*; exit 1; fi; \
	  if [ $$rc != 0 ]; then echo "== $$s: failed (exit $$rc) with no sanitizer report =="; exit $$rc; fi; \
	  echo "== $$s: no reports =="; \
	done

# Benchmarks (release build): one table of dq against references measured in the same run.
bench: deps peers
	@missing=""; for p in $(BENCH_APT); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi
	scripts/peers.sh bench
	$(SWIFT) build $(RELEASE_FLAGS) --product dq
	$(SWIFT) build $(RELEASE_FLAGS) --product dq-bench
	python3 Benchmarks/run.py $(BENCH_ARGS)

# Unit tests only (no servers).
unit: build
	$(SWIFT) test --skip-build --filter FHIRDataQueueTests

# Builds only the dq binary (not the test targets, which are most of a clean build's time).
# The demo needs only dq and sekmet-fhir: not the other servers the tests start (PostgreSQL, squid, nginx,
# Canaille).
DEMO_APT := libsqlite3-dev libssl-dev curl python3-venv
demo:
	$(call apt_install,$(DEMO_APT))
	scripts/peers.sh install-fhir
	$(SWIFT) build --product dq
	scripts/demo.sh

# The man page, generated from the command tree (swift-argument-parser's plugin), written to ./dq.1.
man: build
	$(SWIFT) package generate-manual --configuration debug
	cp .build/plugins/GenerateManual/outputs/dq/dq.1 dq.1

lint:
	$(SWIFT) format lint --strict -r Sources Tests Benchmarks Examples/Gateway/Sources

clean:
	rm -rf .build .peers
