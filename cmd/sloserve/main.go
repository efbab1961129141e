// Command sloserve is a latency-aware multi-model ONNX inference server.
//
// One binary with subcommands: serve (package server), loadtest (package
// loadtest), profile, version, and the hidden runner that hosts one ONNX
// Runtime session (package runtime). This package owns only the command
// line: flags, the config's sources, the logger, and their unit tests; the
// end-to-end tests that drive the built binary are in package e2e. It must
// not hold serving, scheduling or control logic; main stays a few lines.
package main

import "os"

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}
