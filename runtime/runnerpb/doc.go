// Package runnerpb is the private protocol between the sloserve server and
// its runner processes, which talk gRPC over a Unix socket: runner.proto and
// the Go code protoc generates from it, checked in.
//
// It owns the wire format only. It must hold no hand-written logic, the
// generated files must never be edited by hand (change the .proto and run
// `make proto`), and nothing outside package runtime may import it: the
// protocol is an implementation detail of runtime, free to change between
// versions, never exposed to clients.
package runnerpb
