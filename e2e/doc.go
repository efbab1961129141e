// Package e2e holds the end-to-end tests and benchmarks of sloserve: they
// build the real binary once, start it as a separate process with the real
// ONNX Runtime, real models and real cgroups, and drive it over real
// sockets (REST, gRPC, metrics), the way a user or an operator would.
//
// It owns the test harness (harness_test.go: the build, the environment
// checks, starting servers on free ports, clients, teardown and its
// checks) and the tests of each topic (e2e_<topic>_test.go) and the
// end-to-end benchmarks (bench_*_test.go). It has no code outside tests.
//
// It must not import package main or reach into the server's packages to
// drive it (it uses only the generated gRPC clients of api/inference and
// api/modelmesh):
// everything it checks goes through the binary's command line,
// its sockets, its logs and what the operating system shows (/proc,
// cgroup files). The benchmarks may call ONNX Runtime directly for their
// in-process baselines.
package e2e
