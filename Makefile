# sloserve developer tasks. `make test` works on a fresh clone: it fetches
# ONNX Runtime, the demo models and the test networks first (all pinned).

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := build

# Go lives in /usr/local/go on our machines; a fresh shell may not have it on PATH.
ifeq ($(shell command -v go 2>/dev/null),)
export PATH := /usr/local/go/bin:$(PATH)
endif

ORT_VERSION := 1.30.0
ORT_LIB     := $(CURDIR)/deps/onnxruntime/libonnxruntime.so.$(ORT_VERSION)
TOOLS_BIN   := $(CURDIR)/.tools/bin
VERSION     ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS     := -X github.com/sloserve/sloserve/server.Version=$(VERSION)
PROTOS      := configs/tritonpb/model_config.proto api/inference/grpc_service.proto api/modelmesh/model_runtime.proto runtime/runnerpb/runner.proto

# PKGS narrows `make test` and `make bench`; the end-to-end tests and
# benchmarks, which build and drive the real binary, are PKGS=./e2e.
BENCH      ?= .
BENCHTIME  ?= 1s
BENCHCOUNT ?= 1
PKGS       ?= ./...
SERVE_FLAGS ?=

# Environment the server, the tests and the benchmarks read.
test bench bench-diurnal bench-colocation bench-gpu-day run: export SLOSERVE_ONNXRUNTIME_LIBRARY := $(ORT_LIB)
test bench: export SLOSERVE_TESTMODELS := $(CURDIR)/deps/testmodels
test bench: export SLOSERVE_DEMO_REPOSITORY := $(CURDIR)/demo-repository
test bench: export SLOSERVE_REQUIRE_ORT := 1
# cgroups are writable on the project's machines: the limiter's real tests
# must run there, not skip.
test: export SLOSERVE_REQUIRE_CGROUPS := 1
# Prometheus comes from test-tools: its e2e test must run, not skip.
test: export SLOSERVE_REQUIRE_PROMETHEUS := 1
# Chromium too: the dashboard's browser test must run, not skip.
test: export SLOSERVE_REQUIRE_CHROMIUM := 1
# And helm: the deploy package renders the chart with it.
test: export SLOSERVE_REQUIRE_HELM := 1
# And the Kubernetes API server (kube-apiserver, etcd, CRDs) the manifests
# are applied to.
test: export SLOSERVE_REQUIRE_KUBE := 1
# And jaeger: the tracing e2e test exports to it.
test: export SLOSERVE_REQUIRE_JAEGER := 1
# Profiles the servers under test measure are cached for the run's later
# servers, inside the checkout.
test bench: export SLOSERVE_CONTROL_PROFILE_CACHE_DIR := $(CURDIR)/.cache/profiles

.PHONY: setup setup-gpu gpu-check test-tools onnxruntime models testmodels proto-tools proto build run test bench bench-diurnal bench-colocation bench-gpu-day clean distclean

setup: onnxruntime models testmodels

onnxruntime:
	scripts/fetch-onnxruntime.sh

# On a machine with an NVIDIA GPU (CUDA 12, cuDNN 9): the CUDA build of
# ONNX Runtime in deps/onnxruntime-gpu/ (docs/gpu.md), then the GPU day for
# real on GPU 0 under MPS, every policy, POLICY_RUNS times. Never run here:
# our machines have no GPU.
setup-gpu: setup
	scripts/fetch-onnxruntime-gpu.sh

gpu-check: setup-gpu build
	POLICY_RUNS=$(POLICY_RUNS) scripts/gpu-check.sh

models:
	scripts/fetch-models.sh

testmodels:
	scripts/fetch-testmodels.sh

# Tools the tests run: prometheus (promtool), chromium, chromedriver from
# Debian; helm, pinned, through the Go module proxy into .tools/bin;
# kube-apiserver and etcd built from their Go modules (tools/kube),
# and the CRDs the manifests use, into .tools/.
test-tools:
	scripts/install-test-tools.sh

proto-tools:
	scripts/install-proto-tools.sh

proto: proto-tools
	protoc -I . \
	  --plugin=protoc-gen-go=$(TOOLS_BIN)/protoc-gen-go \
	  --plugin=protoc-gen-go-grpc=$(TOOLS_BIN)/protoc-gen-go-grpc \
	  --go_out=. --go_opt=paths=source_relative \
	  --go-grpc_out=. --go-grpc_opt=paths=source_relative \
	  $(PROTOS)

build:
	CGO_ENABLED=1 go build -ldflags '$(LDFLAGS)' -o bin/sloserve ./cmd/sloserve

run: setup build
	./bin/sloserve serve $(SERVE_FLAGS)

test: setup test-tools
	go vet $(PKGS)
	go test -race -count=1 -timeout 45m $(PKGS)
	# Tests the race detector would falsify: its exit runs C++ destructors; its heap counts are not the code's.
	go test -count=1 -run 'TestRunnerStopWritesNoTelemetry$$' ./runtime
	go test -count=1 -run 'TestRESTJSONBodyReused$$' ./api
	# Measurements of simulations, tenfold slower under -race, which finds nothing in them.
	go test -count=1 -run 'TestNoisyHostAdmissionBound$$|TestAdmissionRiskCalibration$$' ./qos

bench: setup
	go test -run '^$$' -bench '$(BENCH)' -benchtime $(BENCHTIME) -count=$(BENCHCOUNT) -timeout 60m $(PKGS)

# The diurnal goodput benchmark: one server per share policy on the same
# scenario, one combined report (BENCHMARKS.md). About 16 minutes.
# POLICY_RUNS repeats it (results in DIURNAL_OUT-1, -2, ...) and prints
# the medians (scripts/policy-medians.py); BENCHMARKS.md reports 3.
DIURNAL_OUT ?= loadtest-results/diurnal
POLICY_RUNS ?= 1
bench-diurnal bench-colocation bench-gpu-day: export SLOSERVE_CONTROL_PROFILE_CACHE_DIR := $(CURDIR)/.cache/profiles
bench-diurnal: setup build
	for i in $$(seq 1 $(POLICY_RUNS)); do \
	  ./bin/sloserve loadtest --compare --out $(DIURNAL_OUT)-$$i loadtest/scenarios/diurnal.yaml; done
	scripts/policy-medians.py $$(seq -f '$(DIURNAL_OUT)-%g' 1 $(POLICY_RUNS))

# Co-location: two latency-critical services with a daily swell beside two
# best-effort batch jobs that fill the machine; a 2-minute day per policy,
# about 8 minutes a run.
COLOCATION_OUT ?= loadtest-results/colocation
bench-colocation: setup build
	for i in $$(seq 1 $(POLICY_RUNS)); do \
	  ./bin/sloserve loadtest --compare --out $(COLOCATION_OUT)-$$i loadtest/scenarios/colocation.yaml; done
	scripts/policy-medians.py $$(seq -f '$(COLOCATION_OUT)-%g' 1 $(POLICY_RUNS))

# A GPU-scale day: twelve models on four simulated GPUs with placement
# (loadtest/scenarios/gpu-day.yaml); a 6-minute day per policy after a
# minute's warm-up, about 25 minutes a run. Simulated GPUs: no GPU needed.
GPU_DAY_OUT ?= loadtest-results/gpu-day
bench-gpu-day: setup build
	for i in $$(seq 1 $(POLICY_RUNS)); do \
	  ./bin/sloserve loadtest --compare --out $(GPU_DAY_OUT)-$$i loadtest/scenarios/gpu-day.yaml; done
	scripts/policy-medians.py $$(seq -f '$(GPU_DAY_OUT)-%g' 1 $(POLICY_RUNS))

# Build outputs only; `distclean` also drops fetched files and tools.
clean:
	rm -rf bin/ coverage.out coverage.html cover.out *.test
	go clean -testcache

distclean: clean
	rm -rf deps/ .tools/ demo-repository/*/[0-9]*/
