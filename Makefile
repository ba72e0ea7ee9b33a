# dq: make test (all tests against real servers), make demo (the main job on loopback).
SWIFT ?= swift
APT_PACKAGES := libsqlite3-dev libssl-dev sqlite3 curl openssl python3-venv
export DQ_BIN := $(CURDIR)/.build/debug/dq

.PHONY: all build release deps peers test unit demo bench torture lint clean

all: build

# System packages: installed when missing (needs root, as on CI); otherwise names what to install.
deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  else echo "install:$$missing (sudo apt-get install$$missing)"; exit 1; fi; \
	fi

build: deps
	$(SWIFT) build --build-tests

release: deps
	$(SWIFT) build -c release

peers:
	scripts/peers.sh install

# Every test: unit tests and integration tests against a real sekmet-fhir server started here.
test: build peers
	@scripts/peers.sh start
	@set -a; . .peers/env; set +a; export DQ_REQUIRE_PEERS=1; \
	$(SWIFT) test --skip-build; rc=$$?; scripts/peers.sh stop; exit $$rc

# Unit tests only (no servers).
unit: build
	$(SWIFT) test --skip-build --filter FHIRDataQueueTests

demo: build peers
	scripts/demo.sh

lint:
	$(SWIFT) format lint --strict -r Sources Tests

clean:
	rm -rf .build .peers
